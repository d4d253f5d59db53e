"""What the two env runners share: their arguments, how a policy and its filter are made, the
filters' changes sent with a fragment, the weights, the runner's state (`get_state`/`set_state`,
`reset`), the callbacks' episodes (`impala_tf.rollout.hooks`) and `run_episodes`.

`EnvRunner` (one policy, a vector of gymnasium envs) and `MultiAgentEnvRunner` (several policies
over multi-agent envs) differ in how they step envs and cut sequences; everything here is written
once so that the two cannot drift. Both keep their policies, observation filters and weights'
versions in dicts keyed by policy id (`policies`, `filters`, `versions`); what each has in flight
(envs, unfinished episodes, actions computed ahead) is its own (`_in_flight`, `_restore`).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import gymnasium as gym
import numpy as np

from impala_tf.acting.factory import make_policy
from impala_tf.acting.filters import Filter, filter_from_state, get_filter
from impala_tf.acting.remote_policy import RemotePolicy
from impala_tf.config.callbacks import Callbacks
from impala_tf.envs.faults import StepProgress
from impala_tf.models.spec import ModelSpec
from impala_tf.rollout.fragment import DEFAULT_POLICY_ID, Episode
from impala_tf.rollout.hooks import HookEpisodes
from impala_tf.rollout.spec import RunnerSpec
from impala_tf.utils.seeds import sampler_seeds

__all__ = ["RunnerBase", "Weights"]

#: What a broadcast carries: {policy_id: (weights, num_grad_updates)}; the weights are None with
#: central inference (the driver's inference server holds them).
Weights = Mapping[str, tuple["list[np.ndarray] | None", int]]

#: With central inference: the actor's connection to the driver's inference server and
#: {policy_id: per-env shapes of the model's recurrent state}.
Remote = tuple[Any, Mapping[str, list[tuple[int, ...]]]]


class RunnerBase:
    """The arguments and helpers both env runners share.

    Args:
      spec: What the runner is built from (`impala_tf.driver.specs.runner_spec`).
      worker_index: 0 for the driver's own runner (evaluation), i + 1 for actor i; seeds the
        envs and the action samplers.
      explore: Sample actions (True) or take the most likely one; None: `spec.explore`.
      update_filter: Whether observations update the observation filters (False in evaluation,
        whose filters stay the driver's).
      progress: Where the runner publishes the step it is in (read by the host to say where a
        hung actor hangs).

    The runner keeps one instance of the spec's `callbacks` class and calls its episode hooks
    and `on_sample_end`.
    """

    #: {policy_id: the acting policy}, {policy_id: its observation filter} and {policy_id: the
    #: `num_grad_updates` of its weights}; filled by the subclass.
    policies: dict[str, Any]
    filters: dict[str, Filter]
    versions: dict[str, int]
    policy_ids: Sequence[str]
    #: Whether the action samplers' seeds are those of a multi-agent runner
    #: (`impala_tf.utils.seeds.sampler_seeds`).
    multi_agent: bool = False

    def __init__(
        self,
        spec: RunnerSpec,
        worker_index: int,
        explore: bool | None,
        update_filter: bool,
        progress: StepProgress | None,
    ):
        self.spec = spec
        self.worker_index = worker_index
        self.num_envs = spec.num_envs
        self.horizon = spec.horizon
        self.progress = progress if progress is not None else StepProgress()
        self.explore = spec.explore if explore is None else bool(explore)
        self._update_filter = bool(update_filter)
        where = f"actor {worker_index - 1}" if worker_index > 0 else "the driver's runner"
        self.callbacks = Callbacks(spec.callbacks, where)
        self._hooks = HookEpisodes(self)

    def _make_policy(
        self,
        policy_id: str,
        spaces: tuple[gym.Space, gym.Space],
        model: ModelSpec,
        seed: int | None,
        remote: Remote | None,
        precision: str = "float32",
        frame_stack: tuple[int, int] | None = None,
    ) -> Any:
        """The policy that acts for `policy_id`: through the driver's inference server
        (`remote`; with the env's `frame_stack`, the server keeps the stacks and takes each
        new frame once) or in this process (numpy for MLPs, TensorFlow built under `precision`
        otherwise; they act on the env's own stacks)."""
        obs_space, act_space = spaces
        if remote is not None:
            conn, state_shapes = remote
            shapes = state_shapes.get(policy_id, [])
            return RemotePolicy(
                conn, policy_id, act_space, shapes, self.explore, seed, frame_stack=frame_stack
            )
        return make_policy(
            obs_space, act_space, model, explore=self.explore, seed=seed, precision=precision
        )

    @property
    def policy_map(self) -> dict[str, Any]:
        """{policy_id: the acting policy} (RLlib's `worker.policy_map`)."""
        return dict(self.policies)

    def _policy_seeds(self, seed: int | None) -> dict[str, int | None]:
        """{policy_id: its action sampler's seed} of a runner built with `seed`."""
        return sampler_seeds(seed, self.worker_index, self.policy_ids, self.multi_agent)

    def _make_filter(self, policy_id: str, obs_space: gym.Space) -> Filter:
        """`observation_filter` for `policy_id`'s observations (a float space, if it filters)."""
        name = self.spec.observation_filter
        if name != "NoFilter" and not np.issubdtype(obs_space.dtype or np.float32, np.floating):
            raise ValueError(
                f"`observation_filter` {name!r} standardises observations and needs a float "
                f"observation space; policy {policy_id!r} has {obs_space}."
            )
        return get_filter(name, obs_space.shape)

    def _flush_filters(self) -> dict[str, Filter] | None:
        """Each filter's changes since the last fragment (merged by the driver); resets their
        buffers. None when this runner's filters do not learn."""
        if not self._update_filter or self.spec.observation_filter == "NoFilter":
            return None
        out = {}
        for pid, f in self.filters.items():
            out[pid] = f.delta()
            f.reset_buffer()
        return out

    def wrap_env(self, wrapper: Callable[[gym.Env], gym.Env]) -> gym.Env:
        """Replaces this runner's first env by `wrapper(env)` and returns the wrapper.

        The evaluation runner wraps its one env in an `impala_tf.envs.video.EpisodeRecorder`.
        Each runner keeps its gymnasium envs in the list `self.envs`.

        Raises:
          TypeError: the runner steps ale-py's native vector env (training runners only),
            whose envs are not gymnasium envs.
        """
        envs = self.envs
        if not envs:
            raise TypeError(
                f"{type(self).__name__} {self.worker_index} steps a native vector env, whose "
                "envs cannot be wrapped."
            )
        envs[0] = wrapped = wrapper(envs[0])
        return wrapped

    def run_episodes(self, num_episodes: int) -> list[Episode]:
        """Samples (each runner's `sample`) until `num_episodes` episodes have finished; returns
        the first that many."""
        done: list[Episode] = []
        while len(done) < num_episodes:
            done.extend(self.sample().episodes)
        return done[:num_episodes]

    # Weights and state ------------------------------------------------------------------------

    def set_weights(self, weights: Weights, filters: Mapping[str, Filter] | None = None) -> None:
        """Loads {policy_id: (weights, num_grad_updates)} for some or all policies (weights
        None: central inference, the driver's server holds them).

        `filters`, when given, holds the driver's merged observation filters: each policy's
        filter is synced to its own (RLlib's `sync_filters`).

        Raises:
          ValueError: a policy id this runner does not act with.
        """
        unknown = sorted(set(weights) - set(self.policies))
        if unknown:
            raise ValueError(f"Weights for {unknown}, but this runner acts with {self.policy_ids}.")
        for pid, (policy_weights, version) in weights.items():
            if policy_weights is not None:
                self.policies[pid].set_weights(policy_weights)
            self.versions[pid] = int(version)
        for pid, f in (filters or {}).items():
            if f is not None and pid in self.filters:
                self.filters[pid].sync(f)

    def get_weights(self) -> dict[str, list[np.ndarray]]:
        """{policy_id: its weights} ([] with central inference)."""
        return {pid: p.get_weights() for pid, p in self.policies.items()}

    def reset(self, seed: int | None) -> None:
        """Starts new episodes in every env, as if this runner had been built with `seed`.

        The envs are reset with the seeds `env_seed(seed, worker_index, j)` and the action
        samplers restart from their seeds; with `seed=None` both continue from unseeded
        randomness. Unfinished episodes and steps not yet emitted are dropped; weights are kept.
        """
        self._restart(seed)
        self._hooks.clear()
        for pid, seed_of in self._policy_seeds(seed).items():
            self.policies[pid].reseed(seed_of)

    def get_state(self) -> dict[str, Any]:
        """A picklable snapshot of this runner, for an exact resume (`set_state`).

        It holds each policy's weights and version, observation filter and action sampler
        state, and, when the envs can be pickled, the envs with everything in flight
        (`"envs"`, bytes). Envs that cannot be pickled (simulators holding handles, e.g. Atari)
        give `"envs": None` and the reason in `"envs_error"`: a runner restored from such a
        snapshot starts new episodes.
        """
        envs, error = None, None
        try:
            envs = pickle.dumps(self._in_flight(), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - any env may refuse; the snapshot says why.
            error = f"{type(e).__name__}: {e}"
        return {
            "weights": {
                pid: (p.get_weights(), self.versions[pid]) for pid, p in self.policies.items()
            },
            "obs_filters": {pid: f.get_state() for pid, f in self.filters.items()},
            "policy_rngs": {pid: p.get_rng_state() for pid, p in self.policies.items()},
            "envs": envs,
            "envs_error": error,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores a `get_state()` snapshot; each key is optional.

        Keys: `"weights"` ({policy_id: (weights, num_grad_updates)}); `"envs"` (bytes: replaces
        the envs and everything in flight); `"seed"` (when there are no `"envs"`: new
        episodes, as `reset(seed)`); `"obs_filters"`; `"policy_rngs"` (the action samplers'
        states, applied last). Older snapshots are read too: single-agent ones from before
        policies were keyed (a weights list, `"policy_version"`, `"obs_filter"`,
        `"policy_rng"`), and those of the earlier multi-agent runner (`"obs_filter"` keyed by
        policy id).
        """
        state = _keyed(state)
        if state.get("weights") is not None:
            self.set_weights(state["weights"])
        if state.get("envs") is not None:
            in_flight = pickle.loads(state["envs"])
            self.close()
            self._restore(in_flight, state)
            self._hooks.clear()  # The callbacks' episodes start again.
        elif "seed" in state:
            self.reset(state["seed"])
        filters = state.get("obs_filters")
        legacy = state.get("obs_filter")
        if filters is None and isinstance(legacy, Mapping) and "name" not in legacy:
            filters = legacy
        for pid, f in (filters or {}).items():
            if pid in self.filters and f is not None:
                self.filters[pid] = filter_from_state(f)
        for pid, rng in (state.get("policy_rngs") or {}).items():
            if pid in self.policies and rng is not None:
                self.policies[pid].set_rng_state(rng)

    def _restart(self, seed: int | None) -> None:
        """Resets every env with `seed` and drops everything in flight (`reset`)."""
        raise NotImplementedError

    def _in_flight(self) -> Any:
        """What `get_state` pickles into `"envs"`: the envs and everything in flight."""
        raise NotImplementedError

    def _restore(self, in_flight: Any, state: Mapping[str, Any]) -> None:
        """Takes the envs and everything in flight from `in_flight` (`_in_flight()` unpickled;
        the old envs are closed); `state` is the whole snapshot."""
        raise NotImplementedError


def _keyed(state: dict[str, Any]) -> dict[str, Any]:
    """A runner snapshot with its per-policy entries keyed by policy id (older single-agent
    snapshots held one policy's weights, filter and sampler state unkeyed)."""
    weights = state.get("weights")
    if weights is None or isinstance(weights, Mapping):
        return state
    keyed = dict(state)
    keyed["weights"] = {DEFAULT_POLICY_ID: (weights, int(state.get("policy_version", 0)))}
    for old, new in (("obs_filter", "obs_filters"), ("policy_rng", "policy_rngs")):
        if state.get(old) is not None:
            keyed[new] = {DEFAULT_POLICY_ID: state[old]}
    return keyed
