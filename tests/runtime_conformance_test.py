"""Every runtime scenario on three placements: processes with 1 and 2 policies, Ray with 2.

One behaviour, one test, every placement (Sample Factory's `test_example.py`): the same driver
runs a single-agent CartPole (one policy) and a two-agent MultiAgentCartPole (policies p0, p1,
`tests.support.configs.small_config`), with actors as local processes or as Ray actors. Tests
wait on the counters the result dict exposes, never on sleeps.

Ray with one policy is left out to keep the suite within its ten minutes: the backend and the
policy count are separate layers (the driver's policy map does not depend on where actors run,
and the Ray backend's single-policy path is tested in tests/ray_backend_test.py), so Ray with
two policies covers what Ray adds.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import signal
import sys

import numpy as np
import pytest

from impala_tf import Impala, checkpoints
from impala_tf.config import ImpalaConfig
from impala_tf.config.base import AlgorithmConfig
from impala_tf.config.policies import PolicySpec
from impala_tf.driver.aggregation import AggregatorHost
from impala_tf.workers.shared_arrays import SEGMENT_PREFIX
from tests.support import callbacks, envs, models
from tests.support.configs import BACKENDS, POLICY_COUNTS, small_config
from tests.support.processes import alive, wait_until

PLACEMENTS = [(b, p) for b in BACKENDS for p in POLICY_COUNTS if (b, p) != ("ray", 1)]


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory):
    """One Ray for the module's Ray placements (the runtime reuses an initialised Ray)."""
    from tests.support.ray import local_ray

    with local_ray(str(tmp_path_factory.mktemp("ray-home"))) as ray:
        yield ray


@pytest.fixture(params=PLACEMENTS, ids=[f"{b}-{p}policies" for b, p in PLACEMENTS])
def placement(request) -> tuple[str, int]:
    backend, policies = request.param
    if backend == "ray":
        request.getfixturevalue("ray_session")
    return backend, policies


def _config(placement: tuple[str, int], **overrides) -> ImpalaConfig:
    backend, policies = placement
    return small_config(policies=policies, backend=backend, **overrides)


def _policies(placement: tuple[str, int]) -> list[str]:
    return ["default_policy"] if placement[1] == 1 else ["p0", "p1"]


def _node_ip(backend: str) -> str:
    """The driver's node address as RLlib reports it: Ray's on Ray, the default route's here."""
    if backend == "ray":
        import ray

        return ray.util.get_node_ip_address()
    from impala_tf.acting.inference_protocol import node_ip_address

    return node_ip_address()


def _segments() -> list[str]:
    """This driver's shared memory segments still in /dev/shm (weights, fragments, batches)."""
    if not os.path.isdir("/dev/shm"):
        return []
    prefix = f"{SEGMENT_PREFIX}{os.getpid()}_"
    return [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]


def _train_until(algo, predicate, max_iterations: int = 40) -> dict:
    """Trains until `predicate(result)` holds; fails after `max_iterations` iterations."""
    result = None
    for _ in range(max_iterations):
        result = algo.train()
        if predicate(result):
            return result
    raise AssertionError(f"not reached in {max_iterations} iterations; last result: {result}")


def _refuse_to_pickle(config, protocol):
    """`AlgorithmConfig.__reduce_ex__` that fails a pickle (`copy.deepcopy` still works)."""
    if sys._getframe(1).f_globals.get("__name__") == "copy":
        return object.__reduce_ex__(config, protocol)
    raise pickle.PicklingError("an AlgorithmConfig was pickled: workers get specs, not the config")


def test_iterations_report_rllib_results_with_consistent_counters(placement, monkeypatch):
    # Actors are built from the plan's `RunnerSpec`: the config never crosses to a worker.
    monkeypatch.setattr(AlgorithmConfig, "__reduce_ex__", _refuse_to_pickle)
    algo = _config(placement).build()
    try:
        pids = list(algo.actors.pids().values())
        results = [algo.train() for _ in range(3)]
    finally:
        algo.stop()
    if placement[0] == "local":  # Ray actors are Ray's processes to reap.
        assert wait_until(lambda: not any(alive(p) for p in pids), 10), "stop() ends actors"
    last = results[-1]
    assert [r["training_iteration"] for r in results] == [1, 2, 3]
    assert 0 < last["num_env_steps_trained"] <= last["num_samples_added_to_queue"]
    assert last["num_agent_steps_trained"] <= last["num_agent_steps_sampled"]
    assert last["timesteps_total"] == last["num_env_steps_sampled"]
    if placement[1] == 1:
        assert last["num_agent_steps_sampled"] == last["num_env_steps_sampled"]
    else:  # Two agents act per env step until one is done.
        assert last["num_agent_steps_sampled"] > last["num_env_steps_sampled"]
    assert last["num_weight_broadcasts"] > 0
    assert last["episodes_total"] > 0 and math.isfinite(last["episode_reward_mean"])
    assert last["num_healthy_workers"] == 2
    assert last["node_ip"] == _node_ip(placement[0])
    assert sorted(last["info"]["learner"]) == _policies(placement)
    for info in last["info"]["learner"].values():
        assert info["num_grad_updates_lifetime"] >= 1
        assert all(math.isfinite(info["learner_stats"][k]) for k in ("policy_loss", "vf_loss"))
    expected_policy_rewards = [] if placement[1] == 1 else ["p0", "p1"]
    assert sorted(last["policy_reward_mean"]) == expected_policy_rewards


def test_a_killed_actor_is_restarted_and_counted(placement):
    algo = _config(placement).build()
    try:
        algo.train()
        old = algo.actors.pids()[0]
        os.kill(old, signal.SIGKILL)
        result = _train_until(algo, lambda r: r["num_env_runner_restarts"] >= 1)
        assert result["num_env_runner_failures"] >= 1
        assert wait_until(lambda: 0 in algo.actors.pids() and algo.actors.pids()[0] != old, 60)
        sampled = result["num_env_steps_sampled"]
        after = _train_until(algo, lambda r: r["num_env_steps_sampled"] > sampled)
        assert after["num_healthy_workers"] == 2
    finally:
        algo.stop()
    assert _segments() == []


def test_a_killed_actor_raises_without_restarts(placement):
    algo = _config(placement, restart_failed_env_runners=False).build()
    try:
        algo.train()
        os.kill(algo.actors.pids()[1], signal.SIGKILL)
        with pytest.raises(RuntimeError, match="restart_failed_env_runners"):
            _train_until(algo, lambda r: False)
    finally:
        algo.stop()


def test_a_hung_actor_is_killed_after_the_sample_timeout_and_restarted(placement, tmp_path, caplog):
    agents = 0 if placement[1] == 1 else 2
    env_config = {"marker": str(tmp_path / "hung"), "after": 30, "num_agents": agents}
    config = _config(placement, sample_timeout_s=3.0).environment(
        envs.hanging_env, env_config=env_config
    )
    algo = config.build()
    try:
        with caplog.at_level(logging.WARNING, logger="impala_tf.driver.sampling"):
            result = _train_until(algo, lambda r: r["num_env_runner_restarts"] >= 1)
        assert os.path.exists(tmp_path / "hung")
        assert result["num_env_runner_failures"] >= 1
        assert "sample_timeout_s=3" in caplog.text
        sampled = result["num_env_steps_sampled"]
        assert _train_until(algo, lambda r: r["num_env_steps_sampled"] > sampled)
    finally:
        algo.stop()


def test_a_killed_aggregation_worker_is_restarted_and_its_steps_counted(placement):
    algo = _config(placement, num_aggregation_workers=1).build()
    try:
        algo.train()
        (pid,) = algo.aggregation.pids().values()
        os.kill(pid, signal.SIGKILL)
        result = _train_until(algo, lambda r: r["num_aggregation_worker_restarts"] >= 1)
        trained = result["num_env_steps_trained"]
        after = _train_until(algo, lambda r: r["num_env_steps_trained"] > trained)
        assert after["num_aggregation_worker_restarts"] >= 1
        assert len(algo.aggregation.pids()) == 1
    finally:
        algo.stop()
    assert _segments() == []


def test_aggregation_workers_get_fragments_by_reference_and_the_driver_only_train_batches(
    placement, monkeypatch
):
    """A fragment's batches go from its actor to an aggregation worker by reference (Ray's object
    store; shared memory on local processes), and the train batches come back so: the driver
    reads those, never a fragment's batches."""
    if placement[0] == "ray":
        from impala_tf.workers.ray_backend import RayStoredValue as Stored
    else:
        from impala_tf.workers.shared_values import SharedValue as Stored
    read_here = []
    get = Stored.get
    monkeypatch.setattr(Stored, "get", lambda self: read_here.append(self) or get(self))
    # No in-flight limit to reach: every fragment goes to the worker (at the limit the driver
    # aggregates a fragment itself, reading its batches: aggregation_test.py).
    config = _config(
        placement, num_aggregation_workers=1, max_requests_in_flight_per_aggregator_worker=1000
    )
    algo = config.build()
    handed = []
    call = algo.aggregation.workers.call

    def recording_call(worker, method, *args, **kwargs):
        if method is AggregatorHost.process_parts:
            handed.append(args[0])
        return call(worker, method, *args, **kwargs)

    algo.aggregation.workers.call = recording_call
    try:
        results = [algo.train() for _ in range(2)]
    finally:
        algo.stop()
    assert results[-1]["num_env_steps_trained"] > 0
    assert results[-1]["num_times_no_aggregation_worker_available"] == 0
    assert handed and all(isinstance(h, Stored) for h in handed)
    assert read_here  # The train batches, ...
    assert not {id(h) for h in handed} & {id(v) for v in read_here}  # ... and nothing else.
    assert _segments() == []


def test_save_then_restore_returns_to_the_saved_weights_counters_and_iteration(placement, tmp_path):
    algo = _config(placement).build()
    try:
        for _ in range(2):
            algo.train()
        path = algo.save(str(tmp_path / "checkpoint"))
        stored = checkpoints.read_state(path)
        for _ in range(2):
            algo.train()
        moved_on = {p: algo.get_policy_weights(p) for p in _policies(placement)}
        algo.restore(path)
        assert algo.iteration == stored["iteration"] == 2
        assert algo.metrics.counters.as_dict() == stored["counters"]
        restored = {p: algo.get_policy_weights(p) for p in _policies(placement)}
        result = algo.train()
    finally:
        algo.stop()
    assert result["training_iteration"] == 3
    assert result["num_env_steps_sampled"] > stored["counters"]["num_env_steps_sampled"]
    for pid in restored:  # Training after the save moved the weights; the restore undid it.
        assert any(not np.array_equal(a, b) for a, b in zip(restored[pid], moved_on[pid]))
    other = _config(placement).build()
    try:
        other.restore(path)
        for pid, arrays in restored.items():
            for a, b in zip(arrays, other.get_policy_weights(pid)):
                np.testing.assert_array_equal(a, b)
    finally:
        other.stop()


def test_evaluation_during_training_reports_summed_and_per_policy_returns(placement):
    config = _config(
        placement,
        evaluation_interval=1,
        evaluation_duration=3,
        evaluation_config={"explore": False},
    )
    algo = config.build()
    try:
        result = algo.train()
    finally:
        algo.stop()
    evaluation = result["evaluation"]
    assert evaluation["episodes_this_iter"] == 3
    assert math.isfinite(evaluation["episode_reward_mean"])
    assert evaluation["env_runners"]["num_episodes"] == 3
    per_policy = evaluation["policy_reward_mean"]
    assert sorted(per_policy) == ([] if placement[1] == 1 else ["p0", "p1"])
    if placement[1] == 2:  # The summed return is the sum over the agents' own returns.
        assert evaluation["episode_reward_mean"] == pytest.approx(sum(per_policy.values()))


def _own_config(placement: tuple[str, int]) -> ImpalaConfig:
    """A user's models and callbacks: RLlib's TFModelV2 example for the one policy; a Keras
    functional model for p0 and a subclassed one for p1 (a custom model per policy)."""
    config = _config(placement).callbacks(callbacks.EpisodeStats)
    if placement[1] == 1:
        return config.training(model={"custom_model": "tests.support.models:TwoHeadedModel"})
    functional = {
        "custom_model": "tests.support.models:functional_model",
        "custom_model_config": {"hidden": 8},
    }
    return config.multi_agent(
        policies={
            "p0": PolicySpec(config={"model": functional}),
            "p1": PolicySpec(config={"model": {"custom_model": models.SubclassedModel}}),
        }
    )


def test_a_users_models_and_callbacks_reach_actors_learners_evaluation_and_checkpoints(
    placement, tmp_path
):
    config = _own_config(placement).evaluation(evaluation_interval=1, evaluation_duration=2)
    algo = config.build()
    try:
        result = _train_until(
            algo,
            lambda r: (
                r["custom_metrics"]
                and all(i["num_grad_updates_lifetime"] for i in r["info"]["learner"].values())
            ),
        )
        with algo.learners.locked():  # No update between the read and the save.
            weights = {pid: algo.get_policy_weights(pid) for pid in _policies(placement)}
            path = algo.save(str(tmp_path / "ckpt"))
    finally:
        algo.stop()
    assert result["callback_ok"] is True  # on_train_result, in the driver.
    # Episode hooks in the actors: one metric per episode of the window, summarised.
    metrics = result["custom_metrics"]
    assert metrics["steps_mean"] == pytest.approx(result["episode_len_mean"])
    assert 0 <= metrics["obs0_min"] <= metrics["obs0_mean"] <= metrics["obs0_max"]
    assert len(result["hist_stats"]["obs0"]) >= result["hist_stats"]["episode_lengths"][0]
    assert result["evaluation"]["custom_metrics"]["steps_mean"] > 0  # And in evaluation.
    for pid in _policies(placement):
        assert result["info"]["learner"][pid]["num_grad_updates_lifetime"] >= 1
    loaded = Impala.from_checkpoint(path)  # No process starts.
    assert loaded.actors is None and loaded.learners is None
    for pid in _policies(placement):
        policy = loaded.get_policy(pid)
        assert type(policy.model).__name__ == "CustomActorCritic"
        for a, b in zip(policy.get_weights(), weights[pid]):
            np.testing.assert_array_equal(a, b)
        action = loaded.compute_single_action(np.zeros(4, np.float32), policy_id=pid)
        assert action in (0, 1)
    loaded.stop()


def test_a_raising_callback_stops_the_run_naming_the_hook_and_class(placement):
    algo = _config(placement).callbacks(callbacks.FailingEpisodeEnd).build()
    try:
        with pytest.raises(RuntimeError, match="FailingEpisodeEnd.on_episode_end raised in actor"):
            _train_until(algo, lambda r: False)
    finally:
        algo.stop()
