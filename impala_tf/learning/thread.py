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

Timers (mean milliseconds in `info.timing_breakdown`): the loader's `learner_dequeue_time_ms`
and `learner_load_time_ms` (`impala_tf.learning.loader`); `learner_load_wait_time_ms` the learner
waiting for its next unit (nonzero when loading, or sampling, is slower than training);
`learner_grad_time_ms` one update. With microbatches the learner stats add the seed's
`sample_time_ms` (waiting for a microbatch), `grad_time_ms` (one microbatch's gradients),
`update_time_ms` (applying the accumulated gradients; RLlib's timed its synchronous weight
broadcast here, ours is the driver's), `opt_peak_throughput` and `sample_peak_throughput` (env
steps/s of those two) and `opt_samples` (env steps per microbatch).

A loader that fails (a malformed batch, a timeout) ends the dataset, so the thread ends with the
loader's exception in `error` and the driver raises from it.

Host reads. An update reads one tensor back to the host: its stats, stacked into one float64
vector on the device (`_pack`); the device is never waited on otherwise (a microbatch's
gradients are queued, not waited for, so on an accelerator `grad_time_ms` is the time to queue
one and the wait shows in `update_time_ms`). The thread keeps `num_grad_updates` as a host int,
`version`, set from each update's stats, so the driver (`LearnerGroup.versions()`, read every
training step) never reads a device value. Weights are read only when asked for
(`policy_snapshot`, which reads the counter with them).

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
next one's begin. `learner_grad_time_ms` is the thread's own time per update: queueing it
(on a CPU, running it) plus waiting for its stats. A unit's slot is freed when its last update
is queued, so the queued update's batch is on the device beside the `num_slots` units. Not
measured on a GPU (none here): skipping a non-finite update is a `tf.cond`
(`ImpalaLearner._cross_replica_update`), whose `Switch` kernel keeps its predicate in host
memory, so queueing an update probably returns only once its gradients are computed, and what
overlaps is the optimizer step, the stats read and the host's work between updates.
`tools.bench_gpu --parts thread` measures what the thread reaches against the update alone.
"""

from __future__ import annotations

import collections
import copy
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import keras
import numpy as np
import tensorflow as tf

from impala_tf.data.train_batch import MinibatchBuffer, TrainBatch
from impala_tf.learning import devices, pipeline
from impala_tf.learning.learner import ImpalaLearner
from impala_tf.learning.loader import LearnerQueueTimeout, Loader, UnitInfo
from impala_tf.learning.nonfinite import NonFiniteGuard
from impala_tf.learning.stats import TimerStat, WindowStat, timer_ms

__all__ = ["LearnerQueueTimeout", "LearnerThread", "MinibatchBuffer", "TrainBatch"]


_END_OF_DATA = (StopIteration, tf.errors.OutOfRangeError, EOFError)


class _Pending(NamedTuple):
    """An update queued on the device whose stats are not read yet (module docstring)."""

    packed: tf.Tensor  # Its stats (`_pack`).
    info: UnitInfo
    env_steps: int
    queue_s: float  # Host seconds queueing the update (on a CPU: running it).
    grad_s: float  # Microbatches: seconds of their gradients before the update; else 0.


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
        self.outqueue: queue.Queue = queue.Queue()
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
        # The update queued and not read yet (`queues_updates`), and the updates read and not
        # reported yet (reported by this thread, outside `lock`).
        self._pending: _Pending | None = None
        self._read: collections.deque[tuple[dict[str, Any], UnitInfo, int, int]] = (
            collections.deque()
        )
        self.learner_queue_size = WindowStat("size", 50)
        self.load_wait_timer = TimerStat()
        self.grad_timer = TimerStat()
        # The microbatch optimizer's own stats (seed 004).
        self.sample_timer = TimerStat()
        self.microbatch_grad_timer = TimerStat()
        self.update_timer = TimerStat()
        self.num_steps = 0
        self.stats: dict[str, Any] = {}
        self._error: BaseException | None = None
        # Held during each update (each microbatch's gradients, each apply), so a checkpoint sees
        # weights, optimizer state and counters from the same step.
        self.lock = threading.RLock()
        # Weights published after an update for a driver that would not wait (`policy_snapshot`).
        self._snapshot_wanted = False
        self._published: tuple[list[np.ndarray], int] | None = None
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
        self._dataset = pipeline.make_dataset(
            self.loader.shards,
            signature,
            strategy,
            buffer_size=self.num_slots,
            accelerator=self.accelerator,
            threads=int(spec.num_gpu_loader_threads),
        )
        # `num_grad_updates` on the host (module docstring); None: read the variable at the
        # next use (after `flush`, when a restore is about to load it).
        self._version_lock = threading.Lock()
        self._version: int | None = int(learner.num_grad_updates.numpy())
        self._stat_keys: tuple[str, ...] = ()
        # Autograph is not needed (the graph code is explicit) and costs seconds of tracing.
        self._train_fn = tf.function(self._distributed_step, autograph=False)
        self._accumulate_fn = tf.function(self._distributed_accumulate, autograph=False)
        self._apply_fn = tf.function(self._distributed_apply, autograph=False)
        self._reset_fn = tf.function(self._distributed_reset, autograph=False)

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
        with self._version_lock:
            if self._version is None:
                self._version = int(self.learner.num_grad_updates.numpy())
            return self._version

    def _set_version(self, version: int | None) -> None:
        with self._version_lock:
            self._version = version

    # The learner -----------------------------------------------------------------------------

    def _next_unit(self) -> tuple[Any, UnitInfo]:
        data = next(self._iterator)
        return data, self.loader.units.popleft()

    def _pack(self, stats: dict[str, tf.Tensor]) -> tf.Tensor:
        """The stats as one float64 vector (read back in one copy); the keys are kept."""
        self._stat_keys = tuple(stats)
        return tf.stack([tf.cast(v, tf.float64) for v in stats.values()])

    def _unpack(self, packed: tf.Tensor) -> dict[str, Any]:
        """The update's one read back to the host: its stats, as Python numbers."""
        stats = dict(zip(self._stat_keys, packed.numpy().tolist()))
        for key in self.learner.count_keys:
            stats[key] = int(stats[key])
        return stats

    def _distributed_step(self, data):
        outputs = self.strategy.run(self.learner.train_step, args=(data,))
        # Every replica returns the same (all-reduced) stats.
        return self._pack(self.strategy.experimental_local_results(outputs)[0])

    def _distributed_accumulate(self, data):
        rows = self.strategy.run(self.learner.accumulate_step, args=(data,))
        return self.strategy.experimental_local_results(rows)[0]

    def _distributed_apply(self):
        outputs = self.strategy.run(self.learner.apply_accumulated)
        return self._pack(self.strategy.experimental_local_results(outputs)[0])

    def _distributed_reset(self):
        self.strategy.run(self.learner.reset_accumulators)

    def _trace(self) -> None:
        """Traces the update functions now (while the actors start), not on the first batch."""
        spec = self._dataset.element_spec
        if self.microbatching:
            self._accumulate_fn.get_concrete_function(spec)
            self._apply_fn.get_concrete_function()
        else:
            self._train_fn.get_concrete_function(spec)

    def run(self) -> None:
        # An error ends the thread and is kept in `self.error`; the driver, seeing the thread
        # dead, raises RLlib's "The learner thread died while training!" from it.
        try:
            self._callbacks.on_train_begin()
            self._trace()
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
                waited = time.perf_counter() - start
                self.load_wait_timer.push(waited)
                if self.microbatching:
                    self.sample_timer.push(waited)
                    self.sample_timer.push_units_processed(info.env_steps)
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
            self._queue(self._train_fn, info, info.env_steps, start, 0.0, data)
        self._report_read()

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
            self._accumulate_fn(data)
        seconds = time.perf_counter() - start
        self.microbatch_grad_timer.push(seconds)
        self.microbatch_grad_timer.push_units_processed(info.env_steps)
        acc.add(info.env_steps, seconds)
        if not info.last:
            return
        start = time.perf_counter()
        with self.lock:
            if self._flushed_since(info):  # Flushed: the sums were zeroed.
                return
            self._queue(self._apply_fn, info, acc.env_steps, start, acc.grad_seconds)
        self._accumulated = _Accumulation(self.generation)
        self._report_read()

    def _flushed_since(self, info: UnitInfo) -> bool:
        """Under `lock`: whether the unit's batch was taken before a `flush` (it is dropped, and
        counted in `num_units_dropped`)."""
        if info.generation == self.generation:
            return False
        self.num_units_dropped += 1
        return True

    def _begin_update(self) -> None:
        """Keras' `on_train_batch_begin`, numbered after the updates reported and queued."""
        self._callbacks.on_train_batch_begin(self.num_steps + (self._pending is not None))

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
        if self._version is None:  # After a restore: read before this update changes it.
            self.version  # noqa: B018 - the property reads and keeps it.
        packed = update(*args)
        previous = self._pending
        self._pending = _Pending(packed, info, env_steps, time.perf_counter() - start, grad_s)
        if previous is not None:
            self._read_one(previous)
        if not (self.queues_updates and self._unit_at_hand()):
            self._take_pending()
        self._publish_if_wanted()

    def _take_pending(self) -> None:
        """Under `lock`: reads the pending update's stats, if there is one."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._read_one(pending)

    def _read_pending(self) -> None:
        """Reads the pending update's stats, if there is one, and reports what was read."""
        with self.lock:
            self._take_pending()
        self._report_read()

    def _read_one(self, pending: _Pending) -> None:
        """Under `lock`: the update's one read back to the host; its timers; its version."""
        start = time.perf_counter()
        stats = self._unpack(pending.packed)
        seconds = pending.queue_s + time.perf_counter() - start
        updates_before = self.version
        self._set_version(stats["num_grad_updates_lifetime"])
        self.grad_timer.push(pending.grad_s + seconds)
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
        self._read.append((stats, pending.info, pending.env_steps, updates_before))

    def _report_read(self) -> None:
        """Reports the updates read so far, in order (this thread, outside `lock`)."""
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
        self.learner_queue_size.push(self.inqueue.qsize())
        self._callbacks.on_train_batch_end(self.num_steps - 1, logs=stats)

    def policy_snapshot(self, wait: bool = True) -> tuple[list[np.ndarray], int] | None:
        """The policy weights and their `num_grad_updates`, read between two updates.

        Every weight read for actors, evaluation and checkpoints comes from here or holds
        `lock`, so all variables come from the same update.

        Args:
          wait: True: waits for a running update to end, then reads. False: never waits for
            the thread (the driver's broadcasts, which would otherwise wait most of an update
            each time): reads now when no update is running; else returns what the thread
            published after its latest update (None before the first) and asks it to publish
            again when the running update ends. On an accelerator a read waits for the update
            the thread queued last to finish on the device (module docstring).

        Returns:
          `(weights, num_grad_updates)`, or None (only with `wait=False`).
        """
        if not self.lock.acquire(blocking=wait):
            self._snapshot_wanted = True
            return self._published
        try:
            return self._read_snapshot()
        finally:
            self.lock.release()

    def _read_snapshot(self) -> tuple[list[np.ndarray], int]:
        # The counter is read with the weights (not `version`, which may not count a queued
        # update yet): both come after every update queued so far.
        weights = self.learner.get_policy_weights()
        return weights, int(self.learner.num_grad_updates.numpy())

    def _publish_if_wanted(self) -> None:
        """After an update, under `lock`: publishes the weights if the driver asked."""
        if self._snapshot_wanted:
            self._snapshot_wanted = False
            self._published = self._read_snapshot()

    def flush(self) -> int:
        """Drops every batch taken so far: queued, loaded, buffered or half accumulated.

        Call it with `lock` held (as `Impala.restore` does around loading the weights): no
        update that started before returns after it, and none of those batches trains later.
        The gradient accumulators are zeroed.

        Returns:
          The number of train batches removed from the inqueue.
        """
        self._published = None  # Weights from before a restore must not be broadcast after it.
        self._pending = None  # Its stats are dropped with the batches (it has trained).
        self._set_version(None)  # A restore loads the counter next: read it at the next use.
        removed = self.loader.flush()
        if self.microbatching:
            self._reset_fn()
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
        """RLlib's `info.learner_queue`: the queue's size when each update was reported, and
        the queue's own counters (APPO's circular buffer: batches added and dropped)."""
        return {**self.learner_queue_size.stats(), **self.inqueue.stats()}

    def timing_ms(self) -> dict[str, float]:
        """RLlib's `info.timing_breakdown` of the learner (module docstring: Timers)."""
        return {
            "learner_grad_time_ms": timer_ms(self.grad_timer),
            "learner_load_time_ms": timer_ms(self.load_timer),
            "learner_load_wait_time_ms": timer_ms(self.load_wait_timer),
            "learner_dequeue_time_ms": timer_ms(self.queue_timer),
        }

    def add_learner_metrics(self, result: dict[str, Any]) -> dict[str, Any]:
        """Adds `info.learner_queue` and `info.timing_breakdown` to a result dict (RLlib's)."""
        info = result.setdefault("info", {})
        info["learner_queue"] = self.queue_stats()
        info["timing_breakdown"] = self.timing_ms()
        return result

    def latest_stats(self) -> dict[str, Any]:
        return copy.deepcopy(self.stats)


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
