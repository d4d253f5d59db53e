"""From the policy's actions to the env's: RLlib's `normalize_actions` and `clip_actions`.

The policy samples Box actions from an unbounded diagonal Gaussian. RLlib (and impala_tf) keep
those raw samples in the train batch (`actions`, the policy's own space, so log pi(a) and
log mu(a) are of the same number) and only transform the copy the env receives:

* `normalize_actions=True` (RLlib's default): the policy acts in [-1, 1]; each bounded float Box
  component is unsquashed to the space's bounds, `low + (a + 1) * (high - low) / 2`, then
  clipped to [low, high] (RLlib's `unsquash_action`). Box components unbounded on either side
  are passed through unchanged.
* else `clip_actions=True`: Box actions are clipped to [low, high] (RLlib's `clip_action`).
* else the actions reach the env as sampled.

Discrete and MultiDiscrete actions are never changed here (the policy already samples them in
the space). Everything is numpy and works on a batch [B, *action_shape].
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np

__all__ = ["ActionAdapter", "clip_action", "unsquash_action"]


def _bounded(space: gym.spaces.Box) -> bool:
    return bool(np.all(space.bounded_below) and np.all(space.bounded_above))


def unsquash_action(actions: np.ndarray, space: gym.Space) -> np.ndarray:
    """Maps actions from [-1, 1] to `space`'s bounds and clips them there (RLlib's semantics).

    Args:
      actions: float [B, *space.shape] (or [*space.shape]), actions in the normalized space.
      space: The env's action space. Only a Box bounded on both sides with a float dtype is
        transformed; any other space returns `actions` unchanged.

    Returns:
      `low + (actions + 1) * (high - low) / 2` clipped to [low, high], in the space's dtype.
    """
    if (
        not isinstance(space, gym.spaces.Box)
        or not np.issubdtype(space.dtype, np.floating)
        or not _bounded(space)
    ):
        return actions
    low = space.low.astype(np.float64)
    high = space.high.astype(np.float64)
    out = low + (np.asarray(actions, np.float64) + 1.0) * (high - low) / 2.0
    return np.clip(out, low, high).astype(space.dtype)


def clip_action(actions: np.ndarray, space: gym.Space) -> np.ndarray:
    """Clips Box actions to [low, high] (RLlib's `clip_action`); other spaces pass through.

    Args:
      actions: [B, *space.shape] (or [*space.shape]) actions.
      space: The env's action space.

    Returns:
      The clipped actions in the space's dtype (Box), else `actions` unchanged.
    """
    if not isinstance(space, gym.spaces.Box):
        return actions
    return np.clip(actions, space.low, space.high).astype(space.dtype)


class ActionAdapter:
    """Turns a batch of policy actions into the actions the env steps with.

    Args:
      space: The env's action space.
      normalize_actions: RLlib's `normalize_actions` (unsquash from [-1, 1], then clip).
      clip_actions: RLlib's `clip_actions` (clip to the bounds; only without
        `normalize_actions`, as in RLlib).
    """

    def __init__(self, space: gym.Space, normalize_actions: bool, clip_actions: bool):
        self.space = space
        self.normalize_actions = bool(normalize_actions)
        self.clip_actions = bool(clip_actions)
        self.active = isinstance(space, gym.spaces.Box) and (
            self.normalize_actions or self.clip_actions
        )

    def __call__(self, actions: np.ndarray) -> np.ndarray:
        """Returns the env's actions for policy actions [B, *action_shape]."""
        if not self.active:
            return actions
        if self.normalize_actions:
            return unsquash_action(actions, self.space)
        return clip_action(actions, self.space)
