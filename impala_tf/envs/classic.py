"""Classic-control envs shipped with impala_tf: `StatelessCartPole`, a partially observed CartPole.

Importing `impala_tf.envs` registers `StatelessCartPole` under the gymnasium id
`impala_tf/StatelessCartPole-v1` (500-step time limit, as `CartPole-v1`).
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.envs.classic_control import CartPoleEnv

__all__ = ["STATELESS_CARTPOLE_ID", "StatelessCartPole", "register"]

#: The gymnasium id of `StatelessCartPole`.
STATELESS_CARTPOLE_ID = "impala_tf/StatelessCartPole-v1"

# Positions of the cart position and the pole angle in CartPole's [x, x_dot, theta, theta_dot].
_OBSERVED = [0, 2]


class StatelessCartPole(CartPoleEnv):
    """CartPole without the velocities: observations are [cart position, pole angle], float32 [2].

    RLlib's `StatelessCartPole` example env: with the two velocity entries removed, a policy
    needs memory (e.g. `use_lstm`) to balance the pole. Dynamics, rewards and termination are
    CartPole's; the observation bounds are twice the termination thresholds, as in RLlib.

    Args:
      config: Ignored (RLlib's env-creator signature); keyword arguments go to `CartPoleEnv`.
    """

    def __init__(self, config: dict | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        high = np.array([self.x_threshold * 2, self.theta_threshold_radians * 2], np.float32)
        self.observation_space = gym.spaces.Box(low=-high, high=high, dtype=np.float32)

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        return np.asarray(obs, np.float32)[_OBSERVED], reward, terminated, truncated, info

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        obs, info = super().reset(seed=seed, options=options)
        return np.asarray(obs, np.float32)[_OBSERVED], info


def register() -> None:
    """Registers `StatelessCartPole` as `STATELESS_CARTPOLE_ID` (idempotent)."""
    if STATELESS_CARTPOLE_ID not in gym.registry:
        gym.register(
            id=STATELESS_CARTPOLE_ID,
            entry_point=StatelessCartPole,
            max_episode_steps=500,
            reward_threshold=475.0,
        )


register()
