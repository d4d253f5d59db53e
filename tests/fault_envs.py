"""Misbehaving envs for the fault tests (importable by actor processes as `tests.fault_envs`)."""

from __future__ import annotations

import os
import time

import gymnasium as gym
import numpy as np

__all__ = ["misbehaving_cartpole"]


class _Misbehaving(gym.Wrapper):
    """CartPole that misbehaves (`mode`) from its `after`-th step on.

    Modes: "nan_reward", "nan_obs", "inf_reward", "wrong_shape", "wrong_dtype",
    "raise_step", "raise_reset" (from the `after`-th reset), "hang" (sleeps for an hour; with
    `marker`, only while that file does not exist yet: it is created before hanging, so a
    restarted actor does not hang again), "nan_reset".
    """

    def __init__(self, env: gym.Env, mode: str, after: int, marker: str | None):
        super().__init__(env)
        self.mode = mode
        self.after = after
        self.marker = marker
        self.steps = 0
        self.resets = 0
        if mode == "wrong_dtype":
            self.observation_space = gym.spaces.Box(0, 255, (4,), np.uint8)

    def reset(self, **kwargs):
        self.resets += 1
        obs, info = self.env.reset(**kwargs)
        if self.mode == "wrong_dtype":
            obs = np.zeros(4, np.uint8)
        if self.resets > self.after and self.mode == "raise_reset":
            raise OSError("simulator crashed in reset")
        if self.mode == "nan_reset":
            obs = np.full_like(obs, np.nan)
        return obs, info

    def step(self, action):
        self.steps += 1
        obs, reward, terminated, truncated, info = self.env.step(action)
        if self.mode == "wrong_dtype":
            obs = np.zeros(4, np.uint8)
        if self.steps < self.after:
            return obs, reward, terminated, truncated, info
        mode = self.mode
        if mode == "nan_reward":
            reward = float("nan")
        elif mode == "inf_reward":
            reward = float("inf")
        elif mode == "nan_obs":
            obs = np.full_like(obs, np.nan)
            terminated = False
        elif mode == "wrong_shape":
            obs = np.zeros(3, np.float32)
        elif mode == "wrong_dtype":
            obs = np.full(4, 0.5, np.float64)
        elif mode == "raise_step":
            raise RuntimeError("simulator crashed in step")
        elif mode == "hang" and not (self.marker and os.path.exists(self.marker)):
            if self.marker:
                with open(self.marker, "w") as f:
                    f.write("hung once")
            time.sleep(3600)
        return obs, reward, terminated, truncated, info


def misbehaving_cartpole(env_config) -> gym.Env:
    """`_Misbehaving` CartPole; only env `vector_index` (default 0) of `worker_index` (default:
    every runner) misbehaves, the others are plain CartPole."""
    env = gym.make("CartPole-v1")
    worker = env_config.get("worker_index")
    if getattr(env_config, "vector_index", 0) != env_config.get("vector_index", 0) or (
        worker is not None and getattr(env_config, "worker_index", None) != worker
    ):
        return env
    return _Misbehaving(
        env,
        mode=env_config["mode"],
        after=int(env_config.get("after", 1)),
        marker=env_config.get("marker"),
    )
