"""End-to-end tests of the `Impala` driver beyond the runtime scenarios: the result dict's learner
entries, a full learner queue, the learner queue timeout, envs that raise, weight broadcasts
that never wait for a running update, and `stop`.

Iterations and counters, killed and hung actors, a killed aggregation worker, save and restore,
and evaluation run on every placement in `tests/runtime_conformance_test.py`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
import pytest

from impala_tf.data.sample_batch import SampleBatch
from impala_tf.driver.algorithm import Impala
from impala_tf.learning.thread import LearnerQueueTimeout, LearnerThread
from impala_tf.rollout.fragment import DEFAULT_POLICY_ID
from impala_tf.rollout.host import RunnerHost
from tests.support import envs
from tests.support.batches import sequence_batch
from tests.support.configs import small_config
from tests.support.processes import alive, wait_until


def test_a_result_holds_rllibs_learner_stats_learner_queue_and_timing_breakdown():
    config = small_config()
    algo = config.build()
    try:
        result = algo.train()
    finally:
        algo.stop()
    info = result["info"]
    policy_info = info["learner"]["default_policy"]
    stats = policy_info["learner_stats"]
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
    assert result["time_this_iter_s"] >= config.min_time_s_per_iteration
    assert result["time_total_s"] == result["time_this_iter_s"]


class _SlowLearner(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        time.sleep(0.2)


def test_a_full_learner_queue_drops_batches_and_counts_them():
    # Each fragment (4 envs x 10 steps) makes 4 train batches of 10 steps; with a slow learner
    # and a queue of one, all but the last batch of each step find the queue full.
    config = small_config(train_batch_size=10, learner_queue_size=1, min_time_s_per_iteration=1)
    algo = Impala(config, callbacks=[_SlowLearner()])
    try:
        result = algo.train()
    finally:
        algo.stop()
    assert result["num_times_learner_queue_full"] > 0
    assert result["num_samples_added_to_queue"] < result["num_env_steps_sampled"]
    assert result["num_env_steps_trained"] <= result["num_samples_added_to_queue"]


def test_learner_queue_timeout_names_the_setting():
    config = small_config(learner_queue_timeout=1, min_time_s_per_iteration=30)
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


def test_env_that_raises_is_reported_with_its_error():
    config = small_config(restart_failed_env_runners=False)
    config.environment(envs.faulty_cartpole, env_config={"fail_after": 25})
    algo = config.build()
    try:
        with pytest.raises(RuntimeError, match="faulty env raised after 25 steps"):
            for _ in range(20):
                algo.train()
    finally:
        algo.stop()


def test_env_that_always_raises_is_not_restarted_forever():
    config = small_config()
    config.environment(envs.faulty_cartpole, env_config={"fail_after": 1})
    algo = config.build()
    try:
        with pytest.raises(RuntimeError, match="failed 3 times in a row"):
            for _ in range(50):
                algo.train()
    finally:
        algo.stop()


def test_broken_env_creator_fails_at_build():
    config = small_config()
    config.environment(envs.broken_env)
    with pytest.raises(ValueError, match="cannot be built"):
        config.build()


# Broadcasts ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _update_running(thread: LearnerThread) -> Iterator[list[np.ndarray]]:
    """Holds the learner thread's `lock` on another thread, as a running update does; yields the
    weights read under it (what the update leaves)."""
    held, release, weights = threading.Event(), threading.Event(), []

    def hold() -> None:
        with thread.lock:
            weights.append(thread.learner.get_policy_weights())
            held.set()
            release.wait(120)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        assert held.wait(60)
        yield weights[0]
    finally:
        release.set()
        holder.join(60)


def _returns_promptly(fn: Callable[[], Any], timeout_s: float = 20.0) -> Any:
    """Calls `fn` on another thread and fails unless it returns within `timeout_s`."""
    done, out = threading.Event(), {}

    def call() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - raised again below.
            out["error"] = e
        done.set()

    threading.Thread(target=call, daemon=True).start()
    assert done.wait(timeout_s), "the call waited for the running update"
    if "error" in out:
        raise out["error"]
    return out["value"]


def _versions_held(algo: Impala) -> dict[int, int]:
    """{actor id: `num_grad_updates` of the weights the actor holds} (weights sent before the
    call are applied before it)."""
    states = algo.actors.workers.call_and_wait([0, 1], RunnerHost.get_state, timeout_s=60)
    return {i: int(state["weights"][DEFAULT_POLICY_ID][1]) for i, state in states.items()}


def test_a_broadcast_never_waits_for_a_running_update_nor_sends_older_weights():
    """`Broadcaster.step` reads weights without waiting: during an update it sends what the
    learner thread published after its previous one, and only when that is newer than what was
    sent; the actors that sampled meanwhile get it at the next step that can."""
    algo = small_config().build()  # Nothing trains but the batches put below.
    pid, broadcaster, thread = DEFAULT_POLICY_ID, algo.broadcaster, algo.learner_thread
    counters = algo.metrics.counters
    T, rows = algo.config.rollout_fragment_length, algo.learners.rows[pid]

    def update(k: int) -> None:
        """Runs the learner's k-th update (on a synthetic train batch) and waits for it."""
        columns = sequence_batch(algo.observation_space, algo.action_space, T, rows, seed=k)
        algo.learners.put_waiting(pid, SampleBatch(columns), 0.0)
        assert wait_until(lambda: algo.learners.versions()[pid] == k, 60)

    try:
        assert broadcaster.sent[pid][1] == 0  # The start's weights.
        update(1)
        with _update_running(thread):
            # Update 1 published nothing (nobody asked): nothing newer than sent can be read.
            assert _returns_promptly(lambda: broadcaster.step([0])) is False
        assert broadcaster.sent[pid][1] == 0 and counters.num_weight_broadcasts == 0
        update(2)  # Publishes its weights, since the step above asked.
        with _update_running(thread) as weights_2:
            # Actor 0 sampled in the step above and waited: it gets the published weights.
            assert _returns_promptly(lambda: broadcaster.step([])) is True
        sent, version = broadcaster.sent[pid]
        assert version == 2 and counters.num_weight_broadcasts == 1
        assert all(np.array_equal(a, b) for a, b in zip(sent, weights_2, strict=True))
        assert _versions_held(algo) == {0: 2, 1: 0}  # Actor 1 never sampled: not sent to.

        update(3)  # Publishes (the step above asked again).
        update(4)  # Publishes nothing: version 3 stays the published one.
        broadcaster.send([0, 1])  # A restart's or restore's direct read: version 4.
        update(5)
        with _update_running(thread):
            # Published version 3 is older than the sent version 4: nothing is sent.
            assert _returns_promptly(lambda: broadcaster.step([0])) is False
            # Nor does a whole training step wait (its batches queue for the learner).
            for _ in range(3):
                _returns_promptly(algo.training_step)
        assert broadcaster.sent[pid][1] == 4 and counters.num_weight_broadcasts == 1
        assert _versions_held(algo) == {0: 4, 1: 4}
    finally:
        algo.stop()


def test_stop_ends_every_actor_and_aggregation_worker_and_can_be_repeated():
    algo = small_config(num_aggregation_workers=1).build()
    pids = [*algo.actors.pids().values(), *algo.aggregation.pids().values()]
    assert len(pids) == 3 and all(alive(pid) for pid in pids)
    algo.stop()
    assert wait_until(lambda: not any(alive(pid) for pid in pids), 10)
    algo.stop()
    with pytest.raises(RuntimeError, match="stopped algorithm"):
        algo.train()
