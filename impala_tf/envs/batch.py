"""Env batches: the B envs of one env runner, stepped together (B = `num_envs_per_env_runner`).

Three implementations behind one interface, so the env runner has one stepping loop:

* `GymEnvBatch`: a list of gymnasium envs stepped one after another in Python (any env);
* `GymVectorEnvBatch`: a gymnasium `VectorEnv` that steps all B envs in one call, such as the
  numpy-vectorised CartPole that `gymnasium.make_vec` builds from an env's vector entry point
  (`impala_tf.envs.make.make_env_batch` decides when it applies);
* `impala_tf.envs.atari_vector.AtariVectorEnvBatch`: ale-py's native `AtariVectorEnv` (C++
  threads step and preprocess all B envs; `impala_tf.envs.atari.vector_env_kwargs` decides when
  it applies).

The two gymnasium batches pickle into an env runner's snapshot (`EnvRunner.get_state`, kept in
deterministic checkpoints) under this module's path; ale-py's does not pickle.

`step(actions)` returns the next observation of every env, with finished episodes already reset
(the reset observation replaces the one the episode ended on, which is kept in `final_obs` for
truncated envs so the runner can bootstrap from it). Episodes as the learner sees them
(`terminateds`/`truncateds`) may be shorter than the episodes the runner reports: with episodic
life a lost life terminates the training episode while the game, the reported episode, goes on
(`episode_ends`).

Every env call goes through an `impala_tf.envs.faults.EnvGuard`, which names the env, runner,
env index and step when an env raises or returns malformed data, and keeps the place of the
call readable by the driver (a hung env). A non-finite reward or observation raises, or with
`drop_nonfinite_episodes` ends its episode: the step is marked truncated and `dropped`, its
reward is 0, no final observation is kept, and the episode is not reported.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode

from impala_tf.envs.faults import (
    EnvCallError,
    EnvGuard,
    NonFiniteEnvError,
    StepProgress,
    check_observation,
)

__all__ = [
    "BatchStep",
    "EnvBatch",
    "GymEnvBatch",
    "GymVectorEnvBatch",
    "declared_frame_stack",
    "resets_in_the_ending_step",
    "sent_frame_stack",
]


def _stacker(env: gym.Env) -> Any:
    """The env or wrapper in `env`'s chain that declares `frame_stack`, or None."""
    while env is not None:
        if "frame_stack" in dir(type(env)) or "frame_stack" in vars(env):
            return env
        env = getattr(env, "env", None)
    return None


def declared_frame_stack(env: gym.Env) -> tuple[int, int] | None:
    """The (k, s) frame stack an env declares (`frame_stack`, anywhere in its wrappers), else
    None. Such an env also sets `stack_refilled` after each `reset` and `step`."""
    stacker = _stacker(env)
    declared = None if stacker is None else stacker.frame_stack
    return None if declared is None else (int(declared[0]), int(declared[1]))


def sent_frame_stack(
    declared: tuple[int, int] | None, observation_filter: str
) -> tuple[int, int] | None:
    """The frame stack whose frames an env runner sends (`obs_frames`, `impala_tf.models.frames`):
    the env's declared one, unless an `observation_filter` changes the observations, which then
    travel as `obs`. The one rule for the runners and the learners' batch signature."""
    return declared if observation_filter == "NoFilter" else None


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
      dropped: bool [B] the episode was cut here for a non-finite reward or observation
        (`drop_nonfinite_episodes`); it is not reported.
      stack_restarts: bool [B] where `obs` is a refilled frame stack (k copies of its newest
        frame: a reset, or a serve after a lost life) rather than the previous stack shifted by
        one frame; None from a batch without a `frame_stack` (`impala_tf.models.frames`).
      infos: With `collect_infos` on the batch: each env's info dict of this step; else None.
      ended_obs: With `collect_infos`: row -> the observation an episode (reported or
        training) ended on, before its env was reset; else None.
    """

    obs: np.ndarray
    rewards: np.ndarray
    terminateds: np.ndarray
    truncateds: np.ndarray
    final_obs: dict[int, np.ndarray]
    episode_ends: np.ndarray
    dropped: np.ndarray
    stack_restarts: np.ndarray | None = None
    infos: list[dict] | None = None
    ended_obs: dict[int, np.ndarray] | None = None


class EnvBatch(abc.ABC):
    """B envs stepped together; spaces are those of one env.

    `frame_stack` is (k, s) when the observations are stacks of k frames of s channels, newest
    last, that shift by one frame per step and are refilled with copies at a reset (RLlib's
    `framestack`); `step` then reports `stack_restarts`. None otherwise.

    `collect_infos` (off by default, since it costs a little per step): `step` also returns each
    env's info dict and the observations ended episodes ended on (what RLlib's episode
    callbacks read, `impala_tf.config.callbacks`).
    """

    num_envs: int
    observation_space: gym.Space
    action_space: gym.Space
    frame_stack: tuple[int, int] | None = None
    collect_infos: bool = False

    @abc.abstractmethod
    def reset(self, seeds: Sequence[int | None]) -> np.ndarray:
        """Starts new episodes in every env (env j seeded with `seeds[j]`); returns [B, ...]."""

    @abc.abstractmethod
    def step(self, actions: np.ndarray) -> BatchStep:
        """Steps every env with its row of `actions`; finished episodes are reset."""

    @abc.abstractmethod
    def close(self) -> None:
        """Releases the envs."""

    def __getstate__(self) -> dict[str, Any]:
        # The guard holds the runner's shared progress array, which does not pickle; the
        # runner that restores a batch gives it its own guard.
        state = self.__dict__.copy()
        state.pop("guard", None)
        return state


class GymEnvBatch(EnvBatch):
    """A list of gymnasium envs, stepped in turn.

    An env may mark a training-episode end that is not a reported-episode end with
    `info["game_over"] = False` (episodic life, `impala_tf.envs.atari`); it is still reset, and
    its `reset()` continues the game.

    Args:
      envs: The envs (same spaces).
      guard: Calls and checks the envs (a default one naming "an env" when None).
    """

    def __init__(self, envs: Sequence[gym.Env], guard: EnvGuard | None = None):
        if not envs:
            raise ValueError("GymEnvBatch needs at least one env.")
        self.envs = list(envs)
        self.num_envs = len(self.envs)
        self.observation_space = self.envs[0].observation_space
        self.action_space = self.envs[0].action_space
        self._dtype = self.observation_space.dtype or np.float32
        self.frame_stack = declared_frame_stack(self.envs[0])
        # Where each env says whether it refilled its stack: found once, read every step.
        self._stackers = [_stacker(env) for env in self.envs] if self.frame_stack else []
        self.guard = guard if guard is not None else EnvGuard("(unnamed)", "an env batch")
        self.guard.bind(self.observation_space)

    def reset(self, seeds: Sequence[int | None]) -> np.ndarray:
        guard = self.guard
        return np.stack(
            [guard.reset(env, seed, j) for j, (env, seed) in enumerate(zip(self.envs, seeds))]
        )

    def step(self, actions: np.ndarray) -> BatchStep:
        n, guard = self.num_envs, self.guard
        rewards = np.empty(n, np.float64)
        terminateds = np.zeros(n, bool)
        truncateds = np.zeros(n, bool)
        ends = np.zeros(n, bool)
        dropped = np.zeros(n, bool)
        restarts = None if self.frame_stack is None else np.zeros(n, bool)
        final_obs: dict[int, np.ndarray] = {}
        infos = [] if self.collect_infos else None
        ended_obs = {} if self.collect_infos else None
        next_obs = None
        guard.progress.set(guard.steps, 0, StepProgress.STEP)
        where = guard.progress.buffer
        for j, env in enumerate(self.envs):
            where[1] = j  # One shared-memory write per env step (for hang reports).
            obs, reward, terminated, truncated, info = guard.step(env, actions[j], j)
            if infos is not None:
                infos.append(info)
            if reward - reward != 0.0:  # NaN or +-inf, at the cost of one subtraction.
                guard.nonfinite(j, f"reward ({reward})")
                reward, dropped[j] = 0.0, True
            rewards[j] = reward
            if dropped[j]:
                truncateds[j] = True
            elif terminated or truncated:
                terminateds[j] = terminated
                truncateds[j] = truncated and not terminated
                if truncateds[j]:
                    final = np.asarray(obs, dtype=self._dtype)
                    if guard.float_obs and not np.isfinite(final).all():
                        guard.nonfinite(j, "final observation")
                        dropped[j] = True
                    else:
                        final_obs[j] = final
                ends[j] = info.get("game_over", True) and not dropped[j]
            if dropped[j] or terminated or truncated:
                if ended_obs is not None:
                    ended_obs[j] = np.asarray(obs, dtype=self._dtype)
                obs = guard.reset(env, None, j)
                where[2] = StepProgress.STEP
            if restarts is not None:
                restarts[j] = self._stackers[j].stack_refilled
            obs = np.asarray(obs, dtype=self._dtype)
            if next_obs is None:
                next_obs = np.empty((n, *obs.shape), self._dtype)
            next_obs[j] = obs
        guard.progress.set(guard.steps, -1, StepProgress.POLICY)
        if guard.float_obs and not np.isfinite(next_obs).all():
            bad = ~np.isfinite(next_obs.reshape(n, -1)).all(axis=1)
            for j in np.flatnonzero(bad):
                j = int(j)
                guard.nonfinite(j, "observation")
                # The step led to a non-finite observation: cut the episode before it.
                terminateds[j], truncateds[j], ends[j], dropped[j] = False, True, False, True
                final_obs.pop(j, None)
                next_obs[j] = guard.reset(self.envs[j], None, j)
                if restarts is not None:
                    restarts[j] = self._stackers[j].stack_refilled
            guard.progress.set(guard.steps, -1, StepProgress.POLICY)
        guard.steps += 1
        return BatchStep(
            next_obs,
            rewards,
            terminateds,
            truncateds,
            final_obs,
            ends,
            dropped,
            restarts,
            infos,
            ended_obs,
        )

    def close(self) -> None:
        for env in self.envs:
            env.close()


class GymVectorEnvBatch(EnvBatch):
    """A gymnasium `VectorEnv`: B envs stepped by one `step` call.

    The runner's contract is the same-step reset: an env whose episode ended returns its reset
    observation in the step that ended it, and the observation it ended on is kept for
    bootstrapping. How a vector env gets there depends on its autoreset mode
    (`metadata["autoreset_mode"]`, gymnasium 1.x):

    * `SAME_STEP`: as it is; the ended observations are in `info["final_obs"]`.
    * `DISABLED`: the ended envs are reset here, `reset(options={"reset_mask": ended})`.
    * `NEXT_STEP` (an ended env returns its reset observation one step later, ignoring that
      step's action): only where the ended envs can be reset at once here. gymnasium's
      `CartPoleVectorEnv` is one: its ended state columns are drawn again as its own `reset`
      draws them, from its own generator. Other `NEXT_STEP` envs are refused when the batch is
      built: their reset steps would enter the fragments as transitions no action caused.

    The finiteness checks run over the whole batch at once; with `drop_nonfinite_episodes` a
    non-finite reward or observation ends its episode (marked truncated and dropped, as in
    `GymEnvBatch`) and its env is reset with a `reset_mask`.

    Args:
      env: The vector env; its `single_observation_space` and `single_action_space` are the
        batch's spaces.
      guard: Names the env and step when the vector env raises (a default one when None).

    Raises:
      ValueError: the vector env's autoreset mode cannot give same-step resets.
    """

    def __init__(self, env: Any, guard: EnvGuard | None = None):
        self.env = env
        self.num_envs = int(env.num_envs)
        self.observation_space = env.single_observation_space
        self.action_space = env.single_action_space
        self._dtype = self.observation_space.dtype or np.float32
        self._shape = (self.num_envs, *self.observation_space.shape)
        self._same_step = _autoreset_mode(env) is AutoresetMode.SAME_STEP
        self._cartpole = _resets_rows_now(env)
        if not resets_in_the_ending_step(env):
            raise ValueError(
                f"The vector env {type(env).__name__} resets its envs one step after they end "
                "(gymnasium's AutoresetMode.NEXT_STEP), which impala_tf cannot train on. Make "
                "it with autoreset_mode=AutoresetMode.SAME_STEP (or DISABLED: impala_tf then "
                "resets ended envs with a `reset_mask`)."
            )
        self.guard = guard if guard is not None else EnvGuard("(unnamed)", "an env batch")
        self.guard.bind(self.observation_space)

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return getattr(self.env, name)(*args, **kwargs)
        except gym.error.DependencyNotInstalled:
            raise
        except Exception as e:
            guard = self.guard
            raise EnvCallError(
                f"env {guard.label} ({guard.who}, vector env {type(self.env).__name__}) at "
                f"step {guard.steps}: {name}() raised {type(e).__name__}: {e}"
            ) from e

    def _checked(self, obs: Any) -> np.ndarray:
        """The batch's observations as a new array of the space's dtype, or EnvSpaceError."""
        if type(obs) is np.ndarray and obs.shape == self._shape and obs.dtype == self._dtype:
            return obs.copy()
        return np.array(check_observation(obs, self._shape, self._dtype, self.guard.where(0)))

    def _reset_rows(self, rows: np.ndarray, obs: np.ndarray) -> None:
        """Resets the envs of the bool mask `rows`; writes their first observations into `obs`."""
        self.guard.progress.set(self.guard.steps, int(np.flatnonzero(rows)[0]), StepProgress.RESET)
        if self._cartpole:
            first = _cartpole_reset_rows(self.env, rows)
        else:
            first, _ = self._call("reset", options={"reset_mask": rows})
            first = self._checked(first)[rows]
        if self.guard.float_obs and not np.isfinite(first).all():
            raise NonFiniteEnvError(
                f"{self.guard.where(int(np.flatnonzero(rows)[0]))}: reset() returned a "
                "non-finite observation (a first observation cannot be dropped)."
            )
        obs[rows] = first
        self.guard.progress.set(self.guard.steps, -1, StepProgress.POLICY)

    def reset(self, seeds: Sequence[int | None]) -> np.ndarray:
        # A vector env has one generator: it is seeded with its first env's seed.
        self.guard.progress.set(self.guard.steps, -1, StepProgress.RESET)
        obs, _ = self._call("reset", seed=None if seeds[0] is None else int(seeds[0]))
        obs = self._checked(obs)
        if self.guard.float_obs and not np.isfinite(obs).all():
            raise NonFiniteEnvError(
                f"{self.guard.where(0)}: reset() returned a non-finite observation (a first "
                "observation cannot be dropped, even with drop_nonfinite_episodes=True)."
            )
        return obs

    def step(self, actions: np.ndarray) -> BatchStep:
        guard, n = self.guard, self.num_envs
        guard.progress.set(guard.steps, -1, StepProgress.STEP)
        obs, rewards, terminated, truncated, info = self._call("step", actions)
        guard.progress.set(guard.steps, -1, StepProgress.POLICY)
        obs = self._checked(obs)
        rewards = np.array(rewards, np.float64)
        terminated = np.asarray(terminated, bool)
        truncated = np.asarray(truncated, bool) & ~terminated
        ended = terminated | truncated
        dropped = np.zeros(n, bool)
        if not np.isfinite(rewards).all():
            dropped = ~np.isfinite(rewards)
            for j in np.flatnonzero(dropped):
                guard.nonfinite(int(j), f"reward ({rewards[j]})")
            rewards[dropped] = 0.0
        # The observation each ended episode ended on (SAME_STEP envs already reset them).
        ended_obs: dict[int, np.ndarray] = {}
        if ended.any():
            last = info.get("final_obs") if self._same_step else obs
            ended_obs = {int(j): np.array(last[j], self._dtype) for j in np.flatnonzero(ended)}
        if guard.float_obs:
            # As `GymEnvBatch`: an ongoing episode's observation, and the one a truncated episode
            # ended on (it is bootstrapped from); first observations are checked when reset.
            if not np.isfinite(obs).all():
                for j in np.flatnonzero(~np.isfinite(obs.reshape(n, -1)).all(axis=1) & ~ended):
                    guard.nonfinite(int(j), "observation")
                    dropped[j] = True
            for j in np.flatnonzero(truncated & ~dropped):
                if not np.isfinite(ended_obs[int(j)]).all():
                    guard.nonfinite(int(j), "final observation")
                    dropped[j] = True
        reset = (dropped & ~ended) if self._same_step else (ended | dropped)
        if reset.any():
            self._reset_rows(reset, obs)
        if (
            self._same_step
            and ended.any()
            and guard.float_obs
            and not np.isfinite(obs[ended]).all()
        ):
            raise NonFiniteEnvError(
                f"{guard.where(int(np.flatnonzero(ended)[0]))}: reset() returned a "
                "non-finite observation (a first observation cannot be dropped)."
            )
        guard.steps += 1
        truncated |= dropped
        terminated &= ~dropped
        final_obs = {}
        if truncated.any():
            final_obs = {j: o for j, o in ended_obs.items() if truncated[j] and not dropped[j]}
        infos = None
        if self.collect_infos:
            infos = [
                {k: v[j] for k, v in info.items() if not k.startswith("_") and k != "final_obs"}
                for j in range(n)
            ]
        return BatchStep(
            obs,
            rewards,
            terminated,
            truncated,
            final_obs,
            ended & ~dropped,
            dropped,
            None,
            infos,
            ended_obs if self.collect_infos else None,
        )

    def close(self) -> None:
        self.env.close()


def _autoreset_mode(env: Any) -> AutoresetMode:
    """A vector env's autoreset mode (gymnasium's default is NEXT_STEP). Read from the instance:
    ale-py writes the mode of its last-made env into its class's metadata."""
    metadata = getattr(env, "metadata", None) or {}
    return AutoresetMode(metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP))


def _resets_rows_now(env: Any) -> bool:
    """Whether `_cartpole_reset_rows` can reset some envs of this vector env at once."""
    from gymnasium.envs.classic_control.cartpole import CartPoleVectorEnv

    return type(env) is CartPoleVectorEnv


def resets_in_the_ending_step(env: Any) -> bool:
    """Whether a `GymVectorEnvBatch` of this vector env can start an ended env's next episode
    in the step that ended it: a SAME_STEP or DISABLED autoreset mode, or gymnasium's
    `CartPoleVectorEnv`."""
    return _autoreset_mode(env) is not AutoresetMode.NEXT_STEP or _resets_rows_now(env)


def _cartpole_reset_rows(env: Any, rows: np.ndarray) -> np.ndarray:
    """Resets the envs `rows` (bool [B]) of a `CartPoleVectorEnv` now; returns their first
    observations [rows.sum(), 4].

    The state columns are drawn as its `reset` draws them (uniform in its reset bounds, from its
    own generator), their step counters restart, and their NEXT_STEP resets are cancelled, so
    the next `step` moves them by the actions it is given.
    """
    env.state[:, rows] = env.np_random.uniform(low=env.low, high=env.high, size=(4, rows.sum()))
    env.steps[rows] = 0
    env.prev_done[rows] = False
    return env.state[:, rows].T.astype(np.float32)
