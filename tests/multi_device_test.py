"""Tests of the multi-device learner thread: towers, tower-stack slots, timers, failed loaders.

Two logical CPU devices (tests/conftest.py) stand in for two GPUs, as `_fake_gpus=True` does.
"""

from __future__ import annotations

import os
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from impala_tf.config import ConfigWarning, ImpalaConfig
from impala_tf.data.sample_batch import SampleBatch
from impala_tf.learning import pipeline
from impala_tf.learning.learner import ImpalaLearner
from impala_tf.learning.thread import LearnerThread, TrainBatch
from tests.support import batches as fakes
from tests.support import strategies

OBS, ACT, T, ROWS = fakes.OBS, fakes.ACT, fakes.T, fakes.ROWS
_config = fakes.learner_config


def _batch(seed: int) -> SampleBatch:
    return SampleBatch(fakes.sequence_batch(OBS, ACT, T, ROWS, seed=seed))


def _thread(config, strategy=None, callbacks=None, weights=None) -> LearnerThread:
    strategy = strategy or tf.distribute.get_strategy()
    keras.utils.set_random_seed(0)
    with strategy.scope():
        learner = ImpalaLearner(config, OBS, ACT)
    if weights is not None:
        learner.model.set_weights(weights)
    signature = pipeline.batch_signature(config, OBS, ACT, strategy.num_replicas_in_sync)
    return LearnerThread(learner, strategy, signature, callbacks=callbacks)


def _train(thread: LearnerThread, batches, updates: int):
    thread.start()
    try:
        for batch in batches:
            thread.inqueue.put(TrainBatch(batch))
        outputs = [thread.outqueue.get(timeout=60) for _ in range(updates)]
    finally:
        thread.stop()
    assert thread.error is None, thread.error
    return outputs


def _weights(learner) -> list[np.ndarray]:
    return [w.copy() for w in learner.model.get_weights()]


def test_two_towers_reuse_device_batches_and_match_one_device():
    # Two tower stacks, two passes each: RLlib's ring serves A, B, A, B. The minibatch buffer
    # size is the number of stacks (derived, with a warning), and each batch is loaded once.
    config = _config(
        num_gpus=2, _fake_gpus=True, num_multi_gpu_tower_stacks=2, minibatch_buffer_size=1
    )
    config.num_sgd_iter = 2
    with pytest.warns(ConfigWarning, match="num_multi_gpu_tower_stacks=2. slots"):
        config.validate()
    thread = _thread(config, strategy=strategies.mirrored())
    assert thread.minibatch_buffer.size == 2 and thread.num_slots == 2
    init = _weights(thread.learner)
    batches = [_batch(1), _batch(2)]
    outputs = _train(thread, batches, updates=4)
    assert thread.load_timer.count == 2  # loaded once, trained twice
    assert [steps for steps, _, _ in outputs] == [ROWS * T] * 4

    single = _thread(_config(), weights=init).learner
    step = tf.function(single.train_step, autograph=False)
    expected = []
    for batch in (batches[0], batches[1], batches[0], batches[1]):
        out = step({k: tf.constant(v) for k, v in fakes.flat(dict(batch)).items()})
        expected.append({k: float(v) for k, v in out.items()})
    for wa, wb in zip(_weights(single), _weights(thread.learner)):
        np.testing.assert_allclose(wb, wa, rtol=1e-4, atol=1e-6)
    for (_, _, stats), ref in zip(outputs, expected):
        for key in ("policy_loss", "vf_loss", "grad_gnorm", "vf_explained_var"):
            assert stats[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), key
    assert outputs[-1][2]["num_agent_steps_trained"] == 4 * ROWS * T


@pytest.mark.parametrize("stacks", [1, 3])
def test_loader_holds_at_most_the_tower_stacks(stacks):
    gate = fakes.Gate(timeout_s=30)
    thread = _thread(_config(num_multi_gpu_tower_stacks=stacks), callbacks=[gate])
    thread.start()
    try:
        for seed in range(6):
            thread.inqueue.put(TrainBatch(_batch(seed)))
        assert gate.entered.wait(60)
        # One slot trains, the others are loaded ahead; then the loader waits for a slot.
        assert thread.loader_waiting.wait(60)
        assert 6 - thread.inqueue.qsize() == stacks
        assert thread.load_timer.count == stacks
        gate.release.set()
        for _ in range(6):
            thread.outqueue.get(timeout=120)
    finally:
        gate.release.set()
        thread.stop()
    assert thread.error is None


def test_timers_measure_loading_and_waiting():
    thread = _thread(_config())
    thread.start()
    try:
        assert thread.loader_waiting.wait(60)  # Traced and started: it waits for a batch.
        time.sleep(2.0)  # the loader and the learner wait for data meanwhile
        thread.inqueue.put(TrainBatch(_batch(0)))
        thread.outqueue.get(timeout=120)
    finally:
        thread.stop()
    metrics = thread.add_learner_metrics({})["info"]["timing_breakdown"]
    # They waited about 2 s; a wide margin for a busy machine, where the threads start waiting
    # late (a timer that measured nothing would report about 0).
    assert metrics["learner_load_wait_time_ms"] >= 300
    assert metrics["learner_dequeue_time_ms"] >= 300
    assert thread.load_timer.count == 1 and metrics["learner_load_time_ms"] > 0
    assert thread.reports.grad_timer.count == 1 and metrics["learner_grad_time_ms"] > 0


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda b: b.update(action_dist_inputs=b["action_dist_inputs"][..., :2]), "action_dist"),
        (lambda b: b.pop("values_bootstrapped"), "values_bootstrapped"),
    ],
    ids=["wrong-shape", "missing"],
)
def test_a_malformed_batch_ends_the_thread_with_an_error_naming_the_column(corrupt, message):
    thread = _thread(_config(num_gpus=2, _fake_gpus=True), strategy=strategies.mirrored())
    thread.start()
    try:
        good, bad = _batch(0), dict(_batch(1))
        corrupt(bad)
        thread.inqueue.put(TrainBatch(good))
        thread.inqueue.put(TrainBatch(SampleBatch(bad)))
        thread.outqueue.get(timeout=120)  # the good batch trains
        thread.join(30)
        assert not thread.is_alive(), "a failed loader must end the thread, not hang it"
    finally:
        thread.stop()
    assert isinstance(thread.error, ValueError)
    assert message in str(thread.error)


def test_fake_gpus_driver_trains_and_raises_from_a_failed_loader():
    config = (
        ImpalaConfig()
        .environment("CartPole-v1")
        .env_runners(num_env_runners=1, num_envs_per_env_runner=4, rollout_fragment_length=10)
        .training(train_batch_size=40, model={"fcnet_hiddens": [16]})
        .resources(num_gpus=2, _fake_gpus=True)
        .reporting(min_time_s_per_iteration=0.5)
        .debugging(seed=0)
    )
    with strategies.own_collective_keys():
        algo = config.build()
    try:
        assert algo.strategy.num_replicas_in_sync == 2
        result = algo.train()
        assert result["num_env_steps_trained"] > 0
        stats = result["info"]["learner"]["default_policy"]["learner_stats"]
        assert np.isfinite(stats["total_loss"])
        bad = dict(_batch(0))
        bad["rewards"] = np.zeros((ROWS, 10, 2), np.float32)
        algo.learner_thread.inqueue.put(TrainBatch(SampleBatch(bad)))
        with pytest.raises(RuntimeError, match="learner thread died") as info:
            for _ in range(20):
                algo.train()
    finally:
        algo.stop()
    assert "rewards" in str(info.value.__cause__)


def test_an_lstm_policy_on_two_towers_matches_one_device():
    # RLlib's `cartpole-impala-fake-gpus` example trains an LSTM on two devices: each tower
    # unrolls its half of the sequences from their stored states. (Whether that example learns
    # is a learning-suite criterion, `tools/learning_suite.py`, not a unit test.)
    model = {"fcnet_hiddens": [16], "use_lstm": True, "lstm_cell_size": 8}
    config = _config(num_gpus=2, _fake_gpus=True, model=model)
    strategy = strategies.mirrored()
    keras.utils.set_random_seed(0)
    with strategy.scope():
        learner = ImpalaLearner(config, OBS, ACT)
    states = tuple(tuple(s.shape[1:]) for s in learner.model.initial_state(1))
    assert states == ((8,), (8,))
    init = _weights(learner)
    signature = pipeline.batch_signature(config, OBS, ACT, 2, states)
    thread = LearnerThread(learner, strategy, signature)
    batches = [
        SampleBatch(fakes.sequence_batch(OBS, ACT, T, ROWS, seed=s, state_shapes=states))
        for s in (3, 4)
    ]
    outputs = _train(thread, batches, updates=2)

    single = _thread(_config(model=model), weights=init).learner
    step = tf.function(single.train_step, autograph=False)
    for batch, (_, _, stats) in zip(batches, outputs):
        ref = step({k: tf.constant(v) for k, v in fakes.flat(dict(batch)).items()})
        for key in ("policy_loss", "vf_loss", "grad_gnorm"):
            assert stats[key] == pytest.approx(float(ref[key]), rel=1e-4, abs=1e-6), key
    for wa, wb in zip(_weights(single), _weights(thread.learner)):
        np.testing.assert_allclose(wb, wa, rtol=1e-4, atol=1e-6)


def test_fake_gpus_example_config():
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs")
    config, stop = ImpalaConfig.from_yaml(os.path.join(path, "cartpole-impala-fake-gpus.yaml"))
    config.validate(require_env=True)
    assert stop == {"episode_reward_mean": 150, "training_iteration": 400}
    assert (config.num_gpus, config._fake_gpus, config.train_batch_size) == (2, True, 1000)
    assert config.model["use_lstm"] is True
    assert config.num_learner_devices == 2
