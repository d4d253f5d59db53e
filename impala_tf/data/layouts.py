"""Learner layouts of a `SampleBatch`: sequence, flat and time-major views of its columns.

Shapes: B is the number of rows (env sequences), T is time (`rollout_fragment_length`), N is the
number of env steps in a flat batch (B*T).

* sequence layout (what actors emit, `impala_tf.data.sample_batch`): per-step columns
  [B, T, ...], per-sequence columns (`is_per_sequence_column`) [B, ...];
* flat layout (RLlib's): per-step columns [N, ...] with the steps of one env contiguous
  (`to_flat`, `from_flat`);
* time-major layout (what the learner computes on): per-step columns [T, B, ...]
  (`time_major`, `from_time_major`).

Per-sequence columns are [B, ...] in every layout and are never reshaped or transposed. The
conversions check that every per-step column has the same T and that the batch is not
compressed (`impala_tf.data.sample_batch.decompress` first). Numpy only, like the rest of
`impala_tf.data`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from impala_tf.data.sample_batch import EncodedColumn, SampleBatch, is_per_sequence_column

__all__ = ["from_flat", "from_time_major", "time_major", "to_flat"]


def _per_step_time(columns: Mapping[str, np.ndarray], time_axis: int) -> int | None:
    """Checks that per-step columns have a shared time axis and returns its length."""
    seq_len, first_name = None, None
    for name, column in columns.items():
        if is_per_sequence_column(name):
            continue
        if isinstance(column, EncodedColumn):
            raise ValueError(f"column {name!r} is compressed; decompress(batch) first")
        if column.ndim < 2:
            raise ValueError(
                f"per-step column {name!r} has shape {column.shape}; expected at least two "
                "leading dimensions (rows and time)"
            )
        if seq_len is None:
            seq_len, first_name = column.shape[time_axis], name
        elif column.shape[time_axis] != seq_len:
            raise ValueError(
                f"column {name!r} has {column.shape[time_axis]} time steps but column "
                f"{first_name!r} has {seq_len}"
            )
    return seq_len


def to_flat(batch: SampleBatch) -> dict[str, np.ndarray]:
    """Converts sequence layout to RLlib's flat layout.

    Per-step columns [B, T, ...] become [B*T, ...] with each env's steps contiguous (a reshape,
    so a view when the input is contiguous). Per-sequence columns (`is_per_sequence_column`)
    stay [B, ...], which is why the result is a plain dict: its columns no longer share one
    leading length when RNN states are present. `SampleBatch(to_flat(batch))` is valid for
    batches without them.

    Args:
        batch: a SampleBatch in sequence layout.

    Returns:
        Column name -> array in flat layout.

    Raises:
        ValueError: a per-step column has fewer than two dimensions, the time lengths differ,
            or the batch is compressed.
    """
    _per_step_time(batch, time_axis=1)
    return {
        name: column if is_per_sequence_column(name) else column.reshape((-1,) + column.shape[2:])
        for name, column in batch.items()
    }


def from_flat(columns: Mapping[str, Any], seq_len: int) -> SampleBatch:
    """Inverse of `to_flat`: [B*T, ...] per-step columns -> [B, T, ...] with T = `seq_len`.

    This is the reshape RLlib's learner makes (B = N // T for non-RNN models).

    Args:
        columns: flat-layout columns (a dict or a SampleBatch without per-sequence columns).
        seq_len: T, the number of steps per row.

    Returns:
        A SampleBatch in sequence layout.

    Raises:
        ValueError: `seq_len` < 1 or does not divide the number of steps of a per-step column.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    out = {}
    for name, value in columns.items():
        column = np.asarray(value)
        if not is_per_sequence_column(name):
            if column.ndim == 0 or column.shape[0] % seq_len:
                raise ValueError(
                    f"column {name!r} has shape {column.shape}; its leading length must be a "
                    f"multiple of seq_len={seq_len}"
                )
            column = column.reshape((-1, seq_len) + column.shape[1:])
        out[name] = column
    return SampleBatch(out)


def time_major(batch: SampleBatch) -> dict[str, np.ndarray]:
    """Returns the learner's view: per-step columns [T, B, ...], per-sequence columns [B, ...].

    The per-step arrays are transposed views of the batch's arrays (not contiguous);
    `tf.convert_to_tensor` copies them into place.

    Args:
        batch: a SampleBatch in sequence layout.

    Returns:
        Column name -> array.

    Raises:
        ValueError: a per-step column has fewer than two dimensions, the time lengths differ,
            or the batch is compressed.
    """
    _per_step_time(batch, time_axis=1)
    return {
        name: column if is_per_sequence_column(name) else np.swapaxes(column, 0, 1)
        for name, column in batch.items()
    }


def from_time_major(columns: Mapping[str, Any]) -> SampleBatch:
    """Inverse of `time_major`: per-step [T, B, ...] -> [B, T, ...]; per-sequence unchanged.

    Args:
        columns: column name -> array, per-step columns time-major.

    Returns:
        A SampleBatch in sequence layout (per-step columns are views).

    Raises:
        ValueError: a per-step column has fewer than two dimensions or the time lengths differ.
    """
    arrays = {name: np.asarray(value) for name, value in columns.items()}
    _per_step_time(arrays, time_axis=0)
    return SampleBatch(
        {
            name: column if is_per_sequence_column(name) else np.swapaxes(column, 0, 1)
            for name, column in arrays.items()
        }
    )
