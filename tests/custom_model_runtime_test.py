"""A custom model in the runtime's other places: the central inference server, the learner on
two devices (`MirroredStrategy` over logical CPUs), and a checkpoint restored into a new run.

Every placement (processes, Ray x one, two policies) is in `tests/runtime_conformance_test.py`.
"""

from __future__ import annotations

import numpy as np

from impala_tf import Impala
from tests.support import strategies
from tests.support.configs import small_config

#: A recurrent TFModelV2 whose state starts at ones, not zeros (what the server must hand out).
RECURRENT = {"custom_model": "tests.support.models:Counter", "max_seq_len": 5}


def _train_until_updated(algo, iterations: int = 30) -> dict:
    for _ in range(iterations):
        result = algo.train()
        infos = result["info"]["learner"].values()
        if all(i["num_grad_updates_lifetime"] >= 1 for i in infos) and result["episodes_total"]:
            return result
    raise AssertionError(f"no update of every policy in {iterations} iterations: {result}")


def test_the_inference_server_acts_with_a_custom_recurrent_model():
    algo = small_config(inference="central").training(model=RECURRENT).build()
    try:
        assert algo.plan.central_inference
        np.testing.assert_array_equal(algo.actors.server.initial_states["default_policy"], [[1.0]])
        result = _train_until_updated(algo)
        served = algo.actors.server.stats()
    finally:
        algo.stop()
    assert served["num_requests"] > 0 and result["num_env_steps_trained"] > 0


def test_a_custom_model_trains_on_two_devices():
    config = small_config(num_env_runners=1, num_gpus=2, _fake_gpus=True).training(
        model={"custom_model": "tests.support.models:TwoHeadedModel"}
    )
    with strategies.own_collective_keys():
        algo = config.build()
    try:
        assert algo.strategy.num_replicas_in_sync == 2
        result = _train_until_updated(algo)
    finally:
        algo.stop()
    stats = result["info"]["learner"]["default_policy"]["learner_stats"]
    assert np.isfinite(stats["total_loss"]) and stats["grad_gnorm"] > 0


def test_a_custom_model_checkpoint_restores_into_a_new_run(tmp_path):
    config = small_config(num_env_runners=1).training(model=RECURRENT)
    algo = config.build()
    try:
        _train_until_updated(algo)
        path = algo.save(str(tmp_path / "ckpt"))
        iteration = algo.iteration
    finally:
        algo.stop()
    saved = Impala.from_checkpoint(path).get_weights()["default_policy"]
    resumed = config.build()
    try:
        resumed.restore(path)
        assert resumed.iteration == iteration
        for a, b in zip(resumed.get_weights()["default_policy"], saved):
            np.testing.assert_array_equal(a, b)
        assert resumed.train()["training_iteration"] == iteration + 1
    finally:
        resumed.stop()
