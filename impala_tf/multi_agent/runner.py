"""`MultiAgentEnvRunner`: steps multi-agent envs with several policies; per-policy fragments.

The runner owns `num_envs_per_env_runner` `MultiAgentEnv`s. Each env step, the agents that have
an observation are grouped by the policy `policy_mapping_fn` maps them to (asked once per agent
and episode) and each policy acts for its agents in one batched call. Every (env, agent) pair
keeps its own stream of steps, across episodes, like one env of a single-agent runner
(`truncate_episodes`); whenever a stream holds T = `rollout_fragment_length` steps they become
one [1, T] sequence of its policy's batch. So `sample()` steps the envs T times (T * B env
steps) and returns a `MultiAgentFragment` whose `MultiAgentBatch` holds, per policy, the
sequences completed meanwhile ([R, T, ...], R varies; steps not yet filling a sequence wait for
the next call). The columns are the single-agent runner's (`impala_tf.actors.env_runner`).

`values_bootstrapped[t]` of an agent's step is the behaviour value of that agent's next
observation: 0 after the agent's termination, V(final observation) after a truncation (its own
or the episode's `__all__`), else the value computed when it next acts (computed one step
ahead, as the single-agent runner does, so it is known before the step is emitted).

Observations pass through one filter per policy (`observation_filter`, RLlib keeps one per
policy too); the fragment carries each policy's changes (`filter_delta`: {policy_id: Filter}).

Episode metrics: the return of an episode is the sum over its agents (RLlib's
`episode_reward`); `policy_rewards[policy_id]` lists each agent's own return under the policy it
acted with (RLlib's `policy_reward_mean` inputs).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

import gymnasium as gym
import numpy as np

from impala_tf.actions import ActionAdapter
from impala_tf.actors.env_runner import POLICY_VERSION, EnvRunner, env_seed, make_env
from impala_tf.envs.faults import StepProgress
from impala_tf.filters import Filter, filter_from_state, get_filter
from impala_tf.multi_agent import spec as ma_spec
from impala_tf.multi_agent.batch import MultiAgentBatch
from impala_tf.multi_agent.env import ALL, MultiAgentEnv
from impala_tf.numpy_policy import make_policy
from impala_tf.sample_batch import SampleBatch

__all__ = ["MultiAgentEnvRunner", "MultiAgentFragment", "policy_spaces"]

#: Step fields of a stream, in the order they are stored.
_FIELDS = ("obs", "actions", "logits", "logp", "vf", "rewards", "term", "trunc", "vb", "version")


@dataclasses.dataclass
class MultiAgentFragment:
    """What a multi-agent runner sends per sample request (`Fragment`'s fields, per policy).

    Attributes:
      batch: The `MultiAgentBatch` (policy batches of completed [R, T] sequences).
      episode_returns: Summed (over agents) returns of the episodes that ended.
      episode_lengths: Their lengths in env steps.
      policy_version: The driver's broadcast counter of the weights loaded when sampling.
      actor_id: Index of the actor that produced it (0-based).
      sample_time_s: Wall time spent producing it.
      filter_delta: {policy_id: observation filter changes}, or None without filters.
      num_nonfinite_episodes_dropped: Always 0 (kept for the driver's counters).
      policy_rewards: {policy_id: [each agent's return in the episodes that ended]}.
      agent_steps_sampled: Agent steps taken while sampling (RLlib's agent-step count).
    """

    batch: MultiAgentBatch
    episode_returns: list[float]
    episode_lengths: list[int]
    policy_version: int
    actor_id: int = 0
    sample_time_s: float = 0.0
    filter_delta: dict[str, Filter] | None = None
    num_nonfinite_episodes_dropped: int = 0
    policy_rewards: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    agent_steps_sampled: int = 0

    @property
    def env_steps(self) -> int:
        return self.batch.env_steps()


def policy_spaces(
    config: Any, env: MultiAgentEnv | None = None
) -> dict[str, tuple[gym.Space, gym.Space]]:
    """{policy_id: (observation_space, action_space)}: the spec's, else the first agent's mapped.

    Agents are mapped with `policy_mapping_fn` (episode 0); a policy no agent maps to and whose
    spec names no spaces takes the env's common spaces.

    Raises:
      ValueError: an agent maps to a policy that `policies` does not name.
    """
    specs = ma_spec.normalize_policies(config.policies)
    own = env is None
    if own:
        env = make_env(config, 0, 0)
    try:
        if not isinstance(env, MultiAgentEnv):
            raise ValueError(
                f"The env {config.env!r} is not a MultiAgentEnv (impala_tf.multi_agent.env), "
                "but `policies`/`policy_mapping_fn` are set."
            )
        mapping = ma_spec.resolve_mapping_fn(config.policy_mapping_fn)
        episode = ma_spec.EpisodeInfo(0)
        by_policy: dict[str, Any] = {}
        for agent in env.possible_agents:
            pid = mapping(agent, episode, worker=None)
            if pid not in specs:
                raise ValueError(
                    f"`policy_mapping_fn` maps agent {agent!r} to {pid!r}, which is not in "
                    f"`policies` {sorted(specs)}."
                )
            by_policy.setdefault(pid, agent)
        out = {}
        for pid, spec in specs.items():
            agent = by_policy.get(pid)
            obs = spec.observation_space or (
                env.get_observation_space(agent) if agent is not None else env.observation_space
            )
            act = spec.action_space or (
                env.get_action_space(agent) if agent is not None else env.action_space
            )
            out[pid] = (obs, act)
        return out
    finally:
        if own:
            env.close()


class _Stream:
    """The steps of one (env, agent, policy) not yet emitted, in arrival order."""

    __slots__ = _FIELDS

    def __init__(self):
        for name in _FIELDS:
            setattr(self, name, [])

    def __len__(self) -> int:
        return len(self.obs)

    def ready(self, horizon: int) -> bool:
        return len(self) >= horizon and all(v is not None for v in self.vb[:horizon])

    def pop(self, horizon: int) -> dict[str, list]:
        out = {}
        for name in _FIELDS:
            values = getattr(self, name)
            out[name] = values[:horizon]
            setattr(self, name, values[horizon:])
        return out


class MultiAgentEnvRunner:
    """Steps `num_envs_per_env_runner` multi-agent envs with every policy; see the module doc.

    Args:
      config: The algorithm config (with `policies`, `policy_mapping_fn`).
      worker_index: 1-based index of this runner; it derives the env and sampling seeds.
      explore: Overrides `config.explore` (evaluation passes False).
      update_filter: Update the observation filters with what is seen (actors).
      progress: Shared progress record (kept for the pool's hang reports).
    """

    def __init__(
        self,
        config: Any,
        worker_index: int = 1,
        explore: bool | None = None,
        update_filter: bool = True,
        progress: StepProgress | None = None,
    ):
        self.config = config
        self.worker_index = worker_index
        self.num_envs = int(config.num_envs_per_env_runner)
        self.horizon = int(config.rollout_fragment_length)
        self.progress = progress if progress is not None else StepProgress()
        self.envs = [make_env(config, worker_index, j) for j in range(self.num_envs)]
        self.spaces = policy_spaces(config, self.envs[0])
        self.mapping = ma_spec.resolve_mapping_fn(config.policy_mapping_fn)
        explore = config.explore if explore is None else explore
        base_seed = env_seed(config.seed, worker_index, 0)
        self.policies = {}
        self.filters: dict[str, Filter] = {}
        self._actions: dict[str, ActionAdapter] = {}
        for k, (pid, (obs_space, act_space)) in enumerate(sorted(self.spaces.items())):
            pconfig = ma_spec.policy_config(config, pid)
            seed = None if base_seed is None else base_seed + 7919 * (k + 1)
            self.policies[pid] = make_policy(
                obs_space, act_space, pconfig.model, explore=explore, seed=seed
            )
            self.filters[pid] = get_filter(config.observation_filter, obs_space.shape)
            self._actions[pid] = ActionAdapter(
                act_space, config.normalize_actions, config.clip_actions
            )
        self.versions = {pid: 0 for pid in self.policies}
        self.policy_version = 0
        self._update_filter = bool(update_filter)
        self._episode_counter = 0
        self._reset_all(config.seed)

    # Episodes ---------------------------------------------------------------------------------

    def _new_episode(self, j: int) -> None:
        self._episode_counter += 1
        self._episode_ids[j] = self._episode_counter
        self._agent_policy[j] = {}
        self._agent_return[j] = collections.defaultdict(float)
        self._episode_length[j] = 0
        self._done_agents[j] = set()

    def _reset_all(self, seed: int | None) -> None:
        self._episode_ids = [0] * self.num_envs
        self._agent_policy: list[dict] = [{} for _ in range(self.num_envs)]
        self._agent_return: list[dict] = [{} for _ in range(self.num_envs)]
        self._episode_length = [0] * self.num_envs
        self._done_agents: list[set] = [set() for _ in range(self.num_envs)]
        self._streams: dict[tuple, _Stream] = {}
        self._awaiting: dict[tuple, tuple[_Stream, int]] = {}
        self._obs: list[dict] = []
        for j, env in enumerate(self.envs):
            self._new_episode(j)
            obs, _ = env.reset(seed=env_seed(seed, self.worker_index, j))
            self._obs.append(dict(obs))
        self._next: list[dict] | None = None

    def _policy_of(self, j: int, agent: Any) -> str:
        pid = self._agent_policy[j].get(agent)
        if pid is None:
            episode = ma_spec.EpisodeInfo(self._episode_ids[j], j, self.worker_index)
            pid = self.mapping(agent, episode, worker=None)
            if pid not in self.policies:
                raise ValueError(
                    f"`policy_mapping_fn` maps agent {agent!r} to {pid!r}, which is not in "
                    f"`policies` {sorted(self.policies)}."
                )
            self._agent_policy[j][agent] = pid
        return pid

    # Acting -------------------------------------------------------------------------------------

    def _act(self, items: list[tuple[int, Any, str, Any]], update: bool) -> list[tuple]:
        """Runs each policy once on its agents' observations; per item (obs, step fields).

        Args:
          items: (env index, agent id, policy id, raw observation).
          update: Whether the filters may learn from these observations.
        """
        out: list[tuple | None] = [None] * len(items)
        groups: dict[str, list[int]] = collections.defaultdict(list)
        for i, (_, _, pid, _) in enumerate(items):
            groups[pid].append(i)
        for pid, rows in groups.items():
            space = self.spaces[pid][0]
            raw = np.stack([np.asarray(items[i][3], dtype=space.dtype or np.float32) for i in rows])
            obs = self.filters[pid](raw, update=update and self._update_filter)
            step = self.policies[pid].step(obs)
            for k, i in enumerate(rows):
                out[i] = (
                    obs[k],
                    step.actions[k],
                    step.logits[k],
                    float(step.logp[k]),
                    float(step.values[k]),
                    self.versions[pid],
                )
        return out  # type: ignore[return-value]

    def _compute_next(self) -> None:
        items = [
            (j, agent, self._policy_of(j, agent), o)
            for j in range(self.num_envs)
            for agent, o in self._obs[j].items()
            if agent not in self._done_agents[j]
        ]
        results = self._act(items, update=True)
        self._next = [{} for _ in range(self.num_envs)]
        for (j, agent, pid, _), result in zip(items, results):
            self._next[j][agent] = (pid, *result)
            waiting = self._awaiting.pop((j, agent), None)
            if waiting is not None:
                stream, index = waiting
                stream.vb[index] = result[4]

    def set_weights(
        self,
        weights: dict[str, tuple[list[np.ndarray], int]],
        policy_version: int = 0,
        obs_filter: dict[str, Filter] | None = None,
    ) -> None:
        """Loads {policy_id: (weights, num_grad_updates)}; syncs the filters to the driver's."""
        for pid, (w, version) in weights.items():
            self.policies[pid].set_weights(w)
            self.versions[pid] = int(version)
        self.policy_version = int(policy_version)
        for pid, f in (obs_filter or {}).items():
            self.filters[pid].sync(f)

    def get_weights(self) -> dict[str, list[np.ndarray]]:
        return {pid: p.get_weights() for pid, p in self.policies.items()}

    def sample(self) -> MultiAgentFragment:
        """Steps every env `rollout_fragment_length` times; returns the completed sequences."""
        start = time.perf_counter()
        horizon = self.horizon
        if self._next is None:
            self._compute_next()
        returns: list[float] = []
        lengths: list[int] = []
        policy_rewards: dict[str, list[float]] = collections.defaultdict(list)
        agent_steps = 0
        for _ in range(horizon):
            truncated: list[tuple[_Stream, int, int, Any, str, Any]] = []
            for j, env in enumerate(self.envs):
                acting = self._next[j]
                if not acting:  # Every agent waits (cannot happen in a well-formed env).
                    raise RuntimeError(f"env {j}: no agent has an observation to act on.")
                actions = {
                    a: self._actions[pid](np.asarray(fields[1])[None])[0]
                    for a, (pid, *fields) in acting.items()
                }
                obs, rewards, terms, truncs, _ = env.step(actions)
                self._episode_length[j] += 1
                all_term, all_trunc = bool(terms.get(ALL)), bool(truncs.get(ALL))
                episode_over = all_term or all_trunc
                for agent, reward in rewards.items():
                    self._agent_return[j][agent] += float(reward)
                for agent, (pid, o, a, logits, logp, vf, version) in acting.items():
                    key = (j, agent, pid)
                    stream = self._streams.get(key)
                    if stream is None:
                        stream = self._streams[key] = _Stream()
                    term = bool(terms.get(agent, False))
                    trunc = bool(truncs.get(agent, False)) or (episode_over and not term)
                    for name, value in zip(
                        _FIELDS,
                        (o, a, logits, logp, vf, float(rewards.get(agent, 0.0)), term, trunc,
                         None, version),
                    ):  # fmt: skip
                        getattr(stream, name).append(value)
                    index = len(stream) - 1
                    agent_steps += 1
                    if term:
                        stream.vb[index] = 0.0
                    elif trunc:
                        truncated.append((stream, index, j, agent, pid, obs.get(agent)))
                    else:
                        self._awaiting[(j, agent)] = (stream, index)
                    if term or trunc:
                        self._done_agents[j].add(agent)
                if episode_over:
                    returns.append(float(sum(self._agent_return[j].values())))
                    lengths.append(self._episode_length[j])
                    for agent, ret in self._agent_return[j].items():
                        pid = self._agent_policy[j].get(agent)
                        if pid is not None:
                            policy_rewards[pid].append(ret)
                    for agent in list(self._done_agents[j]):
                        self._awaiting.pop((j, agent), None)
                    self._new_episode(j)
                    new_obs, _ = env.reset()
                    self._obs[j] = dict(new_obs)
                else:
                    self._obs[j] = {a: o for a, o in obs.items() if a not in self._done_agents[j]}
            if truncated:
                missing = [t for t in truncated if t[5] is None]
                if missing:
                    raise RuntimeError(
                        f"Agent {missing[0][3]!r} was truncated without a final observation."
                    )
                values = self._act([(j, a, pid, o) for _, _, j, a, pid, o in truncated], True)
                for (stream, index, *_), result in zip(truncated, values):
                    stream.vb[index] = result[4]
            self._compute_next()
        self.progress.set(0, -1, StepProgress.IDLE)
        return MultiAgentFragment(
            batch=MultiAgentBatch(self._emit(), horizon * self.num_envs),
            episode_returns=returns,
            episode_lengths=lengths,
            policy_version=self.policy_version,
            actor_id=self.worker_index - 1,
            sample_time_s=time.perf_counter() - start,
            filter_delta=self._flush_filters(),
            policy_rewards=dict(policy_rewards),
            agent_steps_sampled=agent_steps,
        )

    def _emit(self) -> dict[str, SampleBatch]:
        """Pops every completed [T] sequence into its policy's [R, T, ...] batch."""
        horizon = self.horizon
        rows: dict[str, list[dict[str, list]]] = collections.defaultdict(list)
        for (_, _, pid), stream in sorted(self._streams.items(), key=lambda kv: str(kv[0])):
            while stream.ready(horizon):
                rows[pid].append(stream.pop(horizon))
        out = {}
        for pid, seqs in rows.items():

            def col(name, dtype=None, seqs=seqs):
                return np.asarray([s[name] for s in seqs], dtype=dtype)

            out[pid] = SampleBatch(
                {
                    "obs": col("obs"),
                    "actions": col("actions"),
                    "rewards": col("rewards", np.float32),
                    "terminateds": col("term", bool),
                    "truncateds": col("trunc", bool),
                    "action_dist_inputs": col("logits", np.float32),
                    "action_logp": col("logp", np.float32),
                    "vf_preds": col("vf", np.float32),
                    "values_bootstrapped": col("vb", np.float32),
                    POLICY_VERSION: col("version", np.int64),
                }
            )
        return out

    def _flush_filters(self) -> dict[str, Filter] | None:
        if not self._update_filter or self.config.observation_filter == "NoFilter":
            return None
        out = {}
        for pid, f in self.filters.items():
            out[pid] = f.delta()
            f.reset_buffer()
        return out

    # Resuming ---------------------------------------------------------------------------------

    def reset(self, seed: int | None) -> None:
        """Starts new episodes everywhere, as if built with `seed`; pending steps are dropped."""
        self._reset_all(seed)
        base = env_seed(seed, self.worker_index, 0)
        for k, pid in enumerate(sorted(self.policies)):
            self.policies[pid].reseed(None if base is None else base + 7919 * (k + 1))

    def get_state(self) -> dict[str, Any]:
        """Weights, versions and filters (the envs are not snapshotted: a resume starts anew)."""
        return {
            "weights": {
                pid: (p.get_weights(), self.versions[pid]) for pid, p in self.policies.items()
            },
            "policy_version": self.policy_version,
            "obs_filter": {pid: f.get_state() for pid, f in self.filters.items()},
            "envs": None,
            "envs_error": "multi-agent runners do not snapshot their envs",
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Applies a `get_state()` snapshot or `{"seed": s}` (new episodes, as `reset(s)`)."""
        if state.get("weights") is not None:
            self.set_weights(state["weights"], state.get("policy_version", 0))
        if "seed" in state:
            self.reset(state["seed"])
        for pid, f in (state.get("obs_filter") or {}).items():
            self.filters[pid] = filter_from_state(f)

    # Samples until that many episodes have finished: (return summed over agents, length) pairs.
    run_episodes = EnvRunner.run_episodes

    def close(self) -> None:
        for env in self.envs:
            env.close()
