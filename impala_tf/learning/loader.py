"""`Loader`: the learner thread's source of device batches (RLlib's multi-GPU tower stacks).

A `tf.data` pipeline (`impala_tf.learning.pipeline`) is the loader: its source (`Loader.shards`, run
in a tf.data thread) takes train batches off the learner queue, cuts each *unit* (the batch, or
its microbatches) into per-device shards and hands them to the dataset, which copies them onto
the learner devices. Units occupy *slots*: `num_multi_gpu_tower_stacks` of them (at least
`minibatch_buffer_size`, so the minibatch buffer's ring always fits). The loader fills a free
slot while the learner trains on the others, and the learner thread frees a slot
(`release_slot`) only when its unit has had its last pass. So at most that many units are on
the devices or in the pipeline, and with one slot loading and training alternate, as in RLlib.
Departure from RLlib: when the learner runs on an accelerator there are at least two slots, so
that the next unit is cut, copied and waiting on the device while the current one trains (a
second train batch of device memory); on a CPU, where loading and training share the cores, the
slots are as above.

Flushes: `flush` bumps the *generation*. Every unit carries the generation of the batch it came
from, stamped when the batch was taken off the queue (taking and stamping are one step), so
the learner thread drops the units of batches taken before a flush (a restore) instead of
training on them.

A loader that fails (a malformed batch, a timeout) keeps its exception in `error` and ends the
dataset, so the learner thread ends and the driver raises from it; it never leaves the learner
waiting. If no batch arrives for `learner_queue_timeout` seconds the loader stops with a
`LearnerQueueTimeout` that names the settings to change.

Timers: `queue_timer` the waits on the queue (`learner_dequeue_time_ms`), `load_timer` the work
per unit (`learner_load_time_ms`: fetching a train batch that an aggregation worker left in the
store, `impala_tf.data.train_batch.BatchHandle`; decompression, cutting into device shards, layout
and dtype conversion, checks; the host->device copy then runs asynchronously in the dataset).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np

from impala_tf.data.sample_batch import SampleBatch, decompress
from impala_tf.data.train_batch import BatchLost, TrainBatch
from impala_tf.learning import pipeline
from impala_tf.learning.stats import TimerStat

__all__ = ["LearnerQueueTimeout", "Loader", "UnitInfo"]

logger = logging.getLogger(__name__)

_POLL_S = 0.1


class LearnerQueueTimeout(RuntimeError):
    """The learner waited `learner_queue_timeout` seconds without receiving a batch."""


class UnitInfo(NamedTuple):
    """What the learner needs to know about a unit the loader put in the dataset."""

    env_steps: int
    policy_version: float
    last: bool  # The last unit of its train batch's pass: the update happens after it.
    source: TrainBatch | None = None  # Saved if the update turns out non-finite.
    generation: int = 0  # Units of an older generation than the thread's are dropped.


class Loader:
    """The learner queue, the slots and the dataset's source (module docstring).

    Args:
      inqueue: The learner queue (`LearnerSpec.make_queue()`).
      signature: `pipeline.batch_signature(...)` of one replica's shard of a unit.
      num_replicas: The learner devices.
      num_slots: The units loaded or training at once at most.
      micro_rows: Sequences per microbatch, or None to load whole train batches.
      timeout: `learner_queue_timeout`, seconds.
      stopped: Set when the learner thread stops (the loader's waits end).
    """

    def __init__(
        self,
        inqueue: Any,
        signature: dict[str, Any],
        num_replicas: int,
        num_slots: int,
        micro_rows: int | None,
        timeout: float,
        stopped: threading.Event,
    ):
        self.inqueue = inqueue
        self.num_slots = int(num_slots)
        self._signature = signature
        self._num_replicas = int(num_replicas)
        self._micro_rows = micro_rows
        self._timeout = float(timeout)
        self._stopped = stopped
        self._free_slots = threading.Semaphore(self.num_slots)
        #: Set while the loader waits: for a train batch (the queue is empty), or for a free
        #: slot (all `num_slots` units are loaded or training).
        self.waiting = threading.Event()
        #: The infos of the units handed to the dataset, in order (the learner pops them).
        self.units: collections.deque[UnitInfo] = collections.deque()
        # Where the next train batch comes from: the queue, or (microbatches) the minibatch
        # buffer of host batches the learner thread sets up over `wait_for_batch`.
        self.next_batch: Callable[[], TrainBatch] = self.wait_for_batch
        self.generation = 0
        self._generation_lock = threading.Lock()
        self.queue_timer = TimerStat()
        self.load_timer = TimerStat()
        self.error: BaseException | None = None

    def wait_for_batch(self) -> TrainBatch:
        """Takes the next batch off the queue, stamped with the generation; `queue.Empty`
        once stopped; `LearnerQueueTimeout` after `timeout` seconds without one."""
        deadline = time.monotonic() + self._timeout
        while not self._stopped.is_set():
            try:
                # Taking a batch and stamping it are one step for `flush`.
                with self._generation_lock:
                    item = self.inqueue.get(
                        timeout=min(_POLL_S, max(0.0, deadline - time.monotonic()))
                    )
                    item.generation = self.generation
                self.waiting.clear()
                return item
            except queue.Empty:
                self.waiting.set()  # Nothing queued: the loader waits for a batch.
                if time.monotonic() >= deadline:
                    raise LearnerQueueTimeout(
                        f"The learner received no train batch for {self._timeout:g} s "
                        f"(learner_queue_timeout={self._timeout:g}). The actors are sampling too "
                        "slowly for the learner: raise `learner_queue_timeout`, or add actors "
                        "(`num_env_runners`, `num_envs_per_env_runner`), or check that the env "
                        "steps at all."
                    ) from None
        raise queue.Empty

    def release_slot(self) -> None:
        """Frees the slot of a unit that had its last pass."""
        self._free_slots.release()

    def flush(self) -> int:
        """Starts a new generation and empties the queue (releasing what it held).

        Returns:
          The number of train batches removed from the queue.
        """
        with self._generation_lock:
            self.generation += 1
            return self.inqueue.drain()

    def _acquire_slot(self) -> bool:
        if self._free_slots.acquire(blocking=False):
            return True
        self.waiting.set()  # Every slot holds a unit: the loader waits for one.
        try:
            while not self._stopped.is_set():
                if self._free_slots.acquire(timeout=_POLL_S):
                    return True
            return False
        finally:
            self.waiting.clear()

    def _next_train_batch(self) -> TrainBatch:
        start = time.perf_counter()
        item = self.next_batch()
        # Only completed waits count: the one that a stop interrupts is not a dequeue.
        self.queue_timer.push(time.perf_counter() - start)
        return item

    def _cut(self, item: TrainBatch) -> list[tuple[SampleBatch, UnitInfo]]:
        """The units of one pass over a train batch: the batch itself, or its microbatches."""
        batch = item.batch
        rows = self._micro_rows
        if rows is None:
            info = UnitInfo(batch.env_steps, item.policy_version, True, item, item.generation)
            return [(batch, info)]
        batch = decompress(batch)
        if len(batch) % rows:
            raise ValueError(
                f"A train batch of {len(batch)} sequences cannot be cut into microbatches of "
                f"{rows} (`microbatch_size` / `rollout_fragment_length`)."
            )
        units = []
        for start in range(0, len(batch), rows):
            micro = batch.slice(start, start + rows)
            last = start + rows == len(batch)
            info = UnitInfo(micro.env_steps, item.policy_version, last, item, item.generation)
            units.append((micro, info))
        return units

    def shards(self) -> Iterator[dict[str, np.ndarray]]:
        """The dataset's source: the device shards of each unit, one slot per unit."""
        pending: collections.deque = collections.deque()
        try:
            while self._acquire_slot():
                start = None
                while not pending:
                    item = self._next_train_batch()
                    start = time.perf_counter()
                    try:  # Fetches a batch queued as a handle (`impala_tf.data.train_batch`).
                        pending.extend(self._cut(item))
                    except BatchLost as e:  # Counted by the aggregation stage; the next one.
                        logger.warning("Skipping a train batch: %s", e)
                unit, info = pending.popleft()
                start = start or time.perf_counter()
                shards = pipeline.replica_shards(unit, self._signature, self._num_replicas)
                self.load_timer.push(time.perf_counter() - start)
                self.units.append(info)
                yield from shards
        except queue.Empty:  # Stopped while waiting for a batch.
            return
        except GeneratorExit:  # The dataset was torn down (`stop`): not a loader failure.
            raise
        except BaseException as e:  # noqa: BLE001 - ends the dataset; the thread reports it.
            if self.error is None:  # The first error is the cause; keep it.
                self.error = e
            return
