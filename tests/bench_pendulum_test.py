"""Tests of the pure-logic parts of tools.bench_pendulum: line parsing and the thresholds."""

from __future__ import annotations

import math

import pytest

from impala_tf.training import reporting
from tools import bench_pendulum


def test_parses_the_binarys_own_progress_line():
    result = {
        "training_iteration": 13,
        "time_total_s": 65.2,
        "timesteps_total": 1_332_000,
        "episode_reward_mean": -702.25,
        "episode_reward_min": -1556.0,
        "episode_reward_max": -288.0,
        "num_env_steps_sampled_throughput_per_sec": 3595.0,
        "num_env_steps_trained_throughput_per_sec": 3595.0,
    }
    line = reporting.progress_line(result, timestep_budget=5_000_000)
    steps, ret = bench_pendulum.parse_impala_line(line + "\n")
    assert steps == 1_332_000
    assert ret == pytest.approx(-702.25, abs=0.05)


def test_a_line_before_any_episode_has_a_nan_return():
    line = reporting.progress_line({"training_iteration": 1, "timesteps_total": 500})
    steps, ret = bench_pendulum.parse_impala_line(line)
    assert steps == 500 and math.isnan(ret)


@pytest.mark.parametrize("line", ["", "I1123 starting actors", "iteration 3 done", "{not json"])
def test_other_lines_are_not_points(line):
    assert bench_pendulum.parse_impala_line(line) is None
    assert bench_pendulum.parse_rllib_line(line) is None


def test_parses_rllib_json_lines():
    assert bench_pendulum.parse_rllib_line('{"steps": 2500, "return": -1200.5}\n') == (
        2500,
        -1200.5,
    )
    steps, ret = bench_pendulum.parse_rllib_line('{"steps": 10, "return": NaN}')
    assert steps == 10 and math.isnan(ret)
    assert bench_pendulum.parse_rllib_line('{"t": 1.0}') is None


def test_summary_finds_the_first_crossing_of_each_target_and_the_best():
    curve = [
        (10.0, 1_000, math.nan),
        (20.0, 2_000, -1200.0),
        (30.0, 3_000, -700.0),  # reaches -700 exactly: counts.
        (40.0, 4_000, -900.0),
        (50.0, 5_000, -199.5),
        (60.0, 6_000, -150.0),
        (70.0, 7_000, -180.0),
    ]
    summary = bench_pendulum.summarize(curve)
    assert summary["reached"][-700.0] == (30.0, 3_000)
    assert summary["reached"][-200.0] == (50.0, 5_000)
    assert summary["best"] == (-150.0, 6_000)
    assert summary["last"] == (70.0, 7_000, -180.0)


def test_summary_of_a_curve_that_never_gets_there():
    summary = bench_pendulum.summarize([(1.0, 10, math.nan), (2.0, 20, -1100.0)])
    assert summary["reached"] == {-700.0: None, -200.0: None}
    assert summary["best"] == (-1100.0, 20)
    empty = bench_pendulum.summarize([])
    assert empty["best"] is None and empty["last"] is None


def test_a_run_with_no_point_gets_a_row_that_says_so():
    row = bench_pendulum._row("RLlib 2.60 seed 1", bench_pendulum.summarize([]))
    assert "no iteration finished" in row
    row = bench_pendulum._row("ours", bench_pendulum.summarize([(12.0, 2_479_500, -184.2)]))
    assert "2,479,500 steps, 12 s" in row and "-184" in row
