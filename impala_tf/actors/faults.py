"""Errors an env can cause in an env runner, and the cheap checks that find them.

An `EnvRunner` wraps what goes wrong in one of its envs into an `EnvError` that names the env
(its gymnasium id or creator), the actor (0-based, `worker_index - 1`), the env index within the
runner and the step (env steps this runner has taken per env, and the step within the episode):

* `EnvCallError`: the env raised in `reset` or `step`. Recoverable: the driver restarts the
  actor (`restart_failed_env_runners`), as an env may fail transiently (a simulator crash).
* `EnvSpaceError`: the env returned an observation of the wrong shape or dtype for its
  `observation_space`. Fatal: a restart would fail the same way.
* `NonFiniteEnvError`: the env returned a NaN or infinite observation or reward, and
  `drop_nonfinite_episodes` is False. Fatal.

The checks are cheap: observation shape and dtype are checked at every reset and at the first
step of each fragment (later steps write into the same preallocated [B, ...] array, which a
wrong shape cannot fit), and finiteness costs one `np.isfinite` over the B rewards and, for
float observations, the [B, ...] observations per vector step.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "EnvCallError",
    "EnvError",
    "EnvSpaceError",
    "NonFiniteEnvError",
    "StepProgress",
    "check_observation",
    "env_name",
]


class EnvError(RuntimeError):
    """An env misbehaved; the message names the env, actor, env index and step.

    Attributes:
      fatal: Whether restarting the actor cannot help (the driver then raises at once).
    """

    fatal = False


class EnvCallError(EnvError):
    """The env raised in `reset` or `step`."""


class EnvSpaceError(EnvError, ValueError):
    """An observation does not match the env's `observation_space` (shape or dtype)."""

    fatal = True


class NonFiniteEnvError(EnvError, ValueError):
    """An observation or reward is NaN or infinite (and `drop_nonfinite_episodes` is False)."""

    fatal = True


def env_name(env: Any) -> str:
    """A readable name for `config.env`: the gymnasium id, or the creator's qualified name."""
    if isinstance(env, str):
        return repr(env)
    name = getattr(env, "__qualname__", None) or getattr(env, "__name__", None)
    return f"creator {name}" if name else repr(env)


def check_observation(obs: Any, shape: tuple[int, ...], dtype: np.dtype, where: str) -> np.ndarray:
    """Returns `obs` as an array of `dtype`, or raises `EnvSpaceError` saying what is wrong.

    Args:
      obs: What the env returned.
      shape: The `observation_space` shape.
      dtype: The `observation_space` dtype; values of the same kind (float64 for float32) and
        of a safely castable dtype are accepted, others (a float for uint8 pixels) are not.
      where: Names the env, actor, env index and step for the message.
    """
    array = np.asarray(obs)
    if array.shape != tuple(shape):
        raise EnvSpaceError(
            f"{where} returned an observation of shape {array.shape}, but its "
            f"observation_space has shape {tuple(shape)}."
        )
    if array.dtype != dtype and not np.can_cast(array.dtype, dtype, casting="same_kind"):
        raise EnvSpaceError(
            f"{where} returned an observation of dtype {array.dtype}, which does not fit its "
            f"observation_space dtype {np.dtype(dtype)}."
        )
    return array.astype(dtype, copy=False)


class StepProgress:
    """Where an env runner is, readable by the driver while the runner hangs.

    Backed by a shared int64 array `[steps, env_index, phase]` (a `multiprocessing.RawArray`
    in actor processes, a numpy array otherwise): `steps` is the per-env step count of the
    runner, `env_index` the env being called (-1 when none), `phase` one of `PHASES`.
    """

    IDLE, RESET, STEP, POLICY = 0, 1, 2, 3
    PHASES = ("idle", "reset", "step", "policy")

    def __init__(self, buffer: Any = None):
        self.buffer = buffer if buffer is not None else np.zeros(3, np.int64)

    def set(self, steps: int, env_index: int, phase: int) -> None:
        buffer = self.buffer
        buffer[0] = steps
        buffer[1] = env_index
        buffer[2] = phase

    def describe(self) -> str:
        """E.g. "in step() of env index 3 at step 1200"."""
        steps, index, phase = (int(x) for x in self.buffer[:3])
        name = self.PHASES[phase] if 0 <= phase < len(self.PHASES) else "?"
        if name in ("reset", "step"):
            return f"in {name}() of env index {index} at step {steps}"
        if name == "policy":
            return f"in the policy's forward pass at step {steps}"
        return f"at step {steps}"
