"""What the two env runners share: their arguments, how a policy and its filter are made, the
filters' changes sent with a fragment, the episode callbacks' bookkeeping, and `run_episodes`.

`EnvRunner` (one policy, a vector of gymnasium envs) and `MultiAgentEnvRunner` (several policies
over multi-agent envs) differ in how they step envs and cut sequences; everything here is written
once so that the two cannot drift.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import gymnasium as gym
import numpy as np

from impala_tf.acting.factory import make_policy
from impala_tf.acting.filters import Filter, get_filter
from impala_tf.acting.remote_policy import RemotePolicy
from impala_tf.config.callbacks import Callbacks
from impala_tf.config.callbacks import Episode as CallbackEpisode
from impala_tf.envs.faults import StepProgress
from impala_tf.models.spec import ModelSpec
from impala_tf.rollout.fragment import Episode
from impala_tf.rollout.spec import RunnerSpec

__all__ = ["RunnerBase"]

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
        self._episode_count = 0

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

    def _hook_args(self) -> dict[str, Any]:
        """The arguments every episode hook gets besides `episode` and `env_index`."""
        return {"worker": self, "base_env": self.base_env, "policies": self.policy_map}

    def _new_hook_episode(self, env_index: int) -> CallbackEpisode:
        """A new callbacks `Episode` of env `env_index` (a unique id within the run)."""
        self._episode_count += 1
        episode_id = self.worker_index * 1_000_000_000 + self._episode_count
        return CallbackEpisode(episode_id, env_index, self.worker_index)

    def _make_filter(self, policy_id: str, obs_space: gym.Space) -> Filter:
        """`observation_filter` for `policy_id`'s observations (a float space, if it filters)."""
        name = self.spec.observation_filter
        if name != "NoFilter" and not np.issubdtype(obs_space.dtype or np.float32, np.floating):
            raise ValueError(
                f"`observation_filter` {name!r} standardises observations and needs a float "
                f"observation space; policy {policy_id!r} has {obs_space}."
            )
        return get_filter(name, obs_space.shape)

    def _filter_deltas(self, filters: Mapping[str, Filter]) -> dict[str, Filter] | None:
        """Each filter's changes since the last fragment (merged by the driver); resets their
        buffers. None when this runner's filters do not learn."""
        if not self._update_filter or self.spec.observation_filter == "NoFilter":
            return None
        out = {}
        for pid, f in filters.items():
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
