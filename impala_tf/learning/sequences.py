"""The learner's time-major layout (`to_time_major`), and RLlib's `max_seq_len` for recurrent
models: fragments cut into sequences with their start states.

T is time (`rollout_fragment_length`), B is batch (env fragments), L = `model.max_seq_len`,
C = ceil(T / L) the sequences per fragment, H the recurrent state size.

RLlib's old stack (`rnn_sequencing`, the legacy IMPALA TF policy's `make_time_major` with
`seq_lens`) trains recurrent policies on sequences of at most `max_seq_len` steps, each starting
from the state the actor had at its first step, padded to `max_seq_len`, with a mask over the
padding; V-trace runs over the time-major [L, number of sequences] layout, so each sequence is
its own trace, bootstrapped at its end. impala_tf does the same:

* the env runner records the recurrent state at every L-th step of a fragment: each state column
  `state_in_i` is [B, C, H] (`state_column_shapes`);
* the learner (`chunk_time_major`) cuts each fragment's [T] steps into C sequences of L steps,
  zero-padding the last one when L does not divide T, and unrolls the model over [L, B * C];
* each sequence bootstraps from `values_bootstrapped` (the behaviour value of the next
  observation) at its last valid step, through the same cut the loss uses for a time-limit
  truncation, so the padding never enters the V-trace targets; the mask removes the padding
  from the loss sums and stats.

Two differences from RLlib, on purpose: sequences are cut at every L steps of a fragment, not
also at episode starts (the state is zeroed at an episode start inside a sequence, which gives
the same model outputs with less padding); and a short sequence bootstraps from the value after
its last valid step, where RLlib's padded time-major row would hand V-trace a padding value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import tensorflow as tf

from impala_tf.data.sample_batch import OBS, OBS_FRAMES, OBS_RESTARTS
from impala_tf.models import frames as frames_lib

__all__ = [
    "STATE_PREFIX",
    "ChunkedBatch",
    "chunk_time_major",
    "num_sequences",
    "state_column_shapes",
    "to_time_major",
]

#: The prefix of the recurrent-state columns (`state_in_0`, `state_in_1`, ...).
STATE_PREFIX = "state_in_"


def num_sequences(horizon: int, max_seq_len: int) -> int:
    """C: the sequences one fragment of `horizon` steps is cut into (ceil(T / L))."""
    if max_seq_len <= 0:
        raise ValueError(f"`model.max_seq_len` must be a positive int, got {max_seq_len!r}.")
    return math.ceil(int(horizon) / int(max_seq_len))


def state_column_shapes(
    horizon: int, max_seq_len: int, state_shapes: tuple[tuple[int, ...], ...]
) -> tuple[tuple[int, ...], ...]:
    """Per-row shapes of the `state_in_i` columns: (C, *state shape) for each state tensor.

    Args:
      horizon: T, `rollout_fragment_length`.
      max_seq_len: L, `model.max_seq_len`.
      state_shapes: The model's state shapes without the batch dimension (e.g. ((H,), (H,))).

    Returns:
      One shape per state tensor, e.g. ((C, H), (C, H)); () for a model without state.
    """
    c = num_sequences(horizon, max_seq_len)
    return tuple((c, *shape) for shape in state_shapes)


class ChunkedBatch(tuple):
    """What `chunk_time_major` returns: (columns, mask, sequence_ends).

    Attributes:
      columns: Per-step columns [L, B * C, ...]; state columns [B * C, H].
      mask: float32 [L, B * C], 1 at valid steps, 0 at padding.
      sequence_ends: bool [L, B * C], True at the last valid step of each sequence.
    """

    __slots__ = ()

    def __new__(cls, columns: dict, mask: tf.Tensor, sequence_ends: tf.Tensor):
        return super().__new__(cls, (columns, mask, sequence_ends))

    columns = property(lambda self: self[0])
    mask = property(lambda self: self[1])
    sequence_ends = property(lambda self: self[2])


def chunk_time_major(batch: Mapping[str, tf.Tensor], max_seq_len: int) -> ChunkedBatch:
    """Cuts time-major fragments into sequences of at most `max_seq_len` steps.

    Sequence c of fragment b holds steps [c * L, min((c + 1) * L, T)) of the fragment and is
    column b * C + c of the output; it starts from `state_in_i[b, c]`.

    Args:
      batch: Per-step columns [T, B, ...] (T known statically) and state columns
        `state_in_i` [B, C, H], C = ceil(T / L) (the env runner's layout), or [B, H] when
        T <= L (one sequence per fragment).
      max_seq_len: L (`model.max_seq_len`).

    Returns:
      `ChunkedBatch` of the columns [L, B * C, ...] (padding is zeros / False), state columns
      [B * C, H], the mask and the sequence ends.

    Raises:
      ValueError: T is unknown, or a state column has the wrong number of sequences.
    """
    horizon = batch["rewards"].shape[0]
    if horizon is None:
        raise ValueError("chunk_time_major needs the fragment length T known statically")
    c = num_sequences(horizon, max_seq_len)
    length = min(int(max_seq_len), horizon) if c == 1 else int(max_seq_len)
    pad = c * length - horizon
    columns = {}
    for key, column in batch.items():
        column = tf.convert_to_tensor(column)
        if key.startswith(STATE_PREFIX):
            if column.shape.rank == 2:
                if c != 1:
                    raise ValueError(
                        f"`{key}` holds one state per fragment ({column.shape}), but fragments "
                        f"of {horizon} steps are cut into {c} sequences of `model.max_seq_len` "
                        f"= {max_seq_len}: the batch needs the state at each sequence start, "
                        f"[B, {c}, H]."
                    )
                columns[key] = column
                continue
            if column.shape[1] != c:
                raise ValueError(
                    f"`{key}` has {column.shape[1]} sequence start states per fragment "
                    f"(shape {column.shape}); fragments of {horizon} steps with "
                    f"`model.max_seq_len` = {max_seq_len} need {c}."
                )
            columns[key] = tf.reshape(column, tf.concat([[-1], tf.shape(column)[2:]], 0))
            continue
        columns[key] = _chunk(column, c, length, pad)
    b = tf.shape(batch["rewards"])[1]
    # Over the padded time axis: valid steps, and the last valid step of each sequence.
    steps = np.arange(c * length)
    valid = steps < horizon
    ends = valid & ((steps % length == length - 1) | (steps == horizon - 1))
    mask = _chunk(tf.tile(tf.constant(valid, tf.float32)[:, None], tf.stack([1, b])), c, length, 0)
    ends = _chunk(tf.tile(tf.constant(ends)[:, None], tf.stack([1, b])), c, length, 0)
    return ChunkedBatch(columns, mask, ends)


def _chunk(column: tf.Tensor, c: int, length: int, pad: int) -> tf.Tensor:
    """[T, B, ...] -> [L, B * C, ...]: pads time to C * L, then sequence c of b is column b*C+c."""
    if c == 1 and pad == 0:
        return column
    rank = column.shape.rank
    if pad:
        column = tf.pad(column, [[0, pad]] + [[0, 0]] * (rank - 1))
    trailing = tf.shape(column)[2:]
    # [C * L, B, ...] -> [C, L, B, ...] -> [L, B, C, ...] -> [L, B * C, ...]
    column = tf.reshape(column, tf.concat([[c, length], tf.shape(column)[1:]], 0))
    column = tf.transpose(column, [1, 2, 0] + list(range(3, rank + 1)))
    return tf.reshape(column, tf.concat([[length, -1], trailing], 0))


def to_time_major(batch: Mapping[str, tf.Tensor], horizon: int) -> dict[str, tf.Tensor]:
    """`batch` with per-step columns time-major [T, B, ...], as the learner trains on them.

    A time-major batch ([T, B] `rewards`) is returned as it is; a flat one ([B * T], each env's
    T = `horizon` steps contiguous, RLlib's `SampleBatch`) is reshaped as RLlib's
    `make_time_major` does. The recurrent-state columns (`STATE_PREFIX`) are per sequence and
    stay as they are. Frame-stacked observations that came as frames (`obs_frames`,
    `obs_restarts`) are rebuilt into `obs` first, in the graph (`impala_tf.models.frames`).

    Raises:
      ValueError: `rewards` is neither [T, B] nor [B * T].
    """
    batch = _with_stacks(batch, horizon)
    rewards = batch["rewards"]
    if rewards.shape.rank == 2:
        return dict(batch)
    if rewards.shape.rank != 1:
        raise ValueError(
            f"`rewards` must be [T, B] (time-major) or [B*T] (flat), got shape {rewards.shape}"
        )
    out = {}
    for key, column in batch.items():
        if key.startswith(STATE_PREFIX):
            out[key] = column
            continue
        column = tf.convert_to_tensor(column)
        seq = tf.reshape(column, tf.concat([[-1, horizon], tf.shape(column)[1:]], axis=0))
        perm = [1, 0] + list(range(2, column.shape.rank + 1))
        out[key] = tf.transpose(seq, perm)
    return out


def _with_stacks(batch: Mapping[str, tf.Tensor], horizon: int) -> Mapping[str, tf.Tensor]:
    """`batch` with `obs` rebuilt from `obs_frames` and `obs_restarts`, if it has them."""
    if OBS_FRAMES not in batch:
        return batch
    out = dict(batch)
    frames, restarts = out.pop(OBS_FRAMES), tf.convert_to_tensor(out.pop(OBS_RESTARTS))
    if restarts.shape.rank == 2:  # Time-major [T, B].
        stacks = frames_lib.rebuild_stacks(frames, tf.transpose(restarts))
        out[OBS] = tf.transpose(stacks, [1, 0, 2, 3, 4])
    else:  # Flat [B * T].
        stacks = frames_lib.rebuild_stacks(frames, tf.reshape(restarts, [-1, horizon]))
        out[OBS] = tf.reshape(stacks, tf.concat([[-1], tf.shape(stacks)[2:]], axis=0))
    return out
