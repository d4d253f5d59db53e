"""Learning tests: short runs that must actually learn (marked slow; they run in CI too)."""

from __future__ import annotations

import os

import pytest

from impala_tf.config import ImpalaConfig
from tools.bench_robustness import collapses

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs")


@pytest.mark.slow
def test_the_readme_cartpole_config_reaches_its_stop_reward_without_collapsing():
    """The README's command as a user runs it: the shipped config, no seed, until its own stop
    criteria (a mean return of 450, or 2M env steps). It must reach 450, and no stretch of it
    may be a lasting collapse (entropy under 0.01 for 3 iterations in a row, or a return under
    20 for 5: `tools.bench_robustness`), so a run that learns, collapses and creeps back fails.
    """
    config, stop = ImpalaConfig.from_yaml(os.path.join(CONFIGS, "cartpole-impala.yaml"))
    target, budget = stop["episode_reward_mean"], stop["timesteps_total"]
    algo = config.build()
    results = []
    try:
        while True:
            results.append(algo.train())
            last = results[-1]
            if last["episode_reward_mean"] >= target or last["timesteps_total"] >= budget:
                break
    finally:
        algo.stop()
    curve = [round(r["episode_reward_mean"], 1) for r in results]
    assert last["episode_reward_mean"] >= target, (
        f"mean return {last['episode_reward_mean']:.1f} after {last['timesteps_total']:,d} env "
        f"steps; returns by iteration: {curve}"
    )
    found = collapses(results)
    assert found["lasting"] == 0, f"a lasting collapse: returns {curve}, {found}"
