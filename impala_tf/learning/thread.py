"""`LearnerThread`: the background thread that trains the `ImpalaLearner` on queued batches.

RLlib's contract (its old-stack `LearnerThread`): the driver puts train batches on a bounded
`inqueue` (`learner_queue_size`); the thread trains on each `num_sgd_iter` times through a
`MinibatchBuffer` (`minibatch_buffer_size` slots), and puts `(env_steps, agent_steps, stats)` on
an unbounded `outqueue`, one entry per update. If no batch arrives for `learner_queue_timeout`
seconds the thread stops with a `LearnerQueueTimeout` that names the settings to change.

Loading (RLlib's multi-GPU tower stacks) is `impala_tf.learning.loader.Loader`'s: a `tf.data`
pipeline whose source takes batches off the queue and cuts them into device shards, in *slots*
the thread frees after each unit's last pass, with flush generations; its module docstring says
how.

Without `microbatch_size`, the unit is the train batch and the minibatch buffer holds *device*
batches: each of the `num_sgd_iter` passes reuses the batch already on the devices. With
`microbatch_size`, the unit is a microbatch; the learner adds each one's gradients to its
accumulators and applies them after the last microbatch of the train batch (one update); the
minibatch buffer then holds the host batch and every pass streams its microbatches again, so the
full train batch never lives on a device.

A loader that fails (a malformed batch, a timeout) ends the dataset, so the thread ends with the
loader's exception in `error` and the driver raises from it.

Host reads. An update reads one tensor back to the host, its stats (`impala_tf.learning.reports`
reads and reports them and keeps the timers of `info.timing_breakdown`); the device is never
waited on otherwise (a microbatch's gradients are queued, not waited for, so on an accelerator
`grad_time_ms` is the time to queue one and the wait shows in `update_time_ms`). `version` and
the weights (`policy_snapshot`) come from `impala_tf.learning.publisher.PolicyPublisher`.

Queued updates (on an accelerator only). Reading an update's stats waits for the update, so a
thread that reads them before starting the next leaves the device idle while it reports, takes
the next unit and queues the next update. On an accelerator the thread queues update n+1 first
and reads n's stats after, whenever the next unit is at hand (buffered for another pass, or
already handed to the dataset by the loader); otherwise, and always on a CPU (where a call
returns when its work is done, so there is nothing to overlap), it reads them at once. So on an
accelerator the outputs, `version` and `on_train_batch_end` of update n come after update n+1
was queued (and its `on_train_batch_begin` called), never later than that; the thread reads a
pending update's stats before it waits for data and before it ends, so none is lost or held
back while the learner starves. Departure from Keras' `fit`, where each batch's end precedes the
next one's begin. A unit's slot is freed when its last update is queued, so the queued
update's batch is on the device beside the `num_slots` units. Skipping a non-finite update is a
`tf.cond` (`impala_tf.learning.gradients.apply_if_finite`), whose `Switch` kernel keeps its
predicate in host memory, so queueing an update probably returns only once its gradients are
computed (not measured on a GPU), and what overlaps is the optimizer step, the stats read and
the host's work between updates.
`tools.bench_gpu --parts thread` measures what the thread reaches against the update alone.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from impala_tf.data.train_batch import MinibatchBuffer, TrainBatch
from impala_tf.learning import devices, pipeline
from impala_tf.learning.learner import ImpalaLearner
from impala_tf.learning.loader import LearnerQueueTimeout, Loader, UnitInfo
from impala_tf.learning.nonfinite import NonFiniteGuard
from impala_tf.learning.publisher import PolicyPublisher
from impala_tf.learning.replica_steps import ReplicaSteps
from impala_tf.learning.reports import QueuedUpdate, UpdateReports
from impala_tf.learning.stats import TimerStat

__all__ = ["LearnerQueueTimeout", "LearnerThread", "MinibatchBuffer", "TrainBatch"]


_END_OF_DATA = (StopIteration, tf.errors.OutOfRangeError, EOFError)


class LearnerThread(threading.Thread):
    """Trains `learner` on the batches put on `inqueue`; a daemon thread.

    Args:
      learner: The `ImpalaLearner` (built inside `strategy.scope()`).
      strategy: The learner's distribution strategy.
      signature: `pipeline.batch_signature(...)` of one replica's shard of a unit.
      callbacks: Keras callbacks called around each update (`on_train_batch_begin/end` with the
        stats as logs, `on_train_begin/end`).
      accelerator: Whether the update runs on an accelerator (two loader slots, units copied
        onto the device ahead of use, the next update queued before the stats of the last are
        read); None decides from `strategy` (`devices.on_accelerator`). Tests force True on CPU
        devices.
      name: The thread's name.
      nonfinite_dir: Where the batches of skipped non-finite updates are saved
        (`impala_tf.learning.nonfinite`; None: a temporary directory at the first one).

    Attributes:
      reports: What the updates report, and the timers (`UpdateReports`).
      publisher: `version` and the weights read for the driver (`PolicyPublisher`).
      steps: The learner's steps under `strategy` (`ReplicaSteps`).

    Raises:
      ValueError: `microbatch_size` does not cut the train batch into whole, evenly sharded
        microbatches (see `pipeline.microbatches_per_batch`).
    """

    def __init__(
        self,
        learner: ImpalaLearner,
        strategy: tf.distribute.Strategy,
        signature: dict[str, tf.TensorSpec],
        callbacks: list[keras.callbacks.Callback] | None = None,
        accelerator: bool | None = None,
        name: str = "impala-learner",
        nonfinite_dir: str | None = None,
    ):
        super().__init__(name=name, daemon=True)
        spec = learner.spec
        self.learner = learner
        self.strategy = strategy
        self.num_replicas = strategy.num_replicas_in_sync
        self.num_microbatches = pipeline.microbatches_per_batch(spec, self.num_replicas)
        self._micro_rows = pipeline.microbatch_rows(spec, self.num_replicas)
        self.microbatching = self._micro_rows is not None
        self._signature = signature
        self._stopped = threading.Event()
        size, passes = spec.minibatch_ring_size, int(spec.num_sgd_iter)
        if self.microbatching:
            # Passes re-stream the host batch: the ring holds train batches off the queue.
            num_slots = int(spec.num_multi_gpu_tower_stacks)
        else:
            # Passes reuse the device batch: the ring holds units out of the dataset.
            self.minibatch_buffer = MinibatchBuffer(self._next_unit, size, passes)
            num_slots = max(int(spec.num_multi_gpu_tower_stacks), self.minibatch_buffer.size)
        self.accelerator = (
            devices.on_accelerator(strategy) if accelerator is None else bool(accelerator)
        )
        if self.accelerator:  # Loading overlaps the update (module docstring).
            num_slots = max(num_slots, 2)
        # RLlib's learner queue, or the algorithm's own (APPO: its circular buffer).
        self.loader = Loader(
            spec.make_queue(),
            signature,
            self.num_replicas,
            num_slots,
            self._micro_rows,
            float(spec.learner_queue_timeout),
            self._stopped,
        )
        if self.microbatching:
            self.minibatch_buffer = MinibatchBuffer(self.loader.wait_for_batch, size, passes)
            self.loader.next_batch = lambda: self.minibatch_buffer.get()[0]
        # Whether the next update is queued before the last one's stats are read (module
        # docstring: only where the device runs while the host goes on).
        self.queues_updates = self.accelerator
        # The update queued and not read yet (`queues_updates`).
        self._pending: QueuedUpdate | None = None
        self._error: BaseException | None = None
        # Held during each update (each microbatch's gradients, each apply), so a checkpoint sees
        # weights, optimizer state and counters from the same step.
        self.lock = threading.RLock()
        # `version` and the weights, read by the driver (`policy_snapshot`).
        self.publisher = PolicyPublisher(learner, self.lock)
        self._iterator: Iterator | None = None
        self._accumulated = _Accumulation()
        # Units of batches taken before a `flush` (queued, loaded, in the minibatch buffer or
        # half accumulated) are dropped, never trained; counted here.
        self.num_units_dropped = 0
        # Skipped (non-finite) updates; `nonfinite.directory` is where their batches go.
        self.nonfinite = NonFiniteGuard(spec.max_nonfinite_updates, nonfinite_dir)
        self._callbacks = keras.callbacks.CallbackList(
            callbacks or [], add_history=False, add_progbar=False, model=learner
        )
        # The updates read and not reported yet, their reports and the timers.
        self.reports = UpdateReports(
            learner, self.loader, self._callbacks, self.nonfinite, self.microbatching
        )
        self._dataset = pipeline.make_dataset(
            self.loader.shards,
            signature,
            strategy,
            buffer_size=self.num_slots,
            accelerator=self.accelerator,
            threads=int(spec.num_gpu_loader_threads),
        )
        self.steps = ReplicaSteps(learner, strategy, self.reports.pack)

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    @property
    def error(self) -> BaseException | None:
        """The exception that ended the thread (its own, or the loader's), or None."""
        return self._error if self._error is not None else self.loader.error

    @error.setter
    def error(self, value: BaseException | None) -> None:
        self._error = value

    @property
    def outqueue(self) -> queue.Queue:
        """RLlib's outqueue: `(env_steps, agent_steps, stats)` for each update reported."""
        return self.reports.outqueue

    @property
    def inqueue(self) -> Any:
        """RLlib's learner queue (`LearnerSpec.make_queue()`; APPO: its circular buffer)."""
        return self.loader.inqueue

    @property
    def generation(self) -> int:
        """The loader's flush generation (`impala_tf.learning.loader`)."""
        return self.loader.generation

    @property
    def num_slots(self) -> int:
        return self.loader.num_slots

    @property
    def loader_waiting(self) -> threading.Event:
        """Set while the loader waits for a train batch or a free slot."""
        return self.loader.waiting

    @property
    def queue_timer(self) -> TimerStat:
        return self.loader.queue_timer

    @property
    def load_timer(self) -> TimerStat:
        return self.loader.load_timer

    @property
    def version(self) -> int:
        """`num_grad_updates` after the latest update, a host int (reads no device value, except
        once after `flush`)."""
        return self.publisher.version

    # The learner -----------------------------------------------------------------------------

    def _next_unit(self) -> tuple[Any, UnitInfo]:
        data = next(self._iterator)
        return data, self.loader.units.popleft()

    def run(self) -> None:
        # An error ends the thread and is kept in `self.error`; the driver, seeing the thread
        # dead, raises RLlib's "The learner thread died while training!" from it.
        try:
            self._callbacks.on_train_begin()
            # Traced now (while the actors start), not on the first batch.
            self.steps.trace(self._dataset.element_spec, self.microbatching)
            self._iterator = iter(self._dataset)
            while not self._stopped.is_set() and self.error is None:
                if self._pending is not None and not self._unit_at_hand():
                    self._read_pending()  # Before waiting for data (module docstring).
                start = time.perf_counter()
                try:
                    if self.microbatching:
                        (data, info), released = self._next_unit(), True
                    else:
                        (data, info), released = self.minibatch_buffer.get()
                except _END_OF_DATA:
                    break
                self.reports.unit_waited(time.perf_counter() - start, info.env_steps)
                if self.microbatching:
                    self._accumulate(data, info)
                else:
                    self.step(data, info)
                if released:
                    self.loader.release_slot()
            if self.error is None:
                self._read_pending()
                self._callbacks.on_train_end()
        except BaseException as e:  # noqa: BLE001 - handed to the driver.
            if self.error is None:
                self.error = e
        finally:
            # The loader ends with the thread (an error ends it too, not only `stop`): deleting
            # the iterator waits for a loader blocked on a slot.
            self._stopped.set()
            # Deleting the iterator ends its prefetch threads (native threads that otherwise
            # outlive the run, 2 per algorithm built and stopped in one process). Done here, by
            # the thread that used it, while `stop` waits in `join` (deleted by the caller of
            # `stop` itself, a MirroredStrategy iterator took 9 to 40 s to go, measured).
            self._iterator = None

    def step(self, data, info: UnitInfo) -> None:
        """Runs one update on a distributed train batch and reports it (on an accelerator maybe
        after the next update is queued: module docstring)."""
        with self.lock:
            if self._flushed_since(info):
                return
        self._begin_update()
        start = time.perf_counter()
        with self.lock:
            if self._flushed_since(info):  # Flushed meanwhile.
                return
            self._queue(self.steps.train, info, info.env_steps, start, 0.0, data)
        self.reports.report_read()

    def _accumulate(self, data, info: UnitInfo) -> None:
        """Adds one microbatch's gradients; after the train batch's last one, updates."""
        with self.lock:
            if self._flushed_since(info):
                return
            if self._accumulated.generation != self.generation:  # `flush` zeroed the sums.
                self._accumulated = _Accumulation(self.generation)
        acc = self._accumulated
        if acc.microbatches == 0:
            self._begin_update()
        start = time.perf_counter()
        with self.lock:
            if self._flushed_since(info):  # Flushed meanwhile.
                return
            # Not waited for (module docstring): on a CPU the call returns when it is done.
            self.steps.accumulate(data)
        seconds = time.perf_counter() - start
        self.reports.microbatch_done(seconds, info.env_steps)
        acc.add(info.env_steps, seconds)
        if not info.last:
            return
        start = time.perf_counter()
        with self.lock:
            if self._flushed_since(info):  # Flushed: the sums were zeroed.
                return
            self._queue(self.steps.apply, info, acc.env_steps, start, acc.grad_seconds)
        self._accumulated = _Accumulation(self.generation)
        self.reports.report_read()

    def _flushed_since(self, info: UnitInfo) -> bool:
        """Under `lock`: whether the unit's batch was taken before a `flush` (it is dropped, and
        counted in `num_units_dropped`)."""
        if info.generation == self.generation:
            return False
        self.num_units_dropped += 1
        return True

    def _begin_update(self) -> None:
        """Keras' `on_train_batch_begin`, numbered after the updates reported and queued."""
        self._callbacks.on_train_batch_begin(self.reports.num_steps + (self._pending is not None))

    def _unit_at_hand(self) -> bool:
        """Whether the next unit comes without waiting for a batch: it is buffered for another
        pass, or the loader has handed it to the dataset."""
        return bool(self.loader.units) or (
            not self.microbatching and not self.minibatch_buffer.will_fetch()
        )

    def _queue(
        self, update: Any, info: UnitInfo, env_steps: int, start: float, grad_s: float, *args
    ) -> None:
        """Under `lock`: queues `update(*args)`, then reads the stats of the update before it;
        reads this one's too unless it may wait (`queues_updates` and the next unit at hand)."""
        # After a restore the counter is read now, before this update changes it.
        self.version  # noqa: B018 - the property reads and keeps it.
        packed = update(*args)
        previous = self._pending
        self._pending = QueuedUpdate(packed, info, env_steps, time.perf_counter() - start, grad_s)
        if previous is not None:
            self._read_one(previous)
        if not (self.queues_updates and self._unit_at_hand()):
            self._take_pending()
        self.publisher.publish_if_wanted()

    def _take_pending(self) -> None:
        """Under `lock`: reads the pending update's stats, if there is one."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._read_one(pending)

    def _read_pending(self) -> None:
        """Reads the pending update's stats, if there is one, and reports what was read."""
        with self.lock:
            self._take_pending()
        self.reports.report_read()

    def _read_one(self, pending: QueuedUpdate) -> None:
        """Under `lock`: the update's one read back to the host (`UpdateReports.read`); its
        version."""
        self.publisher.set_version(self.reports.read(pending, updates_before=self.version))

    def policy_snapshot(self, wait: bool = True) -> tuple[list[np.ndarray], int] | None:
        """The policy weights and their `num_grad_updates`, read between two updates
        (`PolicyPublisher.snapshot`). On an accelerator a read waits for the update the thread
        queued last to finish on the device (module docstring).

        Args:
          wait: True: waits for a running update to end. False: never waits for the thread;
            while an update runs, returns the weights published after the latest one (None
            before the first).
        """
        return self.publisher.snapshot(wait)

    def flush(self) -> int:
        """Drops every batch taken so far: queued, loaded, buffered or half accumulated.

        Call it with `lock` held (as `Impala.restore` does around loading the weights): no
        update that started before returns after it, and none of those batches trains later.
        The gradient accumulators are zeroed.

        Returns:
          The number of train batches removed from the inqueue.
        """
        self.publisher.forget()  # Weights and version from before a restore.
        self._pending = None  # Its stats are dropped with the batches (it has trained).
        removed = self.loader.flush()
        if self.microbatching:
            self.steps.reset()
        return removed

    def stop(self, timeout: float = 60.0) -> None:
        """Asks the thread to finish its current step and exit; waits up to `timeout` for it to
        end, the deletion of its `tf.data` iterator included (usually about a second; a process
        that exits while TensorFlow still deletes an iterator can hang in its exit)."""
        self._stopped.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)

    # The driver's interface ------------------------------------------------------------------

    def submit(self, item: TrainBatch, timeout: float | None = 0.0) -> bool:
        """Queues a train batch for training; returns False when the queue stayed full.

        Args:
          item: The batch.
          timeout: Seconds to wait for room: 0 never waits, None waits for as long as it takes.
        """
        try:
            if timeout == 0.0:
                self.inqueue.put_nowait(item)
            else:
                self.inqueue.put(item, timeout=timeout)
        except queue.Full:
            return False
        return True

    def results(self) -> list[tuple[int, int, dict[str, Any]]]:
        """The updates reported and not yet taken: `(env_steps, agent_steps, stats)` each, in
        order (RLlib's outqueue entries); never waits."""
        return self.reports.results()

    def next_result(self, timeout: float) -> tuple[int, int, dict[str, Any]] | None:
        """The next update's `(env_steps, agent_steps, stats)`, waiting up to `timeout` seconds
        (None if none came)."""
        return self.reports.next_result(timeout)

    def between_updates(self) -> threading.RLock:
        """A context manager that holds the thread between two updates (its update lock): a
        read of the weights, optimizer state and counters from one update, or a restore."""
        return self.lock

    def discard(self) -> int:
        """`flush`, and drops the reports not yet taken; call it `between_updates()`.

        Returns:
          The number of train batches removed from the queue.
        """
        removed = self.flush()
        self.results()
        return removed

    def queue_stats(self) -> dict[str, Any]:
        """RLlib's `info.learner_queue` (`UpdateReports.queue_stats`)."""
        return self.reports.queue_stats()

    def timing_ms(self) -> dict[str, float]:
        """RLlib's `info.timing_breakdown` of the learner (`UpdateReports.timing_ms`)."""
        return self.reports.timing_ms()

    def add_learner_metrics(self, result: dict[str, Any]) -> dict[str, Any]:
        """Adds `info.learner_queue` and `info.timing_breakdown` to a result dict (RLlib's)."""
        info = result.setdefault("info", {})
        info["learner_queue"] = self.queue_stats()
        info["timing_breakdown"] = self.timing_ms()
        return result

    def latest_stats(self) -> dict[str, Any]:
        """A copy of the stats of the latest update reported."""
        return self.reports.latest_stats()


class _Accumulation:
    """The learner thread's tally of the microbatches accumulated towards the next update."""

    def __init__(self, generation: int = 0):
        self.generation = generation
        self.microbatches = 0
        self.env_steps = 0
        self.grad_seconds = 0.0

    def add(self, env_steps: int, seconds: float) -> None:
        self.microbatches += 1
        self.env_steps += env_steps
        self.grad_seconds += seconds
