"""Frame-stack coding of image observations: each frame travels once.

B is batch (env sequences), T is time, H x W an image, C = k * s channels: a stack of k frames
of s channels each (s = 1 for grayscale, 3 for RGB), the newest last, as DeepMind's FrameStack
and RLlib's `framestack` build them. Within an episode the stack at step t + 1 is the stack at t
shifted by one frame, so of the k frames in each observation only the newest is new:

    obs[b, t + 1][..., :-s] == obs[b, t][..., s:]

`encode_frame_stacks` turns a fragment's `obs` [B, T, H, W, C] into a `FrameStackColumn`: a
keyframe mask [B, T] (True where the stack does not follow from the previous step: t = 0, an
episode start, or any env whose observations do not shift), the full stacks at keyframes, and
only the newest frame [H, W, s] everywhere else. The shift is checked on the sending side, so the
coding is exact for every env; when it does not pay (no shifting stacks) the observations travel
as they are. A Pong fragment (k = 4, T = 50) then costs about 1/4 of its stacked bytes.

`encode_observations` is what an actor applies to a fragment before sending it: frame-stack
coding where it applies, then zlib (`compress_observations`) on what is left. Receivers unpack
with `impala_tf.sample_batch.decompress`, the one decoding function.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from impala_tf.sample_batch import (
    OBS,
    CompressedColumn,
    EncodedColumn,
    SampleBatch,
    compress,
)

__all__ = ["FrameStackColumn", "encode_frame_stacks", "encode_observations"]

#: Frame-stack coding is used only when it shrinks the observations to this fraction or less;
#: otherwise (e.g. k = 1, or an env whose stacks never shift) they travel unchanged.
_MAX_CODED_FRACTION = 0.9

#: Channels per frame tried, in order: grayscale frames, then RGB frames.
_FRAME_CHANNELS = (1, 3)


#: Stacks of C one-byte channels that fit one machine word: coded with integer shifts, C times
#: faster than comparing strided channel slices.
_WORDS = {2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


def _words(obs: np.ndarray) -> np.ndarray | None:
    """obs [..., C] uint8 as little-endian words [...] (channel i = byte i), or None."""
    word = _WORDS.get(obs.shape[-1])
    if word is None or not obs.flags.c_contiguous:
        return None
    return obs.view(word)[..., 0]


def _packed(array: np.ndarray, zlib_level: int | None) -> np.ndarray | CompressedColumn:
    if zlib_level is None:
        return array
    return compress(SampleBatch({"x": array}), ("x",), zlib_level)["x"]


def _unpacked(part: np.ndarray | CompressedColumn) -> np.ndarray:
    return part.decode() if isinstance(part, CompressedColumn) else part


@dataclass(frozen=True)
class FrameStackColumn(EncodedColumn):
    """Stacked image observations [B, T, H, W, C] with each frame stored once.

    Attributes:
        shape: (B, T, H, W, C) of the original observations.
        dtype: `numpy.dtype.str` of the original observations ("|u1").
        frame_channels: s, the channels of one frame (C = k * s).
        keyframe_mask: bool [B, T]; True where the full stack is stored (always at t = 0).
        keyframes: [K, H, W, C] full stacks at the keyframes, in (b, t) row-major order; an
            ndarray, or a `CompressedColumn` of it when zlib composes with the coding.
        new_frames: [M, H, W, s] the newest frame at every other step (M = B*T - K), same
            order and packing as `keyframes`.
    """

    shape: tuple[int, ...]
    dtype: str
    frame_channels: int
    keyframe_mask: np.ndarray
    keyframes: np.ndarray | CompressedColumn
    new_frames: np.ndarray | CompressedColumn

    @property
    def nbytes(self) -> int:
        """Bytes of the mask, the keyframes and the new frames (as packed)."""
        return int(self.keyframe_mask.nbytes) + sum(
            part.nbytes for part in (self.keyframes, self.new_frames)
        )

    def decode(self) -> np.ndarray:
        """Rebuilds the exact stacked observations [B, T, H, W, C]."""
        b, t = self.shape[:2]
        s = self.frame_channels
        keyframes = _unpacked(self.keyframes)
        new_frames = _unpacked(self.new_frames)
        mask = self.keyframe_mask
        # Index of each position's entry in `keyframes` / `new_frames` (row-major (b, t) order).
        key_index = (np.cumsum(mask.reshape(-1)) - 1).reshape(b, t)
        new_index = (np.cumsum(~mask.reshape(-1)) - 1).reshape(b, t)
        out = np.empty(self.shape, np.dtype(self.dtype))
        words = _words(out) if s == 1 else None
        if words is not None:
            # Stack at t = stack at t - 1 moved down one byte, the new frame in the top byte.
            top = 8 * (self.shape[-1] - 1)
            new_words = new_frames[..., 0].astype(words.dtype) << words.dtype.type(top)
            for step in range(t):
                key = mask[:, step]
                if key.any():
                    out[key, step] = keyframes[key_index[key, step]]
                shifted = ~key
                if shifted.any():
                    words[shifted, step] = (
                        words[shifted, step - 1] >> words.dtype.type(8)
                    ) | new_words[new_index[shifted, step]]
            return out
        for step in range(t):
            key = mask[:, step]
            if key.any():
                out[key, step] = keyframes[key_index[key, step]]
            shifted = ~key
            if shifted.any():
                # The previous step's frames move one frame older; the newest comes from the wire.
                out[shifted, step, ..., :-s] = out[shifted, step - 1, ..., s:]
                out[shifted, step, ..., -s:] = new_frames[new_index[shifted, step]]
        return out

    def __repr__(self) -> str:
        return (
            f"FrameStackColumn(shape={self.shape}, dtype={self.dtype}, "
            f"keyframes={int(self.keyframe_mask.sum())}/{self.keyframe_mask.size}, "
            f"bytes={self.nbytes})"
        )


def _shift_mask(obs: np.ndarray, s: int) -> np.ndarray:
    """bool [B, T]: True where obs[b, t] is NOT obs[b, t - 1] shifted by one s-channel frame."""
    b, t = obs.shape[:2]
    mask = np.ones((b, t), bool)
    if t < 2:
        return mask
    words = _words(obs) if s == 1 else None
    if words is not None:
        shift = words.dtype.type(8)
        keep = words.dtype.type((1 << (8 * (obs.shape[-1] - 1))) - 1)
        same = (words[:, 1:] & keep) == (words[:, :-1] >> shift)
    else:
        same = obs[:, 1:, ..., :-s] == obs[:, :-1, ..., s:]
    mask[:, 1:] = ~same.reshape(b, t - 1, -1).all(axis=2)
    return mask


def encode_frame_stacks(obs: np.ndarray, zlib_level: int | None = None) -> FrameStackColumn | None:
    """Codes stacked image observations so that each frame is stored once.

    Args:
        obs: uint8 [B, T, H, W, C], C a stack of frames along the last axis.
        zlib_level: also zlib-compress the keyframes and new frames at this level (1-9);
            None sends them raw.

    Returns:
        A `FrameStackColumn` that `decode`s to exactly `obs`, or None when the coding does not
        apply (not uint8 [B, T, H, W, C] with C >= 2) or would not shrink the data to 90% or
        less (the stacks do not shift from step to step).
    """
    if not isinstance(obs, np.ndarray) or obs.dtype != np.uint8 or obs.ndim != 5:
        return None
    b, t, _, _, c = obs.shape
    best: tuple[int, int, np.ndarray] | None = None
    for s in _FRAME_CHANNELS:
        if c <= s or c % s:
            continue
        mask = _shift_mask(obs, s)
        keys = int(mask.sum())
        cost = keys * c + (mask.size - keys) * s  # Channels sent, per H x W.
        if best is None or cost < best[0]:
            best = (cost, s, mask)
    if best is None or best[0] > _MAX_CODED_FRACTION * b * t * c:
        return None
    _, s, mask = best
    return FrameStackColumn(
        shape=tuple(obs.shape),
        dtype=obs.dtype.str,
        frame_channels=s,
        keyframe_mask=mask,
        keyframes=_packed(np.ascontiguousarray(obs[mask]), zlib_level),
        new_frames=_packed(np.ascontiguousarray(obs[..., -s:][~mask]), zlib_level),
    )


def encode_observations(
    batch: SampleBatch, *, compress_observations: bool, zlib_level: int = 1
) -> SampleBatch:
    """Packs a fragment's observations for transport; `sample_batch.decompress` undoes it.

    Stacked uint8 image observations [B, T, H, W, C] are frame-stack coded (see the module
    docstring); with `compress_observations` (RLlib's key) the result, or the plain `obs` column
    where the coding does not apply, is also zlib-compressed.

    Args:
        batch: a fragment, per-step columns [B, T, ...]; left unchanged.
        compress_observations: zlib-compress the observations too.
        zlib_level: zlib level for `compress_observations`, 1 (fastest) to 9.

    Returns:
        A SampleBatch sharing every other column with `batch`.
    """
    obs = batch.get(OBS)
    if not isinstance(obs, np.ndarray):
        return batch  # Absent or already packed.
    coded = encode_frame_stacks(obs, zlib_level if compress_observations else None)
    if coded is not None:
        out = SampleBatch(batch)
        out[OBS] = coded
        return out
    return compress(batch, (OBS,), zlib_level) if compress_observations else batch
