"""Learning tests: short runs that must actually learn (marked slow; they run in CI too)."""

from __future__ import annotations

import os

import pytest

from impala_tf.config import ImpalaConfig

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs")


@pytest.mark.slow
def test_cartpole_config_reaches_150():
    config, _ = ImpalaConfig.from_yaml(os.path.join(CONFIGS, "cartpole-impala.yaml"))
    config.debugging(seed=0)
    algo = config.build()
    best = 0.0
    try:
        for _ in range(90):
            result = algo.train()
            best = max(best, result["episode_reward_mean"])
            if best >= 150:
                break
    finally:
        algo.stop()
    assert best >= 150, f"mean return only reached {best:.1f} in {result['timesteps_total']} steps"
