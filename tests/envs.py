"""Env creators used by the runtime tests (importable by actor processes as `tests.envs`)."""

from __future__ import annotations

import time

import gymnasium as gym
import numpy as np


class _Faulty(gym.Wrapper):
    def __init__(self, env: gym.Env, fail_after: int, sleep_s: float):
        super().__init__(env)
        self._steps = 0
        self._fail_after = fail_after
        self._sleep_s = sleep_s

    def step(self, action):
        self._steps += 1
        if self._sleep_s:
            time.sleep(self._sleep_s)
        if self._fail_after and self._steps > self._fail_after:
            raise RuntimeError(f"faulty env raised after {self._fail_after} steps")
        return self.env.step(action)


def faulty_cartpole(env_config) -> gym.Env:
    """CartPole that raises after `fail_after` steps and sleeps `sleep_s` per step."""
    return _Faulty(
        gym.make("CartPole-v1"),
        fail_after=int(env_config.get("fail_after", 0)),
        sleep_s=float(env_config.get("sleep_s", 0.0)),
    )


def broken_env(env_config) -> gym.Env:
    """An env creator that always raises."""
    raise ValueError("this env cannot be built")


class StackedFrames(gym.Env):
    """Random uint8 frames in a DeepMind-style stack of k: each step shifts the stack by one.

    Observations are [size, size, k * channels]: the k newest frames, oldest first. A reset
    fills the stack with k copies of the first frame (as DeepMind's FrameStack does). Episodes
    last `episode_len` steps (terminated); reward 1 when the action equals the newest frame's
    first pixel modulo the number of actions.
    """

    def __init__(self, size=10, k=4, channels=1, episode_len=7, num_actions=3, shift=True):
        self.observation_space = gym.spaces.Box(0, 255, (size, size, k * channels), np.uint8)
        self.action_space = gym.spaces.Discrete(num_actions)
        self._frame_shape = (size, size, channels)
        self._episode_len = episode_len
        self._shift = shift
        self._t = 0
        self._stack = np.zeros(self.observation_space.shape, np.uint8)

    def _frame(self) -> np.ndarray:
        return self.np_random.integers(0, 256, self._frame_shape, dtype=np.uint8)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._t = 0
        k = self.observation_space.shape[-1] // self._frame_shape[-1]
        self._stack = np.concatenate([self._frame()] * k, axis=-1)
        return self._stack.copy(), {}

    def step(self, action):
        reward = float(int(action) == int(self._stack[0, 0, -1]) % self.action_space.n)
        self._t += 1
        if self._shift:
            c = self._frame_shape[-1]
            self._stack = np.concatenate([self._stack[..., c:], self._frame()], axis=-1)
        else:
            self._stack = self.np_random.integers(
                0, 256, self.observation_space.shape, dtype=np.uint8
            )
        return self._stack.copy(), reward, self._t >= self._episode_len, False, {}


def stacked_frames(env_config) -> gym.Env:
    """`StackedFrames` built from `env_config` keys (its constructor's arguments)."""
    return StackedFrames(**dict(env_config))
