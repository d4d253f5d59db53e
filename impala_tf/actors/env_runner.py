"""`EnvRunner`: steps a set of gymnasium envs with a policy and cuts rollout fragments.

The policy is `impala_tf.numpy_policy.make_policy`'s choice: numpy for MLPs, TensorFlow for the
rest; it has no weights until `set_weights` (the driver broadcasts them before any sample).

One env runner (RLlib's "env runner" / "rollout worker") owns `num_envs_per_env_runner` envs and
steps them together, one batched policy call per time step. `sample()` returns a `Fragment`: a
`SampleBatch` of B = num_envs sequences of T = `rollout_fragment_length` steps, per-step columns
shaped [B, T, ...] (`truncate_episodes`: episodes continue across fragments), plus the returns and
lengths of the episodes that finished in it.

With `compress_observations=True` the `obs` column is sent zlib-compressed (RLlib's
`compress_observations`); the aggregation workers or the driver decompress it.

Rewards are clipped for training as RLlib's `clip_rewards` says (True: to their sign, x: to
[-x, x]); episode returns are reported unclipped.

`values_bootstrapped[t]` is the behaviour value of the observation that follows step t in the same
episode: V(x_{t+1}) from the next step's policy call, 0 after a termination, and V(final
observation) after a truncation (computed by one extra batched call on the truncated envs).

Faults (see `impala_tf.actors.faults`): an env that raises in `reset`/`step`, returns an
observation of the wrong shape or dtype, or a NaN/infinite observation or reward raises an
`EnvError` naming the env, the actor, the env index and the step. With
`drop_nonfinite_episodes=True` a non-finite reward or observation instead ends its episode at
that step: the step trains as a truncation with reward 0 and bootstrap value V(x_t) (never the
non-finite data), the episode's return is not reported, and the fragment counts it in
`num_nonfinite_episodes_dropped`. A non-finite first observation (from `reset`) is always an
error.
"""

from __future__ import annotations

import dataclasses
import pickle
import time
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np

from impala_tf.actors.faults import (
    EnvCallError,
    EnvSpaceError,
    NonFiniteEnvError,
    StepProgress,
    check_observation,
    env_name,
)
from impala_tf.config import ImpalaConfig
from impala_tf.numpy_policy import make_policy
from impala_tf.sample_batch import SampleBatch, compress

__all__ = ["EnvContext", "EnvRunner", "Fragment", "make_env", "env_seed"]

#: Seeds of env j in env runner i are `seed + i * _MAX_ENVS_PER_RUNNER + j`, as RLlib derives them.
_MAX_ENVS_PER_RUNNER = 1000


class EnvContext(dict):
    """The `env_config` dict handed to a user's env creator, with RLlib's extra attributes.

    Attributes:
      worker_index: 1-based index of the env runner (0 is the driver/evaluation).
      vector_index: Index of the env within its runner.
      num_workers: Number of env runners.
    """

    def __init__(self, env_config: dict, worker_index: int, vector_index: int, num_workers: int):
        super().__init__(env_config or {})
        self.worker_index = worker_index
        self.vector_index = vector_index
        self.num_workers = num_workers


def env_seed(seed: int | None, worker_index: int, vector_index: int) -> int | None:
    """The seed of env `vector_index` of env runner `worker_index` (None if `seed` is None)."""
    if seed is None:
        return None
    return int(seed) + worker_index * _MAX_ENVS_PER_RUNNER + vector_index


def make_env(config: ImpalaConfig, worker_index: int = 0, vector_index: int = 0) -> gym.Env:
    """Creates one env from `config.env`: a registered gymnasium id or an `env_creator` callable.

    A gymnasium id is made with `gym.make(id, **env_config)`; a callable is called with an
    `EnvContext` holding `env_config` (RLlib's convention).
    """
    env: str | Callable[..., gym.Env] | None = config.env
    if env is None:
        raise ValueError("`env` is not set: pass a gymnasium id or an env_creator(env_config)")
    if callable(env):
        context = EnvContext(config.env_config, worker_index, vector_index, config.num_env_runners)
        made = env(context)
        if not isinstance(made, gym.Env):
            raise TypeError(f"env_creator {env!r} returned {type(made).__name__}, not a gym.Env")
        return made
    if isinstance(env, str) and env.startswith("ALE/"):
        import ale_py

        gym.register_envs(ale_py)
    return gym.make(env, **(config.env_config or {}))


@dataclasses.dataclass
class Fragment:
    """What an env runner sends per sample request.

    Attributes:
      batch: `SampleBatch` of [B, T, ...] sequences (B = num_envs_per_env_runner).
      episode_returns: Returns of the episodes that ended in this fragment.
      episode_lengths: Their lengths in steps.
      policy_version: `num_grad_updates` of the weights that acted (0 before any broadcast).
      actor_id: Index of the actor that produced it (0-based).
      sample_time_s: Wall time spent producing it.
      num_nonfinite_episodes_dropped: Episodes cut for a non-finite observation or reward
        (`drop_nonfinite_episodes`).
    """

    batch: SampleBatch
    episode_returns: list[float]
    episode_lengths: list[int]
    policy_version: int
    actor_id: int = 0
    sample_time_s: float = 0.0
    num_nonfinite_episodes_dropped: int = 0

    @property
    def env_steps(self) -> int:
        return self.batch.env_steps


class EnvRunner:
    """Steps `num_envs_per_env_runner` envs with a policy and returns fragments.

    Args:
      config: The algorithm config (env, env_config, model, rollout_fragment_length,
        num_envs_per_env_runner, seed, explore, gamma).
      worker_index: 1-based index of this runner; it derives the env and sampling seeds.
      explore: Overrides `config.explore` (evaluation passes False).
      progress: Where the runner is (step, env index, phase), shared with the driver so that
        a hang can be reported with its place (`impala_tf.actors.faults.StepProgress`).
    """

    def __init__(
        self,
        config: ImpalaConfig,
        worker_index: int = 1,
        explore: bool | None = None,
        progress: StepProgress | None = None,
    ):
        self.config = config
        self.worker_index = worker_index
        self.num_envs = int(config.num_envs_per_env_runner)
        self.horizon = int(config.rollout_fragment_length)
        self.progress = progress if progress is not None else StepProgress()
        self._steps = 0  # Env steps taken per env (vector steps).
        self._env_label = env_name(config.env)
        self._drop_nonfinite = bool(getattr(config, "drop_nonfinite_episodes", False))
        self.envs = [make_env(config, worker_index, j) for j in range(self.num_envs)]
        self.observation_space = self.envs[0].observation_space
        self.action_space = self.envs[0].action_space
        explore = config.explore if explore is None else explore
        seed = env_seed(config.seed, worker_index, 0)
        self.policy = make_policy(
            self.observation_space, self.action_space, config.model, explore=explore, seed=seed
        )
        self.policy_version = 0
        self._obs_dtype = np.dtype(self.observation_space.dtype or np.float32)
        self._obs_shape = self.observation_space.shape
        self._float_obs = np.issubdtype(self._obs_dtype, np.floating)
        self._clip_actions = isinstance(self.action_space, gym.spaces.Box)
        self._clip_rewards = config.clip_rewards
        self._obs = np.stack(
            [
                self._reset(env, env_seed(config.seed, worker_index, j), j)
                for j, env in enumerate(self.envs)
            ]
        )
        self._state = self.policy.initial_state(self.num_envs)
        self._episode_return = np.zeros(self.num_envs, np.float64)
        self._episode_length = np.zeros(self.num_envs, np.int64)
        self._next = None  # The policy step for self._obs, computed ahead.

    def _where(self, j: int) -> str:
        """Names env `j` of this runner and the step, for error messages."""
        who = f"actor {self.worker_index - 1}" if self.worker_index > 0 else "the driver"
        length = getattr(self, "_episode_length", None)
        episode = f", episode step {int(length[j])}" if length is not None else ""
        return f"env {self._env_label} ({who}, env index {j}) at step {self._steps}{episode}"

    def _reset(self, env: gym.Env, seed: int | None = None, j: int = 0) -> np.ndarray:
        self.progress.set(self._steps, j, StepProgress.RESET)
        try:
            obs, _ = env.reset(seed=seed)
        except gym.error.DependencyNotInstalled:
            raise  # A missing package (e.g. pygame to render), not an env fault: says so itself.
        except Exception as e:
            raise EnvCallError(f"{self._where(j)}: reset() raised {type(e).__name__}: {e}") from e
        if self._obs_shape is None:  # Dict/Tuple spaces: nothing cheap to check.
            return np.asarray(obs, dtype=self._obs_dtype)
        obs = check_observation(obs, self._obs_shape, self._obs_dtype, self._where(j))
        if self._float_obs and not np.isfinite(obs).all():
            raise NonFiniteEnvError(
                f"{self._where(j)}: reset() returned a non-finite observation (a first "
                "observation cannot be dropped, even with drop_nonfinite_episodes=True)."
            )
        return obs

    def _nonfinite(self, j: int, what: str) -> None:
        """Raises `NonFiniteEnvError` for env `j` unless `drop_nonfinite_episodes` is set."""
        if not self._drop_nonfinite:
            raise NonFiniteEnvError(
                f"{self._where(j)} returned a non-finite {what}. Fix the env, or set "
                "drop_nonfinite_episodes=True to drop such episodes (counted in "
                "num_nonfinite_episodes_dropped)."
            )

    def set_weights(self, weights: list[np.ndarray], policy_version: int = 0) -> None:
        """Loads new policy weights; `policy_version` is the learner's `num_grad_updates`."""
        self.policy.set_weights(weights)
        self.policy_version = int(policy_version)

    def get_weights(self) -> list[np.ndarray]:
        return self.policy.get_weights()

    def sample(self) -> Fragment:
        """Steps every env `rollout_fragment_length` times and returns the fragment."""
        start = time.perf_counter()
        horizon, n = self.horizon, self.num_envs
        if self._next is None:
            self._next = self.policy.step(self._obs, self._state)
        first = self._next
        obs_buf = np.empty((horizon, n, *self._obs.shape[1:]), self._obs.dtype)
        act_buf = np.empty((horizon, n, *first.actions.shape[1:]), first.actions.dtype)
        logits_buf = np.empty((horizon, n, first.logits.shape[-1]), np.float32)
        logp_buf = np.empty((horizon, n), np.float32)
        vf_buf = np.empty((horizon, n), np.float32)
        vb_buf = np.empty((horizon, n), np.float32)
        rew_buf = np.empty((horizon, n), np.float32)
        term_buf = np.zeros((horizon, n), bool)
        trunc_buf = np.zeros((horizon, n), bool)
        state_in = self._state
        returns: list[float] = []
        lengths: list[int] = []
        progress, obs_shape, obs_dtype = self.progress, self._obs_shape, self._obs_dtype
        num_dropped = 0

        for t in range(horizon):
            step = self._next
            obs_buf[t] = self._obs
            act_buf[t] = step.actions
            logits_buf[t] = step.logits
            logp_buf[t] = step.logp
            vf_buf[t] = step.values
            env_actions = (
                np.clip(step.actions, self.action_space.low, self.action_space.high)
                if self._clip_actions
                else step.actions
            )
            next_obs = np.empty_like(self._obs)
            final_obs = {}
            dropped: list[int] = []  # Episodes cut at this step for non-finite data.
            progress.set(self._steps, 0, StepProgress.STEP)
            where_buf = progress.buffer
            for j, env in enumerate(self.envs):
                where_buf[1] = j  # One shared-memory write per env step (for hang reports).
                try:
                    obs, reward, terminated, truncated, _ = env.step(env_actions[j])
                except gym.error.DependencyNotInstalled:
                    raise
                except Exception as e:
                    raise EnvCallError(
                        f"{self._where(j)}: step() raised {type(e).__name__}: {e}"
                    ) from e
                try:
                    reward = float(reward)
                except (TypeError, ValueError) as e:
                    raise EnvSpaceError(
                        f"{self._where(j)} returned a reward that is not a number: {reward!r}"
                    ) from e
                drop = False
                if reward - reward != 0.0:  # NaN or +-inf, at the cost of one subtraction.
                    self._nonfinite(j, f"reward ({reward})")
                    reward, drop = 0.0, True
                if obs_shape is not None and (
                    t == 0
                    or type(obs) is not np.ndarray
                    or obs.shape != obs_shape
                    or obs.dtype is not obs_dtype
                ):
                    obs = check_observation(obs, obs_shape, obs_dtype, self._where(j))
                rew_buf[t, j] = reward
                self._episode_return[j] += reward
                self._episode_length[j] += 1
                if drop:
                    trunc_buf[t, j] = True
                    dropped.append(j)
                elif terminated or truncated:
                    term_buf[t, j] = terminated
                    trunc_buf[t, j] = truncated and not terminated
                    if trunc_buf[t, j]:
                        final = np.asarray(obs, dtype=obs_dtype)
                        if self._float_obs and not np.isfinite(final).all():
                            self._nonfinite(j, "final observation")
                            dropped.append(j)
                        else:
                            final_obs[j] = final
                    if not dropped or dropped[-1] != j:
                        returns.append(float(self._episode_return[j]))
                        lengths.append(int(self._episode_length[j]))
                if drop or terminated or truncated:
                    self._episode_return[j] = 0.0
                    self._episode_length[j] = 0
                    obs = self._reset(env, None, j)
                    where_buf[2] = StepProgress.STEP
                next_obs[j] = obs
            progress.set(self._steps, -1, StepProgress.POLICY)
            if self._float_obs and not np.isfinite(next_obs).all():
                bad = ~np.isfinite(next_obs.reshape(n, -1)).all(axis=1)
                for j in np.flatnonzero(bad):
                    self._nonfinite(int(j), "observation")
                    trunc_buf[t, j] = True
                    dropped.append(int(j))
                    self._episode_return[j] = 0.0
                    self._episode_length[j] = 0
                    next_obs[j] = self._reset(self.envs[j], None, int(j))
            self._steps += 1
            num_dropped += len(dropped)
            progress.set(self._steps, -1, StepProgress.POLICY)
            state = step.state
            if final_obs:
                rows = np.fromiter(final_obs, np.int64)
                final = self.policy.step(
                    np.stack([final_obs[j] for j in rows]), tuple(s[rows] for s in state)
                )
            dones = term_buf[t] | trunc_buf[t]
            if state and dones.any():
                state = tuple(np.where(dones[:, None], 0.0, s).astype(s.dtype) for s in state)
            self._obs, self._state = next_obs, state
            self._next = self.policy.step(next_obs, state)
            vb_buf[t] = np.where(term_buf[t], 0.0, self._next.values)
            if final_obs:
                vb_buf[t, rows] = final.values
            if dropped:
                # Bootstrapping from the non-finite observation would poison the targets.
                vb_buf[t, dropped] = vf_buf[t, dropped]

        progress.set(self._steps, -1, StepProgress.IDLE)
        if self._clip_rewards is True:
            rew_buf = np.sign(rew_buf)
        elif self._clip_rewards:
            rew_buf = np.clip(rew_buf, -self._clip_rewards, self._clip_rewards)

        def seq(x):  # [T, B, ...] -> [B, T, ...]
            return np.ascontiguousarray(np.swapaxes(x, 0, 1))

        columns: dict[str, Any] = {
            "obs": seq(obs_buf),
            "actions": seq(act_buf),
            "rewards": seq(rew_buf),
            "terminateds": seq(term_buf),
            "truncateds": seq(trunc_buf),
            "action_dist_inputs": seq(logits_buf),
            "action_logp": seq(logp_buf),
            "vf_preds": seq(vf_buf),
            "values_bootstrapped": seq(vb_buf),
        }
        for i, s in enumerate(state_in):
            columns[f"state_in_{i}"] = s
        batch = SampleBatch(columns)
        if self.config.compress_observations:
            batch = compress(batch)
        return Fragment(
            batch=batch,
            episode_returns=returns,
            episode_lengths=lengths,
            policy_version=self.policy_version,
            actor_id=self.worker_index - 1,
            sample_time_s=time.perf_counter() - start,
            num_nonfinite_episodes_dropped=num_dropped,
        )

    # Resuming ---------------------------------------------------------------------------------

    def reset(self, seed: int | None) -> None:
        """Starts new episodes in every env, as if this runner had been built with `seed`.

        The envs are reset with the seeds `env_seed(seed, worker_index, j)` and the action
        sampler restarts from `env_seed(seed, worker_index, 0)`; with `seed=None` both continue
        from unseeded randomness. Unfinished episodes are dropped; weights are kept.
        """
        self._obs = np.stack(
            [
                self._reset(env, env_seed(seed, self.worker_index, j), j)
                for j, env in enumerate(self.envs)
            ]
        )
        self.policy.reseed(env_seed(seed, self.worker_index, 0))
        self._state = self.policy.initial_state(self.num_envs)
        self._episode_return[:] = 0.0
        self._episode_length[:] = 0
        self._next = None

    def get_state(self) -> dict[str, Any]:
        """A picklable snapshot of this runner, for an exact resume (`set_state`).

        It holds the weights and their version, the action sampler's state, and, when the envs
        can be pickled, the envs with their unfinished episodes (`"envs"`, bytes). Envs that
        cannot be pickled (simulators holding handles, e.g. Atari) give `"envs": None` and the
        reason in `"envs_error"`: a runner restored from such a snapshot starts new episodes.
        """
        envs, error = None, None
        try:
            envs = pickle.dumps(
                (
                    self.envs,
                    self._obs,
                    self._state,
                    self._episode_return,
                    self._episode_length,
                    self._next,
                ),
                protocol=pickle.HIGHEST_PROTOCOL,
            )
        except Exception as e:  # noqa: BLE001 - any env may refuse; the snapshot says why.
            error = f"{type(e).__name__}: {e}"
        return {
            "weights": self.get_weights(),
            "policy_version": self.policy_version,
            "policy_rng": self.policy.get_rng_state(),
            "envs": envs,
            "envs_error": error,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores a `get_state()` snapshot; each key is optional.

        Keys: `"weights"` (with `"policy_version"`); `"envs"` (bytes: replaces the envs and
        their unfinished episodes); `"seed"` (when there are no `"envs"`: new episodes, as
        `reset(seed)`); `"policy_rng"` (the action sampler's state, applied last).
        """
        if state.get("weights") is not None:
            self.set_weights(state["weights"], state.get("policy_version", 0))
        if state.get("envs") is not None:
            envs, obs, rnn_state, returns, lengths, next_step = pickle.loads(state["envs"])
            self.close()
            self.envs = envs
            self._obs, self._state, self._next = obs, rnn_state, next_step
            self._episode_return, self._episode_length = returns, lengths
        elif "seed" in state:
            self.reset(state["seed"])
        if state.get("policy_rng") is not None:
            self.policy.set_rng_state(state["policy_rng"])

    def run_episodes(self, num_episodes: int) -> list[tuple[float, int]]:
        """Samples until `num_episodes` episodes have finished; returns (return, length) pairs."""
        done: list[tuple[float, int]] = []
        while len(done) < num_episodes:
            fragment = self.sample()
            done.extend(zip(fragment.episode_returns, fragment.episode_lengths))
        return done[:num_episodes]

    def close(self) -> None:
        for env in self.envs:
            env.close()
