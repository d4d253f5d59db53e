"""Tests for impala_tf.learning.stats: WindowStat, TimerStat and timer_ms."""

from __future__ import annotations

import math
import threading
import time
import warnings

import numpy as np
import pytest

from impala_tf.learning.stats import QUANTILES, TimerStat, WindowStat, timer_ms


class TestWindowStat:
    def test_partial_window_matches_numpy(self):
        stat = WindowStat("size", 50)
        values = [3, 0, 7, 7, 1]
        for v in values:
            stat.push(v)
        out = stat.stats()
        assert set(out) == {"size_count", "size_mean", "size_std", "size_quantiles"}
        assert out["size_count"] == 5
        assert out["size_mean"] == pytest.approx(np.mean(values))
        assert out["size_std"] == pytest.approx(np.std(values))
        np.testing.assert_allclose(out["size_quantiles"], np.percentile(values, QUANTILES))
        assert QUANTILES == (0, 10, 50, 90, 100)
        assert len(stat) == 5

    def test_window_keeps_last_n_and_counts_all(self):
        stat = WindowStat("q", 5)
        values = [10.0, 20.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
        for v in values:
            stat.push(v)
        window = values[-5:]
        out = stat.stats()
        assert out["q_count"] == 8  # RLlib counts every push, not only the window.
        assert stat.count == 8
        assert len(stat) == 5
        assert out["q_mean"] == pytest.approx(np.mean(window))
        assert out["q_std"] == pytest.approx(np.std(window))
        np.testing.assert_allclose(out["q_quantiles"], np.percentile(window, QUANTILES))
        assert all(type(q) is float for q in out["q_quantiles"])

    def test_empty_window_is_nan_without_warnings(self):
        stat = WindowStat("size", 3)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = stat.stats()
        assert out["size_count"] == 0
        assert math.isnan(out["size_mean"]) and math.isnan(out["size_std"])
        assert out["size_quantiles"] == []

    def test_nan_values_are_ignored(self):
        stat = WindowStat("x", 4)
        for v in [1.0, math.nan, 3.0]:
            stat.push(v)
        out = stat.stats()
        assert out["x_count"] == 3
        assert out["x_mean"] == pytest.approx(2.0)
        np.testing.assert_allclose(out["x_quantiles"], np.percentile([1.0, 3.0], QUANTILES))

    def test_bad_window(self):
        with pytest.raises(ValueError, match="n must be >= 1"):
            WindowStat("x", 0)

    def test_reader_while_writer_pushes(self):
        stat = WindowStat("size", 50)
        n = 20000

        def write():
            for i in range(n):
                stat.push(i % 7)

        writer = threading.Thread(target=write)
        writer.start()
        while writer.is_alive():
            out = stat.stats()
            assert 0.0 <= out["size_mean"] <= 6.0 or out["size_count"] == 0
        writer.join()
        assert stat.stats()["size_count"] == n


class TestTimerStat:
    def test_before_any_sample(self):
        timer = TimerStat()
        assert timer.mean == 0.0
        assert timer.count == 0
        assert timer.total == 0.0
        assert timer.mean_throughput == 0.0
        assert timer.mean_units_processed == 0.0

    def test_window_mean_and_lifetime_totals(self):
        timer = TimerStat()
        assert timer.window_size == 10  # RLlib's default.
        samples = [float(i) for i in range(1, 13)]
        for s in samples:
            timer.push(s)
        assert timer.mean == pytest.approx(np.mean(samples[-10:]))
        assert timer.count == 12
        assert timer.total == pytest.approx(sum(samples))

    def test_custom_window(self):
        timer = TimerStat(window_size=2)
        for s in [1.0, 2.0, 4.0]:
            timer.push(s)
        assert timer.mean == pytest.approx(3.0)
        with pytest.raises(ValueError, match="window_size"):
            TimerStat(window_size=0)

    def test_context_manager_measures_the_block(self):
        timer = TimerStat()
        with timer as entered:
            time.sleep(0.02)
        assert entered is timer
        assert timer.count == 1
        assert 0.015 <= timer.mean < 1.0
        assert timer.total == pytest.approx(timer.mean)

    def test_not_reentrant(self):
        timer = TimerStat()
        with timer, pytest.raises(RuntimeError, match="re-entrant"), timer:
            pass
        assert timer.count == 1

    def test_block_that_raises_is_still_timed(self):
        timer = TimerStat()
        with pytest.raises(KeyError), timer:
            raise KeyError("boom")
        assert timer.count == 1
        with timer:  # Usable again afterwards.
            pass
        assert timer.count == 2

    def test_throughput(self):
        timer = TimerStat()
        timer.push(2.0)
        timer.push_units_processed(10)
        timer.push(3.0)
        timer.push_units_processed(40)
        assert timer.mean_throughput == pytest.approx(50 / 5.0)
        assert timer.mean_units_processed == pytest.approx(25.0)

    def test_reader_while_writer_pushes(self):
        timer = TimerStat(window_size=100)
        n = 20000

        def write():
            for _ in range(n):
                timer.push(0.5)
                timer.push_units_processed(2)

        writer = threading.Thread(target=write)
        writer.start()
        while writer.is_alive():
            assert timer.mean in (0.0, 0.5)
            timer.mean_throughput  # noqa: B018 - must not raise while the deque grows.
        writer.join()
        assert timer.count == n
        assert timer.mean_throughput == pytest.approx(4.0)


def test_timer_ms_rounds_to_three_decimals():
    timer = TimerStat()
    assert timer_ms(timer) == 0.0
    timer.push(0.00123456)
    assert timer_ms(timer) == 1.235
    timer.push(0.00323456)
    assert timer_ms(timer) == 2.235
