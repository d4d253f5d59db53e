"""Tests for impala_tf.data.replay: RLlib's mix-in replay figures and the edge cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from impala_tf.data.replay import MixInReplayBuffer, replay_ratio_from_proportion
from impala_tf.data.sample_batch import SampleBatch, compress

CAPACITY = 10
ITERATIONS = 2000  # Binomial std of a mean over 2000 draws is ~0.011, far inside +-0.1.


def one_row(i: int = 0) -> SampleBatch:
    """A one-row batch tagged with `i` in every column."""
    return SampleBatch(
        obs=np.full((1, 4), i, np.float32), rewards=np.array([float(i)]), id=np.array([i])
    )


def mean_length(buffer: MixInReplayBuffer, adds_per_replay: int) -> float:
    lengths = []
    for i in range(ITERATIONS):
        for _ in range(adds_per_replay):
            buffer.add(one_row(i))
        lengths.append(len(buffer.replay()))
    return float(np.mean(lengths))


class TestRLlibFigures:
    """RLlib's test_mixin_sampling numbers (capacity 10, one-row batches)."""

    def test_ratio_half_returns_two(self):
        buffer = MixInReplayBuffer(CAPACITY, 0.5, seed=0)
        buffer.add(one_row())
        assert len(buffer.replay()) >= 1
        assert mean_length(buffer, 1) == 2.0

    def test_ratio_third(self):
        buffer = MixInReplayBuffer(CAPACITY, 0.333, seed=1)
        assert buffer.replay() is None
        buffer.add(one_row())
        assert len(buffer.replay()) >= 1
        assert mean_length(buffer, 2) == pytest.approx(3.0, abs=0.1)
        assert mean_length(buffer, 1) == pytest.approx(1.5, abs=0.1)

    def test_ratio_point_nine(self):
        buffer = MixInReplayBuffer(CAPACITY, 0.9, seed=2)
        assert buffer.replay() is None
        buffer.add(one_row())
        assert len(buffer.replay()) >= 2
        assert mean_length(buffer, 1) == pytest.approx(10.0, abs=0.1)

    def test_ratio_zero_returns_only_new(self):
        buffer = MixInReplayBuffer(CAPACITY, 0.0, seed=3)
        buffer.add(one_row(7))
        out = buffer.replay()
        assert len(out) == 1 and out["id"][0] == 7
        assert buffer.replay() is None  # Nothing new, no replay allowed.
        assert mean_length(buffer, 1) == 1.0
        buffer.add(one_row(1))
        buffer.add(one_row(2))
        np.testing.assert_array_equal(buffer.replay()["id"], [1, 2])

    def test_ratio_one_returns_one_old_batch(self):
        buffer = MixInReplayBuffer(CAPACITY, 1.0, seed=4)
        assert buffer.replay() is None
        buffer.add(one_row())
        assert len(buffer.replay()) == 1
        assert len(buffer.replay()) == 1  # Replays with nothing new.
        lengths = [len(buffer.replay()) for _ in range(100)]
        assert np.mean(lengths) == 1.0


class TestBehaviour:
    @pytest.mark.parametrize("ratio", [0.0, 0.25, 0.5, 1.0])
    def test_none_before_any_add(self, ratio):
        assert MixInReplayBuffer(CAPACITY, ratio).replay() is None

    def test_none_without_new_data_below_ratio_one(self):
        buffer = MixInReplayBuffer(CAPACITY, 0.5, seed=0)
        buffer.add(one_row())
        assert buffer.replay() is not None
        assert buffer.replay() is None

    def test_new_batches_first_then_stored_ones(self):
        buffer = MixInReplayBuffer(CAPACITY, 0.9, seed=5)
        for i in range(5):
            buffer.add(one_row(i))
        buffer.replay()
        buffer.add(one_row(100))
        buffer.add(one_row(101))
        ids = buffer.replay()["id"]
        np.testing.assert_array_equal(ids[:2], [100, 101])
        assert set(ids[2:]) <= {0, 1, 2, 3, 4, 100, 101}
        assert len(ids) > 2

    def test_ratio_one_draws_from_every_stored_batch(self):
        buffer = MixInReplayBuffer(CAPACITY, 1.0, seed=6)
        seen = set()
        for i in range(200):
            buffer.add(one_row(i % 3))
            seen.update(buffer.replay()["id"].tolist())
        # With 3 stored ids and random picks, every stored id is returned at some point.
        assert seen == {0, 1, 2}

    def test_ring_overwrites_oldest(self):
        buffer = MixInReplayBuffer(3, 1.0, seed=7)
        for i in range(5):
            buffer.add(one_row(i))
        assert len(buffer) == 3
        seen = {int(buffer.replay()["id"][0]) for _ in range(200)}
        assert seen == {2, 3, 4}
        buffer.add(one_row(5))  # Overwrites 2, the oldest left.
        seen = {int(buffer.replay()["id"][0]) for _ in range(200)}
        assert seen == {3, 4, 5}

    def test_capacity_zero_means_one(self):
        buffer = MixInReplayBuffer(0, 0.5, seed=8)
        assert buffer.capacity == 1
        buffer.add(one_row(1))
        buffer.add(one_row(2))
        assert len(buffer) == 1
        # Two new ones, then replays drawn from the single slot (the latest).
        ids = buffer.replay()["id"]
        np.testing.assert_array_equal(ids[:2], [1, 2])
        assert set(ids[2:]) == {2}

    def test_stores_copies_not_aliases(self):
        buffer = MixInReplayBuffer(CAPACITY, 1.0, seed=9)
        batch = one_row(3)
        buffer.add(batch)
        batch["obs"][:] = -1.0
        out = buffer.replay()
        np.testing.assert_array_equal(out["obs"], np.full((1, 4), 3.0))
        out["obs"][:] = -2.0  # Changing the result must not reach the stored batch.
        np.testing.assert_array_equal(buffer.replay()["obs"], np.full((1, 4), 3.0))

    def test_compressed_batches_are_stored_decompressed(self):
        buffer = MixInReplayBuffer(CAPACITY, 0.0)
        buffer.add(compress(one_row(4)))
        out = buffer.replay()
        assert not out.compressed
        np.testing.assert_array_equal(out["obs"], np.full((1, 4), 4.0))

    def test_multi_row_sequence_batches(self):
        buffer = MixInReplayBuffer(CAPACITY, 0.5, seed=10)
        batch = SampleBatch(obs=np.zeros((2, 5, 3)), rewards=np.zeros((2, 5)))
        buffer.add(batch)
        out = buffer.replay()
        assert out["obs"].shape == (4, 5, 3)
        assert out.env_steps == 20

    def test_seed_makes_it_reproducible(self):
        def run(seed):
            buffer = MixInReplayBuffer(CAPACITY, 0.4, seed=seed)
            ids = []
            for i in range(50):
                buffer.add(one_row(i))
                ids.append(buffer.replay()["id"].tolist())
            return ids

        assert run(11) == run(11)
        assert run(11) != run(12)

    def test_stats(self):
        buffer = MixInReplayBuffer(2, 0.5, seed=12)
        assert buffer.stats() == {"added_count": 0, "replayed_count": 0, "num_entries": 0}
        for i in range(3):
            buffer.add(one_row(i))
            buffer.replay()
        # Ratio 0.5 replays exactly one old batch per single new batch.
        assert buffer.stats() == {"added_count": 3, "replayed_count": 3, "num_entries": 2}
        assert len(buffer) == 2


class TestValidation:
    @pytest.mark.parametrize("capacity", [-1, 1.5, True])
    def test_bad_capacity(self, capacity):
        with pytest.raises(ValueError, match="capacity"):
            MixInReplayBuffer(capacity, 0.5)

    @pytest.mark.parametrize("ratio", [-0.1, 1.1, math.nan])
    def test_bad_ratio(self, ratio):
        with pytest.raises(ValueError, match="replay_ratio"):
            MixInReplayBuffer(CAPACITY, ratio)


class TestProportion:
    def test_values(self):
        assert replay_ratio_from_proportion(0.0) == 0.0
        assert replay_ratio_from_proportion(1.0) == 0.5
        assert replay_ratio_from_proportion(2.0) == pytest.approx(2.0 / 3.0)
        assert replay_ratio_from_proportion(math.inf) == 1.0

    @pytest.mark.parametrize("bad", [-1.0, math.nan])
    def test_bad(self, bad):
        with pytest.raises(ValueError, match="replay_proportion"):
            replay_ratio_from_proportion(bad)

    @pytest.mark.parametrize("proportion", [0.5, 1.0, 2.0, 3.5])
    def test_proportion_is_old_batches_per_new_batch(self, proportion):
        buffer = MixInReplayBuffer(
            CAPACITY, replay_ratio_from_proportion(proportion), seed=int(proportion * 10)
        )
        assert mean_length(buffer, 1) == pytest.approx(1.0 + proportion, abs=0.1)
