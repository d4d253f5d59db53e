"""Non-finite updates: skipped, counted, their batches saved, and an error after too many in a row.

`ImpalaLearner` applies an update only when its loss terms and its gradient's global norm are
finite (it reports `update_skipped` otherwise, and leaves weights, optimizer state and counters
as they were). The learner thread hands each update's stats to a `NonFiniteGuard`, which saves
the train batch of a skipped update as `<directory>/batch_<n>.npz` (its columns in the sequence
layout [B, T, ...], B sequences of T steps, plus `_stats_<name>` entries with the update's
stats) and raises `NonFiniteUpdatesError` once `max_nonfinite_updates` updates in a row were
skipped. The driver counts the skips as `num_nonfinite_updates_skipped`.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np

from impala_tf.data.sample_batch import SampleBatch, decompress

__all__ = ["LOSS_STATS", "NonFiniteGuard", "NonFiniteUpdatesError", "save_batch"]

logger = logging.getLogger(__name__)

#: The stats whose non-finiteness skips an update (RLlib's `learner_stats` names).
LOSS_STATS = ("policy_loss", "vf_loss", "entropy", "total_loss", "grad_gnorm", "vf_explained_var")
#: Batches saved at most per run: a run that skips now and then must not fill the disk.
MAX_SAVED_BATCHES = 100


class NonFiniteUpdatesError(RuntimeError):
    """`max_nonfinite_updates` updates in a row had a non-finite loss or gradient.

    Attributes:
      batch_file: The `.npz` file of the last skipped update's train batch (None if not saved).
      stats: Names of the stats that were not finite in that update.
    """

    def __init__(self, message: str, batch_file: str | None, stats: list[str]):
        super().__init__(message)
        self.batch_file = batch_file
        self.stats = stats


def save_batch(path: str, batch: SampleBatch | None, stats: Mapping[str, Any]) -> str:
    """Writes a train batch and an update's stats to `path` (`.npz`); returns `path`.

    Args:
      path: The file to write (its directory is created).
      batch: The train batch in sequence layout (compressed observations are decompressed);
        None writes the stats alone.
      stats: The update's stats; numeric ones are stored as `_stats_<name>` scalars.
    """
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    arrays: dict[str, np.ndarray] = {}
    if batch is not None:
        if batch.compressed:
            batch = decompress(batch)
        arrays.update({key: np.asarray(batch[key]) for key in batch})
    for key, value in stats.items():
        if isinstance(value, (int, float, bool, np.number, np.bool_)):
            arrays[f"_stats_{key}"] = np.asarray(value)
    tmp = path + ".tmp.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, path)
    return path


def _nonfinite_stats(stats: Mapping[str, Any]) -> list[str]:
    names = []
    for key in LOSS_STATS:
        value = stats.get(key)
        try:
            if value is not None and not math.isfinite(float(value)):
                names.append(key)
        except (TypeError, ValueError):
            continue
    return names


class NonFiniteGuard:
    """Tracks skipped updates for the learner thread (see the module docstring).

    Args:
      max_in_a_row: `max_nonfinite_updates`: this many skipped updates in a row raise.
      directory: Where batches are saved; None makes a temporary directory on first use.
    """

    def __init__(self, max_in_a_row: int, directory: str | None = None):
        self.max_in_a_row = int(max_in_a_row)
        self.directory = directory
        self.num_skipped = 0
        self.in_a_row = 0
        self.last_file: str | None = None

    def observe(self, stats: Mapping[str, Any], batch: SampleBatch | None) -> bool:
        """Records one update's stats; returns True when it was skipped.

        Raises:
          NonFiniteUpdatesError: this was the `max_in_a_row`-th skipped update in a row; the
            message names the saved batch file and the non-finite stats.
        """
        if not bool(stats.get("update_skipped", False)):
            self.in_a_row = 0
            return False
        self.num_skipped += 1
        self.in_a_row += 1
        names = _nonfinite_stats(stats) or ["the gradient (an element of it)"]
        path = None
        if self.num_skipped <= MAX_SAVED_BATCHES:
            if self.directory is None:
                self.directory = tempfile.mkdtemp(prefix="impala_tf-nonfinite-")
            path = os.path.join(self.directory, f"batch_{self.num_skipped}.npz")
            try:
                self.last_file = save_batch(path, batch, stats)
            except OSError as e:
                logger.warning("Could not save the non-finite update's batch to %s: %s", path, e)
                path = None
        logger.warning(
            "Skipped an update with non-finite %s (%d in a row, %d in all); batch: %s",
            ", ".join(names),
            self.in_a_row,
            self.num_skipped,
            path or "not saved",
        )
        if self.in_a_row >= self.max_in_a_row:
            raise NonFiniteUpdatesError(
                f"{self.in_a_row} updates in a row had a non-finite loss or gradient "
                f"(max_nonfinite_updates={self.max_in_a_row}); the last one's non-finite stats: "
                f"{', '.join(names)}. Its train batch is saved in {path or self.last_file}. "
                "Check the env's rewards and observations for inf/nan, lower `lr`, or set "
                "`grad_clip`.",
                path or self.last_file,
                names,
            )
        return True
