"""Tests of gradient accumulation over microbatches (`microbatch_size`, RLlib's seed 004).

The accumulated update must equal the full-batch update (weights, optimizer state, stats), on one
device and on two, with one optimizer and with the separate value optimizer, for feed-forward and
recurrent models; the loader must feed microbatches, never the whole train batch.
"""

from __future__ import annotations

import gymnasium as gym
import keras
import numpy as np
import pytest
import tensorflow as tf

from impala_tf.appo import APPOConfig
from impala_tf.config import ImpalaConfig
from impala_tf.data.sample_batch import SampleBatch
from impala_tf.learning import pipeline
from impala_tf.learning.learner import ImpalaLearner
from impala_tf.learning.thread import LearnerThread, TrainBatch
from tests.support import batches as fakes
from tests.support import strategies

OBS = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
ACT = gym.spaces.Discrete(3)
T = 5
ROWS = 8  # sequences per train batch
MICRO_ROWS = 2  # sequences per microbatch


def _config(**overrides) -> ImpalaConfig:
    config = ImpalaConfig().environment("CartPole-v1")
    config.training(
        model={"fcnet_hiddens": [16, 16]},
        train_batch_size=ROWS * T,
        microbatch_size=MICRO_ROWS * T,
        lr=0.01,
    )
    config.env_runners(rollout_fragment_length=T)
    return config.update_from_dict(overrides)


def _learner(config, strategy=None, weights=None) -> ImpalaLearner:
    keras.utils.set_random_seed(0)
    strategy = strategy or tf.distribute.get_strategy()
    with strategy.scope():
        learner = config.learner_class()(config, OBS, ACT)
    if weights is not None:
        learner.model.set_weights(weights)
    return learner


def _state_shapes(learner) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(s.shape[1:]) for s in learner.model.initial_state(1))


def _weights(learner) -> list[np.ndarray]:
    return [w.copy() for w in learner.model.get_weights()]


def _full_batch_updates(config, batches, weights, state_shapes=()):
    """Reference: `train_step` on each whole batch (time-major), one device."""
    full = _learner(config.copy().update_from_dict({"microbatch_size": None}), weights=weights)
    step = tf.function(full.train_step, autograph=False)
    stats = []
    for batch in batches:
        tm = {k: tf.constant(v) for k, v in fakes.time_major(batch).items()}
        stats.append({k: float(v) for k, v in step(tm).items()})
    return full, stats


def _microbatched_updates(config, batches, weights, strategy):
    """`accumulate_step` on each microbatch shard, then `apply_accumulated`, under `strategy`."""
    learner = _learner(config, strategy=strategy, weights=weights)
    n = strategy.num_replicas_in_sync
    signature = pipeline.batch_signature(config, OBS, ACT, n, _state_shapes(learner))
    accumulate = tf.function(
        lambda d: strategy.run(learner.accumulate_step, args=(d,)), autograph=False
    )
    apply = tf.function(lambda: strategy.run(learner.apply_accumulated), autograph=False)
    stats = []
    for batch in batches:
        sample = SampleBatch(batch)
        for start in range(0, ROWS, MICRO_ROWS):
            shards = pipeline.replica_shards(sample.slice(start, start + MICRO_ROWS), signature, n)
            data = strategy.experimental_distribute_values_from_function(
                lambda ctx, shards=shards: {
                    k: tf.constant(v) for k, v in shards[ctx.replica_id_in_sync_group].items()
                }
            )
            accumulate(data)
        out = strategy.experimental_local_results(apply())[0]
        stats.append({k: float(v) for k, v in out.items()})
    return learner, stats


def _assert_same_updates(config, strategy, state_shapes=()):
    batches = [
        fakes.sequence_batch(OBS, ACT, T, ROWS, seed=s, state_shapes=state_shapes) for s in (1, 2)
    ]
    init = _weights(_learner(config))
    full, full_stats = _full_batch_updates(config, batches, init)
    micro, micro_stats = _microbatched_updates(config, batches, init, strategy)
    # Two updates: the second also checks that the optimizer state (Adam moments) and the
    # accumulators' reset match.
    for wf, wm in zip(_weights(full), _weights(micro)):
        np.testing.assert_allclose(wm, wf, rtol=1e-4, atol=1e-6)
    assert not np.allclose(_weights(full)[0], init[0])
    for sf, sm in zip(full_stats, micro_stats):
        for key in (
            "policy_loss",
            "vf_loss",
            "entropy",
            "grad_gnorm",
            "vf_explained_var",
            "max_rho",
        ):
            assert sm[key] == pytest.approx(sf[key], rel=1e-4, abs=1e-6), key
        assert sm["num_agent_steps_trained"] == sf["num_agent_steps_trained"]
    assert micro_stats[-1]["num_grad_updates_lifetime"] == 2
    assert micro_stats[-1]["num_agent_steps_trained"] == 2 * ROWS * T


@pytest.mark.parametrize("devices, separate_vf", [(1, False), (2, True)])
def test_microbatched_update_equals_full_batch_update(devices, separate_vf):
    config = _config(_separate_vf_optimizer=separate_vf, grad_clip=None)
    strategy = strategies.mirrored() if devices == 2 else tf.distribute.get_strategy()
    _assert_same_updates(config, strategy)


def test_appo_microbatched_update_equals_full_batch_update():
    # APPO's loss is a mean: the accumulated sums are divided by the whole batch's valid steps.
    config = APPOConfig.from_dict(_config(grad_clip=0.5).to_dict()).training(use_kl_loss=True)
    _assert_same_updates(config, strategies.mirrored())


def test_microbatched_update_equals_full_batch_update_with_clipping_and_lstm():
    # Clipping applies to the summed gradient, not to each microbatch's; each microbatch starts
    # its sequences from their stored LSTM states.
    config = _config(grad_clip=0.5, model={"fcnet_hiddens": [8], "use_lstm": True,
                                           "lstm_cell_size": 8})  # fmt: skip
    learner = _learner(config)
    _assert_same_updates(config, tf.distribute.get_strategy(), _state_shapes(learner))


def test_accumulation_without_microbatch_size_is_an_error():
    learner = _learner(_config(microbatch_size=None))
    with pytest.raises(ValueError, match="microbatch_size"):
        learner.apply_accumulated()


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"microbatch_size": 7}, "multiple of `rollout_fragment_length`"),
        ({"microbatch_size": 3 * T, "num_gpus": 2, "_fake_gpus": True}, "divide evenly"),
    ],
)
def test_microbatch_sizes_that_do_not_cut_whole_sequences_are_clear_errors(overrides, message):
    config = _config(**overrides)
    with pytest.raises(ValueError, match=message) as info:
        pipeline.microbatches_per_batch(config, config.num_learner_devices)
    assert "microbatch_size" in str(info.value)


def test_train_batches_are_cut_into_whole_microbatches():
    # RLlib accumulates microbatches until at least `train_batch_size` steps. Train batches are
    # `rows_per_batch` sequences; the learner needs a whole number of microbatches in them.
    config = _config(microbatch_size=3 * T, train_batch_size=8 * T)
    rows = pipeline.rows_per_batch(config)
    if rows % 3:
        with pytest.raises(ValueError, match="multiple of `microbatch_size`"):
            pipeline.microbatches_per_batch(config)
    else:
        assert pipeline.microbatches_per_batch(config) == rows // 3
        assert rows * T >= config.train_batch_size


def _run_thread(config, batches, strategy=None, updates=None):
    strategy = strategy or tf.distribute.get_strategy()
    learner = _learner(config, strategy=strategy)
    init = _weights(learner)
    n = strategy.num_replicas_in_sync
    signature = pipeline.batch_signature(config, OBS, ACT, n, _state_shapes(learner))
    thread = LearnerThread(learner, strategy, signature)
    thread.start()
    outputs = []
    try:
        for batch in batches:
            thread.inqueue.put(TrainBatch(SampleBatch(batch), policy_version=0.0))
        for _ in range(updates or len(batches)):
            outputs.append(thread.outqueue.get(timeout=60))
    finally:
        thread.stop()
    assert thread.error is None, thread.error
    return thread, init, outputs


def test_learner_thread_accumulates_microbatches_into_one_update_per_pass():
    config = _config(num_sgd_iter=2)
    batches = [fakes.sequence_batch(OBS, ACT, T, ROWS, seed=s) for s in (3, 4)]
    thread, init, outputs = _run_thread(config, batches, updates=4)
    # The loader hands the devices microbatches only.
    assert thread._dataset.element_spec["obs"].shape[0] == MICRO_ROWS * T
    assert thread.load_timer.count == 2 * 2 * (ROWS // MICRO_ROWS)  # passes x batches x micro
    assert [steps for steps, _, _ in outputs] == [ROWS * T] * 4
    stats = outputs[-1][2]
    assert stats["num_grad_updates_lifetime"] == 4
    assert stats["opt_samples"] == MICRO_ROWS * T
    for key in ("sample_time_ms", "grad_time_ms", "update_time_ms"):
        assert stats[key] > 0, key
    assert stats["opt_peak_throughput"] > 0 and stats["sample_peak_throughput"] > 0
    # num_sgd_iter=2 with one slot of the ring: batch 3 twice, then batch 4 twice.
    full, _ = _full_batch_updates(config, [batches[0]] * 2 + [batches[1]] * 2, init)
    for wf, wt in zip(_weights(full), _weights(thread.learner)):
        np.testing.assert_allclose(wt, wf, rtol=1e-4, atol=1e-6)


def test_learner_thread_microbatches_on_two_devices_match_one_device_full_batch():
    config = _config(num_gpus=2, _fake_gpus=True)
    batches = [fakes.sequence_batch(OBS, ACT, T, ROWS, seed=5)]
    thread, init, outputs = _run_thread(config, batches, strategy=strategies.mirrored())
    per_device = tf.nest.flatten(thread._dataset.element_spec["obs"], expand_composites=True)
    assert [spec.shape[0] for spec in per_device] == [MICRO_ROWS * T // 2] * 2
    full, full_stats = _full_batch_updates(config, batches, init)
    for wf, wt in zip(_weights(full), _weights(thread.learner)):
        np.testing.assert_allclose(wt, wf, rtol=1e-4, atol=1e-6)
    assert outputs[0][2]["policy_loss"] == pytest.approx(full_stats[0]["policy_loss"], rel=1e-4)


def test_driver_reports_the_microbatch_stats():
    config = (
        ImpalaConfig()
        .environment("CartPole-v1")
        .env_runners(num_env_runners=1, num_envs_per_env_runner=4, rollout_fragment_length=10)
        .training(train_batch_size=80, microbatch_size=20, model={"fcnet_hiddens": [16]})
        .reporting(min_time_s_per_iteration=0.5)
        .debugging(seed=0)
    )
    algo = config.build()
    try:
        result = algo.train()
    finally:
        algo.stop()
    stats = result["info"]["learner"]["default_policy"]["learner_stats"]
    assert stats["opt_samples"] == 20
    for key in ("sample_time_ms", "grad_time_ms", "update_time_ms", "opt_peak_throughput"):
        assert stats[key] > 0, key
    assert result["num_env_steps_trained"] > 0
    assert result["num_env_steps_trained"] % 80 == 0  # whole train batches, one update each
