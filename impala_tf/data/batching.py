"""Cutting train batches: fragments' env sequences -> batches of a fixed number of sequences.

numpy only (no TensorFlow), so aggregation worker processes can use it.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np

from impala_tf.data.sample_batch import SampleBatch, concat_samples

__all__ = ["BatchBuilder", "BatchShape", "rows_per_batch"]


class BatchShape(Protocol):
    """The settings that shape a train batch: a learner's `impala_tf.learning.spec.LearnerSpec`,
    or a config (the same RLlib keys)."""

    rollout_fragment_length: int
    train_batch_size: int
    microbatch_size: int | None


#: The env runners' per-step weights version column (`impala_tf.rollout.env_runner.POLICY_VERSION`).
_VERSION_COLUMN = "policy_version"


def rows_per_batch(config: BatchShape, num_replicas: int = 1) -> int:
    """Env sequences per train batch: `train_batch_size / rollout_fragment_length`, rounded up to
    a whole multiple of the number of learner devices `num_replicas`.

    With `microbatch_size` M, a whole number of microbatches of M / T sequences: as RLlib's
    `MicrobatchOptimizer`, microbatches are accumulated until at least `train_batch_size` steps.
    (`impala_tf.learning.pipeline.microbatch_rows` checks that M is whole, evenly sharded
    sequences.)
    """
    horizon = config.rollout_fragment_length
    if config.microbatch_size:
        micro = math.ceil(config.microbatch_size / horizon / num_replicas) * num_replicas
        return math.ceil(config.train_batch_size / config.microbatch_size) * micro
    rows = math.ceil(config.train_batch_size / horizon)
    return math.ceil(rows / num_replicas) * num_replicas


class BatchBuilder:
    """Concatenates fragments' sequences into train batches of exactly `rows` sequences.

    Sequences left over after a batch is cut start the next one, so no sample is dropped. Each
    added batch may carry a policy version (the learner update count of the weights that sampled
    it); a train batch reports the step-weighted mean version of its sequences. A batch with the
    per-step `policy_version` column (what env runners emit) is labelled by that column, so a
    replayed sequence keeps the version it was sampled with and a step acted by older weights
    counts as older; the `version` argument labels batches without it.
    """

    def __init__(self, rows: int):
        self.rows = rows
        self._pending: list[SampleBatch] = []
        self._versions: list[np.ndarray] = []
        self._pending_rows = 0

    def add(self, batch: SampleBatch, version: float = 0.0) -> list[tuple[SampleBatch, float]]:
        """Adds a batch of sequences; returns the (train batch, mean version) pairs it completed."""
        self._pending.append(batch)
        if _VERSION_COLUMN in batch:
            steps = np.asarray(batch[_VERSION_COLUMN], np.float64)
            self._versions.append(steps.reshape(len(batch), -1).mean(axis=1))
        else:
            self._versions.append(np.full(len(batch), version, np.float64))
        self._pending_rows += len(batch)
        out = []
        while self._pending_rows >= self.rows:
            merged = concat_samples(self._pending) if len(self._pending) > 1 else self._pending[0]
            versions = np.concatenate(self._versions)
            out.append((merged.slice(0, self.rows), float(versions[: self.rows].mean())))
            rest = merged.slice(self.rows, len(merged))
            self._pending = [rest] if len(rest) else []
            self._versions = [versions[self.rows :]] if len(rest) else []
            self._pending_rows = len(rest)
        return out

    @property
    def pending_rows(self) -> int:
        return self._pending_rows

    def get_state(self) -> dict[str, Any]:
        """The rows waiting for a train batch as plain data (dicts of numpy columns)."""
        return {"pending": [dict(b) for b in self._pending], "versions": list(self._versions)}

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores `get_state()`."""
        self._pending = [SampleBatch(b) for b in state["pending"]]
        self._versions = [np.asarray(v, np.float64) for v in state["versions"]]
        self._pending_rows = sum(len(b) for b in self._pending)
