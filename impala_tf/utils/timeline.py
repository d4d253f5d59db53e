"""Where a process's start-up and shut-down time goes: named wall-clock marks.

`impala-train --verbose` prints them at its end, e.g. (the README's CartPole command):

    impala-train: timeline (s since process start): flags 0.2, plan 0.6, fork server 0.6,
    tensorflow 7.1, built 7.9, iteration 1 9.5, stop line 14.1, stopped LearnerGroup 14.1,
    stopped AggregationStage 14.1, stopped EnvRunnerGroup 14.2

The marks are set where the phases end: `impala_tf.driver.factory.build_algorithm` (the plan,
the actors' fork server started, TensorFlow's import, the algorithm built with its actors
started), the binary (its flags parsed, the first iteration's result, which includes the
learner's first trace, and the stop line, after the final checkpoint) and
`impala_tf.driver.algorithm.Impala.stop` (each part stopped, by its class's name). Time counts
from the process's start as the kernel records it (Linux), so the interpreter's own start and
the first imports are in the first phase; elsewhere from this module's import.
"""

from __future__ import annotations

import collections
import os
import time

__all__ = ["mark", "marks", "process_start_time", "summary"]

#: The newest marks: a long-lived process (a notebook, Tune's reused workers) adds four at each
#: `Impala.stop` and never prints them, so the oldest go.
_MARKS: collections.deque[tuple[str, float]] = collections.deque(maxlen=256)


def process_start_time() -> float:
    """The process's start in `time.time()`'s clock (Linux: /proc; else this module's import)."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            # Field 22, after the command's parenthesised name (which may hold spaces): the
            # start in clock ticks since boot.
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])  # To 0.01 s; /proc/stat's btime is whole seconds.
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return _IMPORTED


_IMPORTED = time.time()


def mark(name: str) -> None:
    """Records that the phase `name` ended now."""
    _MARKS.append((name, time.time()))


def marks() -> list[tuple[str, float]]:
    """The marks so far, in order: (name, seconds since the process's start)."""
    start = process_start_time()
    return [(name, t - start) for name, t in _MARKS]


def summary() -> str:
    """The marks as one line: `name seconds, ...` (seconds since the process's start)."""
    return ", ".join(f"{name} {seconds:.1f}" for name, seconds in marks())
