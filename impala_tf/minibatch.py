"""What the learner thread takes off its queue: `TrainBatch`, and RLlib's `MinibatchBuffer`.

numpy only: the driver puts `TrainBatch`es on the learner queues without importing the learner.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from impala_tf.sample_batch import SampleBatch

__all__ = ["MinibatchBuffer", "TrainBatch"]


class TrainBatch:
    """A train batch on the learner queue, with what the driver knows about its origin.

    Attributes:
      batch: `SampleBatch` of `rows_per_batch(config)` sequences.
      policy_version: Mean `num_grad_updates` of the weights that sampled it.
    """

    __slots__ = ("batch", "policy_version", "generation")

    def __init__(self, batch: SampleBatch, policy_version: float = 0.0):
        self.batch = batch
        self.policy_version = policy_version
        # The learner thread's `generation` when it took the batch (see `LearnerThread.flush`).
        self.generation = 0

    @property
    def env_steps(self) -> int:
        return self.batch.env_steps


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
