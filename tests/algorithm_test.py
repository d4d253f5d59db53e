"""End-to-end tests of the `Impala` driver: iterations, counters, failures, checkpoints, stop."""

from __future__ import annotations

import collections
import os
import signal
import time
import types

import keras
import numpy as np
import pytest

from impala_tf.algorithm import Impala
from impala_tf.config import ImpalaConfig
from impala_tf.learner_thread import LearnerQueueTimeout


def _config(**overrides) -> ImpalaConfig:
    config = (
        ImpalaConfig()
        .environment("CartPole-v1")
        .env_runners(num_env_runners=2, num_envs_per_env_runner=4, rollout_fragment_length=10)
        .training(train_batch_size=80, model={"fcnet_hiddens": [16]})
        .reporting(min_time_s_per_iteration=0.5)
        .debugging(seed=0)
    )
    return config.update_from_dict(overrides)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_iterations_report_rllib_results_with_consistent_counters(tmp_path):
    algo = _config().build()
    try:
        pids = algo.pool.pids()
        assert len(pids) == 2
        results = [algo.train() for _ in range(3)]
    finally:
        algo.stop()
    for pid in pids:
        deadline = time.time() + 5
        while _alive(pid) and time.time() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), "stop() must end every actor process"
    last = results[-1]
    assert [r["training_iteration"] for r in results] == [1, 2, 3]
    assert last["num_env_steps_trained"] <= last["num_samples_added_to_queue"]
    assert last["num_samples_added_to_queue"] <= last["num_env_steps_sampled"]
    assert last["num_env_steps_trained"] > 0
    assert last["timesteps_total"] == last["num_env_steps_sampled"]
    assert last["num_weight_broadcasts"] > 0
    assert last["episodes_total"] > 0
    assert np.isfinite(last["episode_reward_mean"])
    assert last["env_runners"]["episode_return_mean"] == last["episode_reward_mean"]
    info = last["info"]
    stats = info["learner"]["default_policy"]["learner_stats"]
    for key in (
        "cur_lr",
        "policy_loss",
        "entropy",
        "entropy_coeff",
        "var_gnorm",
        "vf_loss",
        "vf_explained_var",
        "grad_gnorm",
    ):
        assert np.isfinite(stats[key]), key
    policy_info = info["learner"]["default_policy"]
    assert policy_info["num_grad_updates_lifetime"] >= 1
    assert policy_info["diff_num_grad_updates_vs_sampler_policy"] >= 0
    assert set(info["learner_queue"]) >= {"size_count", "size_mean", "size_std", "size_quantiles"}
    assert set(info["timing_breakdown"]) == {
        "learner_grad_time_ms",
        "learner_load_time_ms",
        "learner_load_wait_time_ms",
        "learner_dequeue_time_ms",
    }
    assert info["timing_breakdown"]["learner_grad_time_ms"] > 0
    assert last["time_total_s"] >= 3 * 0.5


class _SlowLearner(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        time.sleep(0.2)


def test_a_full_learner_queue_drops_batches_and_counts_them():
    # Each fragment (4 envs x 10 steps) makes 4 train batches of 10 steps; with a slow learner
    # and a queue of one, all but the last batch of each step find the queue full.
    from impala_tf.algorithm import Impala

    config = _config(train_batch_size=10, learner_queue_size=1, min_time_s_per_iteration=2)
    algo = Impala(config, callbacks=[_SlowLearner()])
    try:
        result = algo.train()
    finally:
        algo.stop()
    assert result["num_times_learner_queue_full"] > 0
    assert result["num_samples_added_to_queue"] < result["num_env_steps_sampled"]
    assert result["num_env_steps_trained"] <= result["num_samples_added_to_queue"]


def test_learner_queue_timeout_names_the_setting():
    from tests import envs

    config = _config(learner_queue_timeout=1, min_time_s_per_iteration=30)
    config.environment(envs.faulty_cartpole, env_config={"sleep_s": 5.0})
    algo = config.build()
    try:
        with pytest.raises(RuntimeError, match="learner thread died") as info:
            algo.train()
    finally:
        algo.stop()
    cause = info.value.__cause__
    assert isinstance(cause, LearnerQueueTimeout)
    assert "learner_queue_timeout" in str(cause)


def test_killed_actor_is_restarted_and_reported():
    algo = _config(min_time_s_per_iteration=1).build()
    try:
        algo.train()
        os.kill(algo.pool.pids()[0], signal.SIGKILL)
        results = [algo.train() for _ in range(3)]
        assert results[-1]["num_env_runner_restarts"] >= 1
        assert results[-1]["num_healthy_workers"] == 2
        sampled = [r["num_env_steps_sampled"] for r in results]
        assert sampled[-1] > sampled[0]
    finally:
        algo.stop()


def test_killed_actor_raises_without_restarts():
    algo = _config(restart_failed_env_runners=False).build()
    try:
        algo.train()
        os.kill(algo.pool.pids()[0], signal.SIGKILL)
        with pytest.raises(RuntimeError, match="Actor 0 failed"):
            for _ in range(20):
                algo.train()
    finally:
        algo.stop()


def test_env_that_raises_is_reported_with_its_error():
    from tests import envs

    config = _config(restart_failed_env_runners=False)
    config.environment(envs.faulty_cartpole, env_config={"fail_after": 25})
    algo = config.build()
    try:
        with pytest.raises(RuntimeError, match="faulty env raised after 25 steps"):
            for _ in range(20):
                algo.train()
    finally:
        algo.stop()


def test_env_that_always_raises_is_not_restarted_forever():
    from tests import envs

    config = _config()
    config.environment(envs.faulty_cartpole, env_config={"fail_after": 1})
    algo = config.build()
    try:
        with pytest.raises(RuntimeError, match="failed 3 times in a row"):
            for _ in range(50):
                algo.train()
    finally:
        algo.stop()


def test_broken_env_creator_fails_at_build():
    from tests import envs

    config = _config()
    config.environment(envs.broken_env)
    with pytest.raises(ValueError, match="cannot be built"):
        config.build()


def test_save_and_restore_round_trip(tmp_path):
    algo = _config(lr_schedule=[[0, 0.001], [100_000, 0.0001]]).build()
    try:
        algo.train()
        algo.train()
        with algo.learner_thread.lock:  # no update between the save and our copy
            saved = algo.save(str(tmp_path / "ckpt"))
            weights = [w.copy() for w in algo.learner.model.get_weights()]
            steps = int(algo.learner.num_agent_steps_trained.numpy())
        counters = dict(algo._counters)
        algo.train()
        assert int(algo.learner.num_agent_steps_trained.numpy()) > steps
    finally:
        algo.stop()
    fresh = _config(lr_schedule=[[0, 0.001], [100_000, 0.0001]]).build()
    try:
        fresh.restore(saved)
        for a, b in zip(weights, fresh.learner.model.get_weights()):
            np.testing.assert_array_equal(a, b)
        assert int(fresh.learner.num_agent_steps_trained.numpy()) == steps
        assert fresh.iteration == 2
        assert dict(fresh._counters) == counters
        result = fresh.train()
        assert result["training_iteration"] == 3
        stats = result["info"]["learner"]["default_policy"]["learner_stats"]
        assert stats["cur_lr"] < 0.001  # the schedule continues from the restored step count
    finally:
        fresh.stop()


class _Snapshots:
    """Stands in for `LearnerThread.policy_snapshot(wait=False)`: returns queued answers."""

    def __init__(self, answers):
        self.answers = list(answers)

    def policy_snapshot(self, wait=True):
        return self.answers.pop(0)


def test_broadcast_never_sends_older_weights_and_remembers_who_waits():
    sent = []
    version = types.SimpleNamespace(numpy=lambda: 11)
    driver = types.SimpleNamespace(
        config=types.SimpleNamespace(broadcast_interval=1),
        deterministic=False,
        learner=types.SimpleNamespace(num_grad_updates=version),
        pool=types.SimpleNamespace(healthy_actor_ids=lambda: [0, 1, 2]),
        _steps_since_broadcast=0,
        _broadcast_version=10,
        _awaiting_weights=set(),
        _counters=collections.Counter(),
    )

    def send(actor_ids, weights, v):
        sent.append((actor_ids, weights, v))
        driver._broadcast_version = v

    driver._send_weights = send
    # An update is running: the learner thread's last published snapshot (8) predates what was
    # sent (10), then none is newer yet: nothing is sent, and actors 0 and 2 keep waiting.
    driver.learner_thread = _Snapshots([(["w8"], 8), (["w10"], 10), (["w11"], 11)])
    Impala._maybe_broadcast(driver, [0])
    Impala._maybe_broadcast(driver, [2])
    assert sent == [] and driver._awaiting_weights == {0, 2}
    Impala._maybe_broadcast(driver, [])  # Published after the update: both get it.
    assert sent == [([0, 2], ["w11"], 11)]
    assert driver._awaiting_weights == set() and driver._counters["num_weight_broadcasts"] == 1
