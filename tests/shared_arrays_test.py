"""Tests of `impala_tf.workers.shared_arrays`: weights written once into shared memory.

The ring itself (exact sets across processes, late readers, closing, a killed writer, no room),
then the local actors of a run: they get exactly the broadcast weights, one policy or two, and
no segment outlives the actors' group, after a killed actor was restarted too. Segments are
found by the name prefix and the creating process's pid (other test runs may share /dev/shm).
"""

from __future__ import annotations

import errno
import importlib
import logging
import multiprocessing as mp
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from impala_tf.driver.counters import Counters
from impala_tf.driver.specs import sampling_spec
from impala_tf.rollout.host import RunnerHost
from impala_tf.workers import WorkerHost
from impala_tf.workers import shared_arrays as sa
from impala_tf.workers.protocol import StoredValue

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_WAIT_S = 60.0
_SHM = "/dev/shm"

pytestmark = pytest.mark.skipif(not os.path.isdir(_SHM), reason="needs /dev/shm (Linux)")


def _segments(pid: int | None = None) -> list[str]:
    """Our segments in /dev/shm made by `pid` (default: this process)."""
    prefix = f"{sa.SEGMENT_PREFIX}{os.getpid() if pid is None else pid}_"
    return sorted(n for n in os.listdir(_SHM) if n.startswith(prefix))


def _set(seq: int) -> list[np.ndarray]:
    """A set whose every element says which write it came from (a torn copy would mix)."""
    return [
        np.full((64, 32), seq, np.float32),
        np.full(7, seq, np.int64),
        np.full((), seq % 2 == 0, np.bool_),
        np.full((3, 5), seq, np.float64),
    ]


def _whole(arrays: list[np.ndarray]) -> int:
    """The one write all of `arrays` came from; fails on a torn or mixed set."""
    seqs = {int(v) for a in arrays[:2] + arrays[3:] for v in np.unique(a)}
    assert len(seqs) == 1, f"a torn or mixed set: values of writes {sorted(seqs)}"
    (seq,) = seqs
    assert bool(arrays[2]) == (seq % 2 == 0)
    return seq


def _read_in_child(handle: sa.SharedArrays, out: mp.Queue) -> None:
    arrays, version = handle.get()
    out.put((arrays, version, [a.flags.writeable for a in arrays]))


# The ring --------------------------------------------------------------------------------------


def test_a_reader_in_another_process_gets_exactly_the_set_written():
    rng = np.random.default_rng(0)
    written = [
        rng.standard_normal((33, 17)).astype(np.float32),  # Odd sizes: alignment of the next.
        rng.integers(-(2**62), 2**62, size=5, dtype=np.int64),
        np.array(np.nan, np.float32),
        rng.standard_normal(0).astype(np.float32),
        rng.standard_normal((2, 3, 4)).astype(np.float16),
    ]
    ring = sa.ArrayRing(written)
    try:
        handle = ring.write(written, version=41)
        assert len(pickle.dumps(handle)) < 1_000  # What a message carries: not the arrays.
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        child = ctx.Process(target=_read_in_child, args=(handle, out))
        child.start()
        arrays, version, writeable = out.get(timeout=_WAIT_S)
        child.join(_WAIT_S)
    finally:
        ring.close()
    assert version == 41
    assert all(writeable)  # Private copies, not views of the ring.
    assert [(a.shape, a.dtype) for a in arrays] == [(a.shape, a.dtype) for a in written]
    assert all(a.tobytes() == b.tobytes() for a, b in zip(arrays, written))  # Bitwise.


def test_each_handle_reads_its_own_write_while_the_ring_has_not_come_round():
    ring = sa.ArrayRing(_set(0), num_slots=4)
    try:
        handles = [ring.write(_set(seq), version=100 + seq) for seq in range(1, 5)]
        for seq, handle in zip(range(1, 5), handles):
            arrays, version = handle.get()
            assert (_whole(arrays), version) == (seq, 100 + seq)
    finally:
        ring.close()


def test_a_reader_paused_mid_copy_while_the_ring_comes_round_gets_a_whole_newer_set(
    monkeypatch,
):
    ring = sa.ArrayRing(_set(0), num_slots=3)
    copy = sa._copy_views
    paused = []

    def pausing_copy(views):
        # The first copy stops after its first array while the writer laps the ring once
        # (every slot rewritten, the reader's too), then finishes: its arrays mix two writes.
        if paused:
            return copy(views)
        first = views[0].copy()
        for seq in range(2, 2 + ring.layout.num_slots):
            ring.write(_set(seq), version=seq)
        paused.append(True)
        return [first, *copy(views[1:])]

    monkeypatch.setattr(sa, "_copy_views", pausing_copy)
    try:
        handle = ring.write(_set(1), version=1)
        arrays, version = handle.get()
    finally:
        ring.close()
    assert paused
    seq = _whole(arrays)
    assert seq == version == 1 + ring.layout.num_slots  # The newest set, whole.


def test_a_reader_that_keeps_losing_the_race_raises_instead_of_spinning(monkeypatch):
    ring = sa.ArrayRing(_set(0), num_slots=2)
    copy = sa._copy_views
    seq = [1]

    def overtaken_copy(views):
        out = copy(views)
        for _ in range(ring.layout.num_slots):  # Every copy overlaps a write of its slot.
            seq[0] += 1
            ring.write(_set(seq[0]), version=seq[0])
        return out

    monkeypatch.setattr(sa, "_copy_views", overtaken_copy)
    try:
        handle = ring.write(_set(1), version=1)
        with pytest.raises(RuntimeError, match="copies in a row overlapped a write"):
            handle.get()
    finally:
        ring.close()


def _write_fast(handles_out: mp.Queue, done: mp.Event, writes: int) -> None:
    ring = sa.ArrayRing(_set(0), num_slots=2)
    for seq in range(1, writes + 1):
        handle = ring.write(_set(seq), version=seq)
        if seq % 50 == 1:
            handles_out.put(handle)
    handles_out.put(None)
    done.wait(_WAIT_S)  # The reader is done: close.
    ring.close()


def test_reads_racing_a_writer_in_another_process_are_never_torn():
    ctx = mp.get_context("spawn")
    handles, done = ctx.Queue(), ctx.Event()
    writer = ctx.Process(target=_write_fast, args=(handles, done, 5_000))
    writer.start()
    try:
        reads = 0
        while (handle := handles.get(timeout=_WAIT_S)) is not None:
            for _ in range(5):
                arrays, version = handle.get()
                assert _whole(arrays) == version >= handle.seq
                reads += 1
        done.set()
        writer.join(_WAIT_S)
    finally:
        if writer.is_alive():
            writer.kill()
    assert reads == 500 and writer.exitcode == 0


def test_a_write_of_another_layout_is_refused_with_both_layouts_named():
    ring = sa.ArrayRing(_set(0))
    try:
        with pytest.raises(ValueError, match="the ring holds"):
            ring.write(_set(1)[:2], version=1)
        with pytest.raises(ValueError, match="float64"):
            ring.write([a.astype(np.float64) for a in _set(1)], version=1)
    finally:
        ring.close()


def test_close_unlinks_while_attached_readers_keep_reading():
    before = _segments()
    ring = sa.ArrayRing(_set(0))
    handle = ring.write(_set(1), version=1)
    assert _segments() == sorted([*before, ring.name])
    assert _whole(handle.get()[0]) == 1  # This process is now attached.
    ring.close()
    ring.close()  # Twice is fine.
    assert _segments() == before
    assert _whole(handle.get()[0]) == 1  # A late reader holds its mapping.
    sa._ATTACHED.pop(ring.name).close()
    with pytest.raises(FileNotFoundError):  # A first attach after close finds nothing.
        handle.get()


def test_segments_of_a_killed_writer_are_unlinked_by_the_resource_tracker():
    script = textwrap.dedent(
        """
        import sys, time
        import numpy as np
        from impala_tf.workers.shared_arrays import ArrayRing
        ring = ArrayRing([np.zeros(1000, np.float32)])
        print(ring.name, flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        name = proc.stdout.readline().strip()
        assert os.path.exists(os.path.join(_SHM, name))
    finally:
        proc.kill()
        proc.wait(_WAIT_S)
    deadline = time.monotonic() + _WAIT_S
    while os.path.exists(os.path.join(_SHM, name)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(os.path.join(_SHM, name))


def test_without_room_in_shared_memory_the_sets_go_by_value_with_a_warning(monkeypatch, caplog):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    rings = sa.ArrayRings()
    before = _segments()
    arrays = _set(3)
    with caplog.at_level(logging.WARNING, logger=sa.__name__):
        shared = rings.share({"p0": (arrays, 3), "p1": (None, 7)})
    try:
        assert shared.items["p0"][0] is arrays and shared.items["p1"] == (None, 7)
        assert "by value" in caplog.text and "--shm-size" in caplog.text
        assert _segments() == before  # The segment that found no room is gone.
        got = shared.get()
        assert got["p0"][0] is arrays and got["p1"] == (None, 7)
    finally:
        rings.close()


def test_a_policy_resent_unchanged_is_not_written_again():
    rings = sa.ArrayRings()
    try:
        arrays = _set(1)
        first = rings.share({"p0": (arrays, 1)}).items["p0"]
        again = rings.share({"p0": (arrays, 1)}).items["p0"]
        newer = rings.share({"p0": (_set(2), 2)}).items["p0"]
        assert again.seq == first.seq and newer.seq == first.seq + 1
    finally:
        rings.close()
    assert _segments() == []


class _CountingValue(StoredValue):
    def __init__(self, value, fetched: list):
        self.value, self.fetched = value, fetched

    def get(self):
        self.fetched.append(self.value)
        return self.value


class _Sink:
    def __init__(self):
        self.weights = []

    def set_weights(self, weights, filters):
        self.weights.append((weights, filters))

    def sample(self):
        return list(self.weights)


def test_the_worker_host_fetches_a_stored_argument_only_when_its_call_runs():
    fetched = []
    host = WorkerHost(_Sink())
    for i in range(3):  # Coalesced: only the newest is applied, so only it is fetched.
        host.submit(i, "set_weights", (_CountingValue(i, fetched), "f"), True, False)
    host.submit(3, "sample", (), False, True)
    _, _, applied = host.run_next()
    assert fetched == [2] and applied == [(2, "f")]


# The local actors of a run ---------------------------------------------------------------------


class ProbeHost(RunnerHost):
    """An actor that also answers which weights it holds (imported by the actor processes)."""

    def held(self) -> dict:
        runner = self.runner
        versions = getattr(runner, "versions", None)
        if versions is None:
            versions = {"default_policy": runner.policy_version}
        return {pid: (w, int(versions[pid])) for pid, w in runner.get_weights().items()}


def make_probe_host(actor_id, *args, **kwargs):
    return ProbeHost(actor_id, *args, **kwargs)


def _random_weights(config, plan, seed: int) -> dict:
    from impala_tf.config.policies import policy_config
    from impala_tf.models import build_model

    rng = np.random.default_rng(seed)
    weights = {}
    for i, (pid, (obs, act)) in enumerate(sorted(plan.spaces.policies.items())):
        model = build_model(obs, act, policy_config(config, pid).model)
        arrays = [rng.standard_normal(w.shape).astype(w.dtype) for w in model.get_weights()]
        weights[pid] = (arrays, 10 * seed + i)
    return weights


def _assert_held(group, weights: dict) -> None:
    held = group.workers.call_and_wait(group.healthy_ids(), ProbeHost.held, timeout_s=_WAIT_S)
    assert sorted(held) == group.healthy_ids()
    for actor_held in held.values():
        assert sorted(actor_held) == sorted(weights)
        for pid, (arrays, version) in weights.items():
            got, got_version = actor_held[pid]
            assert got_version == version
            assert [g.tobytes() for g in got] == [a.tobytes() for a in arrays]  # Bitwise.


@pytest.mark.parametrize("policies", [1, 2])
def test_local_actors_get_exactly_the_broadcast_weights_and_no_segment_outlives_them(policies):

    from impala_tf.driver.plan import make_plan
    from impala_tf.driver.sampling import EnvRunnerGroup
    from tests.support.configs import small_config

    probe = importlib.import_module("tests.shared_arrays_test").make_probe_host
    config = small_config(policies, num_env_runners=2, restart_failed_env_runners=True)
    plan = make_plan(config)
    before = _segments()
    counters = Counters()
    group = EnvRunnerGroup(sampling_spec(config, plan), plan, counters, host_factory=probe)
    try:
        for seed in (1, 2):
            weights = _random_weights(config, plan, seed)
            group.broadcast(weights, group.healthy_ids())
            _assert_held(group, weights)
        assert len(_segments()) == len(before) + len(weights)  # One ring per policy.
        # A killed actor: restarted with the newest weights, read from the same rings.
        os.kill(group.pids()[0], signal.SIGKILL)
        deadline = time.monotonic() + _WAIT_S
        failures = []
        while not failures and time.monotonic() < deadline:
            _, failures = group.fetch(0.1)
        assert group.handle_failures(failures) == [0]
        group.broadcast(weights, [0])
        _assert_held(group, weights)
        assert counters.num_env_runner_restarts == 1
        assert len(_segments()) == len(before) + len(weights)
    finally:
        group.stop()
    assert _segments() == before
