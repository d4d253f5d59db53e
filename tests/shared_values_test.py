"""Tests of `impala_tf.workers.shared_values`: the bodies of `parts` calls in shared memory.

The format (bitwise, private writable arrays; a body without arrays by value), then local worker
processes: a body passed on to another worker's call is read there, never in the driver; the
driver's store removes each segment on release, those of a worker killed after writing, and the
rest on stop; no room in /dev/shm sends bodies by value with one warning; a killed driver leaves
its segments to the resource tracker. Segments are found by the name prefix and this process's
pid (other test runs may share /dev/shm).

`Parts` below is imported by the worker processes as `tests.shared_values_test`.
"""

from __future__ import annotations

import errno
import importlib
import logging
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from impala_tf.utils.shutdown import GracefulShutdown, Interrupted
from impala_tf.workers import ProcessBackend, WorkerGroup, WorkerSpec
from impala_tf.workers import shared_values as sv
from impala_tf.workers.shared_arrays import SEGMENT_PREFIX
from tests.support.processes import wait_until

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_WAIT_S = 60.0
_SHM = "/dev/shm"

pytestmark = pytest.mark.skipif(not os.path.isdir(_SHM), reason="needs /dev/shm (Linux)")


def _segments(pid: int | None = None) -> list[str]:
    """Our segments in /dev/shm named by `pid` (default: this process)."""
    prefix = f"{SEGMENT_PREFIX}{os.getpid() if pid is None else pid}_"
    return sorted(n for n in os.listdir(_SHM) if n.startswith(prefix))


def _body(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "obs": rng.integers(0, 255, (3, 7, 5, 5), dtype=np.uint8),  # Odd sizes: alignment.
        "logp": rng.standard_normal((3, 7)).astype(np.float32),
        "every_other": rng.standard_normal((4, 6))[:, ::2],  # Not contiguous: in-band.
        "fortran": np.asfortranarray(rng.standard_normal((3, 4))),
        "empty": np.zeros((0, 2), np.float64),
        "episodes": [(1.5, 7, {"p": [1.5]})],
    }


def _assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        if isinstance(value, np.ndarray):
            assert (got[key].dtype, got[key].shape) == (value.dtype, value.shape), key
            assert got[key].tobytes() == value.tobytes(), key  # Bitwise.
            assert got[key].flags.f_contiguous == value.flags.f_contiguous, key
        else:
            assert got[key] == value, key


class Parts:
    """A hosted object: `make` returns (head, body), `total` reads a body passed to it.

    Args:
      mode: "" (plain), "no room" (shared memory is full in this worker) or "die after writing"
        (the worker is killed once it wrote its first body, before it answers).
    """

    def __init__(self, worker_id: int, mode: str = "", progress=None):
        del worker_id, progress
        if mode == "no room":

            def full(fd, buffers):
                raise OSError(errno.ENOSPC, "No space left on device")

            os.writev = full
        elif mode == "die after writing":
            write = sv.write_value

            def write_then_die(name, value):
                handle = write(name, value)
                os.kill(os.getpid(), signal.SIGKILL)
                return handle

            sv.write_value = write_then_die

    def make(self, seed: int) -> tuple[int, dict]:
        return seed, _body(seed)

    def total(self, body: dict) -> tuple[float, bool]:
        return float(body["logp"].sum()), all(
            a.flags.writeable for a in body.values() if isinstance(a, np.ndarray)
        )


def _group(num_workers: int = 1, mode: str = "") -> WorkerGroup:
    toys = importlib.import_module("tests.shared_values_test")
    spec = WorkerSpec(
        role="actor",
        factory=toys.Parts,
        make_args=lambda _: (mode,),
        preload=("tests.shared_values_test",),
    )
    return WorkerGroup(ProcessBackend(), spec, num_workers)


def _answers(group: WorkerGroup, replies: int = 0, failures: int = 0) -> tuple[list, list]:
    got: tuple[list, list] = ([], [])
    deadline = time.monotonic() + _WAIT_S
    while len(got[0]) < replies or len(got[1]) < failures:
        assert time.monotonic() < deadline, f"still waiting, got {got}"
        r, f = group.poll(1.0)
        got[0].extend(r)
        got[1].extend(f)
    return got


# The format ------------------------------------------------------------------------------------


def test_a_body_comes_back_bitwise_as_private_writable_arrays_and_is_removed_on_release():
    store = sv.SegmentStore()
    name = store.expect(worker_id=0, call_id=5)
    handle = store.received(0, 5, sv.write_value(name, _body(1)))
    assert isinstance(handle, sv.SharedValue) and _segments() == [name]
    assert len(pickle.dumps(handle)) < 200  # What a message carries: not the arrays.
    got = handle.get()
    _assert_same(got, _body(1))
    assert all(a.flags.writeable for a in got.values() if isinstance(a, np.ndarray))
    got["logp"][0, 0] = -1.0  # Private: the segment keeps its value.
    assert handle.get()["logp"][0, 0] == _body(1)["logp"][0, 0]
    handle.release()
    handle.release()  # Twice is fine.
    assert _segments() == [] and store.names() == []
    with pytest.raises(FileNotFoundError):
        handle.get()


def test_a_signal_during_a_removal_lets_it_finish_then_interrupts(monkeypatch):
    # The first signal's `Interrupted` arriving between the unlink and the unregistration would
    # leave the name registered with no segment: reported as leaked at exit (a CI failure).
    store = sv.SegmentStore()
    name = store.expect(worker_id=0, call_id=1)
    handle = store.received(0, 1, sv.write_value(name, _body(2)))
    unlink, unregister, unregistered = sv._posixshmem.shm_unlink, sv.resource_tracker.unregister, []

    def unlink_then_signal(path):
        unlink(path)
        os.kill(os.getpid(), signal.SIGTERM)  # Handled at the next bytecode of this thread.

    def record(path, rtype):
        unregistered.append(path)
        unregister(path, rtype)

    monkeypatch.setattr(sv._posixshmem, "shm_unlink", unlink_then_signal)
    monkeypatch.setattr(sv.resource_tracker, "unregister", record)
    shutdown = GracefulShutdown().install()
    try:
        with pytest.raises(Interrupted):
            handle.release()
    finally:
        shutdown.uninstall()
    assert unregistered == ["/" + name] and _segments() == []
    store.close()  # The orderly shutdown: nothing left to remove, nothing unregistered twice.
    assert unregistered == ["/" + name] and store.names() == []


def test_a_body_without_arrays_goes_by_value():
    assert sv.write_value(f"{SEGMENT_PREFIX}{os.getpid()}_x_1", {"steps": 3}) is None
    assert _segments() == []


# Local worker processes ------------------------------------------------------------------------


def test_a_body_passed_to_another_workers_call_is_read_there_never_in_the_driver(monkeypatch):
    read_here = []
    get = sv.SharedValue.get
    monkeypatch.setattr(sv.SharedValue, "get", lambda self: read_here.append(self) or get(self))
    group = _group(2)
    try:
        call = group.call(0, Parts.make, 7, parts=True)
        ((reply,), _) = _answers(group, replies=1)
        head, body = reply.value
        assert (reply.call_id, head) == (call, 7)
        assert isinstance(body, sv.SharedValue) and _segments() == [body.name]
        group.call(1, Parts.total, body)
        ((reply,), _) = _answers(group, replies=1)
        assert reply.value == (float(_body(7)["logp"].sum()), True)
        assert read_here == []  # The driver passed a name; worker 1 read the arrays ...
        assert os.stat(os.path.join(_SHM, body.name)).st_size == 0  # ... and freed them.
        with pytest.raises(EOFError, match="taken"):
            body.get()
        body.release()
        assert _segments() == []
    finally:
        group.stop()


def test_a_worker_killed_after_writing_its_body_leaves_no_segment(monkeypatch):
    removed = []
    unlink = sv._unlink
    monkeypatch.setattr(sv, "_unlink", lambda name: removed.append((name, unlink(name))))
    group = _group(mode="die after writing")
    try:
        call = group.call(0, Parts.make, 1, parts=True)
        _, (failure,) = _answers(group, failures=1)
        assert failure.lost_calls == (call,)
        assert [made for _, made in removed] == [True]  # It had made the segment.
        assert _segments() == []
    finally:
        group.stop()


def test_stop_removes_the_segments_the_driver_still_holds():
    group = _group()
    try:
        for seed in (1, 2):
            group.call(0, Parts.make, seed, parts=True)
        replies, _ = _answers(group, replies=2)
        assert len(_segments()) == 2
    finally:
        group.stop()
    assert _segments() == []
    with pytest.raises(FileNotFoundError):
        replies[0].value[1].get()


def test_without_room_in_shared_memory_bodies_go_by_value_with_one_warning(caplog):
    group = _group(mode="no room")
    try:
        with caplog.at_level(logging.WARNING, logger=sv.__name__):
            for seed in (1, 2):
                group.call(0, Parts.make, seed, parts=True)
            replies, _ = _answers(group, replies=2)
        for seed, reply in zip((1, 2), replies):
            _assert_same(reply.value[1], _body(seed))  # The body itself, not a handle.
        assert caplog.text.count("has no room") == 1 and "--shm-size" in caplog.text
        assert _segments() == []  # The segment that found no room is gone.
    finally:
        group.stop()


def test_a_killed_driver_leaves_its_segments_to_the_resource_tracker(tmp_path):
    script = textwrap.dedent(
        """
        import time
        from tests.shared_values_test import Parts, _answers, _group
        group = _group()
        group.call(0, Parts.make, 1, parts=True)
        (reply,), _ = _answers(group, replies=1)
        print(reply.value[1].name, flush=True)
        time.sleep(600)
        """
    )
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.Popen(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        name = proc.stdout.readline().strip()
        assert name and os.path.exists(os.path.join(_SHM, name))
    finally:
        proc.kill()
        proc.wait(_WAIT_S)
    # The worker notices its driver's end within about a second; then the tracker unlinks.
    assert wait_until(lambda: not os.path.exists(os.path.join(_SHM, name)), _WAIT_S)
