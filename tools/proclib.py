"""Reading processes from /proc (Linux): the process tree, stat fields, CPU, memory, fds, threads;
and ending a session's processes (`kill_session`).

The one place in tools/ and tests/ that parses /proc/<pid>/...: the benchmarks (bench_atari's
memory and CPU sampler, bench_learner's peak memory, measure_actor_memory's fork server), the
soak and the storm (a run's processes, and what leaked after `algo.stop()`), and the tests'
process helpers (`tests/support/processes.py`). Memory figures of the whole machine and of one
process's mappings (/proc/meminfo, /proc/<pid>/smaps_rollup) are read by the package itself:
`impala_tf.workers.memory.read_meminfo` and `read_smaps_rollup`.

Every reader takes a pid and never raises for a process that is gone (or exits while it is
read): it returns the empty value its docstring names. A zombie (exited, not yet reaped) still
has a stat, a state "Z" and a place among its parent's children, but no memory, fds or threads.
Standard library only, so that any tool or test imports it for free.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

__all__ = [
    "all_pids",
    "children",
    "cmdline",
    "cpu_seconds",
    "descendants",
    "environ",
    "fd_count",
    "fd_targets",
    "kill_session",
    "mapped_paths",
    "parent_pid",
    "peak_rss_bytes",
    "process_tree",
    "rss_bytes",
    "session_id",
    "session_pids",
    "stat_fields",
    "state",
    "thread_count",
]

_PROC = "/proc"

# Indices into `stat_fields` (proc(5) numbers the fields from 1; ours start at field 3).
_STATE, _PPID, _SESSION, _UTIME, _STIME = 0, 1, 3, 11, 12


def all_pids() -> list[int]:
    """Every process id /proc lists now (threads not included), ascending."""
    return sorted(int(name) for name in os.listdir(_PROC) if name.isdigit())


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name, or None if `pid` is gone.

    Args:
      pid: A process id.

    Returns:
      proc(5)'s fields 3 onwards as strings: `[0]` is the state (field 3), `[1]` the parent
      pid, `[3]` the session id, `[11]` and `[12]` the user and system CPU time in clock ticks.
    """
    try:
        with open(f"{_PROC}/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: the fields follow the last ')'.
    return stat[stat.rfind(b")") + 2 :].decode("ascii", "replace").split()


def state(pid: int) -> str | None:
    """The state letter of `pid` ("R" running, "S" sleeping, "Z" zombie, ...); None if gone."""
    fields = stat_fields(pid)
    return fields[_STATE] if fields else None


def parent_pid(pid: int) -> int | None:
    """The parent process id of `pid`; None if it is gone."""
    fields = stat_fields(pid)
    return int(fields[_PPID]) if fields else None


def session_id(pid: int) -> int | None:
    """The session id of `pid` (its session leader's pid); None if it is gone."""
    fields = stat_fields(pid)
    return int(fields[_SESSION]) if fields else None


def session_pids(sid: int, zombies: bool = False) -> list[int]:
    """The processes of session `sid`, ascending; zombies only with `zombies=True`.

    A binary started in its own session (`start_new_session=True`) keeps its whole tree in it,
    including the processes whose parent exited (they are re-parented, but keep the session).
    """
    found = []
    for pid in all_pids():
        fields = stat_fields(pid)
        if fields is None or int(fields[_SESSION]) != sid:
            continue
        if zombies or fields[_STATE] != "Z":
            found.append(pid)
    return found


def kill_session(sid: int, timeout_s: float = 30.0, process: Any = None) -> list[int]:
    """SIGKILLs every process of session `sid` until it is empty or `timeout_s` has passed.

    Each member is killed by pid, not by process group, so that one which made a group of its
    own is not missed; the session is listed again until it is empty, so that a child forked
    meanwhile is killed too.

    Args:
      sid: The session (a binary started with `start_new_session=True`: its pid).
      timeout_s: Seconds to wait for the session to empty.
      process: The leader's `subprocess.Popen`, if this process started it: it is reaped, so
        that it leaves the listing.

    Returns:
      The pids still alive in the session after `timeout_s` (empty when all are gone).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        left = session_pids(sid)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
        if process is not None:
            process.poll()
        if not left:
            return []
        if time.monotonic() >= deadline:
            return session_pids(sid)
        time.sleep(0.05)


def children(pid: int) -> list[int]:
    """Direct children of `pid` (zombies included), from /proc/<pid>/task/*/children.

    Every thread's list is read: a child belongs to the thread that forked it.
    """
    found: list[int] = []
    try:
        tasks = os.listdir(f"{_PROC}/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"{_PROC}/{pid}/task/{tid}/children", encoding="ascii") as f:
                found.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return found


def descendants(pid: int) -> list[int]:
    """Every descendant of `pid` (children, grandchildren, ..., zombies included), not `pid`."""
    found: list[int] = []
    stack = children(pid)
    while stack:
        child = stack.pop()
        if child in found:
            continue
        found.append(child)
        stack.extend(children(child))
    return found


def process_tree(root_pid: int) -> list[int]:
    """`root_pid` first, then all its descendants; empty if `root_pid` is gone."""
    if not os.path.exists(f"{_PROC}/{root_pid}"):
        return []
    return [root_pid, *descendants(root_pid)]


def cmdline(pid: int) -> list[str]:
    """The argv of `pid` (empty for a zombie, a kernel thread or a process that is gone)."""
    try:
        with open(f"{_PROC}/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    return [arg.decode(errors="replace") for arg in raw.split(b"\0")[:-1]]


def environ(pid: int) -> dict[str, str]:
    """The environment `pid` started with (empty if it is gone or not ours to read)."""
    try:
        with open(f"{_PROC}/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0"))
    return {name: value for name, sep, value in pairs if sep}


def mapped_paths(pid: int) -> list[str]:
    """The files mapped into `pid`'s memory (shared libraries, ...), sorted, each once."""
    try:
        with open(f"{_PROC}/{pid}/maps", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    # address perms offset dev inode [path]; the path may hold spaces.
    paths = {parts[5] for line in lines if len(parts := line.split(maxsplit=5)) == 6}
    return sorted(p for p in paths if p.startswith("/"))


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds `pid` used (all its threads); None if it is gone."""
    fields = stat_fields(pid)
    if fields is None:
        return None
    return (int(fields[_UTIME]) + int(fields[_STIME])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    """Resident set size of `pid` in bytes (VmRSS, from /proc/<pid>/statm); 0 if it is gone."""
    try:
        with open(f"{_PROC}/{pid}/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def peak_rss_bytes(pid: int) -> int:
    """The highest resident set size `pid` has had, in bytes (VmHWM); 0 if it is gone."""
    try:
        with open(f"{_PROC}/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # The kernel writes kB.
    except (OSError, IndexError, ValueError):
        pass
    return 0


def fd_count(pid: int) -> int:
    """Open file descriptors of `pid` (0 if it is gone)."""
    try:
        return len(os.listdir(f"{_PROC}/{pid}/fd"))
    except OSError:
        return 0


def fd_targets(pid: int) -> list[str]:
    """What each open fd of `pid` points at (`pipe:[123]`, a path, ...), sorted (leak reports)."""
    found = []
    try:
        names = os.listdir(f"{_PROC}/{pid}/fd")
    except OSError:
        return found
    for name in names:
        try:
            found.append(os.readlink(f"{_PROC}/{pid}/fd/{name}"))
        except OSError:
            continue
    return sorted(found)


def thread_count(pid: int) -> int:
    """Threads of `pid`, native ones included (0 if it is gone)."""
    try:
        return len(os.listdir(f"{_PROC}/{pid}/task"))
    except OSError:
        return 0
