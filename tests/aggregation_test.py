"""Tree aggregation: the in-process Aggregator and aggregation worker processes end to end."""

from __future__ import annotations

import os
import signal

import numpy as np

from impala_tf.actors.aggregation import Aggregator
from impala_tf.config import ImpalaConfig
from impala_tf.sample_batch import SampleBatch, compress


def _fragment(rows: int, horizon: int = 5, seed: int = 0) -> SampleBatch:
    rng = np.random.default_rng(seed)
    return SampleBatch(
        {
            "obs": rng.normal(size=(rows, horizon, 4)).astype(np.float32),
            "rewards": np.ones((rows, horizon), np.float32),
        }
    )


def test_aggregator_decompresses_and_cuts_fixed_size_batches():
    config = ImpalaConfig(env="CartPole-v1")
    aggregator = Aggregator(config, rows=3)
    fragment = _fragment(4)
    out = aggregator.process(compress(fragment), version=7.0)
    assert len(out) == 1
    batch, version = out[0]
    assert len(batch) == 3 and version == 7.0
    np.testing.assert_array_equal(batch["obs"], fragment["obs"][:3])
    ((batch2, version2),) = aggregator.process(_fragment(2, seed=1), version=9.0)
    assert len(batch2) == 3
    assert version2 == (7.0 + 9.0 + 9.0) / 3  # one leftover row of version 7, two of 9
    np.testing.assert_array_equal(batch2["obs"][0], fragment["obs"][3])


def test_aggregator_mixes_in_replay():
    config = ImpalaConfig(env="CartPole-v1", replay_proportion=1.0, replay_buffer_num_slots=4)
    aggregator = Aggregator(config, rows=1)
    rows = sum(len(b) for i in range(200) for b, _ in aggregator.process(_fragment(1, seed=i), 0))
    # p = 1 replayed batch per new batch on average: about twice the rows that came in.
    assert 1.6 * 200 < rows < 2.4 * 200


def test_aggregation_workers_end_to_end_with_a_killed_aggregator():
    config = (
        ImpalaConfig()
        .environment("CartPole-v1")
        .env_runners(
            num_env_runners=2,
            num_envs_per_env_runner=4,
            rollout_fragment_length=10,
            compress_observations=True,
        )
        .training(
            train_batch_size=80,
            model={"fcnet_hiddens": [16]},
            num_aggregation_workers=1,
            replay_proportion=0.5,
            replay_buffer_num_slots=8,
        )
        .reporting(min_time_s_per_iteration=1)
        .debugging(seed=0)
    )
    algo = config.build()
    try:
        first = algo.train()
        assert first["num_env_steps_trained"] > 0
        os.kill(algo.aggregators.pids()[0], signal.SIGKILL)
        results = [algo.train() for _ in range(3)]
    finally:
        algo.stop()
    last = results[-1]
    assert last["num_aggregation_worker_restarts"] >= 1
    assert last["num_env_steps_trained"] > results[0]["num_env_steps_trained"]
    # Replay makes the learner see more steps than were sampled.
    assert last["num_samples_added_to_queue"] > 0
