"""Tests of tools.bench_cartpole's RLlib side: the settings it gives RLlib, how it reads the run."""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys

import pytest

from impala_tf.config import ImpalaConfig
from tools import bench_cartpole

YAML = os.path.join(bench_cartpole.ROOT, "configs", "cartpole-impala.yaml")


def test_rllib_runs_the_yamls_own_settings():
    config, _ = ImpalaConfig.from_yaml(YAML)
    settings = bench_cartpole.rllib_settings(YAML, target=450, budget_s=600, seed=3)
    assert settings == {
        "runners": config.num_env_runners,
        "envs": config.num_envs_per_env_runner,
        "fragment": config.rollout_fragment_length,
        "batch": config.train_batch_size,
        "lr": config.lr,
        "grad_clip": config.grad_clip,
        "vf": config.vf_loss_coeff,
        "entropy": config.entropy_coeff,
        "hiddens": config.model["fcnet_hiddens"],
        "activation": config.model["fcnet_activation"],
        "vf_share_layers": config.model["vf_share_layers"],
        "min_time_s": config.min_time_s_per_iteration,
        "target": 450.0,
        "budget_s": 600.0,
        "seed": 3,
    }
    # Not RLlib's CartPole example (1 runner, batches of 500): the YAML's, as impala_tf runs it.
    assert (settings["runners"], settings["envs"], settings["batch"]) == (2, 32, 1000)


def _fake_python(tmp_path, rows: list[dict]) -> str:
    """An executable that prints `rows` as RLLIB_SCRIPT does, whatever its arguments."""
    path = tmp_path / "python"
    lines = "".join(f"echo '{json.dumps(r)}'\n" for r in rows)
    path.write_text(f"#!/bin/sh\necho 'a log line'\n{lines}")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_rllib_time_is_its_first_iteration_at_the_target_and_its_rate_excludes_start_up(tmp_path):
    rows = [
        {"t": 30.0, "return": 20.0, "steps": 4_000},
        {"t": 40.0, "return": 460.0, "steps": 14_000},
        {"t": 50.0, "return": 470.0, "steps": 24_000},
    ]
    settings = {"target": 450.0, "budget_s": 5.0}
    out = bench_cartpole.run_rllib(_fake_python(tmp_path, rows), settings)
    assert out["reached"] and out["wall_s"] == 40.0
    assert out["steady_sampled_per_s"] == pytest.approx(20_000 / 20.0)
    assert out["steps"] == 24_000 and out["iterations"] == 3


def test_an_rllib_run_below_the_target_has_no_time(tmp_path):
    rows = [{"t": 30.0, "return": float("nan"), "steps": 0}]
    rows += [{"t": 30.0 + i, "return": 100.0, "steps": 1_000 * i} for i in (1, 2)]
    out = bench_cartpole.run_rllib(_fake_python(tmp_path, rows), {"target": 450.0, "budget_s": 5})
    assert not out["reached"] and out["wall_s"] is None


def test_an_rllib_run_that_prints_no_iteration_fails_with_its_error_output(tmp_path):
    with pytest.raises(RuntimeError, match="RLlib run failed"):
        bench_cartpole.run_rllib(_fake_python(tmp_path, []), {"target": 450.0, "budget_s": 5})


def _fake_python_by_seed(tmp_path, times: dict[int, float | None]) -> str:
    """An executable run as `python -c SCRIPT SETTINGS`: reaches the target at `times[seed]`
    (never when None), sampling 1,000 env steps per second, and records each seed it ran."""
    path = tmp_path / "python"
    path.write_text(
        f"#!{sys.executable}\n"
        "import json, sys\n"
        "s = json.loads(sys.argv[3])\n"
        f"times = {times!r}\n"
        f"open({str(tmp_path / 'seeds')!r}, 'a').write(str(s['seed']) + '\\n')\n"
        "t = times[s['seed']]\n"
        "for k in range(1, 4):\n"
        "    ret = 460.0 if t is not None and k == 3 else 100.0\n"
        "    print(json.dumps({'t': (t or 30.0) - 3 + k, 'return': ret, 'steps': 1000 * k}))\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def _args(seeds, rllib_seeds):
    return argparse.Namespace(
        config=YAML, target=450.0, rllib_budget_s=5.0, seeds=seeds, rllib_seeds=rllib_seeds
    )


def _ours(rates, times, reached=None):
    """impala_tf's runs as `run_impala` returns them, as far as `rllib_lines` reads them."""
    reached = [True] * len(times) if reached is None else reached
    return [
        {"steady_sampled_per_s": rate, "to_target_s": t, "reached": ok}
        for rate, t, ok in zip(rates, times, reached)
    ]


def test_rllib_runs_the_first_seeds_and_the_ratios_are_of_the_medians(tmp_path):
    python = _fake_python_by_seed(tmp_path, {0: 30.0, 1: 60.0, 2: 90.0})
    ours = _ours((4_000.0, 5_000.0, 9_000.0, 1.0), (10.0, 20.0, 20.0, 30.0))
    lines = bench_cartpole.rllib_lines(_args([0, 1, 2, 3], 3), python, ours)
    assert (tmp_path / "seeds").read_text().split() == ["0", "1", "2"]
    text = "\n".join(lines)
    assert "| 1 | yes | 60.0 | 3,000 | 1,000 | 3 |" in text
    # impala_tf's median 4,500 env steps/s against RLlib's 1,000; RLlib's median time 60 s / 20 s.
    assert "**4.5x**" in text and "**3.0x**" in text
    assert "median 60.0 s (3 of 3 reached) / impala_tf's median 20.0 s (4 of 4" in text


def test_an_rllib_seed_that_misses_counts_its_full_time_and_the_ratio_is_a_lower_bound(tmp_path):
    # Seed 5 reaches at 30 s; seed 6 never does, its last iteration at 80 s. Dropped, RLlib's
    # median would be 30 s; counted at its full time it is 55 s, and only a lower bound.
    python = _fake_python_by_seed(tmp_path, {5: 30.0, 6: None})
    (tmp_path / "python").write_text(
        (tmp_path / "python").read_text().replace("(t or 30.0)", "(t or 80.0)")
    )
    ours = _ours((2_000.0,), (20.0,))
    lines = bench_cartpole.rllib_lines(_args([5, 6, 7], 2), python, ours)
    text = "\n".join(lines)
    assert "| 6 | no | >= 80.0 | >= 3,000 |" in text
    assert (
        "median >= 55.0 s (1 of 2 reached) /" in text
        and "**>= 2.8x**" in text
        and "**2.0x**" in text
    )


def test_no_time_ratio_when_both_sides_have_a_seed_that_missed(tmp_path):
    python = _fake_python_by_seed(tmp_path, {5: 30.0, 6: None})
    ours = _ours((2_000.0, 2_000.0), (20.0, 300.0), reached=[True, False])
    text = "\n".join(bench_cartpole.rllib_lines(_args([5, 6], 2), python, ours))
    assert "impala_tf's median >= 160.0 s (1 of 2 reached)" in text
    assert "not given (both sides have seeds that missed" in text
