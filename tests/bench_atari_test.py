"""Tests of the pure-logic parts of tools.bench_atari: the /proc memory sampler, the rates."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
import time

import pytest

from tools import bench_atari, benchlib, proclib

# A parent that starts a child holding 200 MB of touched memory; both wait for stdin to close.
_TREE = textwrap.dedent(
    """
    import subprocess, sys
    child = subprocess.Popen([sys.executable, "-c",
        "import sys; b = bytearray(200 * 2**20); print('ready', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    child.stdout.readline()
    print(child.pid, flush=True)
    sys.stdin.read()
    child.stdin.close()
    child.wait()
    """
)


@pytest.fixture
def tree():
    """(parent pid, child pid) of a live two-process tree whose child holds 200 MB."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _TREE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        child = int(proc.stdout.readline())
        yield proc.pid, child
    finally:
        proc.stdin.close()
        proc.wait(30)


def test_process_tree_finds_descendants(tree):
    parent, child = tree
    pids = proclib.process_tree(parent)
    assert pids[0] == parent
    assert child in pids
    assert os.getpid() not in pids  # The tree is below `parent`, not above it.


def test_process_tree_of_a_dead_pid_is_empty():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert proclib.process_tree(proc.pid) == []


def test_sampler_sums_the_tree(tree):
    parent, child = tree
    sampler = bench_atari.TreeMemorySampler(parent)
    rss_kb, pss_kb, processes = sampler.sample()
    child_rss, _ = bench_atari.memory_kb(child)
    assert processes == 2
    assert child_rss > 200 * 1024  # The child's touched bytearray.
    assert rss_kb > child_rss  # Parent and child summed.
    assert 200 * 1024 < pss_kb <= rss_kb
    assert sampler.peak_rss_kb == rss_kb and sampler.peak_processes == 2
    # The peaks are kept when the tree is gone.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    sampler.root_pid = gone.pid
    assert sampler.sample() == (0, 0, 0)
    assert sampler.peak_rss_kb == rss_kb and sampler.peak_pss_kb == pss_kb


def test_memory_of_an_exited_process_is_zero():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert bench_atari.memory_kb(proc.pid) == (0, 0)


def test_throughput_excludes_the_first_iteration():
    results = [
        {"time_total_s": 30.0, "timesteps_total": 1_000, "num_env_steps_trained": 500},
        {"time_total_s": 40.0, "timesteps_total": 21_000, "num_env_steps_trained": 15_500},
        {"time_total_s": 50.0, "timesteps_total": 41_000, "num_env_steps_trained": 30_500},
    ]
    out = bench_atari.throughput(results)
    assert out["measured_s"] == pytest.approx(20.0)
    assert out["sampled_per_s"] == pytest.approx(2_000.0)
    assert out["trained_per_s"] == pytest.approx(1_500.0)
    single = bench_atari.throughput(results[:1])
    assert single["sampled_per_s"] == pytest.approx(1_000 / 30)
    with pytest.raises(RuntimeError, match="no results"):
        bench_atari.throughput([])


def test_split_spreads_envs_over_processes():
    assert bench_atari._split(32, 2) == [16, 16]
    assert bench_atari._split(5, 2) == [3, 2]
    assert bench_atari._split(1, 4) == [1]


def test_sampler_thread_samples_until_stopped(tree):
    parent, _ = tree
    sampler = bench_atari.TreeMemorySampler(parent, interval_s=0.05)
    sampler.start()
    while sampler.samples < 2:
        sampler._done.wait(0.05)
    sampler.stop()
    assert not sampler.is_alive()
    assert sampler.peak_rss_kb > 200 * 1024 and sampler.peak_processes == 2


def test_cpu_seconds_grow_with_work_and_shares_split_the_tree():
    busy = "import time\nt = time.time()\nwhile time.time() - t < 3: pass"
    proc = subprocess.Popen([sys.executable, "-c", busy])
    try:
        first = proclib.cpu_seconds(proc.pid)
        time.sleep(1.0)
        second = proclib.cpu_seconds(proc.pid)
        proc.wait(30)
    finally:
        proc.kill()
    assert second - first > 0.3  # A busy loop: about one core.
    assert proclib.cpu_seconds(proc.pid) is None  # Reaped.
    samples = [
        (0.0, {1: 10.0, 2: 3.0, 3: 0.0}),
        (5.0, {1: 11.0, 2: 5.0, 3: 0.1}),
        (10.0, {1: 12.0, 2: 8.0, 3: 0.1, 4: 1.0}),  # 4 started in between: left out.
    ]
    shares = bench_atari.cpu_shares(samples, 1, 0.0, 10.0)
    assert shares["window_s"] == 10.0
    assert shares["driver_cores"] == pytest.approx(0.2)
    assert shares["children_cores"] == pytest.approx(0.51)
    assert shares["busy_children"] == 1
    assert shares["total_cores"] == pytest.approx(0.71)
    assert bench_atari.cpu_shares(samples, 1, 6.0, 10.0) is None  # One sample only.


def _learner(seconds: list[float], batch: int = 500) -> dict:
    return {"batch": batch, "learner_s": seconds}


def test_bounds_take_the_best_env_row_and_the_smaller_bound_each_with_its_range():
    rows = [
        {"label": "A", "steps_per_s": [8_000.0, 7_000.0, 9_000.0]},
        {"label": "B", "steps_per_s": [7_800.0, 9_500.0, 7_700.0]},  # Lower median, higher range.
        {"label": "C", "error": "not covered"},
    ]
    # 500 samples per 0.05, 0.04 and 0.0625 s: 10,000, 12,500 and 8,000 samples/s.
    out = bench_atari.bounds(rows, _learner([0.05, 0.04, 0.0625]))
    assert out["env"] == (8_000.0, 7_700.0, 9_500.0)  # Max of the medians, lows and highs.
    assert out["learner"] == pytest.approx((10_000.0, 8_000.0, 12_500.0))
    # The env row bounds the median and the low end, the learner the high end.
    assert out["ceiling"] == pytest.approx((8_000.0, 7_700.0, 9_500.0))
    slow = bench_atari.bounds(rows, _learner([0.1, 0.125, 0.0625]))  # 5,000 (4,000-8,000).
    assert slow["ceiling"] == pytest.approx((5_000.0, 4_000.0, 8_000.0))
    crossing = bench_atari.bounds(rows, _learner([0.0625, 0.0555, 0.08]))  # 8,000 (6,250-9,009).
    assert crossing["ceiling"] == pytest.approx((8_000.0, 6_250.0, 500 / 0.0555))


def test_ratio_to_the_ceiling_takes_its_low_end_from_the_ceilings_high_end():
    ratio = bench_atari.ratio_to(4_000.0, benchlib.Spread(8_000.0, 5_000.0, 10_000.0))
    assert ratio == pytest.approx((0.5, 0.4, 0.8))
    assert bench_atari._verdict(ratio, 0.7) == "not met, the range crosses it"
    assert bench_atari._verdict(ratio, 0.3) == "met"
    assert bench_atari._verdict(ratio, 0.45) == "met, the range crosses it"
    assert bench_atari._verdict(ratio, 0.9) == "not met"


def test_bench_env_runs_the_layouts_in_turn_each_round(monkeypatch):
    config = bench_atari._load_config(bench_atari.DEFAULT_CONFIG)
    calls = []

    def run(name, payloads):
        calls.append(tuple((p["kind"], p["num_envs"], p["threads"]) for p in payloads))
        rate = 1_000.0 * len(calls)  # Each call's processes step 1,000 x call number env steps/s.
        return [{"steps": rate * 2.0, "seconds": 2.0, "obs_shape": [42, 42, 4]} for _ in payloads]

    rows = bench_atari.bench_env("unused.yaml", config, 2.0, cores=2, rounds=3, run=run)
    layouts = [tuple(calls[i]) for i in range(3)]
    assert layouts == [(("vector", 32, 2),), (("vector", 16, 1),) * 2, (("wrapper", 16, 1),) * 2]
    assert calls == layouts * 3  # A, B, C, A, B, C, A, B, C.
    assert [r["steps_per_s"] for r in rows] == [
        [1_000.0, 4_000.0, 7_000.0],  # One process.
        [4_000.0, 10_000.0, 16_000.0],  # Two processes: their rates summed.
        [6_000.0, 12_000.0, 18_000.0],
    ]
    assert [r["envs"] for r in rows] == [32, 32, 32]
    assert rows[0]["obs_shape"] == [42, 42, 4]


def test_trained_so_far_reads_the_last_complete_result(tmp_path):
    path = tmp_path / "result.json"
    assert bench_atari.trained_so_far(str(path)) is None  # Not written yet.
    path.write_text("")
    assert bench_atari.trained_so_far(str(path)) is None
    path.write_text('{"num_env_steps_trained": 500}\n{"num_env_steps_trained": 1500}\n')
    assert bench_atari.trained_so_far(str(path)) == 1500
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"num_env_steps_trained": 25')  # A line being written.
    assert bench_atari.trained_so_far(str(path)) == 1500


def test_sampler_reads_the_probe_with_each_cpu_sample(tree):
    parent, _ = tree
    values = iter([None, 800])
    sampler = bench_atari.TreeMemorySampler(parent, probe=lambda: next(values))
    sampler.sample()
    sampler.sample()
    assert [t for t, _ in sampler.probe_samples] == [t for t, _ in sampler.cpu_samples]
    assert [v for _, v in sampler.probe_samples] == [None, 800]


def test_core_time_divides_the_trees_cpu_by_the_env_steps_trained_in_the_same_window():
    # Driver pid 1 and one actor, pid 2, sampled every second; results at 10, 20 and 30 s are
    # first seen by the samples at 11, 21 and 31 s.
    samples, trained = [], []
    for t in range(0, 36):
        # Start-up: 0.5 cores until 11 s; then the driver 0.5 cores and the actor 1.5.
        driver = 0.5 * t if t <= 11 else 5.5 + 0.5 * (t - 11)
        actor = 0.0 if t <= 11 else 1.5 * (t - 11)
        samples.append((float(t), {1: driver, 2: actor}))
        seen = [n for when, n in ((11, 3_000), (21, 7_000), (31, 11_000)) if t >= when]
        trained.append((float(t), seen[-1] if seen else None))
    out = bench_atari.core_time(samples, trained, 1)
    assert out["window_s"] == 20.0  # From the first result seen to the last, not to the end.
    assert out["env_steps_trained"] == 8_000
    assert out["driver_cores"] == pytest.approx(0.5)
    assert out["children_cores"] == pytest.approx(1.5)
    assert out["total_cores"] == pytest.approx(2.0)
    assert out["core_ms_per_step"] == pytest.approx(2.0 * 20.0 / 8_000 * 1e3)  # 5 ms.
    one_result = [(t, n if n is None or n <= 3_000 else 3_000) for t, n in trained]
    assert bench_atari.core_time(samples, one_result, 1) is None
    assert bench_atari.core_time(samples, [(t, None) for t, _ in trained], 1) is None


def test_report_prints_each_bound_row_and_the_ceiling_with_its_range(monkeypatch):
    monkeypatch.setattr(benchlib, "machine_line", lambda: "a test machine")
    args = argparse.Namespace(
        config=bench_atari.DEFAULT_CONFIG,
        train_time=180.0,
        env_time=10.0,
        bound_rounds=3,
        repeats=10,
    )
    config = argparse.Namespace(env="PongNoFrameskip-v4")
    env_rows = [
        {
            "label": "A",
            "envs": 32,
            "threads": 2,
            "obs_shape": [42, 42, 4],
            "steps_per_s": [6_000.0, 6_300.0, 6_100.0],
        },
        {
            "label": "B",
            "envs": 32,
            "threads": 2,
            "obs_shape": [42, 42, 4],
            "steps_per_s": [8_000.0, 7_800.0, 8_200.0],
        },
    ]
    learner = {
        "batch": 500,
        "model": "conv_stack",
        "learner_s": [0.032, 0.033, 0.031],
        "keras_s": [0.030, 0.031, 0.029],
    }
    inference = [{"batch": 16, "threads": 1, "seconds": [0.0014, 0.0016, 0.0015]}]
    train = {
        "sampled_per_s": 3_200.0,
        "trained_per_s": 3_200.0,
        "iterations": 18,
        "measured_s": 170.0,
        "wall_s": 190.0,
        "episode_reward_mean": -21.0,
        "peak_processes": 5,
        "peak_rss_mb": 2_000.0,
        "peak_pss_mb": 1_500.0,
        "cpu": {
            "window_s": 170.0,
            "env_steps_trained": 544_000,
            "driver_cores": 0.5,
            "children_cores": 1.4,
            "busy_children": 2,
            "total_cores": 1.9,
            "core_ms_per_step": 0.594,
        },
    }
    text = bench_atari.report(
        args, config, 2, env_rows, learner, inference, train, None, (0.5,), (3.0,)
    )
    assert "| B | 32 | 2 | 8,000 | 7,800-8,200 | 32,000 |" in text
    assert (
        "| `ImpalaLearner.train_step` (V-trace, optimizer, clip) | 32.0 | 15,625 | "
        "15,152-16,129 | 1.07x (1.06-1.07) |" in text
    )
    assert "| 16 | 1 | 1.50 | 10,667 | 10,000-11,429 |" in text
    assert "= **8,000** (range 7,800-8,200, from the rows' min and max)" in text
    assert "trained / ceiling = **0.40**, range 0.39-0.41 (one training run" in text
    assert "**0.594 ms of core time per env step trained**" in text
    assert "Core time per env step trained: **0.594 ms** (target <= 0.51: not met)" in text
    assert "under load" not in text
