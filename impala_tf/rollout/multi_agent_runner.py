"""`MultiAgentEnvRunner`: steps multi-agent envs with several policies; per-policy fragments.

B is the number of envs (`num_envs_per_env_runner`), T is time (`rollout_fragment_length`), R the
sequences a policy completed in one fragment, L = `model.max_seq_len`, C = ceil(T / L) and H a
recurrent state's size.

The runner owns B `MultiAgentEnv`s (`impala_tf.multi_agent.env`). Each env step, the agents that
have an observation are grouped by the policy `policy_mapping_fn` maps them to (asked once per
agent and episode) and each policy acts for its agents in one batched call. Every (env, agent,
policy) keeps its own stream of steps, across episodes, like one env of the single-agent
`impala_tf.rollout.env_runner.EnvRunner` (`truncate_episodes`); whenever a stream holds T steps
they become one [1, T] sequence of its policy's batch. So `sample()` steps the envs T times
(T * B env steps) and returns the `Fragment` (`impala_tf.rollout.fragment`) both runners emit:
per policy, a `SampleBatch` of the sequences completed meanwhile ([R, T, ...], R varies; steps
not yet filling a sequence wait for the next call), with the single-agent runner's columns. It
counts RLlib's two step counters: `env_steps` (T * B) and `agent_steps` (one per agent that
acted).

`values_bootstrapped[t]` of an agent's step is the behaviour value of that agent's next
observation: 0 after the agent's termination, V(final observation) after a truncation, else the
value computed when it next acts (computed one step ahead, as the single-agent runner does, so
it is known before the step is emitted). As in RLlib, an agent's step is terminated when its own
flag or the episode's `__all__` termination says so, and truncated when its own or `__all__`'s
truncation does (and it is not terminated). An agent that did not act in the step that ends the
episode (turn-based envs) has its last step closed then by the same rule, bootstrapped (when
truncated) from the final observation the env gave it or, without one, from V of its last
observation. Rewards an agent receives in steps where it does not act are added to its last
step.

Recurrent policies (`model.use_lstm`) keep one state per (env, agent): the agents of a policy
are stepped with their states batched, and an agent's state restarts from zeros when its episode
ends. Each sequence carries `state_in_i` [R, C, H], the agent's state at the start of each of
its C chunks of L steps, exactly as `EnvRunner` emits them (`impala_tf.learning.sequences`).

Observations pass through one filter per policy (`observation_filter`; RLlib keeps one per
policy too); the fragment carries each policy's changes (`filter_deltas`).

Episodes: the return of an episode is the sum over its agents (RLlib's `episode_reward`), its
length counts env steps, and `Episode.policy_returns[policy_id]` lists the return of each agent
that acted with that policy (RLlib's `policy_reward_mean` inputs).

Callbacks (`impala_tf.rollout.hooks`): each env's episode records, per agent, its last raw and
filtered observation, info, action, reward and policy; the hooks run once per env step.
`on_sample_end` gets a `MultiAgentBatch` of the fragment's policy batches.

With central inference (`remote`), each policy acts through an
`impala_tf.acting.remote_policy.RemotePolicy` on the one connection to the driver's inference
server, and this module never imports TensorFlow.

`get_state()` pickles the envs with everything in flight (`_IN_FLIGHT`: the streams, the steps
waiting for their bootstrap value, the actions computed ahead, the recurrent states and the
episodes' bookkeeping), so that `set_state(get_state())` continues exactly.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium as gym
import numpy as np

import impala_tf.config.policies as policy_specs
from impala_tf.acting.actions import ActionAdapter
from impala_tf.acting.filters import Filter
from impala_tf.data.sample_batch import MultiAgentBatch, SampleBatch
from impala_tf.envs.faults import StepProgress
from impala_tf.envs.make import make_env
from impala_tf.multi_agent.env import ALL, MultiAgentEnv
from impala_tf.rollout.agent_streams import (
    STEP_REW,
    STEP_TERM,
    STEP_TRUNC,
    STEP_VB,
    STEP_VF,
    AgentStream,
    emit_sequences,
)
from impala_tf.rollout.base import Remote, RunnerBase
from impala_tf.rollout.fragment import Episode, Fragment
from impala_tf.rollout.hooks import Seen
from impala_tf.rollout.spec import RunnerSpec
from impala_tf.utils.seeds import env_seed

__all__ = ["MultiAgentEnvRunner"]

# A computed action (`_act`) is a tuple: (policy id, filtered obs, action, env action, logits,
# logp, value, version, state in, state out).
_E_PID, _E_ACT_ENV, _E_STATE_IN, _E_STATE_OUT = 0, 3, 8, 9

#: What `get_state()` pickles into `"envs"`: the envs and everything in flight.
_IN_FLIGHT = (
    "envs",
    "_obs",
    "_next",
    "_next_versions",
    "_streams",
    "_awaiting",
    "_states",
    "_episode_counter",
    "_episode_ids",
    "_agent_policy",
    "_agent_return",
    "_episode_length",
    "_done_agents",
)


class MultiAgentEnvRunner(RunnerBase):
    """Steps `num_envs_per_env_runner` multi-agent envs with every policy; see the module doc.

    Args:
      spec: What the runner is built from (`impala_tf.driver.specs.runner_spec`: the policies'
        spaces and the policy mapping among it).
      worker_index: 1-based index of this runner; it derives the env and sampling seeds.
      explore: Overrides `spec.explore` (evaluation passes False).
      update_filter: Update the observation filters with what is seen (actors); False applies
        them unchanged (evaluation).
      progress: Shared progress record (kept for the pool's hang reports).
      remote: With central inference (`impala_tf.acting.inference`): this actor's connection to the
        driver's inference server and {policy_id: per-env shapes of the model's recurrent
        state}. Every policy then acts through a `RemotePolicy` and TensorFlow is never
        imported.
    """

    multi_agent = True

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
        self.envs: list[gym.Env] = [
            make_env(spec.env, worker_index, j) for j in range(self.num_envs)
        ]
        # Through an env creator's wrappers to the multi-agent env.
        base = self.envs[0].unwrapped
        if not isinstance(base, MultiAgentEnv):
            raise ValueError(
                f"The env {spec.env.env!r} is not a MultiAgentEnv (impala_tf.multi_agent.env), "
                "but the multi-agent runner steps it."
            )
        self.spaces = {pid: acting.spaces for pid, acting in spec.policies.items()}
        self.policy_ids: Sequence[str] = tuple(sorted(self.spaces))
        self.mapping = spec.policy_mapping_fn or policy_specs.default_policy_mapping_fn
        self.policies: dict[str, Any] = {}
        self.filters: dict[str, Filter] = {}
        self._adapters: dict[str, ActionAdapter] = {}
        self._obs_dtypes: dict[str, np.dtype] = {}
        self._zero_state: dict[str, tuple] = {}
        self._chunk: dict[str, int] = {}
        seeds = self._policy_seeds(spec.seed)
        for pid in self.policy_ids:
            acting = spec.policies[pid]
            obs_space, act_space = acting.spaces
            policy = self._make_policy(
                pid, acting.spaces, acting.model, seeds[pid], remote, acting.precision
            )
            self.policies[pid] = policy
            self._obs_dtypes[pid] = np.dtype(obs_space.dtype or np.float32)
            self.filters[pid] = self._make_filter(pid, obs_space)
            self._adapters[pid] = ActionAdapter(
                act_space, spec.normalize_actions, spec.clip_actions
            )
            self._zero_state[pid] = tuple(s[0] for s in policy.initial_state(1))
            self._chunk[pid] = acting.model.max_seq_len
        self.versions = {pid: 0 for pid in self.policy_ids}
        self._restart(spec.seed)

    @property
    def base_env(self) -> list[gym.Env]:
        """What episode hooks get as `base_env`: this runner's multi-agent envs."""
        return self.envs

    # Episodes ---------------------------------------------------------------------------------

    def _new_episode(self, j: int) -> None:
        self._episode_counter += 1
        self._episode_ids[j] = self._episode_counter
        self._agent_policy[j] = {}
        self._agent_return[j] = collections.defaultdict(float)
        self._episode_length[j] = 0
        self._done_agents[j] = set()
        self._awaiting[j] = {}  # agent -> its last step, waiting for its bootstrap value.
        self._states[j] = {}  # agent -> its recurrent state (recurrent policies only).

    def _restart(self, seed: int | None) -> None:
        n = self.num_envs
        self._episode_counter = 0
        self._episode_ids = [0] * n
        self._agent_policy: list[dict[Any, str]] = [{} for _ in range(n)]
        self._agent_return: list[dict[Any, float]] = [{} for _ in range(n)]
        self._episode_length = [0] * n
        self._done_agents: list[set] = [set() for _ in range(n)]
        self._awaiting: list[dict[Any, list]] = [{} for _ in range(n)]
        self._states: list[dict[Any, tuple]] = [{} for _ in range(n)]
        self._streams: dict[tuple, AgentStream] = {}
        self._obs: list[dict] = []
        self._infos: list[dict] = []  # Each env's last infos (for the callbacks' episodes).
        for j, env in enumerate(self.envs):
            self._new_episode(j)
            obs, infos = env.reset(seed=env_seed(seed, self.worker_index, j))
            self._obs.append(dict(obs))
            self._infos.append(dict(infos or {}))
        self._next: list[dict] | None = None  # Per env: agent -> its action, computed ahead.
        self._next_versions: dict[str, int] = {}  # Per policy: the version that computed them.

    def _policy_of(self, j: int, agent: Any) -> str:
        pid = self._agent_policy[j].get(agent)
        if pid is None:
            episode = policy_specs.EpisodeInfo(self._episode_ids[j], j, self.worker_index)
            pid = self.mapping(agent, episode, worker=None)
            if pid not in self.policies:
                raise ValueError(
                    f"`policy_mapping_fn` maps agent {agent!r} to {pid!r}, which is not in "
                    f"`policies` {sorted(self.policies)}."
                )
            self._agent_policy[j][agent] = pid
        return pid

    # Acting -----------------------------------------------------------------------------------

    def _act(self, items: list[tuple[str, Any, tuple]]) -> tuple[list[tuple], dict[str, int]]:
        """Runs each policy once on its agents' observations.

        Args:
          items: (policy id, raw observation, recurrent state in) per agent.

        Returns:
          Per item: (policy id, filtered obs, action, env action, logits, logp, value, version,
          state in, state out); and {policy id: the version of the weights that acted}.
        """
        out: list[Any] = [None] * len(items)
        versions: dict[str, int] = {}
        groups: dict[str, list[int]] = {}
        for i, item in enumerate(items):
            groups.setdefault(item[0], []).append(i)
        for pid, rows in groups.items():
            raw = np.asarray([items[i][1] for i in rows], dtype=self._obs_dtypes[pid])
            obs = self.filters[pid](raw, update=self._update_filter)
            zero = self._zero_state[pid]
            state = tuple(
                np.stack([items[i][2][s] for i in rows]) for s in range(len(zero))
            )  # fmt: skip
            step = self.policies[pid].step(obs, state)
            env_actions = self._adapters[pid](step.actions)
            version = getattr(step, "version", None)
            version = versions[pid] = self.versions[pid] if version is None else int(version)
            logp, values = step.logp.tolist(), step.values.tolist()
            actions, logits, new_state = step.actions, step.logits, step.state
            for k, i in enumerate(rows):
                out[i] = (
                    pid,
                    obs[k],
                    actions[k],
                    env_actions[k],
                    logits[k],
                    logp[k],
                    values[k],
                    version,
                    items[i][2],
                    tuple(s[k] for s in new_state) if zero else (),
                )
        return out, versions

    def _compute_next(self) -> None:
        """Computes every waiting agent's next action (and so its previous step's bootstrap)."""
        keys, items = [], []
        for j in range(self.num_envs):
            done, states = self._done_agents[j], self._states[j]
            for agent, o in self._obs[j].items():
                if agent in done:
                    continue
                pid = self._policy_of(j, agent)
                keys.append((j, agent))
                items.append((pid, o, states.get(agent) or self._zero_state[pid]))
        nxt: list[dict] = [{} for _ in range(self.num_envs)]
        entries, self._next_versions = self._act(items)
        for (j, agent), entry in zip(keys, entries):
            nxt[j][agent] = entry
            waiting = self._awaiting[j].pop(agent, None)
            if waiting is not None:
                waiting[STEP_VB] = entry[6]
        self._next = nxt

    def sample(self) -> Fragment:
        """Steps every env `rollout_fragment_length` times; returns the completed sequences."""
        start = time.perf_counter()
        if self._next is None:
            self._compute_next()
        if self._hooks.wanted:
            for j in range(self.num_envs):
                self._hooks.start(j, self._seen(j, self._obs[j], self._infos[j]))
        episodes: list[Episode] = []
        agent_steps = 0
        versions = dict(self.versions)  # Raised to the versions that acted (central inference).
        for _ in range(self.horizon):
            for pid, version in self._next_versions.items():
                if version > versions[pid]:
                    versions[pid] = version
            finals: list[tuple[list, str, Any, tuple]] = []
            for j, env in enumerate(self.envs):
                agent_steps += self._step_env(j, env, finals, episodes)
            if finals:
                values, _ = self._act([(pid, o, s) for _, pid, o, s in finals])
                for (step, *_), entry in zip(finals, values):
                    step[STEP_VB] = entry[6]
            self._compute_next()
        self.progress.set(0, -1, StepProgress.IDLE)
        batches = self._emit()
        if "on_sample_end" in self.callbacks:
            samples = MultiAgentBatch(batches, self.horizon * self.num_envs)
            self.callbacks("on_sample_end", worker=self, samples=samples)
        return Fragment(
            batches=batches,
            env_steps=self.horizon * self.num_envs,
            agent_steps=agent_steps,
            policy_versions=versions,
            episodes=episodes,
            actor_id=self.worker_index - 1,
            sample_time_s=time.perf_counter() - start,
            filter_deltas=self._flush_filters(),
        )

    def _step_env(self, j: int, env: gym.Env, finals: list, episodes: list[Episode]) -> int:
        """Steps env j with its agents' actions; returns the number of agents that acted.

        Steps to bootstrap from a final observation are appended to `finals` as (step, policy
        id, final observation, state); an ended episode is appended to `episodes`.
        """
        acting = self._next[j]
        if not acting:  # Every agent waits (cannot happen in a well-formed env).
            raise RuntimeError(f"env {j}: no agent has an observation to act on.")
        obs, rewards, terms, truncs, infos = env.step({a: e[_E_ACT_ENV] for a, e in acting.items()})
        self._episode_length[j] += 1
        returns, awaiting = self._agent_return[j], self._awaiting[j]
        for agent, reward in rewards.items():
            returns[agent] += reward
            if agent not in acting and agent in awaiting:
                awaiting[agent][STEP_REW] += float(reward)
        all_term, all_trunc = bool(terms.get(ALL)), bool(truncs.get(ALL))
        episode_over = all_term or all_trunc
        done, states, streams = self._done_agents[j], self._states[j], self._streams
        horizon = self.horizon
        for agent, e in acting.items():
            pid = e[_E_PID]
            stream = streams.get((j, agent, pid))
            if stream is None:
                stream = streams[(j, agent, pid)] = AgentStream()
            # RLlib's rule: `__all__` ends every agent's episode the way it ends the episode.
            term = bool(terms.get(agent, False)) or all_term
            trunc = not term and (bool(truncs.get(agent, False)) or all_trunc)
            reward = float(rewards.get(agent, 0.0))
            step = [e[1], e[2], e[4], e[5], e[6], reward, term, trunc, None, e[7]]
            steps = stream.steps
            if e[_E_STATE_IN] and len(steps) % horizon % self._chunk[pid] == 0:
                stream.starts.append(e[_E_STATE_IN])
            steps.append(step)
            if term:
                step[STEP_VB] = 0.0
            elif trunc:
                final = obs.get(agent)
                if final is None:
                    raise RuntimeError(
                        f"Agent {agent!r} was truncated without a final observation."
                    )
                finals.append((step, pid, final, e[_E_STATE_OUT]))
            else:
                awaiting[agent] = step
                if e[_E_STATE_OUT]:
                    states[agent] = e[_E_STATE_OUT]
                continue
            done.add(agent)
            states.pop(agent, None)
        if awaiting and (episode_over or len(terms) + len(truncs) > 2 * len(acting) + 2):
            self._close_waiting(j, obs, terms, truncs, finals)
        hooked = None
        if self._hooks.running:
            hooked = self._step_hook_episode(j, acting, obs, rewards, infos, episode_over)
        if episode_over:
            agent_policy = self._agent_policy[j]
            policy_returns: dict[str, list[float]] = {}
            for agent, pid in agent_policy.items():
                policy_returns.setdefault(pid, []).append(float(returns.get(agent, 0.0)))
            ret = float(sum(returns.values()))
            metrics, hist = hooked or ({}, {})
            episodes.append(Episode(ret, self._episode_length[j], policy_returns, metrics, hist))
            self._new_episode(j)
            obs, infos = env.reset()
        self._obs[j] = obs
        self._infos[j] = dict(infos or {})
        if episode_over and self._hooks.running:
            self._hooks.start(j, self._seen(j, self._obs[j], self._infos[j]))
        return len(acting)

    # Episode callbacks ------------------------------------------------------------------------

    def _seen(self, j: int, obs: dict, infos: dict) -> list[Seen]:
        """What each agent of env j saw: its observation (raw and filtered), info and policy."""
        seen = []
        for agent, raw in obs.items():
            pid = self._policy_of(j, agent)
            filtered = self.filters[pid](np.asarray(raw, self._obs_dtypes[pid])[None], update=False)
            seen.append((agent, raw, filtered[0], infos.get(agent), pid))
        return seen

    def _step_hook_episode(
        self, j: int, acting: dict, obs: dict, rewards: dict, infos: dict, over: bool
    ) -> tuple[dict, dict] | None:
        """Records env j's step in its callbacks `Episode` and calls the episode hooks; the
        ended episode's (custom metrics, hist data) when `over`, else None."""
        self._hooks.record(j, [(a, e[2], e[_E_PID]) for a, e in acting.items()], rewards)
        seen = self._seen(j, obs, dict(infos or {}))
        if over:
            return self._hooks.end(j, seen)
        self._hooks.step(j, seen)
        return None

    def _close_waiting(self, j: int, obs: dict, terms: dict, truncs: dict, finals: list) -> None:
        """Ends the last step of agents done in a step they did not act in (turn-based envs)."""
        awaiting, acting = self._awaiting[j], self._next[j]
        for agent in [a for a in awaiting if a not in acting]:
            term = bool(terms.get(agent, False)) or bool(terms.get(ALL))
            trunc = not term and (bool(truncs.get(agent, False)) or bool(truncs.get(ALL)))
            if not (term or trunc):
                continue
            step = awaiting.pop(agent)
            step[STEP_TERM], step[STEP_TRUNC] = term, trunc
            self._done_agents[j].add(agent)
            state = self._states[j].pop(agent, None)
            if term:
                step[STEP_VB] = 0.0
            elif obs.get(agent) is None:
                step[STEP_VB] = step[
                    STEP_VF
                ]  # No final observation: V of the last one it acted on.
            else:
                pid = self._agent_policy[j][agent]
                finals.append((step, pid, obs[agent], state or self._zero_state[pid]))

    def _emit(self) -> dict[str, SampleBatch]:
        """Pops every completed [T] sequence into its policy's [R, T, ...] batch."""
        return emit_sequences(self._streams, self.horizon, self._chunk, self._zero_state)

    # Resuming ---------------------------------------------------------------------------------

    def _in_flight(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _IN_FLIGHT}

    def _restore(self, in_flight: dict[str, Any], state: Mapping[str, Any]) -> None:
        for name in _IN_FLIGHT:
            setattr(self, name, in_flight[name])
        self._infos = [{} for _ in self.envs]

    def close(self) -> None:
        for env in self.envs:
            env.close()
