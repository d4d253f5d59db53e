"""`Impala.evaluate()` and `evaluation_interval`: which iterations evaluate, the seeds of the
evaluation episodes, and `explore` in evaluation. (Evaluation during training on every placement
is `tests/runtime_conformance_test.py`'s.)"""

from __future__ import annotations

import numpy as np
import pytest

from impala_tf.config import ImpalaConfig
from impala_tf.driver.algorithm import check_deterministic
from tests.support.configs import small_config


def _config(**overrides) -> ImpalaConfig:
    keys = dict(
        num_env_runners=1,
        num_envs_per_env_runner=2,
        train_batch_size=40,
        model={"fcnet_hiddens": [8]},
        min_time_s_per_iteration=0,
        min_sample_timesteps_per_iteration=40,
        evaluation_duration=3,
        lr=0.0,  # The weights stay those of the seed: evaluations differ only by their seeds.
        seed=4,
    )
    return small_config(**{**keys, **overrides})


def _episodes(evaluation: dict) -> dict:
    """An evaluation's episode statistics (without its wall-clock time)."""
    return {k: v for k, v in evaluation.items() if k != "time_this_iter_s"}


def test_every_interval_th_iteration_evaluates_with_seeds_from_the_seed_and_iteration():
    algo = _config(evaluation_interval=2).build()
    try:
        results, weights = [], []
        for _ in range(4):
            results.append(algo.train())
            weights.append(algo.get_policy_weights())
        again = algo.evaluate()  # Iteration 4 again, with the same weights.
    finally:
        algo.stop()
    assert ["evaluation" in r for r in results] == [False, True, False, True]
    for result in (results[1], results[3]):
        evaluation = result["evaluation"]
        assert evaluation["episodes_this_iter"] == 3
        assert evaluation["episode_reward_min"] <= evaluation["episode_reward_mean"]
        assert evaluation["num_env_steps_sampled_this_iter"] == 3 * evaluation["episode_len_mean"]
    for a, b in zip(weights[1], weights[3], strict=True):  # lr = 0: the same policy ...
        np.testing.assert_array_equal(a, b)
    # ... evaluated on the same episodes at the same iteration, on other ones at another.
    assert _episodes(again) == _episodes(results[3]["evaluation"])
    assert _episodes(results[1]["evaluation"]) != _episodes(results[3]["evaluation"])


def test_evaluation_explores_unless_its_config_says_otherwise():
    evaluations = {}
    for name, evaluation_config in [
        ("default", {}),
        ("explore", {"explore": True}),
        ("greedy", {"explore": False}),
    ]:
        algo = _config(evaluation_config=evaluation_config, evaluation_duration=5).build()
        try:  # Iteration 0, the seed's weights: the same episode seeds in every run.
            evaluations[name] = _episodes(algo.evaluate())
        finally:
            algo.stop()
    # RLlib's default: the evaluation config's `explore` (True), sampling actions.
    assert evaluations["default"] == evaluations["explore"]
    assert evaluations["greedy"] != evaluations["explore"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"seed": None}, "a `seed`"),
        ({"num_env_runners": 2}, "one actor"),
        ({"min_time_s_per_iteration": 1}, "min_time_s_per_iteration=0"),
        ({"num_sgd_iter": 2, "minibatch_buffer_size": 2}, "minibatch_buffer_size=1"),
        ({"num_aggregation_workers": 1}, "num_aggregation_workers=0"),
    ],
)
def test_check_deterministic_names_what_to_change(overrides, message):
    config = (
        ImpalaConfig()
        .environment("CartPole-v1")
        .env_runners(num_env_runners=1)
        .reporting(min_time_s_per_iteration=0)
        .debugging(seed=0)
    )
    check_deterministic(config)  # Fine as it is.
    config.update_from_dict(overrides)
    with pytest.raises(ValueError, match="deterministic=True needs") as info:
        check_deterministic(config)
    assert message in str(info.value)
