"""Env faults: errors naming env, actor, env index and step; dropped non-finite episodes;
a hung actor without restarts (`sample_timeout_s`); the new config keys.

Restarting a hung or killed actor is a runtime scenario of `tests/runtime_conformance_test.py`.
"""

from __future__ import annotations

import numpy as np
import pytest

from impala_tf.config import ImpalaConfig
from impala_tf.driver.specs import runner_spec
from impala_tf.envs.faults import EnvCallError, EnvSpaceError, NonFiniteEnvError
from impala_tf.models import build_model
from impala_tf.rollout.env_runner import EnvRunner
from tests.support.envs import misbehaving_cartpole


def _config(mode: str, **overrides) -> ImpalaConfig:
    env_config = {"mode": mode, "vector_index": 1, "after": 3}
    env_config.update(overrides.pop("env_config", {}))
    config = (
        ImpalaConfig()
        .environment(misbehaving_cartpole, env_config=env_config)
        .env_runners(num_env_runners=1, num_envs_per_env_runner=2, rollout_fragment_length=8)
        .training(train_batch_size=16, model={"fcnet_hiddens": [8]})
        .reporting(min_time_s_per_iteration=0.2)
        .debugging(seed=0)
    )
    return config.update_from_dict(overrides)


def _runner(mode: str, **overrides) -> EnvRunner:
    config = _config(mode, **overrides)
    runner = EnvRunner(runner_spec(config), worker_index=1)
    model = build_model(runner.observation_space, runner.action_space, config.model)
    runner.set_weights({"default_policy": (model.get_weights(), 0)})
    return runner


@pytest.mark.parametrize("mode", ["nan_reward", "inf_reward", "nan_obs"])
def test_nonfinite_data_raises_naming_env_actor_index_and_step(mode):
    runner = _runner(mode)
    with pytest.raises(NonFiniteEnvError) as info:
        runner.sample()
    message = str(info.value)
    assert "misbehaving_cartpole" in message
    assert "actor 0" in message and "env index 1" in message
    # The env misbehaves from its 3rd step: the runner had taken 2 steps before.
    assert "at step 2" in message
    assert "drop_nonfinite_episodes" in message


@pytest.mark.parametrize("mode", ["nan_reward", "nan_obs"])
def test_drop_nonfinite_episodes_cuts_and_counts_them(mode):
    runner = _runner(mode, drop_nonfinite_episodes=True)
    total_dropped = 0
    for _ in range(2):
        fragment = runner.sample()
        batch = fragment.batches["default_policy"]
        for key in ("obs", "rewards", "values_bootstrapped", "vf_preds", "action_logp"):
            assert np.isfinite(batch[key]).all(), key
        total_dropped += fragment.num_nonfinite_episodes_dropped
        # The dropped episodes end in truncations of env 1 and report no return.
        assert batch["truncateds"][1].sum() >= fragment.num_nonfinite_episodes_dropped
        assert all(np.isfinite(e.ret) for e in fragment.episodes)
    # Env 1 misbehaves at every step from its 3rd on (each new episode's 1st step after that).
    assert total_dropped >= 8
    # Env 0 is untouched: its truncations are only CartPole's own.
    assert batch["truncateds"][0].sum() == 0


def test_nonfinite_first_observation_is_always_an_error():
    with pytest.raises(NonFiniteEnvError, match="reset\\(\\) returned a non-finite"):
        _runner("nan_reset", drop_nonfinite_episodes=True)


def test_wrong_shape_and_dtype_are_named():
    runner = _runner("wrong_shape")
    with pytest.raises(EnvSpaceError, match=r"shape \(3,\).*shape \(4,\)") as info:
        runner.sample()
    assert "env index 1" in str(info.value)
    runner = _runner("wrong_dtype", env_config={"vector_index": 0}, num_envs_per_env_runner=1)
    with pytest.raises(EnvSpaceError, match="at step 2, .*dtype float64.*dtype uint8"):
        runner.sample()


def test_env_that_raises_names_the_call_and_step():
    runner = _runner("raise_step")
    with pytest.raises(
        EnvCallError, match=r"env index 1\) at step 2.*step\(\) raised RuntimeError"
    ):
        runner.sample()
    # `after=1`: the first reset passes, the second (after the first episode) raises.
    runner = _runner("raise_reset", env_config={"after": 1, "vector_index": 0})
    with pytest.raises(EnvCallError, match=r"env index 0\).*reset\(\) raised OSError"):
        for _ in range(50):
            runner.sample()


def test_a_fatal_env_fault_stops_training_at_once():
    algo = _config("nan_reward").build()
    try:
        with pytest.raises(RuntimeError, match="Actor 0 failed.*non-finite reward") as info:
            for _ in range(20):
                algo.train()
        assert "env index 1" in str(info.value)
    finally:
        algo.stop()


def test_dropped_episodes_are_counted_in_the_result():
    algo = _config("nan_obs", drop_nonfinite_episodes=True).build()
    try:
        result = algo.train()
    finally:
        algo.stop()
    assert result["num_nonfinite_episodes_dropped"] > 0
    assert result["counters"]["num_nonfinite_episodes_dropped"] > 0
    assert np.isfinite(result["info"]["learner"]["default_policy"]["learner_stats"]["total_loss"])


def test_a_hung_actor_without_restarts_raises_naming_the_key_and_step():
    config = _config(
        "hang", env_config={"after": 20}, sample_timeout_s=1.5, restart_failed_env_runners=False
    )
    algo = config.build()
    try:
        with pytest.raises(RuntimeError, match="sample_timeout_s=1.5") as info:
            for _ in range(60):
                algo.train()
    finally:
        algo.stop()
    assert "in step() of env index 1 at step 19" in str(info.value)


def test_max_num_env_runner_restarts_limits_restarts():
    config = _config("raise_step", max_num_env_runner_restarts=0)
    algo = config.build()
    try:
        with pytest.raises(RuntimeError, match="max_num_env_runner_restarts=0"):
            for _ in range(20):
                algo.train()
    finally:
        algo.stop()


def test_restarts_before_a_resume_count_against_max_num_env_runner_restarts(tmp_path):
    # The counter is the one count: restored, it leaves no restart of the limit of 2, where a
    # fresh count would restart twice and then give up on 3 failures in a row.
    config = _config("raise_step", max_num_env_runner_restarts=2)
    algo = config.build()
    try:
        algo.metrics.counters.num_env_runner_restarts = 2
        path = algo.save(str(tmp_path / "checkpoint"))
    finally:
        algo.stop()
    resumed = config.build()
    try:
        resumed.restore(path)
        assert resumed.metrics.counters.num_env_runner_restarts == 2
        with pytest.raises(RuntimeError, match=r"after 2 restarts \(max_num_env_runner_restarts=2"):
            for _ in range(20):
                resumed.train()
    finally:
        resumed.stop()


@pytest.mark.parametrize(
    "key, value",
    [
        ("sample_timeout_s", 0),
        ("sample_timeout_s", -1.0),
        ("sample_timeout_s", "60"),
        ("sample_timeout_s", float("inf")),
        ("drop_nonfinite_episodes", 1),
        ("drop_nonfinite_episodes", None),
        ("max_num_env_runner_restarts", -1),
        ("max_num_env_runner_restarts", 1.5),
    ],
)
def test_new_keys_are_validated(key, value):
    config = ImpalaConfig(**{key: value})
    with pytest.raises(ValueError, match=f"`{key}`"):
        config.validate()


def test_new_keys_have_rllib_defaults_and_builders():
    config = ImpalaConfig()
    assert config.sample_timeout_s == 60.0
    assert config.max_num_env_runner_restarts == 1000
    assert config.drop_nonfinite_episodes is False
    config.env_runners(sample_timeout_s=None, drop_nonfinite_episodes=True)
    config.fault_tolerance(max_num_env_runner_restarts=5)
    config.validate()
