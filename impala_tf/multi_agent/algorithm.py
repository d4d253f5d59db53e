"""`MultiAgentImpala`: the IMPALA driver for several policies (RLlib's multi-agent IMPALA).

Built by `ImpalaConfig.build()` (and `impala-train`) when the config is multi-agent
(`impala_tf.multi_agent.is_multi_agent`). It runs the single-agent driver's `train()` and
training step (`impala_tf.algorithm.Impala`, SEMANTICS.md section 3) with these differences:

* Actors run `MultiAgentEnvRunner`s and return `MultiAgentBatch`es: per policy, the [R, T]
  sequences its agents completed. `num_env_steps_sampled` counts env steps,
  `num_agent_steps_sampled` agent steps (RLlib's two counters).
* Every policy in `policies_to_train` has its own `ImpalaLearner` (its config is the algorithm's
  with the `PolicySpec` overrides) and its own `LearnerThread`, all under the one
  `tf.distribute` strategy. Policies not trained act with the weights they were built with (or
  restored); they are broadcast but never updated.
* Each trained policy's sequences pass through its own mix-in replay buffer and batch cutter
  (`impala_tf.actors.aggregation.Aggregator`; RLlib's `MixInMultiAgentReplayBuffer` in its
  "independent" mode): a policy's train batch is `train_batch_size` of ITS agent steps.
  RLlib cuts one `MultiAgentBatch` of `train_batch_size` env steps and trains every policy on its
  share; with one agent per policy the sizes agree.
* Weights are broadcast as {policy_id: (weights, num_grad_updates)} with one observation filter
  per policy; the fragments' `policy_version` is the driver's broadcast counter.
* Learner outputs count `num_agent_steps_trained`; `num_env_steps_trained` is that count scaled
  by the sampled env-to-agent step ratio (a policy's train batch matches no fixed set of env
  steps).

Results add RLlib's `info.learner.<policy_id>.learner_stats.*`, `policy_reward_mean/min/max`
({policy_id: value} over the agents' own returns in the smoothing window), and report
`episode_reward_mean` as the return summed over an episode's agents. `info.learner_queue` is the
first trained policy's queue; `info.timing_breakdown` averages the policies' learner timers.

Checkpoints: `<dir>/` holds the driver state (and, for tools that expect a learner there, the
first policy's learner); `<dir>/policies/<policy_id>/` is a complete single-policy checkpoint
(learner, that policy's config and observation filter), which `impala-evaluate` and
`impala-export` read with `--policy_id`. Not supported yet: `deterministic=True`, evaluation
during training, aggregation workers, recurrent models.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
from typing import Any

import keras
import numpy as np

from impala_tf import checkpoints, filters, pipeline, sequences
from impala_tf.actors.aggregation import Aggregator
from impala_tf.actors.base import ActorPool, ActorStateUnsupported
from impala_tf.actors.local import LocalActorPool
from impala_tf.algorithm import Impala, _derived_seed, _live_algorithms, make_strategy
from impala_tf.config import ImpalaConfig
from impala_tf.learner import ImpalaLearner
from impala_tf.learner_thread import LearnerThread, TrainBatch
from impala_tf.multi_agent import spec as ma_spec
from impala_tf.multi_agent.runner import MultiAgentFragment, policy_spaces
from impala_tf.nonfinite import NonFiniteUpdatesError
from impala_tf.stats import timer_ms

__all__ = ["MultiAgentImpala", "POLICIES_DIR"]

logger = logging.getLogger(__name__)

#: Subdirectory of a multi-agent checkpoint holding one single-policy checkpoint per policy.
POLICIES_DIR = "policies"
_FETCH_TIMEOUT_S = 0.02


class _LearnerThreads:
    """The per-policy learner threads, seen by the single-agent driver code as one thread."""

    def __init__(self, threads: dict[str, LearnerThread]):
        self.threads = threads

    @property
    def lock(self):
        """The first policy's update lock (what single-policy callbacks hold to read weights)."""
        return next(iter(self.threads.values())).lock

    def stop(self) -> None:
        for thread in self.threads.values():
            thread.stop()

    def add_learner_metrics(self, result: dict[str, Any]) -> dict[str, Any]:
        info = result.setdefault("info", {})
        if not self.threads:
            return result
        first = next(iter(self.threads.values()))
        info["learner_queue"] = first.learner_queue_size.stats()
        timers = collections.defaultdict(list)
        for t in self.threads.values():
            timers["learner_grad_time_ms"].append(timer_ms(t.grad_timer))
            timers["learner_load_time_ms"].append(timer_ms(t.load_timer))
            timers["learner_load_wait_time_ms"].append(timer_ms(t.load_wait_timer))
            timers["learner_dequeue_time_ms"].append(timer_ms(t.queue_timer))
        info["timing_breakdown"] = {k: round(float(np.mean(v)), 3) for k, v in timers.items()}
        return result


class MultiAgentImpala(Impala):
    """IMPALA over several policies (see the module docstring).

    Args:
      config: A multi-agent `ImpalaConfig` (`policies`, `policy_mapping_fn`,
        `policies_to_train`), or one whose env is a `MultiAgentEnv`.
      callbacks: Keras callbacks for every learner thread.
      actor_pool_cls: The `ActorPool` implementation.
      deterministic: Must be False (lockstep mode is single-agent only).
      logdir: The run's directory (non-finite batches go to `<logdir>/nonfinite/<policy_id>`).
    """

    def __init__(
        self,
        config: ImpalaConfig,
        callbacks: list[keras.callbacks.Callback] | None = None,
        actor_pool_cls: type[ActorPool] = LocalActorPool,
        deterministic: bool = False,
        logdir: str | None = None,
    ):
        if deterministic:
            raise ValueError("deterministic=True is not supported for multi-agent configs yet.")
        config = config.copy()
        if config.policies is None:  # A MultiAgentEnv alone: one shared policy, as RLlib.
            config.policies = [ma_spec.DEFAULT_POLICY_ID]
        config.validate(require_env=True)  # With the multi-agent keys (`validate_multi_agent`).
        self.config = config
        self.logdir = logdir
        self.deterministic = False
        self._stopped = False
        self.pool: ActorPool | None = None
        self.learner_thread: _LearnerThreads | None = None
        self.aggregators = None
        self._eval_runner = None
        self.strategy = make_strategy(config)
        if config.seed is not None:
            keras.utils.set_random_seed(int(config.seed))
        self.spaces = policy_spaces(config)
        self.policy_ids = sorted(self.spaces)
        self.policies_to_train = ma_spec.policy_ids_to_train(config)
        self.policy_configs = {p: ma_spec.policy_config(config, p) for p in self.policy_ids}
        self.obs_filters = {
            p: filters.get_filter(config.observation_filter, self.spaces[p][0].shape)
            for p in self.policy_ids
        }
        self.learners: dict[str, ImpalaLearner] = {}
        threads: dict[str, LearnerThread] = {}
        self._local_aggregators: dict[str, Aggregator] = {}
        self._rows: dict[str, int] = {}
        try:
            self.pool = actor_pool_cls(config)
            _live_algorithms.add(self)
            with self.strategy.scope():
                for pid in self.policy_ids:
                    obs_space, act_space = self.spaces[pid]
                    self.learners[pid] = ImpalaLearner(
                        self.policy_configs[pid], obs_space, act_space, name=f"learner_{pid}"
                    )
            # What the driver loop (`impala_tf.loop.fit`) hands Keras callbacks as their model
            # (its `stop_training` flag ends the run): the first trained policy's learner.
            self.learner = self.learners[(self.policies_to_train or self.policy_ids)[0]]
            self.num_replicas = self.strategy.num_replicas_in_sync
            for pid in self.policies_to_train:
                pconfig, learner = self.policy_configs[pid], self.learners[pid]
                state_shapes = sequences.state_column_shapes(
                    pconfig.rollout_fragment_length,
                    pconfig.model["max_seq_len"],
                    tuple(tuple(s.shape[1:]) for s in learner.model.initial_state(1)),
                )
                self._rows[pid] = pipeline.rows_per_batch(pconfig, self.num_replicas)
                signature = pipeline.batch_signature(
                    pconfig, *self.spaces[pid], self.num_replicas, state_shapes
                )
                thread = LearnerThread(learner, self.strategy, signature, callbacks=callbacks)
                thread.name = f"impala-learner-{pid}"
                if logdir is not None:
                    thread.nonfinite.directory = os.path.join(logdir, "nonfinite", pid)
                threads[pid] = thread
                self._local_aggregators[pid] = self._make_aggregator(pid, config.seed)
            self.learner_thread = _LearnerThreads(threads)
            for thread in threads.values():
                thread.start()
        except BaseException:
            self.learner_thread = _LearnerThreads(threads)
            self.stop()
            raise
        self._counters: collections.Counter = collections.Counter()
        smoothing = int(config.metrics_num_episodes_for_smoothing)
        self._episodes: collections.deque = collections.deque(maxlen=smoothing)
        self._policy_rewards = {p: collections.deque(maxlen=smoothing) for p in self.policy_ids}
        self._episodes_total = 0
        self._episodes_this_iter = 0
        self._iteration = 0
        self._time_total_s = 0.0
        self._steps_since_broadcast = 0
        self._broadcast_seq = 0
        self._broadcast_version: Any = None
        self._failures_in_a_row = collections.Counter()
        self._in_flight = {i: 0 for i in range(self.pool.num_actors)}
        self._learner_infos: dict[str, dict[str, Any]] = {}
        self._learner_info: dict[str, Any] = {}
        self._env_steps_trained = 0.0
        self._min_policy_version = 0
        self._broadcast(list(self._in_flight))
        self._top_up_requests()

    @property
    def threads(self) -> dict[str, LearnerThread]:
        """{policy_id: LearnerThread} of the trained policies."""
        return self.learner_thread.threads if self.learner_thread is not None else {}

    def _make_aggregator(self, pid: str, seed: int | None) -> Aggregator:
        pconfig = self.policy_configs[pid].copy()
        index = self.policy_ids.index(pid)
        pconfig.seed = None if seed is None else int(seed) + 1000 * (index + 1)
        return Aggregator(pconfig, self._rows[pid])

    # Weights --------------------------------------------------------------------------------

    def _versions(self) -> tuple[int, ...]:
        return tuple(int(self.learners[p].num_grad_updates.numpy()) for p in self.policy_ids)

    def _policy_snapshot(self) -> tuple[dict[str, tuple[list[np.ndarray], int]], int]:
        """({policy_id: (weights, num_grad_updates)}, broadcast counter), each policy read
        between two of its updates (under its learner thread's lock)."""
        weights = {}
        for pid in self.policy_ids:
            learner = self.learners[pid]
            thread = self.threads.get(pid)
            if thread is None:  # Not trained: nothing updates it.
                weights[pid] = (learner.get_policy_weights(), int(learner.num_grad_updates.numpy()))
            else:
                weights[pid] = thread.policy_snapshot()
        return weights, self._broadcast_seq

    def _filter_to_send(self) -> dict[str, filters.Filter] | None:
        if self.config.observation_filter == "NoFilter":
            return None
        return {p: f.as_serializable() for p, f in self.obs_filters.items()}

    def _broadcast(self, actor_ids: list[int]) -> None:
        self._broadcast_seq += 1
        weights, seq = self._policy_snapshot()
        self.pool.broadcast_weights(weights, seq, actor_ids, self._filter_to_send())
        self._broadcast_version = tuple(weights[p][1] for p in self.policy_ids)

    def _maybe_broadcast(self, sampled: list[int]) -> None:
        self._steps_since_broadcast += 1
        if (
            sampled
            and self._steps_since_broadcast >= self.config.broadcast_interval
            and self._versions() != self._broadcast_version
        ):
            self._broadcast(sampled)
            self._steps_since_broadcast = 0
            self._counters["num_weight_broadcasts"] += 1

    # Sampling -------------------------------------------------------------------------------

    def _process_fragment(self, fragment: MultiAgentFragment) -> list[tuple[str, TrainBatch]]:
        self._in_flight[fragment.actor_id] = max(0, self._in_flight[fragment.actor_id] - 1)
        self._failures_in_a_row[fragment.actor_id] = 0
        if fragment.policy_version < self._min_policy_version:
            return []
        for pid, delta in (fragment.filter_delta or {}).items():
            if delta is not None:
                self.obs_filters[pid].apply_changes(delta)
        self._counters["num_env_steps_sampled"] += fragment.env_steps
        self._counters["num_agent_steps_sampled"] += fragment.agent_steps_sampled
        for ret, length in zip(fragment.episode_returns, fragment.episode_lengths):
            self._episodes.append((ret, length))
        for pid, rewards in fragment.policy_rewards.items():
            self._policy_rewards[pid].extend(rewards)
        self._episodes_total += len(fragment.episode_returns)
        self._episodes_this_iter += len(fragment.episode_returns)
        out = []
        for pid, batch in sorted(fragment.batch.policy_batches.items()):
            aggregator = self._local_aggregators.get(pid)
            if aggregator is None:  # Not in `policies_to_train`.
                continue
            for b, version in aggregator.process(batch, float(np.mean(batch["policy_version"]))):
                out.append((pid, TrainBatch(b, version)))
        return out

    def _check_learner(self) -> None:
        for pid, thread in self.threads.items():
            if not thread.is_alive():
                if isinstance(thread.error, NonFiniteUpdatesError):
                    raise thread.error
                raise RuntimeError(
                    f"The learner thread died while training! (policy {pid!r})"
                ) from thread.error

    def _place_on_learner_queue(self, batches: list[tuple[str, TrainBatch]]) -> None:
        by_policy: dict[str, list[TrainBatch]] = collections.defaultdict(list)
        for pid, batch in batches:
            by_policy[pid].append(batch)
        for pid, items in by_policy.items():
            self._enqueue(self.threads[pid].inqueue, items)

    def _drain_learner_outqueue(self) -> None:
        for pid, thread in self.threads.items():
            while True:
                try:
                    item = thread.outqueue.get_nowait()
                except queue.Empty:
                    break
                self._record_policy_output(pid, item)

    def _record_policy_output(self, pid: str, item: tuple[int, int, dict[str, Any]]) -> None:
        _, agent_steps, stats = item
        stats = dict(stats)
        if stats.pop("update_skipped", False):
            self._counters["num_nonfinite_updates_skipped"] += 1
        self._counters["num_agent_steps_trained"] += agent_steps
        sampled_agents = self._counters["num_agent_steps_sampled"]
        ratio = self._counters["num_env_steps_sampled"] / sampled_agents if sampled_agents else 1.0
        self._env_steps_trained += agent_steps * ratio
        self._counters["num_env_steps_trained"] = int(round(self._env_steps_trained))
        self._learner_infos[pid] = stats

    def training_step(self) -> None:
        """One pass of the driver loop (the single-agent steps, per policy)."""
        self._check_learner()
        fragments, failures = self.pool.fetch_ready(_FETCH_TIMEOUT_S)
        self._handle_failures(failures)
        sampled = sorted({f.actor_id for f in fragments})
        train_batches: list[tuple[str, TrainBatch]] = []
        for fragment in fragments:
            train_batches.extend(self._process_fragment(fragment))
        self._top_up_requests()
        if train_batches:
            self._place_on_learner_queue(train_batches)
        self._drain_learner_outqueue()
        self._counters["num_training_step_calls"] += 1
        self._maybe_broadcast(sampled)

    def evaluate(self) -> dict[str, Any]:
        # Refused, as config validation refuses `evaluation_interval` for multi-agent configs.
        raise ValueError(
            "Evaluation during training is not supported for multi-agent configs; evaluate a "
            "checkpoint with `impala-evaluate --policy_id`."
        )

    # Results --------------------------------------------------------------------------------

    def _result(self, before: collections.Counter, elapsed: float) -> dict[str, Any]:
        result = super()._result(before, elapsed)
        learner = {}
        for pid in self.policies_to_train:
            stats = dict(self._learner_infos.get(pid, {}))
            diff = stats.pop("diff_num_grad_updates_vs_sampler_policy", 0.0)
            learner[pid] = {
                "learner_stats": stats,
                "num_agent_steps_trained": int(stats.get("num_agent_steps_trained", 0)),
                "num_grad_updates_lifetime": int(stats.get("num_grad_updates_lifetime", 0)),
                "diff_num_grad_updates_vs_sampler_policy": diff,
            }
        result["info"]["learner"] = learner
        nan = float("nan")
        for name, fn in (("mean", np.mean), ("min", np.min), ("max", np.max)):
            result[f"policy_reward_{name}"] = {
                pid: float(fn(list(r))) if r else nan for pid, r in self._policy_rewards.items()
            }
        return result

    # Checkpoints ----------------------------------------------------------------------------

    def _policy_dir(self, checkpoint_dir: str, pid: str) -> str:
        return os.path.join(checkpoint_dir, POLICIES_DIR, pid)

    def save(self, checkpoint_dir: str) -> str:
        """Saves the driver state to `checkpoint_dir` and each policy to `policies/<id>/`.

        Each part is written atomically (`checkpoints.write_checkpoint`); the whole is not: a
        process killed between the parts leaves policies from the previous save. Replay buffers
        and rows waiting to fill a train batch are not saved.
        """
        state = {
            "iteration": self._iteration,
            "time_total_s": self._time_total_s,
            "counters": dict(self._counters),
            "env_steps_trained": self._env_steps_trained,
            "episodes": list(self._episodes),
            "policy_rewards": {p: list(r) for p, r in self._policy_rewards.items()},
            "episodes_total": self._episodes_total,
            "steps_since_broadcast": self._steps_since_broadcast,
            "broadcast_seq": self._broadcast_seq,
            "deterministic": False,
            "multi_agent": True,
            "policy_ids": self.policy_ids,
            "observation_filters": {p: f.get_state() for p, f in self.obs_filters.items()},
        }
        first = self.policies_to_train[0] if self.policies_to_train else self.policy_ids[0]
        with self._locked(first):
            checkpoints.write_checkpoint(
                checkpoint_dir, self.learners[first], _storable_config(self.config), state
            )
        for pid in self.policy_ids:
            policy_state = {
                "policy_id": pid,
                "iteration": self._iteration,
                "counters": {},
                "observation_filter": self.obs_filters[pid].get_state(),
            }
            with self._locked(pid):
                checkpoints.write_checkpoint(
                    self._policy_dir(checkpoint_dir, pid),
                    self.learners[pid],
                    self._single_policy_config(pid),
                    policy_state,
                    {"policy_spaces": self.spaces[pid]},
                )
        return checkpoint_dir

    def _single_policy_config(self, pid: str) -> ImpalaConfig:
        """The config stored with one policy: its own keys, with the multi-agent env."""
        return self.policy_configs[pid]

    def _locked(self, pid: str):
        thread = self.threads.get(pid)
        if thread is None:
            import contextlib

            return contextlib.nullcontext()
        return thread.lock

    def restore(self, checkpoint_dir: str) -> None:
        """Restores every policy's learner and the driver state written by `save`.

        Actors start new episodes with seeds derived from `seed` and the restored step count,
        and receive the restored weights; fragments sampled before are dropped, and so are the
        batches queued or buffered for the learners. Replay buffers start empty.
        """
        checkpoint_dir = checkpoints.resolve_checkpoint_dir(checkpoint_dir)
        state = checkpoints.read_driver_state(checkpoint_dir)
        if not state.get("multi_agent"):
            raise ValueError(f"{checkpoint_dir} is not a multi-agent checkpoint.")
        missing = sorted(set(self.policy_ids) - set(state.get("policy_ids", [])))
        if missing:
            raise ValueError(f"{checkpoint_dir} has no policies {missing}.")
        for pid in self.policy_ids:
            path = checkpoints.resolve_checkpoint_dir(self._policy_dir(checkpoint_dir, pid))
            with self._locked(pid):
                if pid in self.threads:
                    self.threads[pid].flush()
                checkpoints.learner_checkpoint(self.learners[pid]).read(
                    os.path.join(path, checkpoints.LEARNER_PREFIX)
                ).assert_consumed()
        for thread in self.threads.values():
            while True:
                try:
                    thread.outqueue.get_nowait()
                except queue.Empty:
                    break
        self._iteration = int(state["iteration"])
        self._time_total_s = float(state["time_total_s"])
        self._counters = collections.Counter(state["counters"])
        self._env_steps_trained = float(state.get("env_steps_trained", 0.0))
        self._episodes.clear()
        self._episodes.extend(tuple(e) for e in state["episodes"])
        for pid, rewards in state.get("policy_rewards", {}).items():
            if pid in self._policy_rewards:
                self._policy_rewards[pid].clear()
                self._policy_rewards[pid].extend(rewards)
        self._episodes_total = int(state["episodes_total"])
        self._steps_since_broadcast = int(state.get("steps_since_broadcast", 0))
        for pid, f in (state.get("observation_filters") or {}).items():
            if pid in self.obs_filters and f is not None:
                self.obs_filters[pid] = filters.filter_from_state(f)
        steps = int(self._counters["num_env_steps_sampled"])
        seed = self.config.seed
        for pid in self.policies_to_train:
            self._local_aggregators[pid] = self._make_aggregator(pid, _derived_seed(seed, steps, 2))
        self._broadcast_seq = max(self._broadcast_seq, int(state.get("broadcast_seq", 0)))
        states = {
            actor_id: {"seed": _derived_seed(seed, steps, 3, actor_id)}
            for actor_id in self.pool.healthy_actor_ids()
        }
        try:
            self.pool.set_actor_states(states)
        except ActorStateUnsupported as e:
            logger.warning("Actors keep their episodes (%s).", e)
        self._broadcast(self.pool.healthy_actor_ids())
        self._min_policy_version = self._broadcast_seq

    # Lookups ----------------------------------------------------------------------------------

    def get_policy_weights(self, policy_id: str) -> list[np.ndarray]:
        """The current weights of one policy (numpy arrays, as the actors receive them)."""
        if policy_id not in self.learners:
            raise KeyError(f"No policy {policy_id!r}; policies: {self.policy_ids}.")
        with self._locked(policy_id):
            return self.learners[policy_id].get_policy_weights()


def _storable_config(config: ImpalaConfig) -> ImpalaConfig:
    """`config` with a module-level mapping function stored as its import path.

    The checkpoint's config is JSON; a function or class defined at module level is written as
    `module:qualname` so that `load_config` (resuming, evaluating) imports it back. Anything else
    (a lambda, a closure, `PolicySpec`s holding spaces) is written as text and must be passed
    again as `config=` when loading.
    """
    fn = config.policy_mapping_fn
    if fn is None or isinstance(fn, (str, dict)):
        return config
    target = fn if isinstance(fn, type) or hasattr(fn, "__qualname__") else type(fn)
    qualname = getattr(target, "__qualname__", "")
    if "<" in qualname or not getattr(target, "__module__", None):
        return config
    stored = config.copy()
    stored.policy_mapping_fn = f"{target.__module__}:{qualname}"
    return stored
