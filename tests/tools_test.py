"""The tools package: every tool imports from the repository root and is listed in its index."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import pkgutil

import pytest

import tools

_LIBRARIES = {"benchlib", "proclib"}
_TOOLS = sorted(m.name for m in pkgutil.iter_modules(tools.__path__) if m.name not in _LIBRARIES)


@pytest.mark.parametrize("name", _TOOLS)
def test_a_tool_imports_and_has_a_command_line(name):
    module = importlib.import_module(f"tools.{name}")
    assert callable(module.main), name


def _package_imports(path: str) -> list[tuple[int, str, str]]:
    """(line, module, name) of every `from impala_tf... import name` in a file, nested ones
    (inside functions: the tools import lazily) included."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return [
        (node.lineno, node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("impala_tf")
        for alias in node.names
    ]


@pytest.mark.parametrize("name", sorted([*_TOOLS, *_LIBRARIES]))
def test_every_import_of_a_tool_resolves_lazy_ones_included(name):
    """A tool imports the package lazily (in the function that needs TensorFlow or Ray), where
    importing the tool does not reach: each such name must still exist."""
    path = os.path.join(os.path.dirname(tools.__file__), f"{name}.py")
    for line, module, attr in _package_imports(path):
        imported = importlib.import_module(module)
        found = hasattr(imported, attr)
        if not found and hasattr(imported, "__path__"):  # `from package import submodule`.
            found = importlib.util.find_spec(f"{module}.{attr}") is not None
        assert found, f"tools/{name}.py:{line}: from {module} import {attr}"


def test_the_index_lists_every_tool_and_library():
    for name in [*_TOOLS, *_LIBRARIES]:
        assert f"`tools.{name}`" in tools.__doc__, name


def test_bench_gpu_prints_its_plan_without_a_gpu_and_refuses_to_measure_on_a_cpu():
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = [sys.executable, "-m", "tools.bench_gpu", "--parts", "learner", "pong"]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="3")
    dry = subprocess.run([*run, "--dry"], capture_output=True, text=True, cwd=root, env=env)
    assert dry.returncode == 0, dry.stderr
    assert "jit_compile_update=True" in dry.stdout and "batch 2,000" in dry.stdout
    assert "mixed_bfloat16" in dry.stdout
    refused = subprocess.run(run, capture_output=True, text=True, cwd=root, env=env)
    assert refused.returncode == 2
    assert "sees none" in refused.stderr and "tools.bench_learner" in refused.stderr


def test_measure_actor_memory_prints_the_guards_estimate_for_both_kinds_of_actor(capsys):
    import gymnasium as gym
    import numpy as np

    from impala_tf.config import ImpalaConfig
    from impala_tf.workers.memory import estimate_pool_bytes
    from tools import measure_actor_memory

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "configs", "cartpole-impala.yaml")
    measure_actor_memory.print_estimate(path)
    out = capsys.readouterr().out
    config, _ = ImpalaConfig.from_yaml(path)
    space = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)  # CartPole-v1's observations.
    for label, numpy_policy in (("TensorFlow actors", False), ("actors without TF", True)):
        per_actor = estimate_pool_bytes(config, space, numpy_policy=numpy_policy)["per_actor"]
        (line,) = [line for line in out.splitlines() if label in line]
        assert f"{per_actor / 2**20:7.1f} MiB per actor" in line


# Failure-inclusive statistics: a run that never reached its target counts at its full value
# (its time or env steps when it ended), never dropped. Each test below would fail if the misses
# were left out of the medians.


def test_run_stats_count_a_run_that_missed_at_its_full_value():
    from tools import benchlib

    # Two of five runs missed, at 300 s each: dropped, the median would be 15 s.
    values = [10.0, 300.0, 20.0, 300.0, 15.0]
    reached = [True, False, True, False, True]
    s = benchlib.run_stats(values, reached)
    assert (s.median, s.low, s.high) == (20.0, 10.0, 300.0)
    assert s.p90 == pytest.approx(300.0) and (s.reached, s.runs) == (3, 5)
    assert not s.exact and s.low_exact
    assert s.text(".1f", " s") == ">= 20.0 s (3 of 5 reached)"
    assert s.range_text() == "[10, >= 300]"
    # A miss holding the minimum makes it a bound too; a figure without a target is exact.
    assert benchlib.run_stats([5.0, 9.0], [False, True]).range_text() == "[>= 5, >= 9]"
    rates = benchlib.run_stats([3.0, 1.0, 2.0])
    assert rates.exact and rates.text() == "2 (3 of 3 reached)" and rates.range_text() == "[1, 3]"
    assert benchlib.percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    with pytest.raises(ValueError, match="no runs"):
        benchlib.run_stats([])
    with pytest.raises(ValueError, match="reached flags"):
        benchlib.run_stats([1.0], [True, False])


def test_a_ratio_of_medians_is_a_bound_where_one_side_missed_and_none_where_both_did():
    from tools import benchlib

    exact = benchlib.run_stats([10.0, 20.0, 30.0])
    missed = benchlib.run_stats([40.0, 300.0, 300.0], [True, False, False])
    assert benchlib.ratio_text(exact, exact) == "1.000"
    assert benchlib.ratio_text(missed, exact) == ">= 15.000"  # 300 / 20: at least.
    assert benchlib.ratio_text(exact, missed, ".2f") == "<= 0.07"
    assert benchlib.ratio_text(missed, missed) == "-"
    assert benchlib.ratio_text(exact, benchlib.run_stats([0.0])) == "-"


def test_watch_training_times_the_process_to_its_end_when_it_never_reaches(tmp_path):
    import sys

    from tools import benchlib

    script = (
        "import time\n"
        "print('iter 1 return 100.0', flush=True)\n"
        "time.sleep(0.3)\n"
        "print('iter 2 return 460.0', flush=True)\n"
        "time.sleep(0.3)\n"
    )
    cmd = [sys.executable, "-c", script]
    reached = benchlib.watch_training(cmd, str(tmp_path), str(tmp_path), 450.0, 60.0)
    assert reached.reached_s is not None and 0.3 <= reached.reached_s < reached.exit_s
    missed = benchlib.watch_training(cmd, str(tmp_path), str(tmp_path), 500.0, 60.0)
    assert missed.reached_s is None and missed.exit_s >= 0.6 and missed.results == []


def test_the_machine_line_names_the_cpu_and_its_widest_vector_extension(tmp_path):
    from tools import benchlib

    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse4_2 avx fma avx2\n\n"
        "processor\t: 1\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse4_2 avx fma avx2\n"
    )
    assert benchlib.cpu_model(str(info)) == "AMD EPYC, AVX2"
    info.write_text("model name\t: Intel Xeon\nflags\t\t: avx2 avx512f avx512_bf16 amx_bf16\n")
    assert benchlib.cpu_model(str(info)) == "Intel Xeon, AVX-512"
    assert benchlib.cpu_model(str(tmp_path / "missing")) == ""


def test_bench_robustness_summary_counts_a_run_that_never_reached_at_its_whole_time():
    from tools import bench_robustness

    def row(reached: bool, to_target_s: float) -> dict:
        return {
            "reached": reached,
            "lasting": 0,
            "dips": 0,
            "steps": 1_000_000,
            "policy_lag": None,
            "first_iter_s": 5.0,
            "to_target_s": to_target_s,
            "exit_s": to_target_s + 1.0,
            "shutdown_s": 1.0 if reached else None,
        }

    rows = [row(True, 20.0), row(False, 300.0), row(True, 30.0), row(False, 300.0)]
    t = bench_robustness.summarise(rows)["to_target_s"]
    assert t == {"median": 165.0, "p90": pytest.approx(300.0), "worst": 300.0}
    # `outcome` is where a miss gets its whole time: process start to exit.
    run = {"results": [], "stop_value": None, "stop_s": None, "exit_s": 301.0, "returncode": 0}
    run.update(first_iter_s=5.0, left_at_exit=2)
    missed = bench_robustness.outcome(run, 450.0, 2_000_000)
    assert not missed["reached"] and missed["to_target_s"] == 301.0
    assert bench_robustness.summarise([missed, *rows])["runs_leaving_processes"] == 1


def _cartpole_run(seed: int, reached: bool, to_target_s: float, steps: int) -> dict:
    """A run as `bench_cartpole.run_impala` returns it."""
    return {
        "seed": seed,
        "backend": "local",
        "reached": reached,
        "wall_s": to_target_s if reached else None,
        "to_target_s": to_target_s,
        "exit_s": to_target_s + 1.0,
        "steps": steps,
        "sampled_per_s": 80_000.0,
        "trained_per_s": 79_000.0,
        "steady_sampled_per_s": 85_000.0,
        "iterations": 10,
    }


def test_bench_cartpole_medians_count_a_seed_that_never_reached(monkeypatch):
    import argparse

    from tools import bench_cartpole, benchlib

    monkeypatch.setattr(benchlib, "machine_line", lambda: "a machine")
    runs = [
        _cartpole_run(0, True, 15.0, 900_000),
        _cartpole_run(1, False, 301.5, 2_000_000),
        _cartpole_run(2, True, 20.0, 1_100_000),
        _cartpole_run(3, False, 300.5, 2_000_000),
    ]
    args = argparse.Namespace(config=bench_cartpole.ROOT + "/configs/c.yaml", target=450.0)
    text = "\n".join(bench_cartpole.seeds_lines(args, runs))
    assert "| 1 | no | >= 301.5 | >= 2,000,000 | 80,000 | 79,000 |" in text
    assert "| 0 | yes | 15.0 | 900,000 |" in text
    # Over the reached seeds only: 17.5 s and 1,000,000 env steps.
    assert "median wall time >= 160.2 s (2 of 4 reached)" in text
    assert "median >= 1,550,000 env steps (2 of 4 reached)" in text
    assert "The medians count every seed: one that never reached counts at its full time" in text
    everyone = "\n".join(bench_cartpole.seeds_lines(args, runs[::2]))
    assert "median wall time 17.5 s (2 of 2 reached)" in everyone and "| >= " not in everyone


def test_bench_cartpole_floor_medians_count_a_seed_that_never_reached(monkeypatch, capsys):
    import argparse

    from tools import bench_cartpole, benchlib

    monkeypatch.setattr(benchlib, "machine_line", lambda: "a machine")
    outcomes = {(0, "0"): (True, 20.0, 1_000_000), (1, "0"): (False, 300.0, 2_000_000)}
    outcomes |= {(0, "auto"): (True, 10.0, 500_000), (1, "auto"): (True, 14.0, 700_000)}

    def run_impala(config, seed, target, timeout, backend="local", stop_time_s=None, sets=()):
        floor = sets[0].split("=")[1]
        return _cartpole_run(seed, *outcomes[(seed, floor)])

    monkeypatch.setattr(bench_cartpole, "run_impala", run_impala)
    args = argparse.Namespace(
        config=bench_cartpole.ROOT + "/configs/c.yaml",
        target=450.0,
        timeout=300.0,
        seeds=[0, 1],
        floors=["0", "auto"],
        no_write=True,
    )
    bench_cartpole.floor_comparison(args)
    out = capsys.readouterr().out
    assert ">= 2,000,000 (>= 300 s, not reached)" in out
    row = "| 0 | 1,000,000 (20 s) | >= 2,000,000 (>= 300 s, not reached) | "
    assert row + ">= 1,500,000 (1 of 2 reached) | >= 160 (1 of 2 reached) |" in out
    assert "| auto | 500,000 (10 s) | 700,000 (14 s) | 600,000 (2 of 2 reached) | 12 (2 of 2" in out
    assert "The medians count every seed, one that never reached at its full" in out


def test_bench_compare_medians_count_a_round_that_never_reached():
    from tools import bench_compare

    def run(reached: bool, to_target_s: float, rate: float) -> dict:
        return {"reached": reached, "to_target_s": to_target_s, "sampled_per_s": rate}

    this = [run(True, 15.0, 1_000.0), run(False, 600.0, 2_000.0), run(False, 610.0, 3_000.0)]
    baseline = [run(True, 20.0, 1_000.0), run(True, 24.0, 1_000.0), run(True, 22.0, 1_000.0)]
    # Over the reached rounds only, this side's median would be 15 s, faster than the baseline's.
    cells = bench_compare.figure_cells(this, baseline, "to_target_s")
    assert cells == (
        ">= 600 [15, >= 610] (1 of 3 reached)",
        "22 [20, 24] (3 of 3 reached)",
        ">= 27.273",
    )
    # A rate has no target: every round counts as it is, with no bound and no count.
    assert bench_compare.figure_cells(this, baseline, "sampled_per_s") == (
        "2,000 [1,000, 3,000]",
        "1,000 [1,000, 1,000]",
        "2.000",
    )
    both = bench_compare.figure_cells(this, this, "to_target_s")
    assert both[2] == "-"
    assert {key for figures in bench_compare.FIGURES.values() for key, _ in figures} == {
        "to_target_s",
        "sampled_per_s",
        "trained_per_s",
    }
