"""Sets of arrays written once into shared memory and read by any local process (weights).

A weight broadcast to local worker processes used to pickle the weights once per worker into
its command pipe (4 MB per actor for the Pong CNN: 128 actors cost the driver 128 pickles and
512 MB of pipe writes per broadcast). Here the driver writes each set once into a POSIX shared
memory segment and sends every worker a small handle (`SharedArrays`: the segment's name and
layout, a slot, a sequence number); a worker copies the arrays out when it applies them, which
with coalescing (`impala_tf.workers.host`) is only for the newest handle it holds.

Layout. `ArrayRing` is one segment of `num_slots` slots for one writer and any number of
readers. Every set written has the ring's layout (the shapes and dtypes of the first set: a
policy's weights never change shape), each array at a 64-byte aligned offset of its slot. A
header holds, per slot, three int64: `begin` (the sequence number of the write in progress or
last started), `version` (a number written with the set: the policy's `num_grad_updates`) and
`end` (the sequence number of the last write finished). Write number s (1, 2, ...) goes to slot
s % num_slots.

Why a reader never gets a torn or mixed set, whatever the timing (a seqlock per slot):

* the writer stores `begin = s`, then the arrays and the version, then `end = s`;
* a reader loads `end` (e), copies the arrays and the version, then loads `begin` (b), and keeps
  the copy only if b == e. A write that overlapped the copy in any way stored its `begin` (a
  larger s, sequence numbers never repeat) before touching the arrays, so the later load of
  `begin` sees it and b != e; and e is only ever the number of a finished write, whose arrays
  were all stored before it. So a kept copy is exactly the set of write e, untorn.
* a copy that is not kept means that the ring came round to the slot while the reader was late
  (it applied a handle `num_slots` or more writes old). The reader then copies the slot with the
  largest `end`, the newest finished set, which the writer reaches again only after
  `num_slots - 1` further writes, and checks it the same way. It so gets a newer set than its
  handle named, never an older or a mixed one, and the version read with it says which (an
  actor records that version in its fragments; newer weights are what coalescing prefers
  anyway). A reader that keeps losing the race raises after `_MAX_TRIES` copies rather than
  spinning. Lockstep (deterministic) runs are never late: their one actor reads its handle
  before it next samples, and the driver writes at most two sets meanwhile (a restart's and a
  step's), fewer than `DEFAULT_SLOTS`, so they read exactly what was sent.

The argument needs the stores of one process to become visible to others in program order and
a process's loads not to be reordered with each other: x86-64 guarantees both (TSO), and Python
offers no memory fence to guarantee them elsewhere. Nothing depends on the reader's speed: no
lock is held (a reader killed mid-copy blocks nobody), and the writer never waits.

Lifetime. The driver creates each segment and is its only owner: `ArrayRing.close` unmaps and
unlinks it (the driver's stop, its error paths, the first signal's orderly shutdown). Readers
attach by name on first use, read-only, with no file descriptor kept and without registering
with the resource tracker (a reader's registration could outlive the driver's unlink and be
reported as a leak), and keep the mapping (an unlinked segment lives until its last mapping
goes, so a late reader is safe while the writer stops). A worker that dies holds no segment.
A driver that dies without closing (SIGKILL, or a second signal's immediate exit) leaves the
names to Python's resource tracker, which unlinks them when the driver and its children are
gone. The segment's pages are reserved when it is made (`posix_fallocate`): a full /dev/shm (a
container's 64 MB default) then fails there, cleanly, instead of with SIGBUS on a later write;
`ArrayRings.put` returns None then, and the caller sends those arrays by value.
"""

from __future__ import annotations

import _posixshmem
import collections
import contextlib
import logging
import mmap
import os
import secrets
from collections.abc import Mapping, Sequence
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from impala_tf.utils.shutdown import uninterrupted
from impala_tf.workers.protocol import StoredValue

__all__ = [
    "NO_ROOM_ADVICE",
    "SEGMENT_PREFIX",
    "ArrayRing",
    "ArrayRings",
    "SharedArrays",
    "SharedSets",
    "new_segment_name",
]

logger = logging.getLogger(__name__)

#: The names of every segment of a run start so (in /dev/shm on Linux), then the driver's pid.
SEGMENT_PREFIX = "impala_tf_"
#: What a warning about a full /dev/shm advises.
NO_ROOM_ADVICE = "Give the machine or container more (docker run --shm-size)."
#: Slots per ring: a reader more than this many writes late reads a newer set (module docstring).
DEFAULT_SLOTS = 4
#: Copies a reader tries before giving up (each lost only to a write that overlapped it).
_MAX_TRIES = 100
#: Alignment of the header, each slot and each array in a slot.
_ALIGN = 64
#: Header columns per slot.
_BEGIN, _VERSION, _END = 0, 1, 2
#: Segments attached in this process, by name, most recent last (readers).
_ATTACHED: collections.OrderedDict[str, _Mapping] = collections.OrderedDict()
#: The most segments a reader keeps attached (one per policy is the common case).
_MAX_ATTACHED = 16


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def new_segment_name() -> str:
    """A fresh segment name: `SEGMENT_PREFIX`, this process's pid (the driver's), a random token
    (`impala_tf.workers.shared_values` appends a call id)."""
    return f"{SEGMENT_PREFIX}{os.getpid()}_{secrets.token_hex(4)}"


class _Layout:
    """Where everything lies in one ring's segment (pickled into every handle: small)."""

    __slots__ = ("arrays", "name", "num_slots", "size", "slot_bytes")

    def __init__(self, name: str, num_slots: int, template: Sequence[np.ndarray]):
        offset, arrays = 0, []
        for a in template:
            arrays.append((offset, tuple(a.shape), a.dtype.str))
            offset = _aligned(offset + a.nbytes)
        self.name = name
        self.num_slots = int(num_slots)
        self.arrays = tuple(arrays)
        self.slot_bytes = max(_ALIGN, offset)
        self.size = self.header_bytes + self.num_slots * self.slot_bytes

    @property
    def header_bytes(self) -> int:
        return _aligned(self.num_slots * 3 * 8)

    def __getstate__(self):
        return (self.name, self.num_slots, self.arrays, self.slot_bytes, self.size)

    def __setstate__(self, state):
        self.name, self.num_slots, self.arrays, self.slot_bytes, self.size = state

    def matches(self, arrays: Sequence[np.ndarray]) -> bool:
        return len(arrays) == len(self.arrays) and all(
            tuple(a.shape) == shape and a.dtype.str == dtype
            for a, (_, shape, dtype) in zip(arrays, self.arrays)
        )


class _Mapping:
    """A segment mapped into this process: the header and each slot's array views.

    Args:
      layout: The ring's layout.
      buffer: The mapped segment (read-only for readers).
      owner: What to close once the views are gone (a `SharedMemory` or an `mmap`).
    """

    def __init__(self, layout: _Layout, buffer: Any, owner: Any):
        self.owner = owner
        start = layout.header_bytes
        self.header = np.ndarray((layout.num_slots, 3), np.int64, buffer, 0)
        self.slots = [
            [
                np.ndarray(shape, np.dtype(dtype), buffer, start + i * layout.slot_bytes + offset)
                for offset, shape, dtype in layout.arrays
            ]
            for i in range(layout.num_slots)
        ]

    def close(self) -> None:
        """Unmaps the segment (the views go first: a mapping with views cannot close)."""
        self.header = None
        self.slots = []
        self.owner.close()


def _describe(layout: list[tuple[tuple, str]]) -> str:
    return "[" + ", ".join(f"{np.dtype(dtype).name}{list(shape)}" for shape, dtype in layout) + "]"


def _copy_views(views: list[np.ndarray]) -> list[np.ndarray]:
    """Private copies of one slot's arrays (a module function: tests pause a copy halfway)."""
    return [v.copy() for v in views]


def _attach(layout: _Layout) -> _Mapping:
    """Maps `layout`'s segment read-only (see "Lifetime" in the module docstring)."""
    fd = _posixshmem.shm_open("/" + layout.name, os.O_RDONLY, mode=0o600)
    try:
        mm = mmap.mmap(fd, layout.size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    return _Mapping(layout, mm, mm)


def _attached(layout: _Layout) -> _Mapping:
    """This process's mapping of `layout`'s segment, attached on first use."""
    mapping = _ATTACHED.get(layout.name)
    if mapping is None:
        mapping = _ATTACHED[layout.name] = _attach(layout)
        while len(_ATTACHED) > _MAX_ATTACHED:
            _ATTACHED.popitem(last=False)[1].close()
    else:
        _ATTACHED.move_to_end(layout.name)
    return mapping


class SharedArrays(StoredValue):
    """A handle on one set written into an `ArrayRing`: what a worker's message carries.

    Attributes:
      layout: The ring's name and layout.
      slot: The slot the set was written to.
      seq: The write's sequence number.
    """

    __slots__ = ("layout", "seq", "slot")

    def __init__(self, layout: _Layout, slot: int, seq: int):
        self.layout = layout
        self.slot = int(slot)
        self.seq = int(seq)

    def __getstate__(self):
        return (self.layout, self.slot, self.seq)

    def __setstate__(self, state):
        self.layout, self.slot, self.seq = state

    def get(self) -> tuple[list[np.ndarray], int]:
        """(private copies of the arrays, the version written with them).

        The set of this handle's write, or a newer one of the same ring when the ring came
        round to its slot meanwhile (see the module docstring); never a torn or mixed set.

        Raises:
          RuntimeError: `_MAX_TRIES` copies in a row overlapped a write.
          FileNotFoundError: The ring was closed before this process first attached to it.
        """
        mapping = _attached(self.layout)
        header, slot = mapping.header, self.slot
        for _ in range(_MAX_TRIES):
            end = int(header[slot, _END])
            arrays = _copy_views(mapping.slots[slot])
            version = int(header[slot, _VERSION])
            if int(header[slot, _BEGIN]) == end:
                return arrays, version
            slot = int(np.argmax(header[:, _END]))  # The newest finished set.
        raise RuntimeError(
            f"shared arrays {self.layout.name}: {_MAX_TRIES} copies in a row overlapped a write "
            f"(the writer outruns this reader by {self.layout.num_slots} slots per copy)"
        )


class SharedSets(StoredValue):
    """{key: `SharedArrays` handle or (arrays, version)}: what `ArrayRings.share` sends.

    A call argument that the worker host resolves before the call runs (`get()`): a coalesced
    broadcast overtaken by a newer one is never read.
    """

    __slots__ = ("items",)

    def __init__(self, items: dict[str, Any]):
        self.items = items

    def __getstate__(self):
        return self.items

    def __setstate__(self, state):
        self.items = state

    def get(self) -> dict[str, tuple[list[np.ndarray] | None, int]]:
        """{key: (private copies of the arrays, version)} (see `SharedArrays.get`)."""
        return {
            key: value.get() if isinstance(value, SharedArrays) else value
            for key, value in self.items.items()
        }


class ArrayRing:
    """One writer's ring of `num_slots` array sets of a fixed layout (module docstring).

    Args:
      template: Arrays whose shapes and dtypes every set written must have.
      num_slots: Slots (at least 2).

    Raises:
      OSError: The segment could not be made or its pages reserved (no room in /dev/shm).
    """

    def __init__(self, template: Sequence[np.ndarray], num_slots: int = DEFAULT_SLOTS):
        if num_slots < 2:
            raise ValueError(f"num_slots={num_slots}: a ring needs at least 2 slots")
        template = [np.asarray(a) for a in template]
        layout = _Layout(new_segment_name(), num_slots, template)
        with uninterrupted():  # Made and registered with the resource tracker, or neither.
            shm = shared_memory.SharedMemory(layout.name, create=True, size=layout.size)
        try:
            if hasattr(os, "posix_fallocate"):  # Reserve the pages now: ENOSPC, not SIGBUS.
                os.posix_fallocate(shm._fd, 0, layout.size)
            self._mapping = _Mapping(layout, shm.buf, shm)
        except BaseException:
            shm.close()
            shm.unlink()
            raise
        self.layout = layout
        self._seq = 0
        self._closed = False

    @property
    def name(self) -> str:
        """The segment's name (`/dev/shm/<name>` on Linux)."""
        return self.layout.name

    @property
    def nbytes(self) -> int:
        """The segment's size in bytes."""
        return self.layout.size

    def write(self, arrays: Sequence[np.ndarray], version: int) -> SharedArrays:
        """Writes one set into the next slot; returns its handle.

        Args:
          arrays: The set, with the ring's layout (copied; the caller keeps them).
          version: An integer stored with it (weights: `num_grad_updates`).

        Raises:
          ValueError: `arrays` have other shapes or dtypes than the ring's.
        """
        if self._closed:
            raise RuntimeError(f"shared arrays {self.name}: the ring was closed")
        arrays = [np.asarray(a) for a in arrays]
        if not self.layout.matches(arrays):
            got = [(a.shape, a.dtype.str) for a in arrays]
            held = [(shape, dtype) for _, shape, dtype in self.layout.arrays]
            raise ValueError(
                f"shared arrays {self.name}: got arrays {_describe(got)}, the ring holds "
                f"{_describe(held)} (a policy's weights keep their shapes and dtypes)"
            )
        self._seq += 1
        slot = self._seq % self.layout.num_slots
        row = self._mapping.header[slot]
        row[_BEGIN] = self._seq
        for view, a in zip(self._mapping.slots[slot], arrays):
            np.copyto(view, a, casting="no")
        row[_VERSION] = int(version)
        row[_END] = self._seq
        return SharedArrays(self.layout, slot, self._seq)

    def close(self) -> None:
        """Unmaps and unlinks the segment (readers already attached keep their mapping). Safe
        to call twice."""
        with uninterrupted():  # Closed, unlinked and unregistered, or not closed.
            if self._closed:
                return
            self._closed = True
            shm = self._mapping.owner
            self._mapping.close()
            with contextlib.suppress(FileNotFoundError):  # Unlinked by someone else already.
                shm.unlink()


class ArrayRings:
    """One `ArrayRing` per key (weights: per policy), made on the first `put` of that key.

    Args:
      num_slots: Slots of each ring.
    """

    def __init__(self, num_slots: int = DEFAULT_SLOTS):
        self.num_slots = int(num_slots)
        self._rings: dict[str, ArrayRing | None] = {}  # None: no room, sent by value.
        self._last: dict[str, tuple[Sequence[np.ndarray], int, SharedArrays]] = {}

    def put(self, key: str, arrays: Sequence[np.ndarray], version: int) -> SharedArrays | None:
        """Writes `arrays` into `key`'s ring; returns the handle, or None when shared memory
        has no room for that ring (the caller sends the arrays by value; warned once).

        The same `arrays` object with the same version as the last put of `key` is not
        written again (a policy re-sent unchanged): its handle is returned.
        """
        last = self._last.get(key)
        if last is not None and last[0] is arrays and last[1] == version:
            return last[2]
        if key not in self._rings:
            try:
                self._rings[key] = ArrayRing(arrays, self.num_slots)
            except OSError as e:
                self._rings[key] = None
                size = sum(np.asarray(a).nbytes for a in arrays) * self.num_slots
                logger.warning(
                    "The weights of %r go to each local actor by value (a pickle per actor): "
                    "shared memory has no room for %d slots of them (%.1f MB): %s. %s",
                    key,
                    self.num_slots,
                    size / 1e6,
                    e,
                    NO_ROOM_ADVICE,
                )
        ring = self._rings[key]
        if ring is None:
            return None
        handle = ring.write(arrays, version)
        self._last[key] = (arrays, version, handle)
        return handle

    def share(self, sets: Mapping[str, tuple[Sequence[np.ndarray] | None, int]]) -> SharedSets:
        """{key: (arrays or None, version)} as one small value to send to many workers.

        Each key's arrays are written into its ring (once, whatever the number of workers it
        goes to); a key without arrays, or without room in shared memory, is kept by value.
        `get()` in the worker gives back {key: (private copies of the arrays, version)}.
        """
        return SharedSets(
            {
                key: (arrays, version)
                if arrays is None or (handle := self.put(key, arrays, version)) is None
                else handle
                for key, (arrays, version) in sets.items()
            }
        )

    def names(self) -> list[str]:
        """The segments' names."""
        return [r.name for r in self._rings.values() if r is not None]

    def close(self) -> None:
        """Closes every ring. Safe to call twice."""
        self._last.clear()
        for ring in self._rings.values():
            if ring is not None:
                ring.close()
        self._rings.clear()
