"""Env creators used by the runtime tests (importable by actor processes as `tests.envs`)."""

from __future__ import annotations

import time

import gymnasium as gym


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
