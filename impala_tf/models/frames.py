"""Frame stacks rebuilt inside TensorFlow graphs (the learner's, the inference server's): each
frame travels once, and is never decoded on the host.

B is batch (env sequences), T is time (`rollout_fragment_length`), H x W an image, and a stacked
observation has C = k * s channels: k frames of s channels each (s = 1 gray, 3 colour), oldest
first, newest last, as RLlib's `framestack` (DeepMind's `FrameStack(env, 4)`) builds them. Within
an episode the stack at step t + 1 is the stack at t shifted by one frame, and a reset fills the
stack with k copies of its first frame.

An env that stacks frames so says it (`frame_stack = (k, s)`: `impala_tf.envs.atari`'s
preprocessing and ale-py's vector env, `impala_tf.envs.atari_vector`), and reports each step
where it refilled a stack (`BatchStep.stack_restarts`: a new game, or a serve after a lost life).
Its env runner then does not store stacked observations; it stores, per env sequence,

* `obs_frames` uint8 [B, T + k - 1, H, W, s]: the k frames of the stack at t = 0, then the
  newest frame of each step t >= 1 (so the newest frame of step t is at t + k - 1);
* `obs_restarts` bool [B, T]: True at a step t >= 1 whose stack was refilled (False at t = 0,
  whose stack is stored whole).

The stack at step t is frames t .. t + k - 1, each position clamped to no earlier than the
newest frame of the last refill at or before t (r + k - 1 for a refill at step r >= 1), which is
the refill's k copies. `rebuild_stacks` does that with one gather in TensorFlow, in the learner's
train step (`ImpalaLearner.time_major`); no actor, aggregation worker or driver decodes frames,
and a train batch moves about 1/k of the bytes of its stacked observations from the actor to the
learner device. `rebuild_stacks_np` is the same in numpy, for tests and tools.
`obs_frames` is a per-sequence column (`impala_tf.data.sample_batch.is_per_sequence_column`): row
operations (replay, batch cutting, device shards) carry it like a recurrent state column.

Acting: per-actor inference and evaluation act on the env's own stacks (no work added). With
central inference (`impala_tf.acting.kept_stacks`) an actor sends the driver's inference server its
envs' stacks whole once, then only each step's newest frames [B, H, W, s] with the refills
(`BatchStep.stack_restarts`), about 1/k of the bytes. The server keeps each env's last k frames
as a ring in a TensorFlow variable and, inside its serving graph, writes the new frames and
gathers each stack's k frames (`split_stacks`, `join_frames`); the host only moves ring
positions (`ring_step_np`, the same clamping as `stack_positions_np`), so the policy sees
exactly the stacks the env returned. Envs that do not declare a frame stack send `obs` as they
are, to the learner and to the server.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

__all__ = [
    "join_frames",
    "rebuild_stacks",
    "rebuild_stacks_np",
    "ring_step_np",
    "split_stacks",
    "stack_positions_np",
]


def stack_positions_np(restarts: np.ndarray, k: int) -> np.ndarray:
    """int [B, T, k]: the `obs_frames` position of each slot of each step's stack."""
    b, t = restarts.shape
    steps = np.arange(t)
    last = np.where(restarts, steps, 0)
    last = np.maximum.accumulate(last, axis=1)  # The last refill at or before t (0: none).
    lower = np.where(last > 0, last + k - 1, 0)
    positions = steps[:, None] + np.arange(k)[None, :]  # [T, k]
    return np.maximum(positions[None], lower[:, :, None])


def rebuild_stacks_np(frames: np.ndarray, restarts: np.ndarray) -> np.ndarray:
    """[B, T, H, W, k * s] stacked observations from `obs_frames` and `obs_restarts`."""
    b, t = restarts.shape
    k = frames.shape[1] - t + 1
    positions = stack_positions_np(np.asarray(restarts, bool), k)
    gathered = frames[np.arange(b)[:, None, None], positions]  # [B, T, k, H, W, s]
    h, w, s = frames.shape[2:]
    return np.ascontiguousarray(np.moveaxis(gathered, 2, 4)).reshape(b, t, h, w, k * s)


def rebuild_stacks(frames: tf.Tensor, restarts: tf.Tensor) -> tf.Tensor:
    """[B, T, H, W, k * s] stacked observations, in the graph (see the module docstring).

    Args:
      frames: uint8 [B, T + k - 1, H, W, s], the `obs_frames` column.
      restarts: bool [B, T], the `obs_restarts` column.

    Returns:
      The stacks, in `frames`' dtype, exactly as the env returned them.
    """
    frames = tf.convert_to_tensor(frames)
    restarts = tf.cast(restarts, tf.bool)
    t = tf.shape(restarts)[1]
    k = tf.shape(frames)[1] - t + 1
    steps = tf.range(t)
    # The last refill at or before each step (0: none): a running max over a [T, T] mask.
    earlier = steps[None, :] <= steps[:, None]  # [T (step), T (candidate)]
    marked = tf.where(restarts, steps[None, :], 0)  # [B, T]
    last = tf.reduce_max(tf.where(earlier[None], marked[:, None, :], 0), axis=2)  # [B, T]
    lower = tf.where(last > 0, last + k - 1, 0)
    positions = steps[:, None] + tf.range(k)[None, :]  # [T, k]
    positions = tf.maximum(positions[None], lower[:, :, None])  # [B, T, k]
    gathered = tf.gather(frames, positions, axis=1, batch_dims=1)  # [B, T, k, H, W, s]
    stacks = tf.transpose(gathered, [0, 1, 3, 4, 2, 5])  # [B, T, H, W, k, s]
    shape = tf.shape(stacks)
    out = tf.reshape(stacks, tf.concat([shape[:4], [shape[4] * shape[5]]], axis=0))
    # Static shapes, where known, for the model that follows.
    b, f, h, w, s = frames.shape
    steps_static = restarts.shape[1]
    k_static = None if f is None or steps_static is None else f - steps_static + 1
    channels = None if k_static is None or s is None else k_static * s
    out.set_shape([b, steps_static, h, w, channels])
    return out


# Stacks kept as rings of frames (the inference server's) ----------------------------------------


def ring_step_np(
    newest: np.ndarray, age: np.ndarray, refills: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One env step of stacks kept as rings of k frames: where each new frame goes, and where
    the k frames of each new stack are.

    Args:
      newest: int [N], the ring position (0 .. k - 1) of each stack's newest frame.
      age: int [N], the frames each stack holds since its last refill, at most k - 1.
      refills: bool [N], True where the env refilled the stack with its new frame.
      k: Frames per stack.

    Returns:
      (newest, age) after the step (the new frame goes to ring position `newest`), and the ring
      positions of each new stack's frames, int [N, k], oldest first: as `stack_positions_np`,
      no earlier than the last refill's frame, which stands for the frames before it.
    """
    newest = (np.asarray(newest) + 1) % k
    age = np.where(refills, 0, np.minimum(np.asarray(age) + 1, k - 1))
    back = np.minimum(np.arange(k - 1, -1, -1)[None, :], age[:, None])  # Steps back per slot.
    return newest, age, (newest[:, None] - back) % k


def split_stacks(stacks: tf.Tensor, k: int) -> tf.Tensor:
    """[N, H, W, k * s] stacks -> [N, k, H, W, s], their frames, oldest first."""
    h, w, c = stacks.shape[1:]
    frames = tf.reshape(stacks, [-1, h, w, k, c // k])
    return tf.transpose(frames, [0, 3, 1, 2, 4])


def join_frames(frames: tf.Tensor) -> tf.Tensor:
    """[N, k, H, W, s] frames, oldest first -> [N, H, W, k * s] stacks (`split_stacks` undone)."""
    k, h, w, s = frames.shape[1:]
    return tf.reshape(tf.transpose(frames, [0, 2, 3, 1, 4]), [-1, h, w, k * s])
