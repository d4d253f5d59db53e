"""Tests of the pure-logic parts of tools.bench_atari: the /proc memory sampler, the rates."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from tools import bench_atari, proclib

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
