"""ale-py's native Atari vector env as an `EnvBatch` (`impala_tf.envs.batch`).

ale-py's `AtariVectorEnv` steps and preprocesses the B envs of one env runner in C++ threads
(B = `num_envs_per_env_runner`). `impala_tf.envs.atari.vector_env_kwargs` decides when its
options cover a config, and `impala_tf.envs.make.make_env_batch` then builds an
`AtariVectorEnvBatch` in place of wrapped `gym.make` envs; the two paths give the same
observations (`impala_tf.envs.atari`). This module turns the vector env's output into the
runner's `BatchStep`: channels-last frame stacks [B, H, W, k], the stack slots a reset left
empty filled, and game ends told apart from life losses.

Its envs cannot be pickled (ale-py's interface holds C++ handles), so an env runner's snapshot
of them is None (`impala_tf.rollout.env_runner.EnvRunner.get_state`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np

from impala_tf.envs.batch import BatchStep, EnvBatch
from impala_tf.envs.faults import EnvCallError, EnvGuard, StepProgress

__all__ = ["AtariVectorEnvBatch"]


class AtariVectorEnvBatch(EnvBatch):
    """ale-py's `AtariVectorEnv` (synchronous, `SAME_STEP` autoreset), channels last.

    The vector env returns frame stacks channels-first `[B, k, H, W]`; they are transposed to
    `[B, H, W, k]`, the layout of the wrapper path and of RLlib's `FrameStack`. With
    `SAME_STEP` autoreset an ended game returns its reset observation in the same step (the
    final one is in `info["final_obs"]`), so no step is lost to a reset. A life loss
    (`life_loss_info`) reports `terminated` while the game continues; a game end is told apart
    by the episode frame number, which restarts only when the env resets.

    ale-py 0.12 pads the frame stack of a reset env with zero frames; for the first `k - 1`
    steps after a reset those slots are filled with the reset frame here, as RLlib's
    `FrameStack` (and `DeepMindPreprocessing`) do.

    Args:
      guard: Names the env and step when the vector env raises (a default one when None).
      kwargs: `AtariVectorEnv` arguments (`impala_tf.envs.atari.vector_env_kwargs`).
    """

    def __init__(self, guard: EnvGuard | None = None, **kwargs: Any):
        from ale_py.vector_env import AtariVectorEnv
        from gymnasium.vector import AutoresetMode

        self.env = AtariVectorEnv(**kwargs, autoreset_mode=AutoresetMode.SAME_STEP)
        self.num_envs = int(kwargs["num_envs"])
        k, height, width = self.env.single_observation_space.shape
        self.observation_space = gym.spaces.Box(0, 255, (height, width, k), np.uint8)
        self.action_space = self.env.single_action_space
        self._frame = np.zeros(self.num_envs, np.int64)
        self._stack = k
        self.frame_stack = (k, 1) if k > 1 else None
        # Steps since each env's last reset, capped at k - 1 (then no padding is left).
        self._age = np.zeros(self.num_envs, np.int64)
        self.guard = guard if guard is not None else EnvGuard("(unnamed)", "an env batch")
        self.guard.bind(self.observation_space)

    @staticmethod
    def _channels_last(obs: np.ndarray) -> np.ndarray:
        """ale-py's stacks [..., k, H, W] as [..., H, W, k], a new C-contiguous array.

        One strided write per stacked frame: on Pong's [16, 4, 42, 42] stacks it takes about a
        third of the time of one transposing copy (`np.ascontiguousarray(np.moveaxis(...))`).
        """
        k = obs.shape[-3]
        out = np.empty((*obs.shape[:-3], *obs.shape[-2:], k), obs.dtype)
        for i in range(k):
            out[..., i] = obs[..., i, :, :]
        return out

    def _unpad(self, obs: np.ndarray) -> np.ndarray:
        """Replaces the zero frames a reset left in the stacks by the reset frame. [B, H, W, k]."""
        for j in np.flatnonzero(self._age < self._stack - 1):
            first = self._stack - 1 - self._age[j]  # The slot holding the reset frame.
            obs[j, ..., :first] = obs[j, ..., first : first + 1]
        return obs

    def reset(self, seeds: Sequence[int | None]) -> np.ndarray:
        if all(s is None for s in seeds):
            obs, info = self.env.reset()
        else:
            # ale-py ignores a seed <= 0 (keeps its own stream); env seeds here are >= 1000.
            obs, info = self.env.reset(
                seed=np.array([-1 if s is None else int(s) for s in seeds], np.int64)
            )
        self._frame = np.asarray(info["episode_frame_number"], np.int64)
        self._age[:] = 0
        return self._unpad(self._channels_last(obs))

    def step(self, actions: np.ndarray) -> BatchStep:
        guard = self.guard
        guard.progress.set(guard.steps, -1, StepProgress.STEP)
        try:
            obs, rewards, terminated, truncated, info = self.env.step(
                np.asarray(actions, np.int64).reshape(self.num_envs)
            )
        except Exception as e:
            raise EnvCallError(
                f"env {guard.label} ({guard.who}, ale-py vector env) at step {guard.steps}: "
                f"step() raised {type(e).__name__}: {e}"
            ) from e
        guard.progress.set(guard.steps + 1, -1, StepProgress.POLICY)
        guard.steps += 1
        frame = np.asarray(info["episode_frame_number"], np.int64)
        terminated = np.asarray(terminated, bool)
        truncated = np.asarray(truncated, bool) & ~terminated
        reset = frame <= self._frame
        self._frame = frame
        self._age = np.where(reset, 0, np.minimum(self._age + 1, self._stack - 1))
        final_obs: dict[int, np.ndarray] = {}
        if truncated.any():
            last = self._channels_last(info["final_obs"])
            final_obs = {int(j): last[j] for j in np.flatnonzero(truncated)}
        ends = (terminated | truncated) & reset
        infos = ended_obs = None
        if self.collect_infos:
            infos = [
                {k: v[j] for k, v in info.items() if not k.startswith("_")}
                for j in range(self.num_envs)
            ]
            ended = np.flatnonzero(reset)
            ended_obs = {}
            if ended.size and "final_obs" in info:
                last = self._channels_last(info["final_obs"])
                ended_obs = {int(j): last[j] for j in ended}
        return BatchStep(
            self._unpad(self._channels_last(obs)),
            np.asarray(rewards, np.float64),
            terminated,
            truncated,
            final_obs,
            ends,
            np.zeros(self.num_envs, bool),  # ALE's uint8 frames and integer scores are finite.
            reset if self.frame_stack is not None else None,  # A reset stack is refilled.
            infos,
            ended_obs,
        )

    def close(self) -> None:
        self.env.close()
