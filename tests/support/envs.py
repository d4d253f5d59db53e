"""Env creators of the tests, the faulty ones included (importable by actor processes).

Every creator takes RLlib's `env_config` (an `EnvContext` in actors: it also has `worker_index`
and `vector_index`):

* `faulty_cartpole`: CartPole that raises after `fail_after` steps and sleeps `sleep_s` per step;
* `broken_env`: a creator that always raises;
* `misbehaving_cartpole`: CartPole that misbehaves from its `after`-th step in one of the modes
  of `_Misbehaving` (non-finite data, wrong shapes or dtypes, raising, hanging), optionally in one
  env of one runner only;
* `HugeRewardCartPole`: finite rewards whose squared value error overflows (non-finite updates);
* `unpicklable_cartpole`: CartPole that refuses to be pickled (a simulator handle);
* `StackedFrames` / `stacked_frames`: DeepMind-style stacks of random uint8 frames;
  `stacked_obs`: such stacks as arrays [B, T, ...], with their refills;
* `Coordination` / `coordination`: a tiny PettingZoo parallel env (two agents rewarded for
  choosing the same action), raw and through `PettingZooParallelEnv`;
* `hanging_env`: CartPole or a `num_agents` MultiAgentCartPole that hangs once, at a step of one
  actor's first env (the marker file makes the restarted actor go on).
"""

from __future__ import annotations

import os
import time

import gymnasium as gym
import numpy as np
from pettingzoo import ParallelEnv

from impala_tf.multi_agent.env import PettingZooParallelEnv

__all__ = [
    "HugeRewardCartPole",
    "hanging_env",
    "StackedFrames",
    "broken_env",
    "faulty_cartpole",
    "misbehaving_cartpole",
    "stacked_frames",
    "stacked_obs",
    "unpicklable_cartpole",
]


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

    With `declare` (the default) it declares its stack as `impala_tf.models.frames` asks
    (`frame_stack`, `stack_refilled`), so env runners send its frames once.
    """

    def __init__(
        self, size=10, k=4, channels=1, episode_len=7, num_actions=3, shift=True, declare=True
    ):
        self.observation_space = gym.spaces.Box(0, 255, (size, size, k * channels), np.uint8)
        self.action_space = gym.spaces.Discrete(num_actions)
        self._frame_shape = (size, size, channels)
        self._episode_len = episode_len
        self._shift = shift
        self._declare = declare
        self._t = 0
        self._stack = np.zeros(self.observation_space.shape, np.uint8)
        self.stack_refilled = True

    @property
    def frame_stack(self):
        k = self.observation_space.shape[-1] // self._frame_shape[-1]
        return (k, self._frame_shape[-1]) if self._declare else None

    def _frame(self) -> np.ndarray:
        return self.np_random.integers(0, 256, self._frame_shape, dtype=np.uint8)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._t = 0
        k = self.observation_space.shape[-1] // self._frame_shape[-1]
        self._stack = np.concatenate([self._frame()] * k, axis=-1)
        self.stack_refilled = True
        return self._stack.copy(), {}

    def step(self, action):
        reward = float(int(action) == int(self._stack[0, 0, -1]) % self.action_space.n)
        self._t += 1
        self.stack_refilled = False
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


def stacked_obs(b, t, k, *, size=6, s=1, episode_len=None, seed=0, levels=256):
    """[B, T, size, size, k*s] uint8 stacks as DeepMind's FrameStack builds them, and the
    refills (True at a step t >= 1 whose stack is k copies of a new episode's first frame)."""
    rng = np.random.default_rng(seed)
    obs = np.empty((b, t, size, size, k * s), np.uint8)
    restarts = np.zeros((b, t), bool)
    for row in range(b):
        stack = None
        for step in range(t):
            frame = rng.integers(0, levels, (size, size, s), dtype=np.uint8)
            if stack is None or (episode_len and (step + row) % episode_len == 0):
                stack = np.concatenate([frame] * k, axis=-1)
                restarts[row, step] = step > 0
            else:
                stack = np.concatenate([stack[..., s:], frame], axis=-1)
            obs[row, step] = stack
    return obs, restarts


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


class HugeRewardCartPole(gym.Wrapper):
    """CartPole whose every 25th step pays 3e38: finite, but the squared value error is inf."""

    def __init__(self, env_config=None):
        super().__init__(gym.make("CartPole-v1"))
        self._steps = 0

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self._steps += 1
        return obs, 3e38 if self._steps % 25 == 0 else reward, terminated, truncated, info


class _Unpicklable(gym.Wrapper):
    def __reduce__(self):
        raise TypeError("this env holds a simulator handle")


def unpicklable_cartpole(env_config) -> gym.Env:
    """CartPole that cannot be pickled (so a runner cannot snapshot it)."""
    return _Unpicklable(gym.make("CartPole-v1"))


class _HangOnce(gym.Wrapper):
    """Sleeps an hour at step `after`, unless the `marker` file exists (it is made first)."""

    def __init__(self, env: gym.Env, after: int, marker: str):
        super().__init__(env)
        self._steps, self._after, self._marker = 0, after, marker

    def step(self, action):
        self._steps += 1
        if self._steps >= self._after and not os.path.exists(self._marker):
            with open(self._marker, "w") as f:
                f.write("hung once")
            time.sleep(3600)
        return self.env.step(action)


def hanging_env(env_config) -> gym.Env:
    """`env_config`: `marker` (a path), `after` (steps, default 20), `num_agents` (0: CartPole,
    else a MultiAgentCartPole of that many agents); only env 0 of runner `worker_index` (default
    1) hangs."""
    agents = int(env_config.get("num_agents", 0))
    if agents:
        from impala_tf.multi_agent.env import MultiAgentCartPole

        env = MultiAgentCartPole({"num_agents": agents})
    else:
        env = gym.make("CartPole-v1")
    worker = int(env_config.get("worker_index", 1))
    if getattr(env_config, "worker_index", 1) != worker or getattr(env_config, "vector_index", 0):
        return env
    return _HangOnce(env, int(env_config.get("after", 20)), env_config["marker"])


_COORDINATION_OBS = gym.spaces.Box(0.0, 1.0, (2,), np.float32)
_COORDINATION_ACT = gym.spaces.Discrete(2)


class Coordination(ParallelEnv):
    """A tiny PettingZoo ParallelEnv: two agents are rewarded for choosing the same action."""

    metadata = {"name": "coordination_v0", "render_modes": ["rgb_array"]}

    def __init__(self, max_cycles: int = 7, render_mode: str | None = None):
        self.possible_agents = ["a", "b"]
        self.agents = []
        self.max_cycles = max_cycles
        self.render_mode = render_mode
        self._t = 0

    def observation_space(self, agent):
        return _COORDINATION_OBS

    def action_space(self, agent):
        return _COORDINATION_ACT

    def reset(self, seed=None, options=None):
        self.agents = list(self.possible_agents)
        self._t = 0
        return {a: np.zeros(2, np.float32) for a in self.agents}, {a: {} for a in self.agents}

    def step(self, actions):
        self._t += 1
        same = float(actions["a"] == actions["b"])
        end = self._t >= self.max_cycles
        obs = {a: np.array([same, self._t / self.max_cycles], np.float32) for a in self.agents}
        rewards = {a: same for a in self.agents}
        terms = {a: False for a in self.agents}
        truncs = {a: end for a in self.agents}
        infos = {a: {} for a in self.agents}
        if end:
            self.agents = []
        return obs, rewards, terms, truncs, infos

    def render(self):
        return np.full((2, 3, 3), self._t, np.uint8)


def coordination(env_config) -> gym.Env:
    return PettingZooParallelEnv(Coordination(**env_config))
