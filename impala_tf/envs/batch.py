"""Env batches: the B envs of one env runner, stepped together (B = `num_envs_per_env_runner`).

Two implementations behind one interface, so the env runner has one stepping loop:

* `GymEnvBatch`: a list of gymnasium envs stepped one after another in Python (any env; the
  CartPole path, unchanged in cost);
* `AtariVectorEnvBatch`: ale-py's native `AtariVectorEnv` (C++ threads step and preprocess all
  B envs; `impala_tf.envs.atari.vector_env_kwargs` decides when it applies).

`step(actions)` returns the next observation of every env, with finished episodes already reset
(the reset observation replaces the one the episode ended on, which is kept in `final_obs` for
truncated envs so the runner can bootstrap from it). Episodes as the learner sees them
(`terminateds`/`truncateds`) may be shorter than the episodes the runner reports: with episodic
life a lost life terminates the training episode while the game, the reported episode, goes on
(`episode_ends`).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np

__all__ = ["AtariVectorEnvBatch", "BatchStep", "EnvBatch", "GymEnvBatch"]


@dataclasses.dataclass
class BatchStep:
    """What one step of an env batch returns (B = number of envs).

    Attributes:
      obs: [B, ...] next observations; a reset observation where an episode ended.
      rewards: float64 [B] raw (unclipped) rewards.
      terminateds: bool [B] the training episode terminated (no bootstrapping).
      truncateds: bool [B] the episode was cut by a time limit (and not terminated).
      final_obs: Row -> the observation a truncated episode ended on.
      episode_ends: bool [B] the reported episode (the whole game for Atari) ended.
    """

    obs: np.ndarray
    rewards: np.ndarray
    terminateds: np.ndarray
    truncateds: np.ndarray
    final_obs: dict[int, np.ndarray]
    episode_ends: np.ndarray


class EnvBatch(abc.ABC):
    """B envs stepped together; spaces are those of one env."""

    num_envs: int
    observation_space: gym.Space
    action_space: gym.Space

    @abc.abstractmethod
    def reset(self, seeds: Sequence[int | None]) -> np.ndarray:
        """Starts new episodes in every env (env j seeded with `seeds[j]`); returns [B, ...]."""

    @abc.abstractmethod
    def step(self, actions: np.ndarray) -> BatchStep:
        """Steps every env with its row of `actions`; finished episodes are reset."""

    @abc.abstractmethod
    def close(self) -> None:
        """Releases the envs."""


class GymEnvBatch(EnvBatch):
    """A list of gymnasium envs, stepped in turn.

    An env may mark a training-episode end that is not a reported-episode end with
    `info["game_over"] = False` (episodic life, `impala_tf.envs.atari`); it is still reset, and
    its `reset()` continues the game.

    Args:
      envs: The envs (same spaces).
    """

    def __init__(self, envs: Sequence[gym.Env]):
        if not envs:
            raise ValueError("GymEnvBatch needs at least one env.")
        self.envs = list(envs)
        self.num_envs = len(self.envs)
        self.observation_space = self.envs[0].observation_space
        self.action_space = self.envs[0].action_space
        self._dtype = self.observation_space.dtype or np.float32

    def reset(self, seeds: Sequence[int | None]) -> np.ndarray:
        return np.stack(
            [
                np.asarray(env.reset(seed=seed)[0], dtype=self._dtype)
                for env, seed in zip(self.envs, seeds)
            ]
        )

    def step(self, actions: np.ndarray) -> BatchStep:
        n = self.num_envs
        rewards = np.empty(n, np.float64)
        terminateds = np.zeros(n, bool)
        truncateds = np.zeros(n, bool)
        ends = np.zeros(n, bool)
        final_obs: dict[int, np.ndarray] = {}
        next_obs = None
        for j, env in enumerate(self.envs):
            obs, reward, terminated, truncated, info = env.step(actions[j])
            rewards[j] = reward
            if terminated or truncated:
                terminateds[j] = terminated
                truncateds[j] = truncated and not terminated
                if truncateds[j]:
                    final_obs[j] = np.asarray(obs, dtype=self._dtype)
                ends[j] = info.get("game_over", True)
                obs = env.reset()[0]
            obs = np.asarray(obs, dtype=self._dtype)
            if next_obs is None:
                next_obs = np.empty((n, *obs.shape), self._dtype)
            next_obs[j] = obs
        return BatchStep(next_obs, rewards, terminateds, truncateds, final_obs, ends)

    def close(self) -> None:
        for env in self.envs:
            env.close()


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
      kwargs: `AtariVectorEnv` arguments (`impala_tf.envs.atari.vector_env_kwargs`).
    """

    def __init__(self, **kwargs: Any):
        from ale_py.vector_env import AtariVectorEnv
        from gymnasium.vector import AutoresetMode

        self.env = AtariVectorEnv(**kwargs, autoreset_mode=AutoresetMode.SAME_STEP)
        self.num_envs = int(kwargs["num_envs"])
        k, height, width = self.env.single_observation_space.shape
        self.observation_space = gym.spaces.Box(0, 255, (height, width, k), np.uint8)
        self.action_space = self.env.single_action_space
        self._frame = np.zeros(self.num_envs, np.int64)
        self._stack = k
        # Steps since each env's last reset, capped at k - 1 (then no padding is left).
        self._age = np.zeros(self.num_envs, np.int64)

    @staticmethod
    def _channels_last(obs: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(np.moveaxis(obs, -3, -1))

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
        obs, rewards, terminated, truncated, info = self.env.step(
            np.asarray(actions, np.int64).reshape(self.num_envs)
        )
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
        return BatchStep(
            self._unpad(self._channels_last(obs)),
            np.asarray(rewards, np.float64),
            terminated,
            truncated,
            final_obs,
            ends,
        )

    def close(self) -> None:
        self.env.close()
