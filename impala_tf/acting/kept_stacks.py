"""Frame stacks kept in the inference server, so that each frame travels from its actor once.

A policy whose env stacks frames (`frame_stacks`, from the env's `frame_stack`; Atari) has its
actors' stacks kept in the driver's `InferenceServer` (`impala_tf.acting.inference`), one
`KeptStacks` per policy (`impala_tf.models.frames` has the ring arithmetic). An actor first sends
its B envs' whole stacks [B, H, W, k * s] (and again after its envs were reset or restored),
then each step's newest frames [B, H, W, s] with `refills` bool [B], which says which envs
refilled their stacks (`BatchStep.stack_restarts`; the messages are in
`impala_tf.acting.inference_protocol`). Each env of a connection owns a ring of its last k
frames in a TensorFlow variable of the policy's; the serving graph writes the new frames,
gathers the stacks and runs the model on them, so the policy sees exactly the stacks the env
returned and the host copies no pixels. A connection's rings are freed when it closes: a
restarted actor's new connection holds none, and frames sent before whole stacks are refused
rather than read against another env's frames.
"""

from __future__ import annotations

from multiprocessing import connection
from typing import Any

import numpy as np

from impala_tf.acting.inference_protocol import Request

__all__ = ["KeptStacks"]


class KeptStacks:
    """One policy's frame stacks, kept for the actors' envs inside TensorFlow.

    Each env of a connection owns a slot: a ring of its last k frames, rows `slot * k .. slot *
    k + k - 1` of one variable [slots * k, H, W, s]. A request's whole stacks are written as
    their k frames; a request's new frames are written once each, and the stacks the model acts
    on are gathered from the rings, in the same graph (`forward`). The host keeps each slot's
    ring position and frames since its refill (`impala_tf.models.frames.ring_step_np`): integers, no
    pixels. Only the server thread uses it.

    Args:
      policy: The policy's `ActorPolicy` (the server's own copy).
      frame_stack: (k, s): k frames of s channels per stack.
    """

    def __init__(self, policy: Any, frame_stack: tuple[int, int]):
        import tensorflow as tf  # The driver's: only a server with frame stacks builds this.

        from impala_tf.models import frames as frames_lib

        k, channels = frame_stack
        shape = tuple(int(d) for d in policy.observation_space.shape)
        if len(shape) != 3 or shape[-1] != k * channels:
            raise ValueError(
                f"a frame stack of {k} frames of {channels} channels does not fit observations "
                f"of shape {shape} ([H, W, k * s] expected)"
            )
        self.k = k
        self.shape = shape
        self.frame_shape = (*shape[:2], channels)
        self.dtype = np.dtype(policy.observation_space.dtype)
        # On a GPU uint8 frames are kept as float16, exactly (every uint8 value is a float16
        # integer): TensorFlow's GPU scatter for integer types copies the whole variable to the
        # host and back, its float16 one writes the rows in device memory.
        on_gpu = bool(tf.config.list_logical_devices("GPU"))
        wide = on_gpu and self.dtype == np.uint8
        storage = tf.float16 if wide else tf.as_dtype(self.dtype)
        self._tf, self._ring_step = tf, frames_lib.ring_step_np
        self._ring = tf.Variable(
            tf.zeros((0, *self.frame_shape), storage),
            shape=(None, *self.frame_shape),
            trainable=False,
        )
        self._regions: dict[connection.Connection, tuple[int, int]] = {}  # conn: (slot, B)
        self._loaded: set[connection.Connection] = set()  # Rings holding the actors' frames.
        self._free: list[tuple[int, int]] = []
        self._end = 0  # Slots given to regions so far.
        self._newest = np.zeros(0, np.int64)  # Per slot: its newest frame's ring position.
        self._age = np.zeros(0, np.int64)  # Per slot: frames since its refill (at most k - 1).
        model, obs_dtype = policy.model, tf.as_dtype(self.dtype)

        def step(whole, keep, load_rows, frames, write_rows, read_rows, state):
            loads = frames_lib.split_stacks(tf.boolean_mask(whole, keep), k)
            loads = tf.reshape(loads, (-1, *self.frame_shape))
            self._ring.scatter_update(tf.IndexedSlices(tf.cast(loads, storage), load_rows))
            self._ring.scatter_update(tf.IndexedSlices(tf.cast(frames, storage), write_rows))
            stacks = frames_lib.join_frames(tf.gather(self._ring, read_rows))
            obs = tf.concat([whole, tf.cast(stacks, obs_dtype)], axis=0)
            return model.step(obs, state)

        state_specs = tuple(
            tf.TensorSpec((None, *s.shape[1:]), s.dtype) for s in model.initial_state(1)
        )
        self._step = tf.function(
            step,
            input_signature=(
                tf.TensorSpec((None, *shape), obs_dtype),
                tf.TensorSpec((None,), tf.bool),
                tf.TensorSpec((None,), tf.int64),
                tf.TensorSpec((None, *self.frame_shape), obs_dtype),
                tf.TensorSpec((None,), tf.int64),
                tf.TensorSpec((None, k), tf.int64),
                state_specs,
            ),
            autograph=False,
        )

    def check(self, conn: connection.Connection, obs: np.ndarray, refills: Any) -> Any:
        """Raises ValueError unless `obs` are whole stacks (`refills` None) or the newest frames
        of the envs whose stacks `conn` had kept; returns `refills` as a bool array (or None)."""
        if obs.dtype != self.dtype:
            raise ValueError(f"frames of dtype {obs.dtype}; the env's are {self.dtype}")
        if refills is None:
            if tuple(obs.shape[1:]) != self.shape:
                raise ValueError(
                    f"stacks of shape {tuple(obs.shape[1:])} to keep, the env's are {self.shape}"
                )
            return None
        refills = np.asarray(refills)
        if refills.dtype != bool or refills.shape != obs.shape[:1]:
            raise ValueError(
                f"refills of dtype {refills.dtype} and shape {refills.shape} for {len(obs)} "
                "frames (bool, one per frame expected)"
            )
        if tuple(obs.shape[1:]) != self.frame_shape:
            raise ValueError(
                f"frames of shape {tuple(obs.shape[1:])}, the env's are {self.frame_shape}"
            )
        region = self._regions.get(conn)
        if conn not in self._loaded or region is None:
            raise ValueError(
                "frames before whole stacks: the server keeps no stacks for this connection "
                "(a new or restarted actor, or one whose request failed, sends its stacks whole "
                "first)"
            )
        if region[1] != len(obs):
            raise ValueError(f"{len(obs)} frames for the {region[1]} envs whose stacks are kept")
        return refills

    def forward(self, requests: list[Request], state: tuple) -> tuple:
        """Updates the requests' kept stacks and runs the model on the stacks; numpy results.

        `requests` come whole observations first (kept or not), frames last.
        """
        k, tf = self.k, self._tf
        whole = [r for r in requests if r.kept != "frames"]
        framed = [r for r in requests if r.kept == "frames"]
        loads = [r for r in whole if r.kept == "stacks"]
        for r in loads:
            self._loaded.discard(r.conn)  # Until the graph has written them.
        load_slots = _rows_or_empty([self._slots(r.conn, len(r.obs)) for r in loads], (0,))
        self._newest[load_slots] = k - 1  # A whole stack fills its ring in order.
        self._age[load_slots] = k - 1
        slots = _rows_or_empty([self._slots(r.conn, len(r.obs)) for r in framed], (0,))
        newest, age, positions = self._ring_step(
            self._newest[slots],
            self._age[slots],
            _rows_or_empty([r.refills for r in framed], (0,), bool),
            k,
        )
        self._newest[slots], self._age[slots] = newest, age
        keep = [np.full(len(r.obs), r.kept == "stacks") for r in whole]
        logits, values, new_state = self._step(
            _rows_or_empty([r.obs for r in whole], (0, *self.shape), self.dtype),
            _rows_or_empty(keep, (0,), bool),
            (load_slots[:, None] * k + np.arange(k)).reshape(-1),
            _rows_or_empty([r.obs for r in framed], (0, *self.frame_shape), self.dtype),
            slots * k + newest,
            slots[:, None] * k + positions,
            tuple(tf.convert_to_tensor(s) for s in state),
        )
        self._loaded.update(r.conn for r in loads)
        return logits.numpy(), values.numpy(), tuple(s.numpy() for s in new_state)

    def forget(self, requests: list[Request]) -> None:
        """After a failed pass: the requesters' kept stacks are unknown (refused until resent)."""
        for r in requests:
            if r.kept:
                self._loaded.discard(r.conn)

    def release(self, conn: connection.Connection) -> None:
        """Frees a closed connection's slots for the next connection that needs as many."""
        self._loaded.discard(conn)
        region = self._regions.pop(conn, None)
        if region is not None:
            self._free.append(region)

    def _slots(self, conn: connection.Connection, n: int) -> np.ndarray:
        """int64 [n]: the slots of `conn`'s n envs (allocated on its first whole stacks)."""
        region = self._regions.get(conn)
        if region is None or region[1] != n:
            self.release(conn)
            region = self._allocate(n)
            self._regions[conn] = region
        return np.arange(region[0], region[0] + n, dtype=np.int64)

    def _allocate(self, n: int) -> tuple[int, int]:
        for i, region in enumerate(self._free):
            if region[1] == n:
                return self._free.pop(i)
        first, self._end = self._end, self._end + n
        capacity = len(self._newest)
        if self._end > capacity:  # Grows by doubling: rare, outside the serving graph.
            more = max(capacity, self._end - capacity)
            tf = self._tf
            zeros = tf.zeros((more * self.k, *self.frame_shape), self._ring.dtype)
            self._ring.assign(tf.concat([self._ring, zeros], axis=0))
            self._newest = np.concatenate([self._newest, np.zeros(more, np.int64)])
            self._age = np.concatenate([self._age, np.zeros(more, np.int64)])
        return first, n


def _rows_or_empty(parts: list[np.ndarray], empty: tuple, dtype: Any = np.int64) -> np.ndarray:
    """The parts' rows one after the other; an empty array of shape `empty` when none."""
    if not parts:
        return np.zeros(empty, dtype)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)
