"""Window statistics and timers for the learner thread's metrics (RLlib's WindowStat, TimerStat).

Values are scalars (Python or numpy numbers); times are seconds. The learner thread records its
queue size in a `WindowStat("size", 50)` and times dequeueing, loading and gradient steps with
`TimerStat`s; `timer_ms` turns a timer into the `timing_breakdown` figure RLlib reports.

Both classes take a lock around every update and read, so one thread may write while another
reads (the learner thread writes, the driver reads).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import numpy as np

__all__ = ["QUANTILES", "TimerStat", "WindowStat", "timer_ms"]

QUANTILES = (0, 10, 50, 90, 100)
"""Percentiles reported by `WindowStat.stats()`."""


class WindowStat:
    """Mean, standard deviation and quantiles over the last `n` pushed values.

    As in RLlib, `{name}_count` is the number of values pushed over the lifetime (not capped at
    `n`), NaN values are ignored, and an empty window reports NaN mean and std and an empty
    quantile list. `len(stat)` is the number of values currently in the window.
    """

    def __init__(self, name: str, n: int):
        """Creates an empty window.

        Args:
            name: prefix of the keys returned by `stats()`.
            n: window length, >= 1.

        Raises:
            ValueError: `n` < 1.
        """
        if n < 1:
            raise ValueError(f"WindowStat window n must be >= 1, got {n}")
        self.name = name
        self.window_size = int(n)
        self._items = np.empty(self.window_size, dtype=np.float64)
        self._next = 0
        self._count = 0
        self._lock = threading.Lock()

    def push(self, value: float) -> None:
        """Adds `value` to the window, replacing the oldest value once the window is full."""
        value = float(value)
        with self._lock:
            self._items[self._next] = value
            self._next = (self._next + 1) % self.window_size
            self._count += 1

    @property
    def count(self) -> int:
        """Number of values pushed since creation."""
        return self._count

    def __len__(self) -> int:
        return min(self._count, self.window_size)

    def stats(self) -> dict[str, Any]:
        """Returns `{name}_count`, `{name}_mean`, `{name}_std` and `{name}_quantiles`.

        Returns:
            count: int, values pushed since creation. mean, std: float over the window
            (population std, NaN for an empty window). quantiles: list of floats, the 0th, 10th,
            50th, 90th and 100th percentiles of the window (linear interpolation), [] if empty.
        """
        with self._lock:
            count = self._count
            window = self._items[: min(count, self.window_size)].copy()
        window = window[~np.isnan(window)]
        if window.size:
            mean, std = float(window.mean()), float(window.std())
            quantiles = [float(q) for q in np.percentile(window, QUANTILES)]
        else:
            # RLlib's np.nanmean of an empty window: NaN (we skip numpy's warning).
            mean, std, quantiles = float("nan"), float("nan"), []
        return {
            f"{self.name}_count": count,
            f"{self.name}_mean": mean,
            f"{self.name}_std": std,
            f"{self.name}_quantiles": quantiles,
        }


class TimerStat:
    """Times code blocks; reports the mean over the last `window_size` timings.

    Use as a context manager (`with timer: ...`) or `push(seconds)` for a duration measured
    elsewhere. `push_units_processed(n)` records how much work a timed block did, for
    `mean_throughput`. A timer is not re-entrant: one block at a time.
    """

    def __init__(self, window_size: int = 10):
        """Creates a timer with no samples.

        Args:
            window_size: number of recent timings (and unit counts) averaged; RLlib's default 10.

        Raises:
            ValueError: `window_size` < 1.
        """
        if window_size < 1:
            raise ValueError(f"TimerStat window_size must be >= 1, got {window_size}")
        self.window_size = int(window_size)
        self._samples: collections.deque[float] = collections.deque(maxlen=self.window_size)
        self._units: collections.deque[float] = collections.deque(maxlen=self.window_size)
        self._start: float | None = None
        self._count = 0
        self._total = 0.0
        self._lock = threading.Lock()

    def __enter__(self) -> TimerStat:
        if self._start is not None:
            raise RuntimeError("TimerStat is already timing a block; it is not re-entrant")
        self._start = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        elapsed = time.perf_counter() - self._start
        self._start = None
        # A block that raised still took this long (as in RLlib).
        self.push(elapsed)

    def push(self, seconds: float) -> None:
        """Records one duration in seconds."""
        seconds = float(seconds)
        with self._lock:
            self._samples.append(seconds)
            self._count += 1
            self._total += seconds

    def push_units_processed(self, n: float) -> None:
        """Records the amount of work (e.g. env steps) done in the latest timed block."""
        with self._lock:
            self._units.append(float(n))

    @property
    def mean(self) -> float:
        """Mean of the last `window_size` durations in seconds; 0.0 before any (as RLlib)."""
        with self._lock:
            samples = list(self._samples)
        return float(np.mean(samples)) if samples else 0.0

    @property
    def count(self) -> int:
        """Number of durations recorded since creation."""
        return self._count

    @property
    def total(self) -> float:
        """Sum of all durations recorded since creation, in seconds."""
        return self._total

    @property
    def mean_units_processed(self) -> float:
        """Mean of the last `window_size` unit counts; 0.0 before any."""
        with self._lock:
            units = list(self._units)
        return float(np.mean(units)) if units else 0.0

    @property
    def mean_throughput(self) -> float:
        """Units per second over the window: sum of unit counts / sum of durations (0.0 if none).

        Pair each timed block with one `push_units_processed` so both windows cover the same
        blocks.
        """
        with self._lock:
            seconds = sum(self._samples)
            units = sum(self._units)
        return units / seconds if seconds else 0.0


def timer_ms(timer: TimerStat) -> float:
    """Returns `timer`'s mean in milliseconds rounded to 3 decimals (RLlib's `timer_to_ms`)."""
    return round(1000.0 * timer.mean, 3)
