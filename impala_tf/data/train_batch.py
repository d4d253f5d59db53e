"""What the learner thread takes off its queue: `TrainBatch`, and RLlib's `MinibatchBuffer`.

numpy only: the driver puts `TrainBatch`es on the learner queues without importing the learner.
"""

from __future__ import annotations

import abc
import queue
from collections.abc import Callable
from typing import Any

from impala_tf.data.sample_batch import SampleBatch

__all__ = [
    "BatchHandle",
    "BatchLost",
    "LearnerQueue",
    "MinibatchBuffer",
    "TrainBatch",
    "release_unread",
]


class BatchLost(RuntimeError):
    """A train batch left in a store could not be fetched (it was lost with its node); the
    learner skips it, and the env steps it held are counted as lost."""


class BatchHandle(abc.ABC):
    """A train batch not yet in this process: fetched by the learner's loader (`get`), so that
    its bytes never pass through the driver's main thread (`impala_tf.driver.aggregation`).

    Attributes:
      env_steps: The batch's env steps, known without fetching it.
    """

    env_steps: int

    @abc.abstractmethod
    def get(self) -> SampleBatch:
        """The batch, fetched into this process (once).

        Raises:
          BatchLost: The stored batch is gone.
        """

    @abc.abstractmethod
    def release(self) -> None:
        """Frees the stored batch without fetching it (a dropped batch). Safe twice."""


class TrainBatch:
    """A train batch on the learner queue, with what the driver knows about its origin.

    The batch may still be a `BatchHandle` when it is queued: the learner's loader fetches it
    when it reads `batch`, and a batch dropped unread is `release`d.

    Attributes:
      batch: `SampleBatch` of `rows_per_batch(config)` sequences.
      policy_version: Mean `num_grad_updates` of the weights that sampled it.
    """

    __slots__ = ("_batch", "env_steps", "policy_version", "generation")

    def __init__(self, batch: SampleBatch | BatchHandle, policy_version: float = 0.0):
        self._batch = batch
        self.env_steps = int(batch.env_steps)
        self.policy_version = policy_version
        # The learner thread's `generation` when it took the batch (see `LearnerThread.flush`).
        self.generation = 0

    @property
    def batch(self) -> SampleBatch:
        """The batch, fetched here first if it was queued as a handle (`BatchLost` if gone)."""
        if isinstance(self._batch, BatchHandle):
            self._batch = self._batch.get()
        return self._batch

    def release(self) -> None:
        """Frees the batch's store if it was never fetched (the batch is dropped)."""
        release_unread(self._batch)


def release_unread(batch: SampleBatch | BatchHandle) -> None:
    """Frees the store of a batch dropped while still a `BatchHandle` (a fetched or local
    `SampleBatch` holds no store)."""
    if isinstance(batch, BatchHandle):
        batch.release()


class LearnerQueue(queue.Queue):
    """RLlib's learner queue: FIFO, `learner_queue_size` train batches at most.

    The learner thread takes batches with `get`; the driver puts them with `put_nowait` (a
    full queue raises `queue.Full`: the driver drops and counts the batch) or a waiting `put`.
    Another algorithm's queue (APPO's circular buffer) has the same methods.
    """

    def __init__(self, maxsize: int):
        super().__init__(maxsize=int(maxsize))

    def drain(self) -> int:
        """Removes and releases every queued batch; returns how many there were."""
        removed = 0
        while True:
            try:
                self.get_nowait().release()
            except queue.Empty:
                return removed
            removed += 1

    def stats(self) -> dict[str, float]:
        """Counters of the queue's own for the result dict's `info.learner_queue` (none)."""
        return {}


class MinibatchBuffer:
    """RLlib's ring of `size` slots, each serving its item `num_passes` times before refilling.

    Args:
      fetch: Returns a new item for an expired slot (may block; its exceptions propagate).
      size: Number of slots (`minibatch_buffer_size`).
      num_passes: Times each item is served (`num_sgd_iter`).
    """

    def __init__(self, fetch: Callable[[], Any], size: int, num_passes: int):
        self.fetch = fetch
        self.size = max(1, int(size))
        self.num_passes = max(1, int(num_passes))
        self.buffers: list[Any] = [None] * self.size
        self.ttl = [0] * self.size
        self.idx = 0

    def will_fetch(self) -> bool:
        """Whether the next `get` calls `fetch` (rather than serving a buffered item again)."""
        return self.ttl[self.idx] <= 0

    def get(self) -> tuple[Any, bool]:
        """Returns (item, released): `released` is True when this was the item's last pass."""
        if self.ttl[self.idx] <= 0:
            self.buffers[self.idx] = self.fetch()
            self.ttl[self.idx] = self.num_passes
        item = self.buffers[self.idx]
        self.ttl[self.idx] -= 1
        released = self.ttl[self.idx] <= 0
        if released:
            self.buffers[self.idx] = None
        self.idx = (self.idx + 1) % self.size
        return item, released
