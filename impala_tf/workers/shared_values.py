"""Values passed by reference between local processes through shared memory (fragments' batches).

The local-process store of `impala_tf.workers.WorkerGroup.call(..., parts=True)`, as Ray's
object store is the Ray one (`impala_tf.workers.ray_backend.RayStoredValue`). A worker process
whose call returns (head, body) writes the body into a POSIX shared memory segment and sends the
driver the head and a `SharedValue` handle (a name and a size); the driver passes the handle on
to another worker's call (an aggregation worker), which reads the body from the segment when the
call runs, or reads it itself (`get`). The body never passes through the driver's pipes or its
pickler: with aggregation workers the driver sees only the fragments' counts and episodes, and
the train batches (and the batches of the fragments it aggregates itself, when every
aggregation worker is at `max_requests_in_flight_per_aggregator_worker`).

Format. The body is pickled with protocol 5, its contiguous arrays as out-of-band buffers, and
written with one `writev`: a header (the number of parts and their sizes), the pickle stream,
then each buffer at a 64-byte aligned offset. A reader copies the segment with one `readv` into
memory of its own and unpickles the arrays as views of that copy: private, writable, one copy
each way, and no mapping to keep (plain reads and writes of a tmpfs file: a full /dev/shm fails
a write with ENOSPC, never with SIGBUS later). A body without out-of-band buffers (no arrays)
goes by value.

Names. The driver names every segment before the call is sent: `SEGMENT_PREFIX`, the driver's
pid, a token of the worker group and the call id (`SegmentStore.expect`), so it knows which
names a worker that dies mid-call may have made.

Lifetime: the driver alone removes segments. A worker registers the name with the driver's
resource tracker (inherited by every local worker process), then creates and fills the segment;
it never removes one, except one it failed to fill (no room), before it answers. A worker that
a handle was passed to empties the segment once it has read it (`ftruncate` to 0): freeing the
pages costs as much as a third of reading them, and so falls to that worker, not to the driver,
whose unlink of the empty segment is then cheap. The driver's `SegmentStore` removes (unlinks
and unregisters):

* a handle's segment when it is released (`SharedValue.release`: an aggregation worker answered
  the call it was passed to, or the driver or a learner's loader read it (a train batch,
  `impala_tf.driver.aggregation.BatchRef`), or it was dropped unread);
* the names of a worker's unanswered calls when the worker dies or is killed (a segment may have
  been made, or half made);
* every name it still holds when the group stops (the driver's stop, its error paths and the
  first signal's orderly shutdown).

Each removal is an unlink and then an unregistration, which a first signal does not cut in two
(`impala_tf.utils.shutdown.uninterrupted`): cut after the unlink, the name would stay registered
with no segment, and the tracker would report it as leaked at exit.

A driver that dies without stopping (SIGKILL, or a second signal's immediate exit) leaves the
registered names to Python's resource tracker, which unlinks them once the driver and its
workers are gone. The one gap is a worker killed between registering a name and creating it:
the tracker then reports that name at its exit, and finds nothing to unlink.

No room in /dev/shm: the worker removes its half-written segment, reports it once (the driver
logs one warning per group) and sends every later body by value, through the pipe.
"""

from __future__ import annotations

import _posixshmem
import logging
import os
import pickle
import struct
import threading
from collections.abc import Sequence
from multiprocessing import resource_tracker
from typing import Any

import numpy as np

from impala_tf.utils.shutdown import uninterrupted
from impala_tf.workers.protocol import StoredValue
from impala_tf.workers.shared_arrays import NO_ROOM_ADVICE, new_segment_name

__all__ = [
    "SegmentStore",
    "SharedValue",
    "ValueWriter",
    "read_value",
    "warn_no_room",
    "write_value",
]

logger = logging.getLogger(__name__)

#: Alignment of each out-of-band buffer in a segment.
_ALIGN = 64
#: The resource tracker's type of POSIX shared memory (it unlinks what is left of it at exit).
_TRACKER_TYPE = "shared_memory"
#: The most buffers one `writev` takes (Linux's IOV_MAX is 1024).
_MAX_IOV = 1000


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _unlink(name: str) -> bool:
    """Unlinks segment `name` and unregisters it; False when there was none.

    Not cut between the two by a first signal (`uninterrupted`): a segment unlinked and still
    registered would be reported as leaked at exit.
    """
    with uninterrupted():
        try:
            _posixshmem.shm_unlink("/" + name)
        except FileNotFoundError:
            return False
        resource_tracker.unregister("/" + name, _TRACKER_TYPE)
    return True


class SharedValue(StoredValue):
    """A handle on a value written into a shared memory segment (what a message carries).

    Attributes:
      name: The segment's name (`/dev/shm/<name>` on Linux).
      nbytes: The segment's size.
    """

    __slots__ = ("_store", "name", "nbytes")

    def __init__(self, name: str, nbytes: int):
        self.name = name
        self.nbytes = int(nbytes)
        self._store: SegmentStore | None = None  # The driver's, once it received the handle.

    def __getstate__(self):
        return (self.name, self.nbytes)

    def __setstate__(self, state):
        self.name, self.nbytes = state
        self._store = None

    def __repr__(self) -> str:
        return f"SharedValue({self.name!r}, {self.nbytes})"

    def get(self) -> Any:
        """A private copy of the value (its arrays writable). In a worker the handle was passed
        to, the segment is emptied after the read: the value is read there once.

        Raises:
          FileNotFoundError: The segment was removed already.
        """
        return read_value(self.name, take=self._store is None)

    def release(self) -> None:
        """Removes the segment (in the driver; a no-op in the process a handle was passed to)."""
        if self._store is not None:
            self._store.release(self.name)
            self._store = None


def _write_all(fd: int, parts: Sequence[memoryview | bytes]) -> None:
    """Writes `parts` one after the other, through short writes (ENOSPC raises)."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        written = os.writev(fd, views[:_MAX_IOV])
        while written and views:
            if written >= len(views[0]):
                written -= len(views.pop(0))
            else:
                views[0] = views[0][written:]
                written = 0


def write_value(name: str, value: Any) -> SharedValue | None:
    """Writes `value` into a new segment `name` (see the module docstring).

    Returns:
      Its handle, or None when `value` holds no out-of-band buffer (no segment was made: send it
      by value).

    Raises:
      OSError: The segment could not be made or filled (no room in /dev/shm); it was removed.
    """
    buffers: list[pickle.PickleBuffer] = []
    stream = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    if not buffers:
        return None
    raws = [b.raw() for b in buffers]
    sizes = [len(stream), *(r.nbytes for r in raws)]
    header = struct.pack(f"<q{len(sizes)}q", len(sizes), *sizes)
    parts: list[memoryview | bytes] = [header, stream]
    offset = len(header) + len(stream)
    for raw in raws:
        pad = _aligned(offset) - offset
        parts += [bytes(pad), raw]
        offset += pad + raw.nbytes
    # Registered first: a driver killed at any moment after the segment exists leaves it to
    # the resource tracker (the module docstring).
    resource_tracker.register("/" + name, _TRACKER_TYPE)
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    except BaseException:
        resource_tracker.unregister("/" + name, _TRACKER_TYPE)
        raise
    try:
        _write_all(fd, parts)
    except BaseException:
        _unlink(name)
        raise
    finally:
        os.close(fd)
    return SharedValue(name, offset)


def read_value(name: str, take: bool = False) -> Any:
    """The value in segment `name`, unpickled from a private copy (see the module docstring).

    Args:
      name: The segment.
      take: Empty the segment after reading it (its pages are freed here; the name stays).

    Raises:
      FileNotFoundError: There is no such segment.
      EOFError: The segment is empty (its value was taken) or shorter than it says.
    """
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR if take else os.O_RDONLY, mode=0o600)
    try:
        size = os.fstat(fd).st_size
        data = np.empty(size, np.uint8)  # Not zeroed first, as a bytearray would be.
        view = memoryview(data).cast("B")
        got = 0
        while got < size:
            n = os.preadv(fd, [view[got:]], got)
            if n == 0:
                break
            got += n
        if take:
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)
    if got < size or not size:
        raise EOFError(f"shared value {name}: {got} bytes of {size} (a taken value is empty)")
    (count,) = struct.unpack_from("<q", view)
    sizes = struct.unpack_from(f"<{count}q", view, 8)
    offset = 8 * (count + 1)
    stream = view[offset : offset + sizes[0]]
    offset += sizes[0]
    buffers = []
    for n in sizes[1:]:
        offset = _aligned(offset)
        buffers.append(view[offset : offset + n])
        offset += n
    return pickle.loads(stream, buffers=buffers)


class ValueWriter:
    """A worker's side: writes bodies into the segments the driver named, or sends them by value
    once shared memory had no room (see the module docstring)."""

    def __init__(self):
        self.no_room: str | None = None  # Why bodies go by value, once a write failed.

    def share(self, name: str, value: Any) -> tuple[Any, str | None]:
        """(`value`'s handle, or `value` itself; a warning for the driver, the first time only)."""
        if self.no_room is not None:
            return value, None
        try:
            handle = write_value(name, value)
        except OSError as e:
            self.no_room = str(e)
            return value, self.no_room
        return (value if handle is None else handle), None


class SegmentStore:
    """The driver's book of one worker group's segments (see "Lifetime" in the module docstring).

    Every name it gave out is either expected (a call not yet answered) or held (a handle
    received and not yet released); it removes them as they end. Thread-safe: the learners'
    loaders release the train batches they fetched (`impala_tf.driver.aggregation.BatchRef`).
    """

    def __init__(self):
        self._base = new_segment_name()
        self._expected: dict[int, dict[int, str]] = {}  # Worker id -> call id -> name.
        self._held: set[str] = set()
        self._closed = False
        self._lock = threading.RLock()

    def expect(self, worker_id: int, call_id: int) -> str:
        """The name worker `worker_id` is to give call `call_id`'s body."""
        name = f"{self._base}_{call_id}"
        with self._lock:
            self._expected.setdefault(worker_id, {})[call_id] = name
        return name

    def received(self, worker_id: int, call_id: int, body: Any) -> Any:
        """Call `call_id` was answered with `body` (a handle, or the value itself): the driver
        now holds the segment, until the handle is released."""
        with self._lock:
            name = self._expected.get(worker_id, {}).pop(call_id, None)
            if isinstance(body, SharedValue) and name == body.name and not self._closed:
                body._store = self
                self._held.add(name)
        return body

    # Each name leaves the book only once its segment is gone: a signal that interrupts a
    # removal (the first one's orderly shutdown) leaves the name for `close`.

    def release(self, name: str) -> None:
        """Removes a held segment (safe twice, and after `close`)."""
        with self._lock:
            if name not in self._held:
                return
        # Outside the lock: unlinking frees the segment's pages (~0.1 ms per MB), and a loader
        # releasing a train batch must not hold up the main thread's `expect` and `received`.
        # A second release meanwhile finds the name gone (`_unlink` returns False).
        _unlink(name)
        with self._lock:
            self._held.discard(name)

    def lost(self, worker_id: int) -> None:
        """Worker `worker_id` has ended: removes whatever its unanswered calls made."""
        with self._lock:
            calls = self._expected.get(worker_id, {})
            for call_id, name in list(calls.items()):
                _unlink(name)
                del calls[call_id]
            self._expected.pop(worker_id, None)

    def names(self) -> list[str]:
        """Every name expected or held."""
        with self._lock:
            return sorted(self._held.union(*(c.values() for c in self._expected.values())))

    def close(self) -> None:
        """Removes every segment expected or held (the workers have ended). Safe twice."""
        with self._lock:
            self._closed = True
            for worker_id in list(self._expected):
                self.lost(worker_id)
            for name in list(self._held):
                self.release(name)


def warn_no_room(role: str, reason: str) -> None:
    """The one warning of a group whose worker found no room in shared memory."""
    logger.warning(
        "The %ss' batches go through the driver by value (a pickle each way): shared memory "
        "has no room for them (%s). %s",
        role,
        reason,
        NO_ROOM_ADVICE,
    )
