"""Reliability of the driver and learner thread: consistent weight reads, restore flushes,
fresh seeds for restarted actors, and non-finite updates counted in the result dict."""

from __future__ import annotations

import os
import threading
import time

import gymnasium as gym
import keras
import numpy as np
import pytest
import tensorflow as tf

from impala_tf import checkpoints, pipeline
from impala_tf.actors.base import ActorFailure
from impala_tf.algorithm import Impala
from impala_tf.config import ImpalaConfig
from impala_tf.learner import ImpalaLearner
from impala_tf.learner_thread import LearnerThread, TrainBatch
from impala_tf.nonfinite import NonFiniteUpdatesError
from impala_tf.reporting import tensorboard_scalars
from impala_tf.sample_batch import SampleBatch
from tests import fakes

OBS = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
ACT = gym.spaces.Discrete(3)
T, ROWS = 5, 4


def _algo_config(**overrides) -> ImpalaConfig:
    config = (
        ImpalaConfig()
        .environment("CartPole-v1")
        .env_runners(num_env_runners=1, num_envs_per_env_runner=2, rollout_fragment_length=10)
        .training(train_batch_size=20, model={"fcnet_hiddens": [8]})
        .reporting(min_time_s_per_iteration=0)
        .debugging(seed=7)
        .resources(num_gpus=0)
    )
    return config.update_from_dict(overrides)


@pytest.fixture(scope="module")
def algo():
    algorithm = Impala(_algo_config())
    yield algorithm
    algorithm.stop()


class _TearingWriter(threading.Thread):
    """Writes update k into every model variable, one at a time with a pause, under the lock
    (as the learner thread's update holds it): a read without the lock sees two updates."""

    def __init__(self, algo: Impala, rounds: int = 40):
        super().__init__(daemon=True)
        self.algo, self.rounds = algo, rounds

    def run(self):
        variables = self.algo.learner.model.trainable_variables
        for k in range(1, self.rounds + 1):
            with self.algo.learner_thread.lock:
                for variable in variables:
                    variable.assign(tf.fill(variable.shape, float(k)))
                    time.sleep(0.001)
            time.sleep(0.001)


def _update_of(weights: list[np.ndarray]) -> set[float]:
    return {float(v) for w in weights for v in np.unique(w)}


def test_weight_reads_for_actors_restarts_evaluation_and_checkpoints_see_one_update(
    algo, tmp_path, monkeypatch
):
    algo.learner_thread.stop()  # Only the writer below changes the weights.
    algo.evaluate()  # Builds the evaluation runner.
    seen: list[list[np.ndarray]] = []
    monkeypatch.setattr(algo.pool, "broadcast_weights", lambda w, v, ids, *filt: seen.append(w))
    monkeypatch.setattr(algo.pool, "restart", lambda i, w, v: seen.append(w))
    monkeypatch.setattr(algo._eval_runner, "set_weights", lambda w, v, *filt: seen.append(w))
    monkeypatch.setattr(algo._eval_runner, "run_episodes", lambda n: [(1.0, 1)])
    saved = []
    writer = _TearingWriter(algo)
    writer.start()
    while writer.is_alive():
        algo._broadcast([0])
        algo._handle_failures([ActorFailure(0, "test")])
        algo._failures_in_a_row.clear()
        algo.evaluate()
        saved.append(algo.save(str(tmp_path / f"checkpoint_{len(saved)}")))
    writer.join()
    for path in saved:
        reader = tf.train.load_checkpoint(os.path.join(path, checkpoints.LEARNER_PREFIX))
        kernels = [
            reader.get_tensor(name)
            for name in reader.get_variable_to_shape_map()
            if name.startswith("model/") and "OPTIMIZER_SLOT" not in name
        ]
        seen.append([k for k in kernels if np.issubdtype(k.dtype, np.floating)])
    assert len(seen) > 20
    mixed = [sorted(_update_of(w)) for w in seen if len(_update_of(w)) > 1]
    assert not mixed, f"torn reads: {mixed[:3]}"


def test_restore_flushes_the_learner_queue_and_restarted_actors_get_fresh_seeds(algo, tmp_path):
    # A restarted actor replays nothing: its first fragment differs from the first one.
    fresh = Impala(_algo_config())
    try:
        first = []
        while not first:
            first, _ = fresh.pool.fetch_ready(1.0)
        first_obs = first[0].batch["obs"][:, 0]
        os.kill(fresh.pool.pids()[0], 9)
        failures = []
        while not failures:
            _, failures = fresh.pool.fetch_ready(1.0)
        fresh._handle_failures(failures)
        fresh.pool.request_samples([0], 1)
        again = []
        while not again:
            again, _ = fresh.pool.fetch_ready(1.0)
        assert fresh._counters["num_env_runner_restarts"] == 1
        assert not np.array_equal(first_obs, again[0].batch["obs"][:, 0])

        # Batches queued before a restore are dropped with it.
        path = fresh.save(str(tmp_path / "checkpoint"))
        thread = fresh.learner_thread
        with thread.lock:  # Keeps the learner from taking them meanwhile.
            for _ in range(3):
                thread.inqueue.put(TrainBatch(SampleBatch(first[0].batch)))
            generation = thread.generation
            fresh.restore(path)
        assert thread.inqueue.qsize() == 0
        assert thread.generation == generation + 1
    finally:
        fresh.stop()


def _batch(seed: int) -> SampleBatch:
    return SampleBatch(fakes.sequence_batch(OBS, ACT, T, ROWS, seed=seed))


def _thread(config) -> LearnerThread:
    keras.utils.set_random_seed(0)
    learner = ImpalaLearner(config, OBS, ACT)
    signature = pipeline.batch_signature(config, OBS, ACT)
    return LearnerThread(learner, tf.distribute.get_strategy(), signature)


def _thread_config(**overrides) -> ImpalaConfig:
    config = ImpalaConfig().environment("CartPole-v1")
    config.training(model={"fcnet_hiddens": [16]}, train_batch_size=ROWS * T, lr=0.01)
    config.env_runners(rollout_fragment_length=T)
    return config.update_from_dict(overrides)


@pytest.mark.parametrize("microbatch_size", [None, 2 * T])
def test_flush_drops_queued_loaded_and_buffered_batches(microbatch_size):
    thread = _thread(_thread_config(microbatch_size=microbatch_size, num_sgd_iter=2))
    thread.start()
    try:
        with thread.lock:  # The learner blocks on its next update: batches pile up.
            for seed in range(3):
                thread.inqueue.put(TrainBatch(_batch(seed)))
            deadline = time.monotonic() + 120
            while thread.inqueue.qsize() == 3 and time.monotonic() < deadline:
                time.sleep(0.05)  # The loader takes one and loads it.
            assert thread.inqueue.qsize() < 3
            time.sleep(0.5)
            thread.flush()
            assert thread.inqueue.qsize() == 0
        deadline = time.monotonic() + 120
        while thread.num_units_dropped == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        assert thread.outqueue.empty()
        assert int(thread.learner.num_grad_updates.numpy()) == 0
        assert thread.num_units_dropped >= 1
        thread.inqueue.put(TrainBatch(_batch(9)))
        outputs = [thread.outqueue.get(timeout=60) for _ in range(2)]  # num_sgd_iter passes.
        assert [o[0] for o in outputs] == [ROWS * T] * 2
    finally:
        thread.stop()
    assert thread.error is None, thread.error


def test_a_flush_mid_microbatch_empties_the_accumulators():
    config = _thread_config(microbatch_size=2 * T)
    thread = _thread(config)
    between, resume = threading.Event(), threading.Event()
    next_unit, calls = thread._next_unit, []

    def paused_next_unit():
        calls.append(1)
        if len(calls) == 2:  # After the first microbatch's gradients were accumulated.
            between.set()
            resume.wait(60)
        return next_unit()

    thread._next_unit = paused_next_unit
    accumulators = thread.learner._accumulators
    thread.start()
    try:
        thread.inqueue.put(TrainBatch(_batch(1)))
        assert between.wait(60)
        assert any(np.any(a.numpy() != 0) for group in accumulators.grads for a in group)
        with thread.lock:
            thread.flush()
        assert all(np.all(a.numpy() == 0) for group in accumulators.grads for a in group)
        assert float(accumulators.rows.numpy()) == 0
        resume.set()
        thread.inqueue.put(TrainBatch(_batch(2)))
        env_steps, _, _ = thread.outqueue.get(timeout=60)
    finally:
        resume.set()
        thread.stop()
    assert thread.error is None, thread.error
    assert env_steps == ROWS * T
    # The update equals one on the new batch alone: nothing of the flushed one is in it.
    reference = _thread(config)
    reference.start()
    try:
        reference.inqueue.put(TrainBatch(_batch(2)))
        reference.outqueue.get(timeout=60)
    finally:
        reference.stop()
    for a, b in zip(thread.learner.model.get_weights(), reference.learner.model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


class HugeRewardCartPole(gym.Wrapper):
    """CartPole whose every 25th step pays 3e38: finite, but the squared value error is inf."""

    def __init__(self, env_config=None):
        super().__init__(gym.make("CartPole-v1"))
        self._steps = 0

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self._steps += 1
        return obs, 3e38 if self._steps % 25 == 0 else reward, terminated, truncated, info


def test_nonfinite_updates_are_counted_in_the_result_and_tensorboard_then_raise(tmp_path):
    config = _algo_config(max_nonfinite_updates=10_000).environment(HugeRewardCartPole)
    algo = Impala(config, logdir=str(tmp_path))
    try:
        result = None
        for _ in range(30):
            result = algo.train()
            if result["num_nonfinite_updates_skipped"] >= 2:
                break
        assert result["num_nonfinite_updates_skipped"] >= 2
        assert result["counters"]["num_nonfinite_updates_skipped"] >= 2
        scalars = tensorboard_scalars(result)
        assert scalars["counters/nonfinite_updates_skipped"] >= 2
        assert os.path.isfile(tmp_path / "nonfinite" / "batch_1.npz")
        assert all(np.all(np.isfinite(w)) for w in algo.learner.model.get_weights())
        # Every batch non-finite from now on: the run stops with the error.
        algo.learner_thread.nonfinite.max_in_a_row = 1
        with pytest.raises(NonFiniteUpdatesError, match="nonfinite/batch_"):
            for _ in range(60):
                algo.train()
    finally:
        algo.stop()


@pytest.mark.parametrize("microbatch_size", [None, 2 * T])
def test_a_snapshot_that_would_wait_is_published_after_the_running_update(microbatch_size):
    thread = _thread(_thread_config(microbatch_size=microbatch_size))
    held, release = threading.Event(), threading.Event()

    def hold_lock():  # Stands for an update in progress on another thread.
        with thread.lock:
            held.set()
            release.wait(60)

    # Idle learner: read at once.
    weights, version = thread.policy_snapshot(wait=False)
    assert version == 0
    assert all(np.array_equal(a, b) for a, b in zip(weights, thread.learner.get_policy_weights()))
    holder = threading.Thread(target=hold_lock)
    holder.start()
    assert held.wait(60)
    assert thread.policy_snapshot(wait=False) is None  # Nothing published yet; asks for one.
    release.set()
    holder.join()
    thread.start()
    try:
        thread.inqueue.put(TrainBatch(_batch(1)))
        thread.outqueue.get(timeout=60)
        after_update = thread.learner.get_policy_weights()
        held.clear(), release.clear()
        holder = threading.Thread(target=hold_lock)
        holder.start()
        assert held.wait(60)
        weights, version = thread.policy_snapshot(wait=False)  # What the update published.
        release.set()
        holder.join()
        assert version == 1
        assert all(np.array_equal(a, b) for a, b in zip(weights, after_update))
        assert thread._snapshot_wanted  # And asked for the next one.
        with thread.lock:
            thread.flush()  # A restore: weights from before it are never handed out after it.
        assert thread._published is None
    finally:
        release.set()
        thread.stop()
    assert thread.error is None, thread.error
