"""Reliability of the driver and learner thread: weight reads from one update, restore and flush
drop what was queued, fresh seeds for restarted actors, non-finite updates counted and raised."""

from __future__ import annotations

import os
import signal
import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from impala_tf import checkpoints
from impala_tf.config import ImpalaConfig
from impala_tf.data.sample_batch import SampleBatch
from impala_tf.data.train_batch import BatchHandle, BatchLost
from impala_tf.driver.algorithm import Impala
from impala_tf.driver.counters import Counters
from impala_tf.driver.learners import LearnerGroup
from impala_tf.driver.plan import make_plan
from impala_tf.driver.specs import policy_learners
from impala_tf.learning import pipeline
from impala_tf.learning.learner import ImpalaLearner
from impala_tf.learning.nonfinite import NonFiniteUpdatesError
from impala_tf.learning.stats import TimerStat
from impala_tf.learning.thread import LearnerThread, TrainBatch
from impala_tf.rollout.fragment import DEFAULT_POLICY_ID
from impala_tf.training.reporting import tensorboard_scalars
from tests.support import envs
from tests.support.batches import ACT, OBS, ROWS, T, learner_config, sequence_batch
from tests.support.configs import small_config
from tests.support.processes import wait_until

PID = DEFAULT_POLICY_ID


def _algo_config(**overrides) -> ImpalaConfig:
    keys = dict(
        num_env_runners=1,
        num_envs_per_env_runner=2,
        train_batch_size=20,
        model={"fcnet_hiddens": [8]},
        min_time_s_per_iteration=0,
        seed=7,
    )
    return small_config(**{**keys, **overrides})


# Weight reads ----------------------------------------------------------------------------------


class _TearingWriter(threading.Thread):
    """Writes update k into every model variable, one at a time with a pause, under the lock
    (as the learner thread's update holds it) and counts it in `num_grad_updates` and the
    thread's host-side `version`: a read without the lock sees two updates."""

    def __init__(self, thread: LearnerThread):
        super().__init__(daemon=True)
        self.thread = thread
        for variable in thread.learner.model.trainable_variables:  # Update 0.
            variable.assign(tf.zeros_like(variable))
        self.done = threading.Event()
        self.rounds = 0

    def run(self):
        learner = self.thread.learner
        while not self.done.is_set():
            self.rounds += 1
            with self.thread.lock:
                for variable in learner.model.trainable_variables:
                    variable.assign(tf.fill(variable.shape, float(self.rounds)))
                    time.sleep(0.001)
                learner.num_grad_updates.assign_add(1)
                self.thread.publisher.set_version(self.thread.version + 1)  # As an update does.
            time.sleep(0.005)


def _updates_in(weights: list[np.ndarray]) -> set[float]:
    return {float(v) for w in weights for v in np.unique(w)}


def test_weight_reads_for_broadcasts_restarts_evaluation_and_checkpoints_see_one_update(tmp_path):
    algo = Impala(_algo_config())
    try:
        algo.learner_thread.stop()  # Only the writer below changes the weights.
        writer = _TearingWriter(algo.learner_thread)
        writer.start()
        seen: dict[str, list] = {"send": [], "step": [], "latest": [], "get": []}
        saved: list[str] = []
        try:
            deadline = time.monotonic() + 120
            while min(map(len, [*seen.values(), saved])) < 5 and time.monotonic() < deadline:
                seen["send"].append(algo.broadcaster.send([0])[PID][0])  # Restarts, restores.
                seen["get"].append(algo.get_policy_weights())
                saved.append(algo.save(str(tmp_path / f"checkpoint_{len(saved)}")))
                seen["latest"].append(algo.broadcaster.latest()[PID][0])  # Evaluation, restarts.
                # Every training step: reads now if no update runs (the writer wrote since the
                # send above, and just released the lock to `latest`), else sends nothing.
                if algo.broadcaster.step([0]):
                    seen["step"].append(algo.broadcaster.sent[PID][0])
        finally:
            writer.done.set()
            writer.join()
    finally:
        algo.stop()
    seen["save"] = []
    for path in saved:
        reader = tf.train.load_checkpoint(checkpoints.learner_prefix(path))
        kernels = [
            reader.get_tensor(name)
            for name in reader.get_variable_to_shape_map()
            if name.startswith("model/") and "OPTIMIZER_SLOT" not in name
        ]
        seen["save"].append([k for k in kernels if np.issubdtype(k.dtype, np.floating)])
    assert writer.rounds > 5 and all(len(reads) >= 5 for reads in seen.values())
    mixed = [
        (kind, sorted(_updates_in(w)))
        for kind, reads in seen.items()
        for w in reads
        if len(_updates_in(w)) > 1
    ]
    assert not mixed, f"torn reads: {mixed[:3]}"


# Restarts and restores -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def algo():
    algorithm = Impala(_algo_config())
    yield algorithm
    algorithm.stop()


def _next_fragment(algo: Impala):
    fragments: list = []
    assert wait_until(lambda: fragments.extend(algo.actors.fetch(1.0)[0]) or fragments, 60)
    return fragments[0]


def test_a_restarted_actor_gets_fresh_seeds_and_replays_no_episode(algo):
    first = _next_fragment(algo).batches[PID]["obs"][:, 0]  # The actor's first observations.
    os.kill(algo.actors.pids()[0], signal.SIGKILL)
    failures: list = []
    assert wait_until(lambda: failures.extend(algo.actors.fetch(1.0)[1]) or failures, 60)
    algo.broadcaster.restarted(algo.actors.handle_failures(failures))
    algo.actors.top_up()
    again = _next_fragment(algo).batches[PID]["obs"][:, 0]
    assert algo.metrics.counters.num_env_runner_restarts == 1
    # Built from the config alone, the new process would start the same episodes.
    assert not np.array_equal(first, again)


def test_a_restore_drops_the_batches_queued_before_it(algo, tmp_path):
    path = algo.save(str(tmp_path / "checkpoint"))
    thread = algo.learner_thread
    spaces, rows = (algo.observation_space, algo.action_space), algo.learners.rows[PID]
    batch = SampleBatch(sequence_batch(*spaces, algo.config.rollout_fragment_length, rows))
    with thread.lock:  # Keeps the learner from taking them meanwhile.
        for _ in range(3):
            thread.inqueue.put(TrainBatch(batch))
        generation = thread.generation
        algo.restore(path)
        assert thread.inqueue.qsize() == 0
    # Any batch the loader took before the restore belongs to the old generation: dropped.
    assert thread.generation == generation + 1


# Learner thread flushes -----------------------------------------------------------------------


def _batch(seed: int) -> SampleBatch:
    return SampleBatch(sequence_batch(OBS, ACT, T, ROWS, seed=seed))


def _thread(config: ImpalaConfig) -> LearnerThread:
    keras.utils.set_random_seed(0)
    learner = ImpalaLearner(config, OBS, ACT)
    signature = pipeline.batch_signature(config, OBS, ACT)
    return LearnerThread(learner, tf.distribute.get_strategy(), signature)


class _Handle(BatchHandle):
    """A train batch queued as a handle (as an aggregation worker's `BatchRef`), or lost."""

    def __init__(self, batch: SampleBatch | None):
        self._batch, self.env_steps = batch, ROWS * T
        self.fetched = self.released = False

    def get(self) -> SampleBatch:
        self.fetched = True
        if self._batch is None:
            raise BatchLost("lost with its node (test)")
        return self._batch

    def release(self) -> None:
        self.released = True


def test_the_loader_fetches_queued_handles_and_skips_a_lost_batch():
    thread = _thread(learner_config())
    lost, good = _Handle(None), _Handle(_batch(1))
    thread.start()
    try:
        thread.inqueue.put(TrainBatch(lost))
        thread.inqueue.put(TrainBatch(good))
        env_steps, _, _ = thread.outqueue.get(timeout=120)  # The good one trained.
        assert lost.fetched and good.fetched and env_steps == ROWS * T
        assert int(thread.learner.num_grad_updates.numpy()) == 1
        assert thread.error is None and thread.is_alive()
    finally:
        thread.stop()


def test_flush_releases_the_handles_it_drops():
    thread = _thread(learner_config())  # Not started: everything stays queued.
    handles = [_Handle(_batch(seed)) for seed in range(2)]
    for handle in handles:
        thread.inqueue.put(TrainBatch(handle))
    assert thread.flush() == 2
    assert all(h.released and not h.fetched for h in handles)


def test_a_batch_dropped_on_a_full_learner_queue_releases_its_handle(monkeypatch):
    config = small_config(learner_queue_size=1)
    plan = make_plan(config)
    learners = policy_learners(config, plan.models)
    group = LearnerGroup(learners, plan, tf.distribute.get_strategy())  # Not started.
    monkeypatch.setattr(group, "_put_waiting", lambda pid, item: None)  # The last one's wait.
    handles = [_Handle(_batch(seed)) for seed in range(3)]
    counters = Counters()
    group.put([(PID, h, 0.0) for h in handles], counters)
    # The first fits the queue of one, the second finds it full, the last would wait for room.
    assert [h.released for h in handles] == [False, True, False]
    assert counters.num_times_learner_queue_full == 1
    assert not any(h.fetched for h in handles)


@pytest.mark.parametrize("microbatch_size", [None, 2 * T])
def test_flush_drops_queued_loaded_and_buffered_batches(microbatch_size):
    thread = _thread(learner_config(microbatch_size=microbatch_size, num_sgd_iter=2))
    thread.start()
    try:
        with thread.lock:  # The learner stops at its next update: batches pile up.
            for seed in range(3):
                thread.inqueue.put(TrainBatch(_batch(seed)))
            # The learner has a loaded unit (also in the minibatch buffer), waiting for the lock.
            assert wait_until(lambda: thread.reports.load_wait_timer.count >= 1, 120)
            thread.flush()
            assert thread.inqueue.qsize() == 0
        assert wait_until(lambda: thread.num_units_dropped >= 1, 120)
        thread.inqueue.put(TrainBatch(_batch(9)))
        outputs = [thread.outqueue.get(timeout=60) for _ in range(2)]  # num_sgd_iter passes.
        # The learner takes batches in order: had a flushed one trained, it would be in these.
        assert [o[0] for o in outputs] == [ROWS * T] * 2
        assert int(thread.learner.num_grad_updates.numpy()) == 2
        assert thread.outqueue.empty()
    finally:
        thread.stop()
    assert thread.error is None, thread.error


class _PausingTimer(TimerStat):
    """The learner's `load_wait_timer`, pushed once per unit before the learner uses it: pauses
    the learner thread at the `pause_at`-th unit until `resume` is set."""

    def __init__(self, pause_at: int):
        super().__init__()
        self.pause_at = pause_at
        self.paused, self.resume = threading.Event(), threading.Event()

    def push(self, seconds: float) -> None:
        super().push(seconds)
        if self.count == self.pause_at:
            self.paused.set()
            self.resume.wait(60)


def test_a_flush_mid_microbatch_empties_the_accumulators():
    config = learner_config(microbatch_size=2 * T)  # Two microbatches per train batch.
    thread = _thread(config)
    thread.reports.load_wait_timer = timer = _PausingTimer(pause_at=2)
    thread.start()
    try:
        thread.inqueue.put(TrainBatch(_batch(1)))
        assert timer.paused.wait(60)  # Paused before the second microbatch ...
        assert thread.reports.microbatch_grad_timer.count == 1  # ... the first one accumulated.
        with thread.lock:
            thread.flush()
        timer.resume.set()
        thread.inqueue.put(TrainBatch(_batch(2)))
        env_steps, _, _ = thread.outqueue.get(timeout=60)
    finally:
        timer.resume.set()
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


@pytest.mark.parametrize("microbatch_size", [None, 2 * T])
def test_a_snapshot_that_would_wait_is_published_after_the_running_update(microbatch_size):
    thread = _thread(learner_config(microbatch_size=microbatch_size))
    held, release = threading.Event(), threading.Event()

    def hold_lock(flush: bool = False):  # Stands for an update in progress on another thread.
        with thread.lock:
            if flush:  # A restore, which flushes under the lock.
                thread.flush()
            held.set()
            release.wait(60)

    def during_update(flush: bool = False):
        """`policy_snapshot(wait=False)` while another thread holds the lock."""
        held.clear(), release.clear()
        holder = threading.Thread(target=hold_lock, args=(flush,))
        holder.start()
        try:
            assert held.wait(60)
            return thread.policy_snapshot(wait=False)
        finally:
            release.set()
            holder.join()

    def update(seed: int):
        thread.inqueue.put(TrainBatch(_batch(seed)))
        thread.outqueue.get(timeout=60)
        return thread.learner.get_policy_weights()

    # Idle learner: read at once.
    weights, version = thread.policy_snapshot(wait=False)
    assert version == 0
    assert all(np.array_equal(a, b) for a, b in zip(weights, thread.learner.get_policy_weights()))
    assert during_update() is None  # Nothing published yet; asks for one.
    thread.start()
    try:
        after_update = update(1)
        weights, version = during_update()  # What the update published ...
        assert version == 1
        assert all(np.array_equal(a, b) for a, b in zip(weights, after_update))
        after_update = update(2)  # ... and, asked again, the next update publishes too.
        weights, version = during_update()
        assert version == 2
        assert all(np.array_equal(a, b) for a, b in zip(weights, after_update))
        # A restore: weights from before it are never handed out after it.
        assert during_update(flush=True) is None
    finally:
        release.set()
        thread.stop()
    assert thread.error is None, thread.error


# Non-finite updates ----------------------------------------------------------------------------


def test_nonfinite_updates_are_skipped_and_counted_in_the_result_and_tensorboard(tmp_path):
    config = _algo_config(max_nonfinite_updates=10_000).environment(envs.HugeRewardCartPole)
    algo = Impala(config, logdir=str(tmp_path))
    try:
        result = None
        for _ in range(30):
            result = algo.train()
            if result["num_nonfinite_updates_skipped"] >= 2:
                break
        weights = algo.get_policy_weights()
    finally:
        algo.stop()
    assert result["num_nonfinite_updates_skipped"] >= 2
    assert result["counters"]["num_nonfinite_updates_skipped"] >= 2
    scalars = tensorboard_scalars(result)
    assert scalars["counters/nonfinite_updates_skipped"] >= 2
    assert os.path.isfile(tmp_path / "nonfinite" / "batch_1.npz")
    assert all(np.all(np.isfinite(w)) for w in weights)


def test_max_nonfinite_updates_in_a_row_end_training_naming_the_saved_batch(tmp_path):
    config = _algo_config(max_nonfinite_updates=1).environment(envs.HugeRewardCartPole)
    algo = Impala(config, logdir=str(tmp_path))
    try:
        with pytest.raises(NonFiniteUpdatesError, match="nonfinite/batch_1.npz"):
            for _ in range(30):
                algo.train()
    finally:
        algo.stop()
