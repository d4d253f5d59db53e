"""Tests of non-finite updates: skipped in the compiled step, counted, saved, and an error after N.

Each runs a `LearnerThread` on synthetic batches whose rewards are NaN, on one device, on two
mirrored (logical CPU) devices and with microbatches.
"""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from impala_tf.data.sample_batch import SampleBatch
from impala_tf.learning import pipeline
from impala_tf.learning.learner import ImpalaLearner
from impala_tf.learning.nonfinite import NonFiniteGuard, NonFiniteUpdatesError
from impala_tf.learning.thread import LearnerThread, TrainBatch
from tests.support import batches as fakes
from tests.support import strategies

OBS, ACT, T, ROWS = fakes.OBS, fakes.ACT, fakes.T, fakes.ROWS
_config = fakes.learner_config


def _batch(seed: int, nan: bool = False) -> SampleBatch:
    columns = fakes.sequence_batch(OBS, ACT, T, ROWS, seed=seed)
    if nan:
        columns["rewards"][1, 2] = np.nan
    return SampleBatch(columns)


def _thread(config, tmp_path, strategy=None) -> LearnerThread:
    strategy = strategy or tf.distribute.get_strategy()
    keras.utils.set_random_seed(0)
    with strategy.scope():
        learner = ImpalaLearner(config, OBS, ACT)
    signature = pipeline.batch_signature(config, OBS, ACT, strategy.num_replicas_in_sync)
    thread = LearnerThread(learner, strategy, signature)
    thread.nonfinite.directory = str(tmp_path / "nonfinite")
    return thread


def _state(learner: ImpalaLearner) -> list[np.ndarray]:
    return [np.array(v.numpy()) for v in learner.state_variables()]


def _run(thread: LearnerThread, batches) -> list:
    thread.start()
    try:
        for batch in batches:
            thread.inqueue.put(TrainBatch(batch))
        return [thread.outqueue.get(timeout=120) for _ in batches]
    finally:
        thread.stop()


CASES = {
    "one_device": ({}, None),
    "mirrored": ({"num_gpus": 2, "_fake_gpus": True}, "mirrored"),
    "microbatches": ({"microbatch_size": 2 * T}, None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_nan_batch_is_skipped_counted_and_saved(case, tmp_path):
    overrides, strategy = CASES[case]
    thread = _thread(_config(**overrides), tmp_path, strategies.mirrored() if strategy else None)
    learner = thread.learner
    before = _state(learner)
    outputs = _run(thread, [_batch(1, nan=True)])
    assert thread.error is None, thread.error
    # Weights, optimizer state and both counters are exactly as before the skipped update.
    for old, new in zip(before, _state(learner)):
        np.testing.assert_array_equal(old, new)
    env_steps, _, stats = outputs[0]
    assert env_steps == 0 and stats["update_skipped"] == 1.0
    assert not np.isfinite(stats["total_loss"])
    assert thread.nonfinite.num_skipped == 1
    path = tmp_path / "nonfinite" / "batch_1.npz"
    with np.load(path) as saved:
        assert saved["rewards"].shape == (ROWS, T)
        assert np.isnan(saved["rewards"][1, 2])
        assert np.isnan(saved["_stats_total_loss"])


@pytest.mark.parametrize("case", sorted(CASES))
def test_finite_batches_after_a_skip_train(case, tmp_path):
    overrides, strategy = CASES[case]
    thread = _thread(_config(**overrides), tmp_path, strategies.mirrored() if strategy else None)
    before = _state(thread.learner)
    outputs = _run(thread, [_batch(1, nan=True), _batch(2)])
    assert thread.error is None, thread.error
    assert [o[2]["update_skipped"] for o in outputs] == [1.0, 0.0]
    assert outputs[1][0] == ROWS * T
    assert int(thread.learner.num_grad_updates.numpy()) == 1
    assert int(thread.learner.num_agent_steps_trained.numpy()) == ROWS * T
    after = _state(thread.learner)
    assert any(not np.array_equal(a, b) for a, b in zip(before, after))
    assert all(np.all(np.isfinite(a)) for a in after)
    assert thread.nonfinite.in_a_row == 0


def test_max_nonfinite_updates_in_a_row_raise_naming_the_batch_file_and_stats(tmp_path):
    thread = _thread(_config(max_nonfinite_updates=3), tmp_path)
    thread.start()
    try:
        for seed in range(3):
            thread.inqueue.put(TrainBatch(_batch(seed, nan=True)))
        for _ in range(2):
            thread.outqueue.get(timeout=120)
        thread.join(120)
    finally:
        thread.stop()
    assert not thread.is_alive()
    error = thread.error
    assert isinstance(error, NonFiniteUpdatesError), error
    path = os.path.join(str(tmp_path), "nonfinite", "batch_3.npz")
    assert error.batch_file == path and os.path.isfile(path)
    assert path in str(error) and "total_loss" in str(error)
    assert "max_nonfinite_updates=3" in str(error)
    assert "total_loss" in error.stats


def test_the_guard_counts_only_consecutive_skips(tmp_path):
    guard = NonFiniteGuard(2, str(tmp_path))
    skipped = {"update_skipped": True, "total_loss": float("nan"), "grad_gnorm": float("inf")}
    assert guard.observe(skipped, None)
    assert not guard.observe({"update_skipped": False, "total_loss": 1.0}, None)
    assert guard.observe(skipped, None)
    with pytest.raises(NonFiniteUpdatesError, match="grad_gnorm") as info:
        guard.observe(skipped, None)
    assert info.value.stats == ["total_loss", "grad_gnorm"]
    assert guard.num_skipped == 3
    assert sorted(os.listdir(tmp_path)) == ["batch_1.npz", "batch_2.npz", "batch_3.npz"]


@pytest.mark.parametrize("value", [0, -1, 1.5, "3", None])
def test_max_nonfinite_updates_is_validated(value):
    with pytest.raises(ValueError, match="max_nonfinite_updates"):
        _config(max_nonfinite_updates=value).validate()
