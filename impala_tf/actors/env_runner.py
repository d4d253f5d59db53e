"""`EnvRunner`: steps a set of gymnasium envs with a policy and cuts rollout fragments.

The policy is `impala_tf.numpy_policy.make_policy`'s choice: numpy for MLPs, TensorFlow for the
rest; it has no weights until `set_weights` (the driver broadcasts them before any sample).

One env runner (RLlib's "env runner" / "rollout worker") owns `num_envs_per_env_runner` envs and
steps them together, one batched policy call per time step. `sample()` returns a `Fragment`: a
`SampleBatch` of B = num_envs sequences of T = `rollout_fragment_length` steps, per-step columns
shaped [B, T, ...] (`truncate_episodes`: episodes continue across fragments), plus the returns and
lengths of the episodes that finished in it. Recurrent policies add `state_in_i` [B, C, H]: the
state at the start of each of the C = ceil(T / `model.max_seq_len`) sequences the learner trains
on (`impala_tf.sequences`).

Fragments leave `sample()` unpacked; the actor process packs their observations for transport
(`impala_tf.frames.encode_observations`: frame-stack coding, and zlib with RLlib's
`compress_observations`), and the aggregation workers or the driver unpack them.

Box actions reach the env unsquashed from [-1, 1] to the space's bounds (`normalize_actions`)
or clipped (`clip_actions`), as `impala_tf.actions` says; the fragment keeps the policy's own
actions, as RLlib's sample batches do.

Rewards are clipped for training as RLlib's `clip_rewards` says (True: to their sign, x: to
[-x, x]; None: the sign for Atari with DeepMind preprocessing, else no clipping); episode returns
are reported unclipped, and per game for Atari with episodic life (`impala_tf.envs.atari`).

The envs are an `impala_tf.envs.batch.EnvBatch`: ale-py's native vector env for Atari where it
covers the config (training runners only), else a list of gymnasium envs.

`values_bootstrapped[t]` is the behaviour value of the observation that follows step t in the same
episode: V(x_{t+1}) from the next step's policy call, 0 after a termination, and V(final
observation) after a truncation (computed by one extra batched call on the truncated envs).

With `observation_filter: MeanStdFilter` every observation the envs return passes through the
runner's filter (`impala_tf.filters`) before the policy sees it, and the `obs` column holds the
filtered observations; each fragment carries the filter's changes (`filter_delta`) for the driver
to merge, and `set_weights` syncs the filter to the driver's merged one.

`policy_version[t]` (int64) is the `num_grad_updates` of the weights that chose step t's action.
The runner computes each step's action one step ahead (the value of the next observation is the
previous step's bootstrap value), so after `set_weights` the first step of the next fragment was
still chosen by the previous weights; this column says so, and the learner's
`diff_num_grad_updates_vs_sampler_policy` is computed from it.

Faults (see `impala_tf.envs.faults`): an env that raises in `reset`/`step`, returns an
observation of the wrong shape or dtype, or a NaN/infinite observation or reward raises an
`EnvError` naming the env, the actor, the env index and the step. With
`drop_nonfinite_episodes=True` a non-finite reward or observation instead ends its episode at
that step: the step trains as a truncation with reward 0 and bootstrap value V(x_t) (never the
non-finite data), the episode's return is not reported, and the fragment counts it in
`num_nonfinite_episodes_dropped`. A non-finite first observation (from `reset`) is always an
error.
"""

from __future__ import annotations

import dataclasses
import pickle
import time
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np

from impala_tf.actions import ActionAdapter
from impala_tf.config import ImpalaConfig
from impala_tf.envs import atari
from impala_tf.envs.batch import AtariVectorEnvBatch, EnvBatch, GymEnvBatch
from impala_tf.envs.faults import EnvGuard, StepProgress, env_name
from impala_tf.filters import Filter, filter_from_state, get_filter
from impala_tf.numpy_policy import make_policy
from impala_tf.sample_batch import SampleBatch

__all__ = [
    "EnvContext",
    "EnvRunner",
    "Fragment",
    "POLICY_VERSION",
    "make_env",
    "make_env_batch",
    "env_seed",
]

#: Per-step column: `num_grad_updates` of the weights that chose the step's action (int64 [B, T]).
POLICY_VERSION = "policy_version"

#: Seeds of env j in env runner i are `seed + i * _MAX_ENVS_PER_RUNNER + j`, as RLlib derives them.
_MAX_ENVS_PER_RUNNER = 1000


class EnvContext(dict):
    """The `env_config` dict handed to a user's env creator, with RLlib's extra attributes.

    Attributes:
      worker_index: 1-based index of the env runner (0 is the driver/evaluation).
      vector_index: Index of the env within its runner.
      num_workers: Number of env runners.
    """

    def __init__(self, env_config: dict, worker_index: int, vector_index: int, num_workers: int):
        super().__init__(env_config or {})
        self.worker_index = worker_index
        self.vector_index = vector_index
        self.num_workers = num_workers


def env_seed(seed: int | None, worker_index: int, vector_index: int) -> int | None:
    """The seed of env `vector_index` of env runner `worker_index` (None if `seed` is None)."""
    if seed is None:
        return None
    return int(seed) + worker_index * _MAX_ENVS_PER_RUNNER + vector_index


def make_env(config: ImpalaConfig, worker_index: int = 0, vector_index: int = 0) -> gym.Env:
    """Creates one env from `config.env`: a registered gymnasium id or an `env_creator` callable.

    A gymnasium id is made with `gym.make(id, **env_config)`; a callable is called with an
    `EnvContext` holding `env_config` (RLlib's convention). An Atari env gets DeepMind
    preprocessing when `preprocessor_pref` is "deepmind" (`impala_tf.envs.atari`), with
    episodic life only for training runners (`worker_index >= 1`; 0 is evaluation).
    """
    env: str | Callable[..., gym.Env] | None = config.env
    if env is None:
        raise ValueError("`env` is not set: pass a gymnasium id or an env_creator(env_config)")
    if callable(env):
        context = EnvContext(config.env_config, worker_index, vector_index, config.num_env_runners)
        made = env(context)
        if not isinstance(made, gym.Env):
            raise TypeError(f"env_creator {env!r} returned {type(made).__name__}, not a gym.Env")
        if atari.deepmind_enabled(config) and atari.is_atari(made):
            return atari.wrap_deepmind(made, config.model, training=worker_index > 0)
        return made
    import impala_tf.envs  # noqa: F401 - registers the shipped envs in this (actor) process.

    if atari.is_atari(env, config.env_config):
        return atari.make_atari_env(env, config, training=worker_index > 0)
    return gym.make(env, **(config.env_config or {}))


def make_env_batch(
    config: ImpalaConfig, worker_index: int, num_envs: int, guard: EnvGuard | None = None
) -> EnvBatch:
    """The `num_envs` envs of env runner `worker_index`, as one `EnvBatch`.

    Training runners (`worker_index >= 1`) of an Atari config that ale-py's `AtariVectorEnv`
    covers (`atari.vector_env_kwargs`) get it; everything else gets `make_env` envs. `guard`
    calls and checks the envs (`impala_tf.envs.faults.EnvGuard`).
    """
    seeds = [env_seed(config.seed, worker_index, j) for j in range(num_envs)]
    if worker_index >= 1 and all(s is None or s > 0 for s in seeds):
        kwargs = atari.vector_env_kwargs(config, training=True, num_envs=num_envs)
        if kwargs is not None:
            return AtariVectorEnvBatch(guard=guard, **kwargs)
    return GymEnvBatch([make_env(config, worker_index, j) for j in range(num_envs)], guard)


@dataclasses.dataclass
class Fragment:
    """What an env runner sends per sample request.

    Attributes:
      batch: `SampleBatch` of [B, T, ...] sequences (B = num_envs_per_env_runner).
      episode_returns: Returns of the episodes that ended in this fragment.
      episode_lengths: Their lengths in steps.
      policy_version: `num_grad_updates` of the weights loaded when the fragment was sampled
        (0 before any broadcast). The first step may have been chosen by older weights: the
        per-step `POLICY_VERSION` column of `batch` has the version of each step.
      actor_id: Index of the actor that produced it (0-based).
      sample_time_s: Wall time spent producing it.
      filter_delta: The observation filter's changes while sampling it (`Filter.delta()`),
        for the driver to merge; None without a filter.
      num_nonfinite_episodes_dropped: Episodes cut for a non-finite observation or reward
        (`drop_nonfinite_episodes`).
    """

    batch: SampleBatch
    episode_returns: list[float]
    episode_lengths: list[int]
    policy_version: int
    actor_id: int = 0
    sample_time_s: float = 0.0
    filter_delta: Filter | None = None
    num_nonfinite_episodes_dropped: int = 0

    @property
    def env_steps(self) -> int:
        return self.batch.env_steps


class EnvRunner:
    """Steps `num_envs_per_env_runner` envs with a policy and returns fragments.

    Args:
      config: The algorithm config (env, env_config, model, rollout_fragment_length,
        num_envs_per_env_runner, seed, explore, gamma).
      worker_index: 1-based index of this runner; it derives the env and sampling seeds.
      explore: Overrides `config.explore` (evaluation passes False).
      update_filter: Update the observation filter (`observation_filter`) with the observations
        seen (actors); False applies it unchanged (evaluation).
      progress: Where the runner is (step, env index, phase), shared with the driver so that
        a hang can be reported with its place (`impala_tf.envs.faults.StepProgress`).
      remote: With central inference (`impala_tf.inference`): this actor's pipe to the driver's
        inference server and the per-env shapes of the model's recurrent state. The runner then
        acts through a `RemotePolicy` and never imports TensorFlow.
    """

    def __init__(
        self,
        config: ImpalaConfig,
        worker_index: int = 1,
        explore: bool | None = None,
        update_filter: bool = True,
        progress: StepProgress | None = None,
        remote: tuple[Any, list[tuple[int, ...]]] | None = None,
    ):
        self.config = config
        self.worker_index = worker_index
        self.num_envs = int(config.num_envs_per_env_runner)
        self.horizon = int(config.rollout_fragment_length)
        self.progress = progress if progress is not None else StepProgress()
        who = f"actor {worker_index - 1}" if worker_index > 0 else "the driver"
        self._guard = EnvGuard(
            env_name(config.env),
            who,
            drop_nonfinite=bool(config.drop_nonfinite_episodes),
            progress=self.progress,
        )
        self.env_batch = make_env_batch(config, worker_index, self.num_envs, self._guard)
        self.observation_space = self.env_batch.observation_space
        self.action_space = self.env_batch.action_space
        explore = config.explore if explore is None else explore
        seed = env_seed(config.seed, worker_index, 0)
        if remote is not None:
            from impala_tf.inference import RemotePolicy

            conn, state_shapes = remote
            self.policy = RemotePolicy(conn, self.action_space, state_shapes, explore, seed)
        else:
            self.policy = make_policy(
                self.observation_space, self.action_space, config.model, explore=explore, seed=seed
            )
        self.policy_version = 0
        self.obs_filter = get_filter(config.observation_filter, self.observation_space.shape)
        self._update_filter = bool(update_filter)
        if config.observation_filter != "NoFilter" and not np.issubdtype(
            self.observation_space.dtype or np.float32, np.floating
        ):
            raise ValueError(
                f"`observation_filter` {config.observation_filter!r} standardises observations "
                f"and needs a float observation space, got {self.observation_space}."
            )
        self._next_version = 0  # The version of the weights that computed `self._next`.
        self._obs_dtype = self.observation_space.dtype or np.float32
        self._env_actions = ActionAdapter(
            self.action_space, config.normalize_actions, config.clip_actions
        )
        is_atari = isinstance(self.env_batch, AtariVectorEnvBatch) or atari.is_atari(
            self.env_batch.envs[0]
        )
        self._clip_rewards = atari.clip_rewards_for(config, is_atari)
        # Raw until the first policy step filters them (after the driver's filter has arrived).
        self._obs = self._reset_all(config.seed)
        self._obs_filtered = False
        self._state = self.policy.initial_state(self.num_envs)
        self._episode_return = np.zeros(self.num_envs, np.float64)
        self._episode_length = np.zeros(self.num_envs, np.int64)
        self._guard.episode_length = self._episode_length  # Updated in place; for messages.
        self._next = None  # The policy step for self._obs, computed ahead.

    @property
    def envs(self) -> list[gym.Env]:
        """The gymnasium envs (empty when a native vector env steps them)."""
        return getattr(self.env_batch, "envs", [])

    def _reset_all(self, seed: int | None) -> np.ndarray:
        seeds = [env_seed(seed, self.worker_index, j) for j in range(self.num_envs)]
        return np.asarray(self.env_batch.reset(seeds), dtype=self._obs_dtype)

    def _filter(self, obs: np.ndarray) -> np.ndarray:
        """Applies the observation filter to a batch of raw observations [N, *obs_shape]."""
        return self.obs_filter(obs, update=self._update_filter)

    def set_weights(
        self,
        weights: list[np.ndarray] | None,
        policy_version: int = 0,
        obs_filter: Filter | None = None,
    ) -> None:
        """Loads new policy weights; `policy_version` is the learner's `num_grad_updates`.

        `weights` is None with central inference (the driver's server holds them).
        `obs_filter`, when given, is the driver's merged observation filter: this runner's
        filter is synced to it (RLlib's `sync_filters`).
        """
        if weights is not None:
            self.policy.set_weights(weights)
        self.policy_version = int(policy_version)
        if obs_filter is not None:
            self.obs_filter.sync(obs_filter)

    def get_weights(self) -> list[np.ndarray]:
        return self.policy.get_weights()

    def sample(self) -> Fragment:
        """Steps every env `rollout_fragment_length` times and returns the fragment."""
        start = time.perf_counter()
        horizon, n = self.horizon, self.num_envs
        if self._next is None:
            if not self._obs_filtered:
                self._obs, self._obs_filtered = self._filter(self._obs), True
            self._next = self.policy.step(self._obs, self._state)
            self._next_version = self._version_of(self._next)
        first = self._next
        version_buf = np.empty((horizon, n), np.int64)
        obs_buf = np.empty((horizon, n, *self._obs.shape[1:]), self._obs.dtype)
        act_buf = np.empty((horizon, n, *first.actions.shape[1:]), first.actions.dtype)
        logits_buf = np.empty((horizon, n, first.logits.shape[-1]), np.float32)
        logp_buf = np.empty((horizon, n), np.float32)
        vf_buf = np.empty((horizon, n), np.float32)
        vb_buf = np.empty((horizon, n), np.float32)
        rew_buf = np.empty((horizon, n), np.float32)
        term_buf = np.zeros((horizon, n), bool)
        trunc_buf = np.zeros((horizon, n), bool)
        # The recurrent state at the start of each `max_seq_len` sequence (impala_tf.sequences).
        seq_len = int(self.config.model["max_seq_len"])
        starts: list[tuple[np.ndarray, ...]] = []
        returns: list[float] = []
        lengths: list[int] = []
        num_dropped = 0

        for t in range(horizon):
            if t % seq_len == 0:
                starts.append(self._state)
            step = self._next
            version_buf[t] = self._next_version
            obs_buf[t] = self._obs
            act_buf[t] = step.actions
            logits_buf[t] = step.logits
            logp_buf[t] = step.logp
            vf_buf[t] = step.values
            # The batch keeps the policy's actions; only the env sees them unsquashed/clipped.
            env_actions = self._env_actions(step.actions)
            stepped = self.env_batch.step(env_actions)
            next_obs = self._filter(stepped.obs.astype(self._obs_dtype, copy=False))
            final_obs = stepped.final_obs
            rew_buf[t] = stepped.rewards
            term_buf[t] = stepped.terminateds
            trunc_buf[t] = stepped.truncateds
            self._episode_return += stepped.rewards
            self._episode_length += 1
            for j in np.flatnonzero(stepped.episode_ends):
                returns.append(float(self._episode_return[j]))
                lengths.append(int(self._episode_length[j]))
                self._episode_return[j] = 0.0
                self._episode_length[j] = 0
            dropped = np.flatnonzero(stepped.dropped)  # Cut for non-finite data; not reported.
            if dropped.size:
                self._episode_return[dropped] = 0.0
                self._episode_length[dropped] = 0
                num_dropped += dropped.size
            state = step.state
            if final_obs:
                rows = np.fromiter(final_obs, np.int64)
                final = self.policy.step(
                    self._filter(
                        np.stack([final_obs[j] for j in rows]).astype(self._obs_dtype, copy=False)
                    ),
                    tuple(s[rows] for s in state),
                )
            dones = term_buf[t] | trunc_buf[t]
            if state and dones.any():
                state = tuple(np.where(dones[:, None], 0.0, s).astype(s.dtype) for s in state)
            self._obs, self._state = next_obs, state
            self._next = self.policy.step(next_obs, state)
            self._next_version = self._version_of(self._next)
            vb_buf[t] = np.where(term_buf[t], 0.0, self._next.values)
            if final_obs:
                vb_buf[t, rows] = final.values
            if dropped.size:
                # Bootstrapping from the non-finite observation would poison the targets.
                vb_buf[t, dropped] = vf_buf[t, dropped]

        self.progress.set(self._guard.steps, -1, StepProgress.IDLE)
        if self._clip_rewards is True:
            rew_buf = np.sign(rew_buf)
        elif self._clip_rewards:
            rew_buf = np.clip(rew_buf, -self._clip_rewards, self._clip_rewards)

        def seq(x):  # [T, B, ...] -> [B, T, ...]
            return np.ascontiguousarray(np.swapaxes(x, 0, 1))

        columns: dict[str, Any] = {
            "obs": seq(obs_buf),
            "actions": seq(act_buf),
            "rewards": seq(rew_buf),
            "terminateds": seq(term_buf),
            "truncateds": seq(trunc_buf),
            "action_dist_inputs": seq(logits_buf),
            "action_logp": seq(logp_buf),
            "vf_preds": seq(vf_buf),
            "values_bootstrapped": seq(vb_buf),
            POLICY_VERSION: seq(version_buf),
        }
        for i in range(len(starts[0])):
            columns[f"state_in_{i}"] = np.stack([start[i] for start in starts], axis=1)
        return Fragment(
            batch=SampleBatch(columns),
            episode_returns=returns,
            episode_lengths=lengths,
            policy_version=max(self.policy_version, int(version_buf.max())),
            actor_id=self.worker_index - 1,
            sample_time_s=time.perf_counter() - start,
            filter_delta=self._flush_filter(),
            num_nonfinite_episodes_dropped=num_dropped,
        )

    def _version_of(self, step) -> int:
        """The weights' version that computed `step` (the server's, with central inference)."""
        version = getattr(step, "version", None)  # Steps pickled before versions: None.
        return self.policy_version if version is None else int(version)

    def _flush_filter(self) -> Filter | None:
        """The filter's changes since the last fragment (for the driver); resets its buffer."""
        if not self._update_filter:
            return None
        delta = self.obs_filter.delta()
        self.obs_filter.reset_buffer()
        return delta

    # Resuming ---------------------------------------------------------------------------------

    def reset(self, seed: int | None) -> None:
        """Starts new episodes in every env, as if this runner had been built with `seed`.

        The envs are reset with the seeds `env_seed(seed, worker_index, j)` and the action
        sampler restarts from `env_seed(seed, worker_index, 0)`; with `seed=None` both continue
        from unseeded randomness. Unfinished episodes are dropped; weights are kept.
        """
        self._obs = self._reset_all(seed)
        self._obs_filtered = False
        self.policy.reseed(env_seed(seed, self.worker_index, 0))
        self._state = self.policy.initial_state(self.num_envs)
        self._episode_return[:] = 0.0
        self._episode_length[:] = 0
        self._next = None

    def get_state(self) -> dict[str, Any]:
        """A picklable snapshot of this runner, for an exact resume (`set_state`).

        It holds the weights and their version, the action sampler's state, and, when the envs
        can be pickled, the envs with their unfinished episodes (`"envs"`, bytes). Envs that
        cannot be pickled (simulators holding handles, e.g. Atari) give `"envs": None` and the
        reason in `"envs_error"`: a runner restored from such a snapshot starts new episodes.
        """
        envs, error = None, None
        try:
            envs = pickle.dumps(
                (
                    self.env_batch,
                    self._obs,
                    self._state,
                    self._episode_return,
                    self._episode_length,
                    self._next,
                ),
                protocol=pickle.HIGHEST_PROTOCOL,
            )
        except Exception as e:  # noqa: BLE001 - any env may refuse; the snapshot says why.
            error = f"{type(e).__name__}: {e}"
        return {
            "weights": self.get_weights(),
            "policy_version": self.policy_version,
            "next_version": self._next_version,
            "obs_filter": self.obs_filter.get_state(),
            "obs_filtered": self._obs_filtered,
            "policy_rng": self.policy.get_rng_state(),
            "envs": envs,
            "envs_error": error,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores a `get_state()` snapshot; each key is optional.

        Keys: `"weights"` (with `"policy_version"`); `"envs"` (bytes: replaces the envs and
        their unfinished episodes); `"seed"` (when there are no `"envs"`: new episodes, as
        `reset(seed)`); `"policy_rng"` (the action sampler's state, applied last).
        """
        if state.get("weights") is not None:
            self.set_weights(state["weights"], state.get("policy_version", 0))
        if state.get("envs") is not None:
            envs, obs, rnn_state, returns, lengths, next_step = pickle.loads(state["envs"])
            self.close()
            # Snapshots taken before env batches existed hold a list of envs.
            if isinstance(envs, list):
                envs = GymEnvBatch(envs, self._guard)
            else:  # Batches pickle without their guard (it holds the shared progress array).
                envs.guard = self._guard
            self.env_batch = envs
            self._obs, self._state, self._next = obs, rnn_state, next_step
            self._episode_return, self._episode_length = returns, lengths
            self._guard.episode_length = self._episode_length
            self._next_version = int(state.get("next_version", self.policy_version))
            self._obs_filtered = bool(state.get("obs_filtered", next_step is not None))
        elif "seed" in state:
            self.reset(state["seed"])
        if state.get("obs_filter") is not None:
            self.obs_filter = filter_from_state(state["obs_filter"])
        if state.get("policy_rng") is not None:
            self.policy.set_rng_state(state["policy_rng"])

    def run_episodes(self, num_episodes: int) -> list[tuple[float, int]]:
        """Samples until `num_episodes` episodes have finished; returns (return, length) pairs."""
        done: list[tuple[float, int]] = []
        while len(done) < num_episodes:
            fragment = self.sample()
            done.extend(zip(fragment.episode_returns, fragment.episode_lengths))
        return done[:num_episodes]

    def close(self) -> None:
        self.env_batch.close()
