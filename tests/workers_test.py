"""Tests of `impala_tf.workers`: one behaviour, one test, on both backends (processes and Ray).

The hosted toy classes live here, at module level: worker processes and Ray actors import them
as `tests.workers_test` (pytest itself imports this file as `workers_test`, so the tests take
them from `_toys()`). Ray starts once for all Ray cases, inside a temporary HOME.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from impala_tf.workers import (
    ProcessBackend,
    RayBackend,
    Reply,
    RestartPolicy,
    WorkerFailure,
    WorkerGroup,
    WorkerHost,
    WorkerSpec,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_WAIT_S = 60.0


# Hosted toys (imported by the workers) --------------------------------------------------------


class FatalError(RuntimeError):
    fatal = True  # A restart cannot cure it.


class Counter:
    """A hosted object that records what it was asked."""

    def __init__(self, worker_id: int, start: int, peer: Any = None, progress: Any = None):
        self.start = start
        self.peer = peer  # Held, as a hosted object holds its pipe to an inference server.
        self.count = start
        self.progress = progress
        self.weights_seen: list[Any] = []
        self.log: list[str] = []

    def incr(self, n: int = 1) -> int:
        self.count += n
        return self.count

    def get(self) -> dict[str, Any]:
        return {"start": self.start, "count": self.count, "weights": list(self.weights_seen)}

    def set_weights(self, weights: Any) -> None:
        self.weights_seen.append(weights)
        self.log.append(f"weights {weights}")

    def set_filter(self, value: Any) -> None:
        self.log.append(f"filter {value}")

    def writable(self) -> list[bool]:
        return [w.flags.writeable for w in self.weights_seen]

    def fail(self) -> None:
        raise ValueError("boom in worker")

    def fail_fatal(self) -> None:
        raise FatalError("observations of the wrong shape")

    def sleep(self, seconds: float, marker: str | None = None) -> float:
        if self.progress is not None:
            self.progress[0] = 7  # "Step 7": what `describe_hang` reads.
        if marker is not None:  # Tells the test that the call is running.
            open(marker, "w").close()
        time.sleep(seconds)
        return seconds

    def _private_helper(self) -> None:
        """Not callable through the group (private)."""

    def env(self, *names: str) -> dict[str, str | None]:
        return {k: os.environ.get(k) for k in names}


class SlowCounter(Counter):
    """A `Counter` whose construction takes `SLOW_START_S` (an env creator importing a lot)."""

    SLOW_START_S = 1.5

    def __init__(self, worker_id: int, start: int, peer: Any = None, progress: Any = None):
        time.sleep(self.SLOW_START_S)
        super().__init__(worker_id, start, peer, progress)


class HangingCounter(Counter):
    """A `Counter` whose construction never ends (an env creator that hangs)."""

    def __init__(self, worker_id: int, start: int, peer: Any = None, progress: Any = None):
        time.sleep(3600)


# Helpers and fixtures -------------------------------------------------------------------------


def _toys() -> Any:
    """This module as the workers import it."""
    return importlib.import_module("tests.workers_test")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _wait_until(predicate: Callable[[], bool], timeout_s: float = _WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _collect(
    group: WorkerGroup, replies: int = 0, failures: int = 0
) -> tuple[list[Reply], list[WorkerFailure]]:
    """Polls until at least `replies` replies and `failures` failures arrived."""
    got: tuple[list[Reply], list[WorkerFailure]] = ([], [])
    deadline = time.monotonic() + _WAIT_S
    while len(got[0]) < replies or len(got[1]) < failures:
        assert time.monotonic() < deadline, f"still waiting, got {got}"
        r, f = group.poll(1.0)
        got[0].extend(r)
        got[1].extend(f)
    return got


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """One Ray for every Ray case of this module, writing only under a temporary HOME."""
    from tests.support import ray as raylib

    with raylib.local_ray(str(tmp_path_factory.mktemp("ray-home")), num_cpus=4) as ray:
        yield ray


@pytest.fixture(params=["process", "ray"])
def backend(request):
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
        return RayBackend(address=None, num_cpus=4)
    return ProcessBackend()


@pytest.fixture
def make_group(backend):
    """make(num_workers, **spec fields) -> (group, the worker ids make_args was called for)."""
    groups = []

    def make(num_workers: int = 1, **spec: Any) -> tuple[WorkerGroup, list[int]]:
        starts: list[int] = []

        def make_args(worker_id: int) -> tuple:
            starts.append(worker_id)
            return (100 * len(starts),)  # A different start value at every (re)start.

        spec.setdefault("preload", ("tests.workers_test",))
        spec.setdefault("factory", _toys().Counter)
        full = WorkerSpec(role="actor", make_args=make_args, **spec)
        group = WorkerGroup(backend, full, num_workers)
        groups.append(group)
        return group, starts

    yield make
    for group in groups:
        group.stop()


# WorkerHost and RestartPolicy (no workers) ----------------------------------------------------


def test_host_applies_the_newest_coalesced_call_of_each_method_before_the_next_call():
    counter = Counter(0, 0)
    host = WorkerHost(counter)
    assert not host.has_pending()
    host.submit(0, "set_weights", ("w0",), coalesce=True, reply=False)
    host.submit(1, "set_filter", ("f1",), coalesce=True, reply=False)
    host.submit(2, "set_weights", ("w2",), coalesce=True, reply=False)
    assert not host.has_pending()  # Stored calls wait for a plain call.
    host.submit(3, "incr", (5,), coalesce=False, reply=True)
    assert host.has_pending()
    # Only the newest of each method, in the order they were last submitted.
    assert host.run_next() == (3, True, 5)
    assert counter.log == ["filter f1", "weights w2"]
    host.submit(4, "get", (), coalesce=False, reply=False)
    host.submit(5, "set_weights", ("w5",), coalesce=True, reply=False)
    # Stored calls run before the next call, whenever they arrived.
    assert host.run_next() == (4, False, {"start": 0, "count": 5, "weights": ["w2", "w5"]})
    assert not host.has_pending()
    host.submit(6, "fail", (), coalesce=False, reply=True)
    with pytest.raises(ValueError, match="boom"):
        host.run_next()
    with pytest.raises(IndexError):
        host.run_next()


def test_restart_policy_raises_or_allows_a_restart_against_the_callers_count():
    failure, fatal = WorkerFailure(3, "it broke"), WorkerFailure(3, "it broke", fatal=True)
    with pytest.raises(RuntimeError, match="^Actor 3 failed: it broke"):
        RestartPolicy("actor", enabled=True, max_restarts=5).on_failure(fatal, 0)
    with pytest.raises(RuntimeError, match="restart_failed_env_runners=False: it broke"):
        RestartPolicy("actor", enabled=False, max_restarts=5).on_failure(failure, 0)
    with pytest.raises(RuntimeError, match=r"max_num_env_runner_restarts=0\): it broke"):
        RestartPolicy("actor", enabled=True, max_restarts=0).on_failure(failure, 0)

    policy = RestartPolicy(
        "aggregation worker", enabled=True, max_restarts=4, max_key="max_agg_restarts"
    )
    policy.on_failure(failure, 0)
    policy.on_failure(failure, 1)
    policy.succeeded(3)  # A reply in between: the count in a row starts again.
    policy.on_failure(failure, 2)
    policy.on_failure(WorkerFailure(1, "other"), 3)
    with pytest.raises(RuntimeError, match=r"after 4 restarts \(max_agg_restarts=4\)"):
        policy.on_failure(WorkerFailure(1, "other"), 4)
    # A resumed run's count: the policy holds no count of its own.
    fresh = RestartPolicy("actor", enabled=True, max_restarts=4)
    with pytest.raises(RuntimeError, match=r"after 4 restarts \(max_num_env_runner_restarts=4\)"):
        fresh.on_failure(failure, 4)

    policy = RestartPolicy("actor", enabled=True, max_restarts=None)
    policy.on_failure(failure, 0)
    policy.on_failure(failure, 1)
    with pytest.raises(RuntimeError, match="^Actor 3 failed 3 times in a row.*Last error: it"):
        policy.on_failure(failure, 2)


# Both backends -------------------------------------------------------------------------------


def test_replies_come_in_call_order_with_increasing_ids(make_group, backend):
    group, starts = make_group(2)
    assert starts == [0, 1]
    assert group.healthy_ids() == [0, 1]
    ids = [group.call(i, Counter.incr, 1) for _ in range(3) for i in (0, 1)]
    assert ids == sorted(ids) and len(set(ids)) == 6
    assert group.outstanding(0) == 3
    replies, failures = _collect(group, replies=6)
    assert failures == []
    assert sorted(r.call_id for r in replies) == ids
    for worker_id, start in ((0, 100), (1, 200)):
        mine = [r for r in replies if r.worker_id == worker_id]
        assert [r.value for r in mine] == [start + 1, start + 2, start + 3]
        assert [r.call_id for r in mine] == ids[worker_id::2]
        assert {r.method for r in mine} == {Counter.incr}
        assert group.outstanding(worker_id) == 0
    pids = group.pids()
    assert sorted(pids) == [0, 1] and os.getpid() not in pids.values()
    node = "local"
    if isinstance(backend, RayBackend):
        import ray

        node = ray.get_runtime_context().get_node_id()
    assert group.node_ids() == {0: node, 1: node}


def test_coalesced_calls_apply_only_the_newest_before_the_next_call(make_group):
    group, _ = make_group(1)
    with pytest.raises(ValueError, match="reply=False"):
        group.call(0, Counter.set_weights, 0, coalesce=True)
    for version in (1, 2, 3):
        assert group.call(0, Counter.set_weights, version, coalesce=True, reply=False) is not None
    first = group.call(0, Counter.get)
    assert group.outstanding(0) == 1  # Coalesced calls are never answered.
    replies, _ = _collect(group, replies=1)
    assert [(r.call_id, r.value["weights"]) for r in replies] == [(first, [3])]
    group.call(0, Counter.set_weights, 4, coalesce=True, reply=False)
    group.call(0, Counter.set_weights, 5, coalesce=True, reply=False)
    second = group.call(0, Counter.get)
    replies, _ = _collect(group, replies=1)
    assert [(r.call_id, r.value["weights"]) for r in replies] == [(second, [3, 5])]


def test_arrays_cross_as_private_writable_copies(make_group, backend, monkeypatch):
    if isinstance(backend, RayBackend):
        import ray

        puts = []
        put = ray.put
        monkeypatch.setattr(ray, "put", lambda value: puts.append(value) or put(value))
    group, _ = make_group(2)
    weights = np.arange(40_000.0)  # Big enough for Ray's object store (zero-copy, read-only).
    for i in range(2):  # One broadcast.
        group.call(i, Counter.set_weights, weights, coalesce=True, reply=False)
    writable = group.call_and_wait([0, 1], Counter.writable, timeout_s=_WAIT_S)
    assert writable == {0: [True], 1: [True]}
    got = group.call_and_wait([0], Counter.get, timeout_s=_WAIT_S)[0]["weights"][0]
    np.testing.assert_array_equal(got, weights)
    got[0] = -1.0  # A private copy: writable, nothing points into Ray's object store.
    if isinstance(backend, RayBackend):
        assert len(puts) == 1 and puts[0] is weights  # Put once for the whole broadcast.


def test_a_killed_worker_is_reported_once_and_restarts_with_fresh_args(make_group):
    group, starts = make_group(2, max_restarts=1)
    pid = group.pids()[0]
    lost = [group.call(0, Counter.sleep, 30.0), group.call(0, Counter.incr)]
    os.kill(pid, signal.SIGKILL)
    _, failures = _collect(group, failures=1)
    assert [(f.worker_id, f.lost_calls, f.fatal) for f in failures] == [(0, tuple(lost), False)]
    assert group.healthy_ids() == [1] and group.outstanding(0) == 0
    assert group.call(0, Counter.get) is None

    group.restart(0)
    assert starts == [0, 1, 0]  # make_args ran again for the restart.
    assert group.healthy_ids() == [0, 1]
    fresh = group.call(0, Counter.get)
    replies, failures = _collect(group, replies=1)
    assert failures == []  # The death was reported once.
    assert [(r.call_id, r.value["start"]) for r in replies] == [(fresh, 300)]
    assert group.pids()[0] != pid


def test_replies_to_calls_before_a_fence_are_stale(make_group):
    group, _ = make_group(1)
    before = group.call(0, Counter.incr, 1)
    group.fence()
    after = group.call(0, Counter.incr, 1)
    replies, _ = _collect(group, replies=2)
    assert {r.call_id: r.stale for r in replies} == {before: True, after: False}


def test_restart_failed_applies_the_groups_restart_rules():
    # The rules are the group's whatever the backend; local processes die at once when killed.
    spec = WorkerSpec(
        role="actor",
        factory=_toys().Counter,
        make_args=lambda _: (100,),
        preload=("tests.workers_test",),
    )
    policy = RestartPolicy("actor", enabled=True, max_restarts=1)
    group = WorkerGroup(ProcessBackend(), spec, 1, restarts=policy)
    try:
        os.kill(group.pids()[0], signal.SIGKILL)
        _, failures = _collect(group, failures=1)
        group.restart_failed(failures[0], restarts_so_far=0)
        assert group.healthy_ids() == [0]
        group.call(0, Counter.get)
        _collect(group, replies=1)
        os.kill(group.pids()[0], signal.SIGKILL)
        _, failures = _collect(group, failures=1)
        with pytest.raises(RuntimeError, match="after 1 restarts"):
            group.restart_failed(failures[0], restarts_so_far=1)
    finally:
        group.stop()


def test_an_exception_is_reported_with_its_traceback_and_fatal_flag(make_group):
    group, _ = make_group(2)
    plain = group.call(0, Counter.fail)
    fatal = group.call(1, Counter.fail_fatal)
    _, failures = _collect(group, failures=2)
    by_worker = {f.worker_id: f for f in failures}
    assert by_worker[0].lost_calls == (plain,) and by_worker[1].lost_calls == (fatal,)
    assert not by_worker[0].fatal and by_worker[1].fatal
    assert "ValueError: boom in worker" in by_worker[0].error
    assert "in fail" in by_worker[0].error  # The remote traceback.
    assert "observations of the wrong shape" in by_worker[1].error
    assert group.healthy_ids() == []


def test_a_hung_call_is_killed_after_timeout_s(make_group, backend):
    def describe_hang(progress: Any) -> str:
        where = "somewhere" if progress is None else f"at step {progress[0]}"
        return f"env Toy-v0 hangs {where}"

    group, _ = make_group(1, timeout_s=1.0, shared_progress=True, describe_hang=describe_hang)
    pid = group.pids()[0]
    hung = group.call(0, Counter.sleep, 60.0)
    started = time.monotonic()
    _, failures = _collect(group, failures=1)
    assert 1.0 <= time.monotonic() - started < 10.0
    [failure] = failures
    assert failure.lost_calls == (hung,)
    where = "at step 7" if isinstance(backend, ProcessBackend) else "somewhere"
    assert failure.error == (
        "actor 0 did not answer a sleep request within sample_timeout_s=1 s: "
        f"env Toy-v0 hangs {where} (the actor was killed)"
    )
    assert group.healthy_ids() == []
    assert _wait_until(lambda: not _alive(pid))


def test_the_call_timeout_counts_from_when_a_worker_is_up_not_from_its_start(make_group):
    """Calls queued while a worker starts (or restarts) wait for it without their clock
    running: a start slower than `timeout_s` is not a hang. A restarted Ray actor on a busy
    machine took longer than a 3 s `sample_timeout_s` and was killed again and again."""
    group, _ = make_group(1, factory=_toys().SlowCounter, timeout_s=0.5, max_restarts=1)
    assert group.spec.timeout_s * 2 < SlowCounter.SLOW_START_S
    first = group.call(0, Counter.incr)
    replies, failures = _collect(group, replies=1)
    assert failures == [] and [(r.call_id, r.value) for r in replies] == [(first, 101)]

    group.restart(0)  # Slow again; and the call still waits for it.
    again = group.call(0, Counter.incr)
    replies, failures = _collect(group, replies=1)
    assert failures == [] and [(r.call_id, r.value) for r in replies] == [(again, 201)]


def test_a_worker_that_does_not_start_within_start_timeout_s_is_killed(make_group):
    group, _ = make_group(1, factory=_toys().HangingCounter, timeout_s=0.5, start_timeout_s=1.5)
    lost = group.call(0, Counter.incr)
    started = time.monotonic()
    _, failures = _collect(group, failures=1)
    assert time.monotonic() - started < 10.0
    [failure] = failures
    assert failure.lost_calls == (lost,)
    assert failure.error == (
        "actor 0 did not start within 1.5 s (its factory, e.g. the env creator, had not "
        "returned; the actor was killed)"
    )
    assert group.healthy_ids() == []


def test_call_and_wait_holds_other_replies_and_failures_for_the_next_poll(make_group):
    group, _ = make_group(2)
    other = group.call(0, Counter.incr, 5)
    group.call(1, Counter.fail)
    states = group.call_and_wait([0, 1], Counter.get, timeout_s=_WAIT_S)
    assert states == {0: {"start": 100, "count": 105, "weights": []}}
    replies, failures = group.poll(0.0)
    assert [(r.call_id, r.value) for r in replies] == [(other, 105)]
    assert [f.worker_id for f in failures] == [1]

    group.call(0, Counter.sleep, 1.0, reply=False)
    with pytest.raises(TimeoutError, match=r"actor \[0\] did not answer 'sleep'"):
        group.call_and_wait([0], Counter.sleep, 0.0, timeout_s=0.2)
    # The abandoned reply comes before this one, and is dropped.
    assert group.call_and_wait([0], Counter.incr, 1, timeout_s=_WAIT_S) == {0: 106}
    assert group.poll(0.0) == ([], [])


def test_workers_run_one_thread_per_numeric_library_and_no_gpu(make_group):
    group, _ = make_group(1)
    want = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1"}
    want["CUDA_VISIBLE_DEVICES"] = ""
    assert group.call_and_wait([0], Counter.env, *want, timeout_s=_WAIT_S) == {0: want}


def test_stop_ends_every_worker_and_is_idempotent(make_group, tmp_path):
    group, _ = make_group(2)
    pids = list(group.pids().values())
    markers = [tmp_path / f"busy-{i}" for i in (0, 1)]
    for i, marker in enumerate(markers):  # Busy workers never read "stop".
        group.call(i, Counter.sleep, 30.0, str(marker))
    assert _wait_until(lambda: all(m.exists() for m in markers))
    group.stop()
    group.stop()
    assert _wait_until(lambda: not any(_alive(p) for p in pids))
    assert group.call(1, Counter.get) is None


def test_ray_refuses_a_custom_resource_that_no_node_offers(ray_cluster):
    spec = WorkerSpec(
        role="actor",
        factory=_toys().Counter,
        make_args=lambda i: (0,),
        resources={"no_such_accelerator": 1.0},
    )
    with pytest.raises(ValueError, match="custom_resources_per_env_runner.*no_such_accelerator"):
        WorkerGroup(RayBackend(address=None, num_cpus=4), spec, 1)
    assert ray_cluster.is_initialized()  # Not shut down: this module's fixture started it.


# Process backend only ------------------------------------------------------------------------


def test_a_pipe_passed_to_a_worker_process_sees_eof_when_it_dies():
    peers, handed = [], []

    def make_args(worker_id: int) -> tuple:
        mine, theirs = mp.Pipe()
        peers.append(mine)
        handed.append(theirs)  # Still referenced here, as a server might.
        return (0, theirs)

    spec = WorkerSpec(role="actor", factory=_toys().Counter, make_args=make_args)
    group = WorkerGroup(ProcessBackend(), spec, 1)
    try:
        pid = group.pids()[0]
        os.kill(pid, signal.SIGKILL)
        assert peers[0].poll(10.0)
        with pytest.raises(EOFError):
            peers[0].recv()
    finally:
        group.stop()


def _run_script(directory, source: str) -> subprocess.CompletedProcess:
    """Runs `source` (dedented) as `directory/script.py` in a fresh Python."""
    script = directory / "script.py"
    script.write_text(textwrap.dedent(source))
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=directory,
        env={**os.environ, "PYTHONPATH": REPO},
        capture_output=True,
        text=True,
        timeout=_WAIT_S,
    )


def test_a_script_without_main_guard_is_not_rerun_in_its_workers(tmp_path):
    result = _run_script(
        tmp_path,
        """
            import os
            from impala_tf.workers import ProcessBackend, WorkerGroup, WorkerSpec

            with open("runs.txt", "a") as f:
                f.write(f"{os.getpid()}\\n")


            class Echo:
                def __init__(self, worker_id, tag):
                    self.tag = tag

                def hello(self, suffix):
                    return self.tag + suffix


            spec = WorkerSpec(role="actor", factory=Echo, make_args=lambda i: (f"w{i}",))
            group = WorkerGroup(ProcessBackend(), spec, 2)
            print(group.call_and_wait([0, 1], Echo.hello, "!", timeout_s=30.0))
            group.stop()
            """,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "{0: 'w0!', 1: 'w1!'}"
    assert len((tmp_path / "runs.txt").read_text().split()) == 1


def test_ended_workers_leave_no_semaphore_for_the_resource_tracker_to_free_at_exit(tmp_path):
    # A Ray actor that exits gracefully (a Tune trial's process) kills its child processes,
    # Python's resource tracker among them, before the interpreter's finalizers run: a command
    # queue still held then restarted the tracker with a warning and KeyError tracebacks.
    result = _run_script(
        tmp_path,
        """
            import os, signal
            from multiprocessing import resource_tracker
            from impala_tf.workers import ProcessBackend, WorkerGroup, WorkerSpec


            class Echo:
                def __init__(self, worker_id):
                    pass

                def hello(self):
                    return "hi"


            if __name__ == "__main__":
                spec = WorkerSpec(
                    role="actor", factory=Echo, make_args=lambda i: (), start_method="forkserver"
                )
                group = WorkerGroup(ProcessBackend(), spec, 2)
                print(group.call_and_wait([0, 1], Echo.hello, timeout_s=30.0))
                group.stop()  # `group` is still referenced when the interpreter exits.
                tracker = resource_tracker._resource_tracker._pid
                os.kill(tracker, signal.SIGKILL)
                os.waitpid(tracker, 0)  # Dead before the interpreter's exit begins.
            """,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "{0: 'hi', 1: 'hi'}"
    assert "resource_tracker" not in result.stderr and "KeyError" not in result.stderr


def test_calls_name_the_hosted_classs_method_not_a_string():
    from impala_tf.workers.protocol import method_name

    assert method_name(Counter.incr) == "incr"
    for wrong in ("incr", lambda: None, Counter._private_helper, 3):
        with pytest.raises(TypeError):
            method_name(wrong)
