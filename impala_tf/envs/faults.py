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

The checks are cheap: every observation's type, shape and dtype are compared by identity with
the space's (`EnvGuard.step`), with the full check only when one differs; finiteness costs one
subtraction per reward and, for float observations, one `np.isfinite` over the [B, ...]
observations per vector step.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

__all__ = [
    "EnvCallError",
    "EnvError",
    "EnvGuard",
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


class EnvGuard:
    """Calls the envs of one env runner and checks what they return.

    The env batches (`impala_tf.envs.batch`) call every env through it, so an env that raises,
    returns a mis-shaped observation or a non-numeric reward is reported with its place (see
    the module docstring), and `progress` tells a hung env's place to the driver.

    Args:
      label: Names the env (`env_name(config.env)`).
      who: Names the runner ("actor 3", "the driver").
      drop_nonfinite: `drop_nonfinite_episodes`: a non-finite reward or observation ends its
        episode (the batch marks it dropped) instead of raising `NonFiniteEnvError`.
      progress: Shared with the driver (a fresh one when None).
    """

    def __init__(
        self,
        label: str,
        who: str,
        drop_nonfinite: bool = False,
        progress: StepProgress | None = None,
    ):
        self.label = label
        self.who = who
        self.drop_nonfinite = bool(drop_nonfinite)
        self.progress = progress if progress is not None else StepProgress()
        self.steps = 0  # Vector steps taken by the runner (steps per env).
        #: The runner's per-env episode lengths ([B] int, updated in place), for messages.
        self.episode_length: np.ndarray | None = None
        self.obs_shape: tuple[int, ...] | None = None
        self.obs_dtype = np.dtype(np.float32)
        self.float_obs = True

    def bind(self, observation_space: gym.Space) -> None:
        """Sets the space observations are checked against."""
        self.obs_dtype = np.dtype(observation_space.dtype or np.float32)
        self.obs_shape = observation_space.shape
        self.float_obs = bool(np.issubdtype(self.obs_dtype, np.floating))

    def where(self, j: int) -> str:
        """Names env `j` and the step, for error messages."""
        episode = ""
        if self.episode_length is not None:
            episode = f", episode step {int(self.episode_length[j])}"
        return f"env {self.label} ({self.who}, env index {j}) at step {self.steps}{episode}"

    def reset(self, env: gym.Env, seed: int | None, j: int) -> np.ndarray:
        """`env.reset(seed=seed)`'s observation, checked; a non-finite one always raises."""
        self.progress.set(self.steps, j, StepProgress.RESET)
        try:
            obs, _ = env.reset(seed=seed)
        except gym.error.DependencyNotInstalled:
            raise  # A missing package (e.g. pygame to render), not an env fault: says so itself.
        except Exception as e:
            raise EnvCallError(f"{self.where(j)}: reset() raised {type(e).__name__}: {e}") from e
        if self.obs_shape is None:  # Dict/Tuple spaces: nothing cheap to check.
            return np.asarray(obs, dtype=self.obs_dtype)
        obs = check_observation(obs, self.obs_shape, self.obs_dtype, self.where(j))
        if self.float_obs and not np.isfinite(obs).all():
            raise NonFiniteEnvError(
                f"{self.where(j)}: reset() returned a non-finite observation (a first "
                "observation cannot be dropped, even with drop_nonfinite_episodes=True)."
            )
        return obs

    def step(self, env: gym.Env, action: Any, j: int) -> tuple[Any, float, bool, bool, dict]:
        """`env.step(action)` with the reward as a float and the observation's shape checked."""
        try:
            obs, reward, terminated, truncated, info = env.step(action)
        except gym.error.DependencyNotInstalled:
            raise
        except Exception as e:
            raise EnvCallError(f"{self.where(j)}: step() raised {type(e).__name__}: {e}") from e
        try:
            reward = float(reward)
        except (TypeError, ValueError) as e:
            raise EnvSpaceError(
                f"{self.where(j)} returned a reward that is not a number: {reward!r}"
            ) from e
        if self.obs_shape is not None and (
            type(obs) is not np.ndarray
            or obs.shape != self.obs_shape
            or obs.dtype is not self.obs_dtype
        ):
            obs = check_observation(obs, self.obs_shape, self.obs_dtype, self.where(j))
        return obs, reward, terminated, truncated, info

    def nonfinite(self, j: int, what: str) -> None:
        """Raises `NonFiniteEnvError` for env `j` unless `drop_nonfinite` is set."""
        if not self.drop_nonfinite:
            raise NonFiniteEnvError(
                f"{self.where(j)} returned a non-finite {what}. Fix the env, or set "
                "drop_nonfinite_episodes=True to drop such episodes (counted in "
                "num_nonfinite_episodes_dropped)."
            )
