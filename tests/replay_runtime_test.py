"""Mix-in replay in the running algorithm: what reaches the learner relative to what was sampled.

The counters: `num_env_steps_sampled` counts env steps the actors produced (each once);
`num_samples_added_to_queue` the env steps put on the learner queue, replayed ones included;
`num_env_steps_trained` the env steps of the batches the learner trained on. With
`replay_proportion` p, each new fragment reaches the batch builder together with p old ones on
average (exactly p for a whole p), so (p + 1) x sampled env steps go towards the learner.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from impala_tf.config import ImpalaConfig
from impala_tf.data.sample_batch import decompress
from impala_tf.data.train_batch import TrainBatch
from impala_tf.driver.algorithm import Impala
from impala_tf.rollout.fragment import DEFAULT_POLICY_ID
from impala_tf.workers import resolve
from tests.support.configs import small_config
from tests.support.processes import wait_until

T, ENVS, BATCH = 10, 2, 40


def _config(**overrides) -> ImpalaConfig:
    keys = dict(
        num_env_runners=1,
        num_envs_per_env_runner=ENVS,
        rollout_fragment_length=T,
        train_batch_size=BATCH,
        replay_buffer_num_slots=4,
        seed=3,
    )
    return small_config(**{**keys, **overrides})


@pytest.mark.parametrize("proportion", [0.0, 1.0, 3.0])
def test_lockstep_learner_trains_p_plus_one_times_the_sampled_steps(proportion):
    config = _config(
        replay_proportion=proportion,
        min_time_s_per_iteration=0,
        min_sample_timesteps_per_iteration=100,
    )
    algo = Impala(config, deterministic=True)
    try:
        result = [algo.train() for _ in range(2)][-1]
    finally:
        algo.stop()
    sampled = result["num_env_steps_sampled"]
    # Each fragment is ENVS x T = 20 steps; what is not yet a whole batch of 40 waits.
    pending = (proportion + 1) * sampled % BATCH
    assert sampled >= 200
    assert result["num_samples_added_to_queue"] == (proportion + 1) * sampled - pending
    assert result["num_env_steps_trained"] == result["num_samples_added_to_queue"]


def test_asynchronous_driver_sends_twice_the_sampled_steps_with_proportion_one():
    config = _config(
        replay_proportion=1.0,
        num_env_runners=2,
        num_envs_per_env_runner=4,
        learner_queue_size=64,
        min_time_s_per_iteration=1,
    )
    algo = config.build()
    try:
        result = [algo.train() for _ in range(2)][-1]
    finally:
        algo.stop()
    sampled = result["num_env_steps_sampled"]
    towards_learner = (
        result["num_samples_added_to_queue"] + BATCH * result["num_times_learner_queue_full"]
    )
    # Every sampled step goes towards the learner twice (once new, once replayed), except for
    # the steps of the train batch being cut.
    assert 2 * sampled - BATCH < towards_learner <= 2 * sampled
    # The learner trails the queue by at most the queued and loaded batches (how far depends on
    # the machine's speed; the lockstep test above shows the exact 2x).
    added, trained = result["num_samples_added_to_queue"], result["num_env_steps_trained"]
    assert added - (64 + 2) * BATCH <= trained <= added
    assert trained > 0


#: Replay slots, and fragments fed through the aggregation in the test below.
SLOTS, FRAGMENTS = 4, 12


def _fetched(algo: Impala) -> list:
    """The next train batches the aggregation workers send back."""
    out: list = []
    assert wait_until(lambda: out.extend(algo.aggregation.fetch(0.5)) or out, 60)
    # Fetched here as the learner's loader fetches them (`TrainBatch.batch`).
    return [(pid, TrainBatch(batch).batch, version) for pid, batch, version in out]


@pytest.mark.parametrize("workers", [0, 1], ids=["in_the_driver", "in_an_aggregation_worker"])
def test_each_train_batch_is_a_new_fragment_and_an_old_one_replayed(workers):
    """With p = 1 and train batches of two fragments' sequences, every fragment the actors send
    makes one train batch: its own sequences, then those of a fragment from the replay slots."""
    envs = 4
    algo = small_config(
        num_envs_per_env_runner=envs,
        train_batch_size=2 * envs * 10,
        replay_proportion=1.0,
        replay_buffer_num_slots=SLOTS,
        num_aggregation_workers=workers,
        compress_observations=True,
    ).build()
    sent, origins = [], []
    try:
        while len(sent) < FRAGMENTS:
            fragments, failures = algo.actors.fetch(5.0)
            assert not failures
            algo.actors.top_up()
            for fragment in fragments[: FRAGMENTS - len(sent)]:
                # With a worker, the batches are in shared memory: the test reads them there.
                sent.append(decompress(resolve(fragment.batches)[DEFAULT_POLICY_ID])["obs"])
                out = algo.aggregation.process(fragment)
                if workers:  # The batches come back from the worker.
                    assert out == []
                    out = _fetched(algo)
                ((pid, batch, _),) = out
                assert pid == DEFAULT_POLICY_ID and len(batch) == 2 * envs
                # The new sequences train at once ...
                np.testing.assert_array_equal(batch["obs"][:envs], sent[-1])
                # ... with a whole earlier fragment's (or this one's) from the replay slots.
                old = batch["obs"][envs:]
                (origin,) = [j for j, obs in enumerate(sent) if np.array_equal(old, obs)]
                assert len(sent) - 1 - SLOTS < origin <= len(sent) - 1
                origins.append(len(sent) - 1 - origin)
        counters = algo.metrics.counters
        assert counters.num_times_no_aggregation_worker_available == 0
    finally:
        algo.stop()
    # Old sequences are mixed in: most replayed fragments are older than the new one.
    assert sum(age > 0 for age in origins) >= FRAGMENTS // 2, origins


def test_replay_example_config():
    from impala_tf.data.replay import replay_ratio_from_proportion

    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs")
    config, stop = ImpalaConfig.from_yaml(os.path.join(path, "cartpole-impala-replay.yaml"))
    config.validate(require_env=True)
    assert stop == {"episode_reward_mean": 450, "timesteps_total": 2000000}
    assert config.replay_proportion == 1.0 and config.replay_buffer_num_slots == 16
    assert replay_ratio_from_proportion(config.replay_proportion) == 0.5
