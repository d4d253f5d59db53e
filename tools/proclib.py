"""Reading a process tree from /proc (Linux): descendants, RSS, open fds, threads.

Used by tools/soak.py and tools/storm.py to measure a run's processes and to check that nothing
leaked after `algo.stop()`.
"""

from __future__ import annotations

import os

__all__ = ["cpu_seconds", "descendants", "fd_count", "fd_targets", "rss_bytes", "thread_count"]


def _children(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc/<pid>/task/*/children (all threads)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as f:
                out.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return out


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (children, grandchildren, ...), without `pid` itself."""
    found: list[int] = []
    stack = _children(pid)
    while stack:
        child = stack.pop()
        if child in found:
            continue
        found.append(child)
        stack.extend(_children(child))
    return found


def rss_bytes(pid: int) -> int:
    """Resident set size of `pid` in bytes (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def fd_count(pid: int) -> int:
    """Open file descriptors of `pid` (0 if it is gone)."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def fd_targets(pid: int) -> list[str]:
    """What each open fd of `pid` points at (`pipe:[123]`, a path, ...), for leak reports."""
    out = []
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for name in names:
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{name}"))
        except OSError:
            continue
    return sorted(out)


def thread_count(pid: int) -> int:
    """Threads of `pid` (0 if it is gone)."""
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time `pid` has used, in seconds (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            # The command name (field 2) may hold spaces: split after its closing parenthesis.
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0
