"""`EnvRunner`: steps a set of gymnasium envs with one policy and cuts rollout fragments.

B is the number of envs (`num_envs_per_env_runner`), T is time (`rollout_fragment_length`).
This is the single-agent case (`impala_tf.rollout.multi_agent_runner` steps multi-agent envs):
one policy, `"default_policy"`, acts for the B envs in one batched call per time step. It is
`impala_tf.acting.factory.make_policy`'s choice (numpy for MLPs, TensorFlow for the rest) and has
no weights until `set_weights`. The envs are an `impala_tf.envs.batch.EnvBatch`: ale-py's native
vector env for Atari where it covers the config (training runners only), else gymnasium envs.

`sample()` returns a `Fragment` (`impala_tf.rollout.fragment`) whose batch is a `SampleBatch` of
B sequences of T steps, per-step columns shaped [B, T, ...] (`truncate_episodes`: episodes
continue across fragments), plus the episodes that finished in it. Recurrent policies add
`state_in_i` [B, C, H]: the state at the start of each of the C = ceil(T / `model.max_seq_len`)
sequences the learner trains on (`impala_tf.learning.sequences`).

An env that stacks frames (`frame_stack`) has its frames stored once: `obs_frames`
[B, T + k - 1, H, W, s] and `obs_restarts` [B, T] replace `obs`, and the learner rebuilds the
stacks (`impala_tf.models.frames`). A policy acting in the runner acts on the env's own stacks;
with central inference the runner sends the server each step's newest frames and refills.
Fragments leave `sample()` unpacked (with `compress_observations` the actor process compresses
the observation column for transport).

Box actions reach the env unsquashed from [-1, 1] to the space's bounds (`normalize_actions`) or
clipped (`clip_actions`, `impala_tf.acting.actions`); the fragment keeps the policy's own actions.
Rewards are clipped for training as `clip_rewards` says (True: to their sign, x: to [-x, x];
None: the sign for Atari with DeepMind preprocessing, else no clipping); episode returns are
reported unclipped, and per game for Atari with episodic life (`impala_tf.envs.atari`).

`values_bootstrapped[t]` is the behaviour value of the observation that follows step t in the same
episode: V(x_{t+1}) from the next step's policy call, 0 after a termination, and V(final
observation) after a truncation (one extra batched call on the truncated envs). The `obs` column
holds observations after the runner's filter (`observation_filter`, `impala_tf.acting.filters`).

`policy_version[t]` (int64) is the `num_grad_updates` of the weights that chose step t's action.
The runner computes each step's action one step ahead, so after `set_weights` the first step of
the next fragment was still chosen by the previous weights; the learner's
`diff_num_grad_updates_vs_sampler_policy` is computed from this column.

Callbacks (`impala_tf.rollout.hooks`): each env's episode has one agent, `"agent0"`;
`on_episode_end` follows the reported episode (a whole game with episodic life).
`on_sample_end` gets each fragment's `SampleBatch` before it is returned.

Faults (`impala_tf.envs.faults`): an env that raises, returns an observation of the wrong shape
or dtype, or non-finite data raises an `EnvError` naming the env, actor, env index and step.
With `drop_nonfinite_episodes=True` a non-finite reward or observation instead ends its episode
at that step: the step trains as a truncation with reward 0 and bootstrap value V(x_t), the
episode is not reported (nor ended in the callbacks), and the fragment counts it in
`num_nonfinite_episodes_dropped`. A non-finite first observation is always an error.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import gymnasium as gym
import numpy as np

from impala_tf.acting.actions import ActionAdapter
from impala_tf.acting.filters import Filter
from impala_tf.config.callbacks import AGENT_ID
from impala_tf.data.sample_batch import OBS, OBS_FRAMES, OBS_RESTARTS, SampleBatch
from impala_tf.envs import atari
from impala_tf.envs.atari_vector import AtariVectorEnvBatch
from impala_tf.envs.batch import GymEnvBatch, sent_frame_stack
from impala_tf.envs.faults import EnvGuard, StepProgress, env_name
from impala_tf.envs.make import make_env_batch
from impala_tf.rollout.base import Remote, RunnerBase
from impala_tf.rollout.fragment import DEFAULT_POLICY_ID, POLICY_VERSION, Episode, Fragment
from impala_tf.rollout.spec import RunnerSpec
from impala_tf.utils.seeds import env_seed

__all__ = ["EnvRunner"]


class EnvRunner(RunnerBase):
    """Steps `num_envs_per_env_runner` envs with one policy (`"default_policy"`); fragments.

    Args:
      spec: What the runner is built from (`impala_tf.driver.specs.runner_spec`).
      worker_index: 1-based index of this runner; it derives the env and sampling seeds.
      explore: Overrides `spec.explore` (evaluation passes False).
      update_filter: Update the observation filter (`observation_filter`) with the observations
        seen (actors); False applies it unchanged (evaluation).
      progress: Where the runner is (step, env index, phase), shared with the driver so that
        a hang can be reported with its place (`impala_tf.envs.faults.StepProgress`).
      remote: With central inference (`impala_tf.acting.inference`): this actor's connection to the
        driver's inference server and {policy_id: per-env shapes of the model's recurrent
        state}. The runner then acts through a `RemotePolicy` and never imports TensorFlow.
    """

    policy_ids = (DEFAULT_POLICY_ID,)

    def __init__(
        self,
        spec: RunnerSpec,
        worker_index: int = 1,
        explore: bool | None = None,
        update_filter: bool = True,
        progress: StepProgress | None = None,
        remote: Remote | None = None,
    ):
        super().__init__(spec, worker_index, explore, update_filter, progress)
        who = f"actor {worker_index - 1}" if worker_index > 0 else "the driver"
        self._guard = EnvGuard(
            env_name(spec.env.env),
            who,
            drop_nonfinite=spec.drop_nonfinite_episodes,
            progress=self.progress,
        )
        self.env_batch = make_env_batch(spec.env, worker_index, self._guard)
        self.env_batch.collect_infos = self.callbacks.episodes
        self.observation_space = self.env_batch.observation_space
        self.action_space = self.env_batch.action_space
        acting = spec.policies[DEFAULT_POLICY_ID]
        seed = self._policy_seeds(spec.seed)[DEFAULT_POLICY_ID]
        # Frame-stacking envs: each frame is stored once (`obs_frames`, impala_tf.models.frames),
        # and sent once to the driver's inference server, which keeps the stacks. The driver's probe
        # decided it; this runner's envs must stack as the probed one did.
        self.frame_stack = spec.frame_stacks.get(DEFAULT_POLICY_ID)
        own = sent_frame_stack(self.env_batch.frame_stack, spec.observation_filter)
        if own != self.frame_stack:
            raise ValueError(
                f"The envs of {who} stack frames as {own} (k frames of s channels), but the "
                f"driver's probe env stacked them as {self.frame_stack}: the env must make the "
                "same observations in every process."
            )
        self._server_keeps_stacks = remote is not None and self.frame_stack is not None
        model = acting.model
        self._seq_len = model.max_seq_len
        policy = self._make_policy(
            DEFAULT_POLICY_ID,
            acting.spaces,
            model,
            seed,
            remote,
            acting.precision,
            frame_stack=self.frame_stack,
        )
        self.policies = {DEFAULT_POLICY_ID: policy}
        self.versions = {DEFAULT_POLICY_ID: 0}
        self.filters = {
            DEFAULT_POLICY_ID: self._make_filter(DEFAULT_POLICY_ID, self.observation_space)
        }
        self._next_version = 0  # The version of the weights that computed `self._next`.
        self._obs_dtype = self.observation_space.dtype or np.float32
        self._env_actions = ActionAdapter(
            self.action_space, spec.normalize_actions, spec.clip_actions
        )
        is_atari = isinstance(self.env_batch, AtariVectorEnvBatch) or (
            isinstance(self.env_batch, GymEnvBatch) and atari.is_atari(self.env_batch.envs[0])
        )
        self._clip_rewards = spec.env.clip_rewards_for(is_atari)
        # Raw until the first policy step filters them (after the driver's filter has arrived).
        self._obs = self._reset_all(spec.seed)
        self._obs_filtered = False
        self._initial_state = self.policy.initial_state(self.num_envs)
        self._state = self._initial_state
        self._episode_return = np.zeros(self.num_envs, np.float64)
        self._episode_length = np.zeros(self.num_envs, np.int64)
        self._guard.episode_length = self._episode_length  # Updated in place; for messages.
        self._next = None  # The policy step for self._obs, computed ahead.

    @property
    def envs(self) -> list[gym.Env]:
        """The gymnasium envs (empty when a native vector env steps them)."""
        return getattr(self.env_batch, "envs", [])

    @property
    def policy(self) -> Any:
        """The acting policy (`policies["default_policy"]`)."""
        return self.policies[DEFAULT_POLICY_ID]

    @property
    def obs_filter(self) -> Filter:
        """The observation filter (`filters["default_policy"]`)."""
        return self.filters[DEFAULT_POLICY_ID]

    @property
    def policy_version(self) -> int:
        """The `num_grad_updates` of the policy's weights (`versions["default_policy"]`)."""
        return self.versions[DEFAULT_POLICY_ID]

    @property
    def base_env(self) -> Any:
        """What episode hooks get as `base_env`: the env batch (`impala_tf.envs.batch`)."""
        return self.env_batch

    def _reset_all(self, seed: int | None) -> np.ndarray:
        seeds = [env_seed(seed, self.worker_index, j) for j in range(self.num_envs)]
        return np.asarray(self.env_batch.reset(seeds), dtype=self._obs_dtype)

    def _filter(self, obs: np.ndarray) -> np.ndarray:
        """Applies the observation filter to a batch of raw observations [N, *obs_shape]."""
        return self.obs_filter(obs, update=self._update_filter)

    def sample(self) -> Fragment:
        """Steps every env `rollout_fragment_length` times and returns the fragment."""
        start = time.perf_counter()
        horizon, n = self.horizon, self.num_envs
        raw_obs = self._obs
        if self._next is None:
            if not self._obs_filtered:
                self._obs, self._obs_filtered = self._filter(self._obs), True
            # No step since the envs' resets: every stack is a refill.
            self._next = self._act(self._obs, self._state, np.ones(n, bool))
            self._next_version = self._version_of(self._next)
        if self._hooks.wanted:
            for j in range(n):
                self._hooks.start(j, [(AGENT_ID, raw_obs[j], self._obs[j], None, None)])
        first = self._next
        version_buf = np.empty((horizon, n), np.int64)
        frames = self.frame_stack
        if frames is None:
            obs_buf = np.empty((horizon, n, *self._obs.shape[1:]), self._obs.dtype)
        else:
            k, ch = frames
            h, w = self._obs.shape[1:3]
            # The stack at t = 0 as its k frames, then the newest frame of each later step.
            frame_buf = np.empty((n, horizon + k - 1, h, w, ch), self._obs.dtype)
            frame_buf[:, :k] = np.moveaxis(self._obs.reshape(n, h, w, k, ch), 3, 1)
            restart_buf = np.zeros((horizon, n), bool)
            restarts = None
        act_buf = np.empty((horizon, n, *first.actions.shape[1:]), first.actions.dtype)
        logits_buf = np.empty((horizon, n, first.logits.shape[-1]), np.float32)
        logp_buf = np.empty((horizon, n), np.float32)
        vf_buf = np.empty((horizon, n), np.float32)
        vb_buf = np.empty((horizon, n), np.float32)
        rew_buf = np.empty((horizon, n), np.float32)
        term_buf = np.zeros((horizon, n), bool)
        trunc_buf = np.zeros((horizon, n), bool)
        # The recurrent state at the start of each `max_seq_len` sequence
        # (impala_tf.learning.sequences).
        seq_len = self._seq_len
        starts: list[tuple[np.ndarray, ...]] = []
        episodes: list[Episode] = []
        num_dropped = 0

        for t in range(horizon):
            if t % seq_len == 0:
                starts.append(self._state)
            step = self._next
            version_buf[t] = self._next_version
            if frames is None:
                obs_buf[t] = self._obs
            elif t > 0:
                frame_buf[:, t + k - 1] = self._obs[..., -ch:]
                restart_buf[t] = restarts
            act_buf[t] = step.actions
            logits_buf[t] = step.logits
            logp_buf[t] = step.logp
            vf_buf[t] = step.values
            # The batch keeps the policy's actions; only the env sees them unsquashed/clipped.
            env_actions = self._env_actions(step.actions)
            stepped = self.env_batch.step(env_actions)
            next_obs = self._filter(stepped.obs.astype(self._obs_dtype, copy=False))
            final_obs = stepped.final_obs
            if frames is not None:
                restarts = stepped.stack_restarts
            rew_buf[t] = stepped.rewards
            term_buf[t] = stepped.terminateds
            trunc_buf[t] = stepped.truncateds
            self._episode_return += stepped.rewards
            self._episode_length += 1
            hooked = {}
            if self._hooks.running:
                hooked = self._step_hook_episodes(stepped, step.actions, next_obs)
            for j in np.flatnonzero(stepped.episode_ends):
                ret = float(self._episode_return[j])
                metrics, hist = hooked.get(int(j), ({}, {}))
                episodes.append(
                    Episode(
                        ret,
                        int(self._episode_length[j]),
                        {DEFAULT_POLICY_ID: [ret]},
                        metrics,
                        hist,
                    )
                )
                self._episode_return[j] = 0.0
                self._episode_length[j] = 0
            dropped = np.flatnonzero(stepped.dropped)  # Cut for non-finite data; not reported.
            if dropped.size:
                self._episode_return[dropped] = 0.0
                self._episode_length[dropped] = 0
                num_dropped += dropped.size
            state = step.state
            if final_obs:
                rows = np.fromiter(final_obs, np.int64)
                final = self.policy.step(
                    self._filter(
                        np.stack([final_obs[j] for j in rows]).astype(self._obs_dtype, copy=False)
                    ),
                    tuple(s[rows] for s in state),
                )
            dones = term_buf[t] | trunc_buf[t]
            if state and dones.any():  # The envs that start an episode start from scratch.
                state = tuple(
                    np.where(dones[:, None], s0, s).astype(s.dtype)
                    for s, s0 in zip(state, self._initial_state)
                )
            self._obs, self._state = next_obs, state
            self._next = self._act(next_obs, state, stepped.stack_restarts)
            self._next_version = self._version_of(self._next)
            vb_buf[t] = np.where(term_buf[t], 0.0, self._next.values)
            if final_obs:
                vb_buf[t, rows] = final.values
            if dropped.size:
                # Bootstrapping from the non-finite observation would poison the targets.
                vb_buf[t, dropped] = vf_buf[t, dropped]

        self.progress.set(self._guard.steps, -1, StepProgress.IDLE)
        if self._clip_rewards is True:
            rew_buf = np.sign(rew_buf)
        elif self._clip_rewards:
            rew_buf = np.clip(rew_buf, -self._clip_rewards, self._clip_rewards)

        def seq(x):  # [T, B, ...] -> [B, T, ...]
            return np.ascontiguousarray(np.swapaxes(x, 0, 1))

        columns: dict[str, Any] = {
            "actions": seq(act_buf),
            "rewards": seq(rew_buf),
            "terminateds": seq(term_buf),
            "truncateds": seq(trunc_buf),
            "action_dist_inputs": seq(logits_buf),
            "action_logp": seq(logp_buf),
            "vf_preds": seq(vf_buf),
            "values_bootstrapped": seq(vb_buf),
            POLICY_VERSION: seq(version_buf),
        }
        if frames is None:
            columns[OBS] = seq(obs_buf)
        else:
            columns[OBS_FRAMES] = frame_buf
            columns[OBS_RESTARTS] = seq(restart_buf)
        for i in range(len(starts[0])):
            columns[f"state_in_{i}"] = np.stack([start[i] for start in starts], axis=1)
        steps = horizon * n
        batch = SampleBatch(columns)
        self.callbacks("on_sample_end", worker=self, samples=batch)
        return Fragment(
            batches={DEFAULT_POLICY_ID: batch},
            env_steps=steps,
            agent_steps=steps,
            policy_versions={DEFAULT_POLICY_ID: max(self.policy_version, int(version_buf.max()))},
            episodes=episodes,
            actor_id=self.worker_index - 1,
            sample_time_s=time.perf_counter() - start,
            filter_deltas=self._flush_filters(),
            num_nonfinite_episodes_dropped=num_dropped,
        )

    # Episode callbacks ------------------------------------------------------------------------

    def _step_hook_episodes(
        self, stepped: Any, actions: np.ndarray, obs: np.ndarray
    ) -> dict[int, tuple[dict, dict]]:
        """Records one env step in each env's callbacks `Episode` and calls the episode hooks.

        Args:
          stepped: The env batch's `BatchStep`.
          actions: [B, ...] the actions taken (the policy's).
          obs: [B, ...] the next observations, filtered.

        Returns:
          {env index: (custom metrics, hist data)} of the episodes that ended.
        """
        hooks, ended = self._hooks, {}
        infos, last = stepped.infos, stepped.ended_obs or {}
        for j in range(self.num_envs):
            info = infos[j] if infos is not None else None
            hooks.record(
                j, [(AGENT_ID, actions[j], DEFAULT_POLICY_ID)], {AGENT_ID: stepped.rewards[j]}
            )
            if stepped.episode_ends[j] or stepped.dropped[j]:
                if stepped.episode_ends[j]:
                    raw = last.get(j)
                    filtered = None if raw is None else self.obs_filter(raw[None], update=False)[0]
                    ended[j] = hooks.end(j, [(AGENT_ID, raw, filtered, info, None)])
                # A dropped episode (non-finite data) is not reported: no end hook.
                hooks.start(j, [(AGENT_ID, stepped.obs[j], obs[j], None, None)])
            else:
                hooks.step(j, [(AGENT_ID, stepped.obs[j], obs[j], info, None)])
        return ended

    def _act(self, obs: np.ndarray, state: tuple, restarts: np.ndarray | None) -> Any:
        """The policy's step on every env's next observation; `restarts` (bool [B], the envs'
        refills) let the driver's inference server keep the stacks (only new frames travel)."""
        if self._server_keeps_stacks:
            return self.policy.step(obs, state, stack_restarts=restarts)
        return self.policy.step(obs, state)

    def _version_of(self, step) -> int:
        """The weights' version that computed `step` (the server's, with central inference)."""
        version = getattr(step, "version", None)  # Steps pickled before versions: None.
        return self.policy_version if version is None else int(version)

    # Resuming ---------------------------------------------------------------------------------

    def _restart(self, seed: int | None) -> None:
        self._obs = self._reset_all(seed)
        self._obs_filtered = False
        self._forget_stacks()
        self._state = self.policy.initial_state(self.num_envs)
        self._episode_return[:] = 0.0
        self._episode_length[:] = 0
        self._next = None

    def get_state(self) -> dict[str, Any]:
        """`RunnerBase.get_state`, plus the version of the weights that computed the action
        ahead (`"next_version"`) and whether the observations held are filtered."""
        return {
            **super().get_state(),
            "next_version": self._next_version,
            "obs_filtered": self._obs_filtered,
        }

    def _in_flight(self) -> tuple:
        return (
            self.env_batch,
            self._obs,
            self._state,
            self._episode_return,
            self._episode_length,
            self._next,
        )

    def _restore(self, in_flight: tuple, state: Mapping[str, Any]) -> None:
        envs, obs, rnn_state, returns, lengths, next_step = in_flight
        # Snapshots taken before env batches existed hold a list of envs.
        if isinstance(envs, list):
            envs = GymEnvBatch(envs, self._guard)
        else:  # Batches pickle without their guard (it holds the shared progress array).
            envs.guard = self._guard
        envs.collect_infos = self.callbacks.episodes
        self.env_batch = envs
        self._forget_stacks()  # The server's copies are of the replaced envs.
        self._obs, self._state, self._next = obs, rnn_state, next_step
        self._episode_return, self._episode_length = returns, lengths
        self._guard.episode_length = self._episode_length
        self._next_version = int(state.get("next_version", self.policy_version))
        self._obs_filtered = bool(state.get("obs_filtered", next_step is not None))

    def _forget_stacks(self) -> None:
        if self._server_keeps_stacks:
            self.policy.forget_stacks()

    def close(self) -> None:
        self.env_batch.close()
