"""`LearnerGroup`: every policy's learner, one learner thread per trained policy, one interface.

Each policy has an `ImpalaLearner` built from its own learner settings and class, which the
driver resolves once from its config (the algorithm's, with the `PolicySpec` overrides;
`impala_tf.driver.specs.policy_learners`), under the one `tf.distribute` strategy; each policy
in `policies_to_train` has a `LearnerThread` training it on its own queue (RLlib's multi-agent
learner trains every policy on its share of one batch; here each policy's train batch is
`train_batch_size` of ITS agent steps). Policies not trained keep the weights they were built
with or restored. A single-agent run is the one-policy case, `"default_policy"`.

The driver talks to the group as it would to one thread: `put` train batches, `drain` the
updates' outputs, `check` for a dead thread, read weights (`snapshot`, `weights`), `flush`
everything queued (restore), `locked()` for a read of every policy from one update each
(checkpoints, histograms), `add_learner_metrics` for the result dict.
"""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from impala_tf.data.sample_batch import SampleBatch
from impala_tf.data.train_batch import TrainBatch
from impala_tf.driver.counters import Counters
from impala_tf.driver.plan import RuntimePlan
from impala_tf.driver.specs import PolicyLearner
from impala_tf.learning import pipeline, sequences
from impala_tf.learning.learner import ImpalaLearner
from impala_tf.learning.nonfinite import NonFiniteUpdatesError
from impala_tf.learning.thread import LearnerThread
from impala_tf.rollout.fragment import DEFAULT_POLICY_ID

__all__ = ["LearnerGroup"]

_PUT_POLL_S = 0.1


class LearnerGroup:
    """The learners of every policy and the threads of the trained ones (module docstring).

    Args:
      policy_learners: {policy_id: the policy's learner settings and class}, for every policy
        of `plan` (`impala_tf.driver.specs.policy_learners`).
      plan: The run's plan (policies, spaces, trained ids).
      strategy: The learners' `tf.distribute` strategy.
      callbacks: Keras callbacks for every learner thread (called around each update).
      logdir: The run's directory: batches of skipped non-finite updates go to
        `<logdir>/nonfinite/` (`<logdir>/nonfinite/<policy_id>/` with several policies).
    """

    def __init__(
        self,
        policy_learners: Mapping[str, PolicyLearner],
        plan: RuntimePlan,
        strategy: tf.distribute.Strategy,
        callbacks: list[keras.callbacks.Callback] | None = None,
        logdir: str | None = None,
    ):
        self.strategy = strategy
        self.policy_ids = plan.policy_ids
        self.trained = list(plan.trained)
        # Each policy's learner settings (read once from its config, overrides applied).
        self.specs = {p: policy_learners[p].spec for p in self.policy_ids}
        self.learners: dict[str, ImpalaLearner] = {}
        self.threads: dict[str, LearnerThread] = {}
        self._fixed_versions: dict[str, int] = {}  # Untrained policies' `num_grad_updates`.
        single = self.policy_ids == [DEFAULT_POLICY_ID]
        replicas = strategy.num_replicas_in_sync
        self.rows: dict[str, int] = {}
        with strategy.scope():
            for pid in self.policy_ids:
                name = "impala_learner" if single else f"learner_{pid}"
                obs, act = plan.spaces.policies[pid]
                learner_class = policy_learners[pid].learner_class
                self.learners[pid] = learner_class(self.specs[pid], obs, act, name=name)
        for pid in self.trained:
            spec, learner = self.specs[pid], self.learners[pid]
            state_shapes = sequences.state_column_shapes(
                spec.rollout_fragment_length,
                spec.max_seq_len,
                tuple(tuple(s.shape[1:]) for s in learner.model.initial_state(1)),
            )
            self.rows[pid] = pipeline.rows_per_batch(spec, replicas)
            signature = pipeline.batch_signature(
                spec,
                *plan.spaces.policies[pid],
                replicas,
                state_shapes,
                frame_stack=plan.spaces.frame_stacks.get(pid),
            )
            nonfinite_dir = None
            if logdir is not None:
                nonfinite_dir = os.path.join(
                    logdir, *(["nonfinite"] if single else ["nonfinite", pid])
                )
            thread = LearnerThread(
                learner,
                strategy,
                signature,
                callbacks=callbacks,
                name="impala-learner" if single else f"impala-learner-{pid}",
                nonfinite_dir=nonfinite_dir,
            )
            self.threads[pid] = thread

    def start(self) -> None:
        for thread in self.threads.values():
            thread.start()

    @property
    def first(self) -> str:
        """The first trained policy (the only one of a single-agent run)."""
        return (self.trained or self.policy_ids)[0]

    # Training -----------------------------------------------------------------------------------

    def check(self) -> None:
        """Raises if a learner thread died: RLlib's "The learner thread died while training!"."""
        for pid, thread in self.threads.items():
            if not thread.is_alive():
                if isinstance(thread.error, NonFiniteUpdatesError):
                    raise thread.error
                where = "" if len(self.threads) == 1 else f" (policy {pid!r})"
                raise RuntimeError(f"The learner thread died while training!{where}") from (
                    thread.error
                )

    def put(self, batches: list[tuple[str, SampleBatch, float]], counters: Counters) -> None:
        """Queues (policy id, train batch, version)s: per policy all but the last without
        blocking, then the last.

        A full queue drops a batch and counts `num_times_learner_queue_full`; waiting on the
        last one keeps the actors, loader and learner from thrashing when sampling outpaces
        training (RLlib does the same); a dead learner ends the wait.
        """
        by_policy: dict[str, list[TrainBatch]] = collections.defaultdict(list)
        for pid, batch, version in batches:
            by_policy[pid].append(TrainBatch(batch, version))
        for pid, items in by_policy.items():
            thread = self.threads[pid]
            for i, item in enumerate(items):
                if i < len(items) - 1:
                    if not thread.submit(item, timeout=0.0):
                        counters.num_times_learner_queue_full += 1
                        item.release()  # Dropped unread: its store goes now.
                        continue
                else:
                    self._put_waiting(pid, item)
                counters.num_samples_added_to_queue += item.env_steps

    def put_waiting(self, pid: str, batch: SampleBatch, version: float) -> None:
        """Puts a train batch on `pid`'s queue, waiting for room while the learners live."""
        self._put_waiting(pid, TrainBatch(batch, version))

    def _put_waiting(self, pid: str, item: TrainBatch) -> None:
        thread = self.threads[pid]
        while True:
            self.check()
            if thread.submit(item, timeout=_PUT_POLL_S):
                return

    def drain(self) -> list[tuple[str, int, dict[str, Any]]]:
        """The outputs of the updates that finished: (policy_id, agent steps trained, stats)."""
        return [
            (pid, agent_steps, stats)
            for pid, thread in self.threads.items()
            for _, agent_steps, stats in thread.results()
        ]

    def wait_output(self, pid: str) -> tuple[str, int, dict[str, Any]]:
        """Waits for the next update of `pid` (lockstep), checking the learners."""
        while True:
            self.check()
            output = self.threads[pid].next_result(_PUT_POLL_S)
            if output is not None:
                _, agent_steps, stats = output
                return pid, agent_steps, stats

    def flush(self) -> None:
        """Drops every batch taken so far and every output not yet drained (a restore).

        Call it inside `locked()`: no update that started before returns after it.
        """
        self._fixed_versions.clear()
        for thread in self.threads.values():
            thread.discard()

    # Weights ------------------------------------------------------------------------------------

    def versions(self) -> dict[str, int]:
        """{policy_id: num_grad_updates} after each policy's latest update, as host ints.

        Read every training step, so it reads no device value: a trained policy's count is its
        learner thread's `version`; an untrained one's is read once (and again after `flush`,
        which a restore calls before loading the counters).
        """
        out = {}
        for pid, learner in self.learners.items():
            thread = self.threads.get(pid)
            if thread is not None:
                out[pid] = thread.version
            else:
                if pid not in self._fixed_versions:
                    self._fixed_versions[pid] = int(learner.num_grad_updates.numpy())
                out[pid] = self._fixed_versions[pid]
        return out

    def snapshot(self, pid: str, wait: bool = True) -> tuple[list[np.ndarray], int] | None:
        """One policy's weights and `num_grad_updates`, read between two of its updates.

        With `wait=False` never waits for a running update: see
        `LearnerThread.policy_snapshot` (None when nothing was published yet).
        """
        thread = self.threads.get(pid)
        if thread is None:  # Not trained: nothing updates it.
            return self.learners[pid].get_policy_weights(), self.versions()[pid]
        return thread.policy_snapshot(wait=wait)

    def weights(self) -> dict[str, tuple[list[np.ndarray], int]]:
        """{policy_id: (weights, num_grad_updates)} of every policy, each from one update."""
        return {pid: self.snapshot(pid, wait=True) for pid in self.policy_ids}

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Holds every learner thread's update lock (a read of all policies between updates)."""
        with contextlib.ExitStack() as stack:
            for pid in sorted(self.threads):
                stack.enter_context(self.threads[pid].between_updates())
            yield

    # Results and shutdown -----------------------------------------------------------------------

    def add_learner_metrics(self, result: dict[str, Any]) -> dict[str, Any]:
        """Adds RLlib's `info.learner_queue` and `info.timing_breakdown` to a result dict.

        With several trained policies the queue is the first one's and the timers are the
        policies' means.
        """
        info = result.setdefault("info", {})
        if not self.threads:
            return result
        info["learner_queue"] = self.threads[self.first].queue_stats()
        timers = collections.defaultdict(list)
        for thread in self.threads.values():
            for name, value in thread.timing_ms().items():
                timers[name].append(value)
        info["timing_breakdown"] = {
            k: (v[0] if len(v) == 1 else round(float(np.mean(v)), 3)) for k, v in timers.items()
        }
        return result

    def stop(self) -> None:
        """Stops every learner thread. Safe to call twice."""
        for thread in self.threads.values():
            thread.stop()
