"""`UpdateReports`: what the learner thread reports of its updates, and its timers.

Each update of `impala_tf.learning.thread.LearnerThread` reads one tensor back to the host: its
stats, stacked on the device into one float64 vector (`pack`) and read back in one copy
(`unpack`, in `read`). The thread reports each update read, in order, outside its update lock
(`report_read`): `(env_steps, agent_steps, stats)` on RLlib's unbounded `outqueue`, Keras'
`on_train_batch_end` with the stats as logs, and the stats to the `NonFiniteGuard` (a skipped,
non-finite update counts 0 env steps). Each report adds
`diff_num_grad_updates_vs_sampler_policy`, the learner's updates before this one minus the
version of the policy that sampled the batch.

Timers (mean milliseconds in `info.timing_breakdown`, `timing_ms`): the loader's
`learner_dequeue_time_ms` and `learner_load_time_ms` (`impala_tf.learning.loader`);
`learner_load_wait_time_ms` the learner waiting for its next unit (nonzero when loading, or
sampling, is slower than training); `learner_grad_time_ms` one update: the thread's time
queueing it (on a CPU, running it) plus waiting for its stats. With microbatches the learner
stats add the seed's `sample_time_ms` (waiting for a microbatch), `grad_time_ms` (one
microbatch's gradients), `update_time_ms` (applying the accumulated gradients; RLlib's timed its
synchronous weight broadcast here, ours is the driver's), `opt_peak_throughput` and
`sample_peak_throughput` (env steps/s of those two) and `opt_samples` (env steps per
microbatch). `info.learner_queue` (`queue_stats`) is the queue's size when each update was
reported, and the queue's own counters.
"""

from __future__ import annotations

import collections
import copy
import queue
import time
from typing import Any, NamedTuple

import keras
import tensorflow as tf

from impala_tf.learning.learner import ImpalaLearner
from impala_tf.learning.loader import Loader, UnitInfo
from impala_tf.learning.nonfinite import NonFiniteGuard
from impala_tf.learning.stats import TimerStat, WindowStat, timer_ms

__all__ = ["QueuedUpdate", "UpdateReports"]


class QueuedUpdate(NamedTuple):
    """An update queued on the device whose stats are not read yet.

    Attributes:
      packed: float64 [K], its stats (`UpdateReports.pack`).
      info: The unit it trained on (its last, with microbatches).
      env_steps: The env steps it trained on.
      queue_s: Host seconds queueing the update (on a CPU: running it).
      grad_s: With microbatches, the seconds of their gradients before the update; else 0.
    """

    packed: tf.Tensor
    info: UnitInfo
    env_steps: int
    queue_s: float
    grad_s: float


class UpdateReports:
    """The learner thread's reports of its updates (module docstring) and its timers.

    Args:
      learner: The learner (its `count_keys` are reported as ints).
      loader: The thread's loader (its queue and timers).
      callbacks: The thread's Keras callbacks (`on_train_batch_end` of each update reported).
      nonfinite: The guard that counts, saves and raises on skipped non-finite updates.
      microbatching: Whether updates accumulate microbatches (their timers are reported).

    Attributes:
      outqueue: RLlib's outqueue, `(env_steps, agent_steps, stats)` for each update reported.
      stats: The stats of the latest update reported.
      num_steps: The updates reported.
      load_wait_timer: The learner waiting for its next unit.
      grad_timer: One update (queueing it and waiting for its stats).
      sample_timer: With microbatches: waiting for a microbatch.
      microbatch_grad_timer: With microbatches: one microbatch's gradients.
      update_timer: With microbatches: applying the accumulated gradients.
      learner_queue_size: The queue's size when each update was reported.
    """

    def __init__(
        self,
        learner: ImpalaLearner,
        loader: Loader,
        callbacks: keras.callbacks.CallbackList,
        nonfinite: NonFiniteGuard,
        microbatching: bool,
    ):
        self.learner = learner
        self.loader = loader
        self.callbacks = callbacks
        self.nonfinite = nonfinite
        self.microbatching = microbatching
        self.outqueue: queue.Queue = queue.Queue()
        self.stats: dict[str, Any] = {}
        self.num_steps = 0
        self.learner_queue_size = WindowStat("size", 50)
        self.load_wait_timer = TimerStat()
        self.grad_timer = TimerStat()
        # The microbatch optimizer's own stats (seed 004).
        self.sample_timer = TimerStat()
        self.microbatch_grad_timer = TimerStat()
        self.update_timer = TimerStat()
        self._keys: tuple[str, ...] = ()
        # The updates read and not reported yet, with the updates before each.
        self._read: collections.deque[tuple[dict[str, Any], UnitInfo, int, int]] = (
            collections.deque()
        )

    def pack(self, stats: dict[str, tf.Tensor]) -> tf.Tensor:
        """The stats as one float64 vector (read back in one copy); the keys are kept."""
        self._keys = tuple(stats)
        return tf.stack([tf.cast(v, tf.float64) for v in stats.values()])

    def unpack(self, packed: tf.Tensor) -> dict[str, Any]:
        """The update's one read back to the host: its stats, as Python numbers."""
        stats = dict(zip(self._keys, packed.numpy().tolist()))
        for key in self.learner.count_keys:
            stats[key] = int(stats[key])
        return stats

    def unit_waited(self, seconds: float, env_steps: int) -> None:
        """Times the learner's wait for its next unit (a microbatch of `env_steps`)."""
        self.load_wait_timer.push(seconds)
        if self.microbatching:
            self.sample_timer.push(seconds)
            self.sample_timer.push_units_processed(env_steps)

    def microbatch_done(self, seconds: float, env_steps: int) -> None:
        """Times one microbatch's gradients (of `env_steps`)."""
        self.microbatch_grad_timer.push(seconds)
        self.microbatch_grad_timer.push_units_processed(env_steps)

    def read(self, update: QueuedUpdate, updates_before: int) -> int:
        """Reads a queued update's stats back to the host and times it; the thread's update
        lock is held. Reported later, by `report_read`.

        Args:
          update: The update.
          updates_before: The learner's `num_grad_updates` before it.

        Returns:
          Its `num_grad_updates_lifetime`.
        """
        start = time.perf_counter()
        stats = self.unpack(update.packed)
        seconds = update.queue_s + time.perf_counter() - start
        self.grad_timer.push(update.grad_s + seconds)
        if self.microbatching:
            self.update_timer.push(seconds)
            stats.update(
                sample_time_ms=timer_ms(self.sample_timer),
                grad_time_ms=timer_ms(self.microbatch_grad_timer),
                update_time_ms=timer_ms(self.update_timer),
                opt_peak_throughput=round(self.microbatch_grad_timer.mean_throughput, 3),
                sample_peak_throughput=round(self.sample_timer.mean_throughput, 3),
                opt_samples=round(self.microbatch_grad_timer.mean_units_processed, 3),
            )
        self._read.append((stats, update.info, update.env_steps, updates_before))
        return stats["num_grad_updates_lifetime"]

    def report_read(self) -> None:
        """Reports the updates read so far, in order (the thread, outside its update lock)."""
        while self._read:
            self._report(*self._read.popleft())

    def _report(
        self, stats: dict[str, Any], info: UnitInfo, env_steps: int, updates_before: int
    ) -> None:
        stats["diff_num_grad_updates_vs_sampler_policy"] = float(
            updates_before - info.policy_version
        )
        # Raises after `max_nonfinite_updates` skipped in a row; a skipped update trains nothing.
        if self.nonfinite.observe(stats, info.source.batch if info.source else None):
            env_steps = 0
        self.stats = stats
        self.num_steps += 1
        self.outqueue.put((env_steps, env_steps, stats))
        self.learner_queue_size.push(self.loader.inqueue.qsize())
        self.callbacks.on_train_batch_end(self.num_steps - 1, logs=stats)

    def results(self) -> list[tuple[int, int, dict[str, Any]]]:
        """The updates reported and not yet taken: `(env_steps, agent_steps, stats)` each, in
        order (RLlib's outqueue entries); never waits."""
        out = []
        while True:
            try:
                out.append(self.outqueue.get_nowait())
            except queue.Empty:
                return out

    def next_result(self, timeout: float) -> tuple[int, int, dict[str, Any]] | None:
        """The next update's `(env_steps, agent_steps, stats)`, waiting up to `timeout` seconds
        (None if none came)."""
        try:
            return self.outqueue.get(timeout=timeout)
        except queue.Empty:
            return None

    def queue_stats(self) -> dict[str, Any]:
        """RLlib's `info.learner_queue`: the queue's size when each update was reported, and
        the queue's own counters (APPO's circular buffer: batches added and dropped)."""
        return {**self.learner_queue_size.stats(), **self.loader.inqueue.stats()}

    def timing_ms(self) -> dict[str, float]:
        """RLlib's `info.timing_breakdown` of the learner (module docstring: Timers)."""
        return {
            "learner_grad_time_ms": timer_ms(self.grad_timer),
            "learner_load_time_ms": timer_ms(self.loader.load_timer),
            "learner_load_wait_time_ms": timer_ms(self.load_wait_timer),
            "learner_dequeue_time_ms": timer_ms(self.loader.queue_timer),
        }

    def latest_stats(self) -> dict[str, Any]:
        """A copy of the stats of the latest update reported."""
        return copy.deepcopy(self.stats)
