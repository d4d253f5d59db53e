"""Tests of tests/support/processes.py and of the tools.proclib readers it is built on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from tests.support import processes
from tools import proclib

# Waits for stdin to close, so that the test decides when it exits.
_WAIT = "import sys; sys.stdin.read()"


@pytest.fixture
def waiting_child():
    """A live child process that exits when its stdin closes."""
    proc = subprocess.Popen([sys.executable, "-c", _WAIT], stdin=subprocess.PIPE)
    try:
        yield proc
    finally:
        proc.stdin.close()
        proc.wait(30)


def _gone_pid() -> int:
    """The pid of a child that exited and was reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ----------------------------------------------------------------------------- alive, wait_until


def test_a_child_is_alive_until_it_exits(waiting_child):
    assert processes.alive(waiting_child.pid)
    assert processes.alive(os.getpid())
    waiting_child.stdin.close()
    waiting_child.wait(30)
    assert not processes.alive(waiting_child.pid)


def test_a_zombie_counts_as_dead():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        # Exited and not reaped: kill(0) still finds it, /proc says "Z".
        assert processes.wait_until(lambda: proclib.state(proc.pid) == "Z", 30, 0.01)
        os.kill(proc.pid, 0)
        assert not processes.alive(proc.pid)
    finally:
        proc.wait()
    assert proclib.state(proc.pid) is None  # Reaped: gone from /proc.


def test_wait_until_polls_and_asks_once_more_at_the_deadline():
    calls = []
    assert processes.wait_until(lambda: calls.append(1) or len(calls) >= 3, 10, 0.001)
    assert len(calls) == 3
    assert not processes.wait_until(lambda: False, timeout_s=0.05, interval_s=0.01)
    late = []
    # No time to poll: the predicate is still asked once, at the deadline.
    assert processes.wait_until(lambda: late.append(1) or True, timeout_s=0.0)
    assert late == [1]


# ----------------------------------------------------------------------------------- descendants

# Starts a child that waits and one that exits at once (never reaped: a zombie), prints their
# pids, and waits for stdin to close.
_PARENT = textwrap.dedent(
    """
    import subprocess, sys
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    print(live.pid, dead.pid, flush=True)
    sys.stdin.read()
    live.stdin.close()
    live.wait()
    dead.wait()
    """
)


def test_descendants_are_the_live_tree_below_a_pid():
    proc = subprocess.Popen(
        [sys.executable, "-c", _PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        live, dead = map(int, proc.stdout.readline().split())
        assert processes.wait_until(lambda: proclib.state(dead) == "Z", 30, 0.01)
        assert sorted(proclib.descendants(proc.pid)) == sorted([live, dead])
        assert proclib.process_tree(proc.pid) == [proc.pid, *proclib.descendants(proc.pid)]
        assert processes.descendants(proc.pid) == [live]  # The zombie is left out.
        assert proc.pid in processes.descendants(os.getpid())
        assert proclib.parent_pid(live) == proc.pid
        assert proclib.children(live) == [] and processes.descendants(live) == []
    finally:
        proc.stdin.close()
        proc.wait(30)
    assert processes.descendants(proc.pid) == [] and proclib.process_tree(proc.pid) == []


# ------------------------------------------------------------------- run_in_background and logs


def test_a_background_run_has_its_own_session_and_logs_both_streams(tmp_path):
    log = tmp_path / "log.txt"
    script = (
        "import sys, time; print('ready', 6 * 7, flush=True); "
        "print('warning on stderr', file=sys.stderr, flush=True); time.sleep(60)"
    )
    proc = processes.run_in_background(
        [sys.executable, "-c", script], cwd=tmp_path, env=dict(os.environ), log_path=log
    )
    try:
        match = processes.wait_for_line(log, r"^ready (\d+)$", timeout_s=30, process=proc)
        assert match.group(1) == "42"
        processes.wait_for_line(log, "on stderr", timeout_s=30, process=proc)
        assert proclib.session_id(proc.pid) == proc.pid != proclib.session_id(os.getpid())
        assert processes.session_pids(proc.pid) == [proc.pid]
        assert os.readlink(f"/proc/{proc.pid}/fd/0") == os.devnull
    finally:
        assert processes.kill_session(proc) == []
    assert proc.returncode == -signal.SIGKILL
    assert not processes.alive(proc.pid)


def test_wait_for_line_times_out_with_the_logs_tail(tmp_path):
    log = tmp_path / "log.txt"
    proc = processes.run_in_background(
        [sys.executable, "-c", "import time; print('hello', flush=True); time.sleep(60)"],
        cwd=tmp_path,
        env=None,
        log_path=log,
    )
    try:
        processes.wait_for_line(log, "hello", timeout_s=30)
        with pytest.raises(TimeoutError, match=r"'never' within 0.2 s(.|\n)*hello"):
            processes.wait_for_line(log, "never", timeout_s=0.2, process=proc)
    finally:
        processes.kill_session(proc)


def test_wait_for_line_stops_when_the_process_exits(tmp_path):
    log = tmp_path / "log.txt"
    proc = processes.run_in_background(
        [sys.executable, "-c", "print('bye', flush=True); raise SystemExit(3)"],
        cwd=tmp_path,
        env=None,
        log_path=log,
    )
    # Its last line still counts after it exited; a line that never comes fails at once.
    assert processes.wait_for_line(log, "^bye$", timeout_s=30, process=proc)
    with pytest.raises(RuntimeError, match=r"status 3 before a line matched 'never'(.|\n)*bye"):
        processes.wait_for_line(log, "never", timeout_s=60, process=proc)
    assert processes.log_tail(tmp_path / "missing.txt") == ""


@pytest.mark.parametrize(
    "ignore_sigint, handler", [(False, "default_int_handler"), (True, "ignored")]
)
def test_a_background_job_may_start_with_sigint_ignored(tmp_path, ignore_sigint, handler):
    # Python keeps SIGINT ignored when it starts that way, and installs its own handler if not.
    script = (
        "import signal; h = signal.getsignal(signal.SIGINT); "
        "print('ignored' if h == signal.SIG_IGN else h.__name__)"
    )
    log = tmp_path / "log.txt"
    proc = processes.run_in_background(
        [sys.executable, "-c", script], tmp_path, None, log, ignore_sigint=ignore_sigint
    )
    try:
        match = processes.wait_for_line(log, r"^\S+$", timeout_s=30, process=proc)
        assert match.group(0) == handler
    finally:
        processes.kill_session(proc)


def test_kill_session_ends_a_child_whose_parent_already_exited(tmp_path):
    log = tmp_path / "log.txt"
    script = (
        "import subprocess, sys; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print('child', p.pid, flush=True)"
    )
    proc = processes.run_in_background([sys.executable, "-c", script], tmp_path, None, log)
    child = int(processes.wait_for_line(log, r"^child (\d+)$", 30, proc).group(1))
    proc.wait(30)
    # Re-parented, but still in the run's session.
    assert processes.session_pids(proc.pid) == [child]
    assert child not in processes.descendants(proc.pid)
    assert processes.kill_session(proc) == []
    assert processes.wait_until(lambda: not processes.alive(child), 10, 0.05)


# ------------------------------------------------------------------------ the /proc readers below


def test_stat_fields_follow_a_command_name_with_spaces_and_parentheses():
    script = (
        "import os, sys; open('/proc/self/comm', 'w').write('a) b (c'); "
        "print(os.getppid(), flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert int(proc.stdout.readline()) == os.getpid()
        with open(f"/proc/{proc.pid}/comm") as f:
            assert f.read().strip() == "a) b (c"
        assert proclib.parent_pid(proc.pid) == os.getpid()
        assert proclib.state(proc.pid) in ("R", "S")
        assert proclib.session_id(proc.pid) == proclib.session_id(os.getpid())
        assert proclib.cpu_seconds(proc.pid) >= 0.0
    finally:
        proc.stdin.close()
        proc.wait(30)


def test_readers_of_a_process(tmp_path, waiting_child):
    me = os.getpid()
    fds, threads = proclib.fd_count(me), proclib.thread_count(me)
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    with open(tmp_path / "held.txt", "w") as held:
        assert proclib.fd_count(me) == fds + 1
        assert os.path.realpath(held.name) in proclib.fd_targets(me)
        assert proclib.thread_count(me) == threads + 1
    stop.set()
    thread.join()
    assert proclib.peak_rss_bytes(me) >= proclib.rss_bytes(me) > 10 * 2**20
    child = waiting_child.pid
    assert proclib.cmdline(child) == [sys.executable, "-c", _WAIT]
    assert proclib.environ(child)["PATH"] == os.environ["PATH"]
    assert any(os.path.basename(p).startswith("libc") for p in proclib.mapped_paths(child))
    assert child in proclib.all_pids() and child in proclib.children(me)


def test_readers_of_a_process_that_is_gone():
    pid = _gone_pid()
    assert proclib.stat_fields(pid) is None and proclib.state(pid) is None
    assert proclib.parent_pid(pid) is None and proclib.session_id(pid) is None
    assert proclib.cpu_seconds(pid) is None
    assert proclib.rss_bytes(pid) == proclib.peak_rss_bytes(pid) == 0
    assert proclib.fd_count(pid) == proclib.thread_count(pid) == 0
    assert proclib.fd_targets(pid) == proclib.cmdline(pid) == proclib.mapped_paths(pid) == []
    assert proclib.environ(pid) == {} and proclib.children(pid) == []
    assert proclib.descendants(pid) == [] and proclib.process_tree(pid) == []
    assert pid not in proclib.all_pids()
