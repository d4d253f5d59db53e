"""`PolicyStep`: what an acting policy returns for one batched env step (no TensorFlow here)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["PolicyStep"]


class PolicyStep(NamedTuple):
    """One acting step for a batch of B observations (numpy arrays).

    Attributes:
      actions: [B, *action_shape], the actions to take.
      logits: float32 [B, logits_size], the behaviour policy's distribution inputs.
      logp: float32 [B], log mu(a|x) of the actions.
      values: float32 [B], V(x) of the behaviour value function.
      state: tuple of [B, ...] arrays, the recurrent state after this step (() if none).
      version: `num_grad_updates` of the weights that computed the step when the policy knows
        it (central inference); None means the version of the weights the actor last loaded.
    """

    actions: np.ndarray
    logits: np.ndarray
    logp: np.ndarray
    values: np.ndarray
    state: tuple
    version: int | None = None
