"""SampleBatch: the numpy columns that actors produce and the learner consumes.

Shapes: B is the number of rows (env sequences), T is time (`rollout_fragment_length`), N is the
number of env steps in a flat batch.

A `SampleBatch` maps RLlib's column names to numpy arrays that share one leading dimension, the
rows. Two layouts are valid:

* sequence layout (what our actors emit): per-step columns are [B, T, ...]; per-sequence columns
  (the RNN start states, `state_in_0`, `state_in_1`, ...) are [B, ...];
* flat layout (RLlib's): every column is [N, ...] with the env steps of one env contiguous.

A column is per-sequence exactly when its name starts with `STATE_IN_PREFIX` ("state_in_") or
is `OBS_FRAMES`; `is_per_sequence_column` is the one place that rule lives. Every other column
is per-step.

`concat_samples` stacks batches along the rows. `compress` and `decompress` shrink the
observation column for transport between processes (`EncodedColumn`). The conversions between
the layouts, and the learner's time-major [T, B, ...] view, are in `impala_tf.data.layouts`.

This module imports numpy and the standard library only, so actor processes load it cheaply.
"""

from __future__ import annotations

import abc
import math
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "ACTIONS",
    "ACTION_DIST_INPUTS",
    "ACTION_LOGP",
    "OBS",
    "OBS_FRAMES",
    "OBS_RESTARTS",
    "REWARDS",
    "STATE_IN_PREFIX",
    "TERMINATEDS",
    "TRUNCATEDS",
    "VALUES_BOOTSTRAPPED",
    "VF_PREDS",
    "CompressedColumn",
    "EncodedColumn",
    "MultiAgentBatch",
    "SampleBatch",
    "compress",
    "concat_samples",
    "decompress",
    "is_per_sequence_column",
]

OBS = "obs"
ACTIONS = "actions"
REWARDS = "rewards"
TERMINATEDS = "terminateds"
TRUNCATEDS = "truncateds"
ACTION_DIST_INPUTS = "action_dist_inputs"
ACTION_LOGP = "action_logp"
VF_PREDS = "vf_preds"
VALUES_BOOTSTRAPPED = "values_bootstrapped"
STATE_IN_PREFIX = "state_in_"
#: Frame-stacked observations as frames, [B, T + k - 1, H, W, s] (`impala_tf.models.frames`): a
#: per-sequence column, and `OBS_RESTARTS` bool [B, T] says where a stack was refilled.
OBS_FRAMES = "obs_frames"
OBS_RESTARTS = "obs_restarts"


def is_per_sequence_column(name: str) -> bool:
    """Returns whether column `name` holds one entry per sequence (an RNN start state).

    Args:
        name: a column name.

    Returns:
        True for names starting with `STATE_IN_PREFIX` and for `OBS_FRAMES`; such columns are
        [B, ...] in both layouts and are never reshaped or transposed. False for per-step
        columns.
    """
    return name.startswith(STATE_IN_PREFIX) or name == OBS_FRAMES


class EncodedColumn(abc.ABC):
    """A column packed for transport (zlib: `CompressedColumn`); `decompress` restores it.

    Subclasses are frozen dataclasses with at least `shape` (the original array's shape) and
    `dtype` (its `numpy.dtype.str`).
    """

    shape: tuple[int, ...]
    dtype: str

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def size(self) -> int:
        """Number of elements of the original array."""
        return math.prod(self.shape)

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes of payload this encoding carries (what travels, pickling overhead aside)."""

    @abc.abstractmethod
    def decode(self) -> np.ndarray:
        """Returns the original array (writable, owning its memory)."""


@dataclass(frozen=True)
class CompressedColumn(EncodedColumn):
    """A column stored as zlib-compressed raw bytes plus the shape and dtype to rebuild it.

    Attributes:
        data: zlib stream of the C-contiguous array bytes.
        shape: shape of the original array; `shape[0]` is the number of rows.
        dtype: `numpy.dtype.str` of the original array (e.g. "|u1", "<f4").
    """

    data: bytes
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        """Length of the zlib stream."""
        return len(self.data)

    def decode(self) -> np.ndarray:
        """Returns the decompressed array."""
        flat = np.frombuffer(zlib.decompress(self.data), dtype=np.dtype(self.dtype))
        return flat.reshape(self.shape).copy()

    def __repr__(self) -> str:
        return f"CompressedColumn(shape={self.shape}, dtype={self.dtype}, bytes={len(self.data)})"


Column = np.ndarray | EncodedColumn


def _as_column(name: Any, value: Any) -> Column:
    """Converts `value` to a column (ndarray unless already compressed) and checks it has rows."""
    if not isinstance(name, str):
        raise TypeError(f"SampleBatch column names must be str, got {name!r}")
    if isinstance(value, np.ndarray | EncodedColumn):
        column = value
    else:
        try:
            column = np.asarray(value)
        except ValueError as e:  # Ragged nested lists.
            raise ValueError(f"column {name!r} cannot be made a numpy array: {e}") from e
    if isinstance(column, np.ndarray) and column.ndim == 0:
        raise ValueError(f"column {name!r} is a scalar; every column needs a leading row dimension")
    return column


def _check_rows(columns: Mapping[str, Column]) -> int:
    """Returns the common leading length of `columns`, raising ValueError if two differ."""
    first_name, rows = None, 0
    for name, column in columns.items():
        if first_name is None:
            first_name, rows = name, len(column)
        elif len(column) != rows:
            raise ValueError(
                f"column {name!r} has {len(column)} rows but column {first_name!r} has {rows}; "
                "every column of a SampleBatch must share the leading dimension"
            )
    return rows


class SampleBatch(dict):
    """Numpy columns with RLlib's names sharing a leading row dimension.

    A `dict` subclass, so `dict(batch)`, `**batch`, pickling and `np.savez(**batch)` work as for
    a plain dict. Hand `dict(batch)` or `time_major(batch)` to TensorFlow rather than the
    SampleBatch itself. Columns are converted to numpy arrays and their leading lengths checked on
    construction and on every `batch[name] = value`.

    `len(batch)` is the number of rows (B in sequence layout, N in flat layout), not the number
    of columns; `len(batch.keys())` gives that. An empty batch is falsy.
    """

    def __init__(
        self, columns: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None, **kwargs: Any
    ):
        """Builds a batch from a mapping (or pairs) of column name -> array-like.

        Args:
            columns: column name -> array (lists are converted with `np.asarray`).
            **kwargs: more columns.

        Raises:
            ValueError: a column is a scalar or ragged, or two columns differ in leading length
                (the message names the column and both lengths).
            TypeError: a column name is not a str.
        """
        super().__init__()
        raw = dict(columns if columns is not None else {}, **kwargs)
        converted = {name: _as_column(name, value) for name, value in raw.items()}
        _check_rows(converted)
        super().update(converted)

    # -- dict behaviour that must keep the invariant ---------------------------------------------

    def __setitem__(self, name: str, value: Any) -> None:
        column = _as_column(name, value)
        # The existing columns already agree with each other, so one of them is enough.
        other = next((key for key in self.keys() if key != name), None)
        if other is not None:
            rows = len(super().__getitem__(other))
            if len(column) != rows:
                raise ValueError(
                    f"column {name!r} has {len(column)} rows but column {other!r} has {rows}; "
                    "every column of a SampleBatch must share the leading dimension"
                )
        super().__setitem__(name, column)

    def update(self, other: Any = (), /, **kwargs: Any) -> None:  # type: ignore[override]
        """Sets several columns, checking each as `batch[name] = value` does."""
        for name, value in dict(other, **kwargs).items():
            self[name] = value

    def setdefault(self, name: str, default: Any = None) -> Column:  # type: ignore[override]
        """Returns column `name`, first setting it to `default` (checked) if absent."""
        if name not in self:
            self[name] = default
        return super().__getitem__(name)

    def __ior__(self, other: Any) -> SampleBatch:  # type: ignore[override]
        self.update(other)
        return self

    def __or__(self, other: Any) -> SampleBatch:  # type: ignore[override]
        merged = SampleBatch(self)
        merged.update(other)
        return merged

    def __reduce__(self):
        # Rebuilding through the constructor keeps unpickling on the validated path and avoids
        # pickling any per-instance state (there is none).
        return (SampleBatch, (dict(self),))

    def __len__(self) -> int:
        for column in self.values():
            return len(column)
        return 0

    def __getitem__(self, key: str | slice) -> Any:
        if isinstance(key, slice):
            return self._slice_rows(key)
        return super().__getitem__(key)

    def __repr__(self) -> str:
        parts = []
        for name, column in self.items():
            if isinstance(column, EncodedColumn):
                kind = type(column).__name__
                parts.append(f"{name}: {column.shape} {column.dtype} (compressed, {kind})")
            else:
                parts.append(f"{name}: {column.shape} {column.dtype}")
        return f"SampleBatch(rows={len(self)}, {{{', '.join(parts)}}})"

    # -- batch operations -------------------------------------------------------------------------

    @property
    def env_steps(self) -> int:
        """Number of env steps: `rewards.size` (B*T or N) when rewards exist, else the rows."""
        rewards = self.get(REWARDS)
        if rewards is None:
            return len(self)
        return int(rewards.size)

    @property
    def count(self) -> int:
        """RLlib's `count`: the steps this batch holds (`env_steps`)."""
        return self.env_steps

    @property
    def compressed(self) -> bool:
        """Whether any column is an `EncodedColumn` (then `decompress` before using it)."""
        return any(isinstance(column, EncodedColumn) for column in self.values())

    def slice(self, start: int | None, end: int | None) -> SampleBatch:
        """Returns rows `[start, end)` of every column as numpy views (no copy).

        Args:
            start: first row (Python slice semantics, negative allowed).
            end: row after the last one.

        Returns:
            A SampleBatch sharing memory with this one.
        """
        return self._slice_rows(slice(start, end))

    def _slice_rows(self, rows: slice) -> SampleBatch:
        if self.compressed:
            raise ValueError("cannot slice a compressed SampleBatch; decompress(batch) first")
        return SampleBatch({name: column[rows] for name, column in self.items()})

    def copy(self) -> SampleBatch:  # type: ignore[override]
        """Returns a deep copy: every array is copied, so the result shares no memory."""
        return SampleBatch(
            {
                name: column if isinstance(column, EncodedColumn) else column.copy()
                for name, column in self.items()
            }
        )


class MultiAgentBatch:
    """RLlib's `MultiAgentBatch`: one `SampleBatch` per policy, from `env_steps` env steps.

    What a multi-agent env runner's `on_sample_end` callback receives
    (`impala_tf.config.callbacks`).

    Attributes:
      policy_batches: {policy_id: SampleBatch}.
      count: The env steps the batches were sampled in.
    """

    def __init__(self, policy_batches: Mapping[str, SampleBatch], env_steps: int):
        self.policy_batches = dict(policy_batches)
        self.count = int(env_steps)

    def env_steps(self) -> int:
        return self.count

    def agent_steps(self) -> int:
        """The agent steps of every policy's batch together."""
        return sum(b.env_steps for b in self.policy_batches.values())

    def __repr__(self) -> str:
        return f"MultiAgentBatch(env_steps={self.count}, policies={sorted(self.policy_batches)})"


def concat_samples(batches: Iterable[SampleBatch]) -> SampleBatch:
    """Concatenates batches along the rows (axis 0).

    Args:
        batches: SampleBatches with the same columns; each column must agree in trailing shape
            and dtype across batches (so fragments of different T cannot be mixed).

    Returns:
        A new SampleBatch that shares no memory with the inputs; an empty SampleBatch for an
        empty input.

    Raises:
        ValueError: column sets differ, a column's trailing shape or dtype differs, or a batch is
            compressed. The message names the column.
    """
    batches = list(batches)
    if not batches:
        return SampleBatch()
    names = list(batches[0].keys())
    for i, batch in enumerate(batches):
        if batch.compressed:
            raise ValueError(f"batch {i} is compressed; decompress it before concat_samples")
        if batch.keys() != batches[0].keys():
            missing = sorted(set(names) - set(batch.keys()))
            extra = sorted(set(batch.keys()) - set(names))
            raise ValueError(
                f"batch {i} has different columns than batch 0: missing {missing}, extra {extra}"
            )
    out = {}
    for name in names:
        first = batches[0][name]
        for i, batch in enumerate(batches[1:], start=1):
            column = batch[name]
            if column.shape[1:] != first.shape[1:] or column.dtype != first.dtype:
                raise ValueError(
                    f"column {name!r} of batch {i} is {column.shape[1:]} {column.dtype} per row "
                    f"but {first.shape[1:]} {first.dtype} in batch 0"
                )
        out[name] = np.concatenate([batch[name] for batch in batches], axis=0)
    return SampleBatch(out)


def compress(batch: SampleBatch, columns: Iterable[str] = (OBS,), level: int = 1) -> SampleBatch:
    """Compresses whole columns with zlib (RLlib's `compress_observations`, numpy + stdlib).

    RLlib LZ4-compresses each observation separately; we compress each column's raw bytes in one
    zlib call (which releases the GIL), and keep shape and dtype beside the bytes.

    Args:
        batch: the batch to compress; left unchanged.
        columns: names to compress; absent or already compressed ones are skipped.
        level: zlib level, 1 (fastest, the default) to 9 (smallest).

    Returns:
        A new SampleBatch whose other columns are shared with `batch`.

    Raises:
        ValueError: a column to compress holds Python objects.
    """
    out = dict(batch)
    for name in columns:
        column = out.get(name)
        if column is None or isinstance(column, EncodedColumn):
            continue
        if column.dtype.hasobject:
            raise ValueError(f"column {name!r} has dtype object and cannot be compressed")
        contiguous = np.ascontiguousarray(column)
        out[name] = CompressedColumn(
            data=zlib.compress(contiguous, level),
            shape=tuple(contiguous.shape),
            dtype=contiguous.dtype.str,
        )
    return SampleBatch(out)


def decompress(batch: SampleBatch) -> SampleBatch:
    """Restores every encoded column; returns `batch` itself when nothing is encoded.

    The one place where transported batches are unpacked (zlib: `compress`, RLlib's
    `compress_observations`). Every receiver calls it. Frame-stacked observations stay frames
    (`OBS_FRAMES`): the learner rebuilds the stacks in its graph (`impala_tf.models.frames`).

    Args:
        batch: a SampleBatch, encoded or not.

    Returns:
        A SampleBatch of numpy arrays (decoded arrays are writable and own their memory).
    """
    if not batch.compressed:
        return batch
    return SampleBatch(
        {
            name: column.decode() if isinstance(column, EncodedColumn) else column
            for name, column in batch.items()
        }
    )
