"""Tests for impala_tf.data.sample_batch and impala_tf.data.layouts: validation, slicing, concat,
layouts, compression."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from impala_tf.data import sample_batch as sb
from impala_tf.data.layouts import from_flat, from_time_major, time_major, to_flat
from impala_tf.data.sample_batch import (
    OBS,
    REWARDS,
    CompressedColumn,
    SampleBatch,
    compress,
    concat_samples,
    decompress,
    is_per_sequence_column,
)

B, T, OBS_DIM, STATE = 3, 5, 4, 6


def make_batch(rows: int = B, seq_len: int = T, start: int = 0) -> SampleBatch:
    """A sequence-layout batch whose values encode (row, step) so layouts can be checked."""
    row = np.arange(start, start + rows)[:, None]
    step = np.arange(seq_len)[None, :]
    code = (100 * row + step).astype(np.float32)  # [B, T]
    return SampleBatch(
        {
            sb.OBS: np.repeat(code[..., None], OBS_DIM, axis=-1),
            sb.ACTIONS: (100 * row + step).astype(np.int64),
            sb.REWARDS: code,
            sb.TERMINATEDS: np.zeros((rows, seq_len), dtype=bool),
            sb.TRUNCATEDS: np.ones((rows, seq_len), dtype=bool),
            sb.ACTION_DIST_INPUTS: np.stack([code, -code], axis=-1),
            sb.ACTION_LOGP: -code,
            sb.VF_PREDS: code + 0.5,
            sb.VALUES_BOOTSTRAPPED: code + 0.25,
            sb.STATE_IN_PREFIX + "0": np.tile(row.astype(np.float32), (1, STATE)),
        }
    )


def test_column_name_constants_are_rllibs():
    assert (sb.OBS, sb.ACTIONS, sb.REWARDS) == ("obs", "actions", "rewards")
    assert (sb.TERMINATEDS, sb.TRUNCATEDS) == ("terminateds", "truncateds")
    assert (sb.ACTION_DIST_INPUTS, sb.ACTION_LOGP) == ("action_dist_inputs", "action_logp")
    assert (sb.VF_PREDS, sb.VALUES_BOOTSTRAPPED) == ("vf_preds", "values_bootstrapped")
    assert sb.STATE_IN_PREFIX == "state_in_"
    assert is_per_sequence_column("state_in_1")
    assert not is_per_sequence_column("obs")


class TestConstruction:
    def test_lists_become_arrays_and_len_is_rows(self):
        batch = SampleBatch({OBS: [[1.0, 2.0], [3.0, 4.0]]}, rewards=[0.5, 1.5])
        assert isinstance(batch[OBS], np.ndarray)
        assert batch[OBS].shape == (2, 2)
        assert len(batch) == 2
        assert len(batch.keys()) == 2
        assert batch

    def test_accepts_pairs(self):
        batch = SampleBatch([(OBS, np.zeros(3)), (REWARDS, np.ones(3))])
        assert set(batch) == {OBS, REWARDS}

    def test_empty_batch(self):
        batch = SampleBatch()
        assert len(batch) == 0
        assert not batch
        assert batch.env_steps == 0

    def test_zero_rows_is_falsy(self):
        assert not SampleBatch(obs=np.zeros((0, 4)))

    def test_length_mismatch_names_column_and_both_lengths(self):
        with pytest.raises(ValueError, match=r"'rewards' has 4 rows but column 'obs' has 3"):
            SampleBatch(obs=np.zeros((3, 2)), rewards=np.zeros(4))

    def test_scalar_column_rejected(self):
        with pytest.raises(ValueError, match="'rewards' is a scalar"):
            SampleBatch(rewards=1.0)

    def test_ragged_column_rejected(self):
        with pytest.raises(ValueError, match="'obs'"):
            SampleBatch(obs=[[1, 2], [3]])

    def test_non_str_name_rejected(self):
        with pytest.raises(TypeError):
            SampleBatch({1: np.zeros(2)})

    def test_setitem_checks_length(self):
        batch = make_batch()
        batch["extra"] = np.zeros(B)
        with pytest.raises(ValueError, match=r"'bad' has 2 rows but column 'obs' has 3"):
            batch["bad"] = np.zeros(2)
        # Replacing the only column may change the length.
        single = SampleBatch(obs=np.zeros(2))
        single[OBS] = np.zeros(5)
        assert len(single) == 5

    def test_update_setdefault_and_or_check_length(self):
        batch = make_batch()
        with pytest.raises(ValueError, match="'bad'"):
            batch.update(bad=np.zeros(B + 1))
        with pytest.raises(ValueError, match="'bad'"):
            batch.setdefault("bad", np.zeros(B + 1))
        with pytest.raises(ValueError, match="'bad'"):
            batch |= {"bad": np.zeros(B + 1)}
        with pytest.raises(ValueError, match="'bad'"):
            _ = batch | {"bad": np.zeros(B + 1)}
        assert "bad" not in batch
        merged = batch | {"ok": [1, 2, 3]}
        assert isinstance(merged, SampleBatch) and "ok" in merged and "ok" not in batch
        assert batch.setdefault("ok2", [4, 5, 6]) is batch["ok2"]

    def test_env_steps(self):
        assert make_batch().env_steps == B * T
        flat = SampleBatch(obs=np.zeros((7, 2)), rewards=np.zeros(7))
        assert flat.env_steps == 7
        assert SampleBatch(obs=np.zeros((4, 2))).env_steps == 4

    def test_repr_shows_rows_and_columns(self):
        text = repr(compress(make_batch()))
        assert "rows=3" in text and "obs" in text and "compressed" in text


class TestSliceCopyPickle:
    def test_slice_returns_views_of_rows(self):
        batch = make_batch()
        part = batch[1:3]
        assert isinstance(part, SampleBatch)
        assert len(part) == 2
        for name in batch:
            np.testing.assert_array_equal(part[name], batch[name][1:3])
            assert np.shares_memory(part[name], batch[name])
        np.testing.assert_array_equal(batch.slice(-1, None)[REWARDS], batch[REWARDS][-1:])

    def test_copy_is_deep(self):
        batch = make_batch()
        copied = batch.copy()
        assert isinstance(copied, SampleBatch)
        for name in batch:
            np.testing.assert_array_equal(copied[name], batch[name])
            assert not np.shares_memory(copied[name], batch[name])

    def test_pickle_round_trip(self):
        batch = make_batch()
        restored = pickle.loads(pickle.dumps(batch))
        assert type(restored) is SampleBatch
        for name in batch:
            np.testing.assert_array_equal(restored[name], batch[name])
            assert restored[name].dtype == batch[name].dtype


class TestConcat:
    def test_matches_numpy_concatenate_and_copies(self):
        first, second = make_batch(2, start=0), make_batch(3, start=10)
        joined = concat_samples([first, second])
        assert len(joined) == 5
        assert joined.env_steps == 5 * T
        for name in first:
            np.testing.assert_array_equal(joined[name], np.concatenate([first[name], second[name]]))
            assert joined[name].dtype == first[name].dtype
            assert not np.shares_memory(joined[name], first[name])

    def test_single_batch_is_copied(self):
        batch = make_batch()
        joined = concat_samples([batch])
        assert not np.shares_memory(joined[OBS], batch[OBS])

    def test_empty_input(self):
        assert len(concat_samples([])) == 0

    def test_different_columns_named(self):
        other = make_batch()
        del other[sb.VF_PREDS]
        with pytest.raises(ValueError, match="missing \\['vf_preds'\\]"):
            concat_samples([make_batch(), other])

    def test_different_trailing_shape_named(self):
        with pytest.raises(ValueError, match="column 'obs'"):
            concat_samples([make_batch(seq_len=5), make_batch(seq_len=4)])

    def test_different_dtype_named(self):
        other = make_batch()
        other[REWARDS] = other[REWARDS].astype(np.float64)
        with pytest.raises(ValueError, match="column 'rewards'"):
            concat_samples([make_batch(), other])

    def test_compressed_rejected(self):
        with pytest.raises(ValueError, match="compressed"):
            concat_samples([make_batch(), compress(make_batch())])


class TestLayouts:
    def test_to_flat_is_env_contiguous(self):
        batch = make_batch()
        flat = to_flat(batch)
        assert flat[REWARDS].shape == (B * T,)
        assert flat[OBS].shape == (B * T, OBS_DIM)
        assert flat[sb.ACTION_DIST_INPUTS].shape == (B * T, 2)
        for b in range(B):
            for t in range(T):
                assert flat[REWARDS][b * T + t] == 100 * b + t
        np.testing.assert_array_equal(flat["state_in_0"], batch["state_in_0"])

    def test_from_flat_inverts_to_flat(self):
        batch = make_batch()
        back = from_flat(to_flat(batch), seq_len=T)
        assert isinstance(back, SampleBatch)
        for name in batch:
            np.testing.assert_array_equal(back[name], batch[name])

    def test_flat_without_states_is_a_sample_batch(self):
        batch = make_batch()
        del batch["state_in_0"]
        flat = SampleBatch(to_flat(batch))
        assert len(flat) == flat.env_steps == B * T

    def test_from_flat_rejects_bad_seq_len(self):
        with pytest.raises(ValueError, match="'rewards'"):
            from_flat({REWARDS: np.zeros(7)}, seq_len=3)
        with pytest.raises(ValueError, match="seq_len"):
            from_flat({REWARDS: np.zeros(6)}, seq_len=0)

    def test_to_flat_rejects_flat_columns(self):
        flat = SampleBatch(obs=np.zeros((6, 2)), rewards=np.zeros(6))
        with pytest.raises(ValueError, match="'rewards'"):
            to_flat(flat)

    def test_inconsistent_time_rejected(self):
        batch = SampleBatch(obs=np.zeros((2, 5, 3)), rewards=np.zeros((2, 4)))
        with pytest.raises(ValueError, match="'rewards' has 4 time steps"):
            time_major(batch)

    def test_time_major_transposes_per_step_columns_only(self):
        batch = make_batch()
        tm = time_major(batch)
        assert tm[REWARDS].shape == (T, B)
        assert tm[OBS].shape == (T, B, OBS_DIM)
        for t in range(T):
            for b in range(B):
                assert tm[REWARDS][t, b] == 100 * b + t
                np.testing.assert_array_equal(tm[OBS][t, b], batch[OBS][b, t])
        np.testing.assert_array_equal(tm["state_in_0"], batch["state_in_0"])
        assert tm["state_in_0"].shape == (B, STATE)

    def test_from_time_major_inverts(self):
        batch = make_batch()
        back = from_time_major(time_major(batch))
        for name in batch:
            np.testing.assert_array_equal(back[name], batch[name])
            assert back[name].shape == batch[name].shape

    def test_compressed_batch_rejected(self):
        with pytest.raises(ValueError, match="compressed"):
            time_major(compress(make_batch()))


class TestCompression:
    @pytest.mark.parametrize("dtype", [np.uint8, np.float32, np.bool_])
    def test_round_trip(self, dtype):
        rng = np.random.default_rng(0)
        obs = (rng.random((B, T, 8, 8)) * 200).astype(dtype)
        batch = SampleBatch(obs=obs, rewards=np.ones((B, T), np.float32))
        packed = compress(batch)
        assert packed.compressed and not batch.compressed
        assert isinstance(packed[OBS], CompressedColumn)
        assert len(packed) == B and packed.env_steps == B * T
        assert packed[REWARDS] is batch[REWARDS]
        restored = decompress(pickle.loads(pickle.dumps(packed)))
        assert not restored.compressed
        np.testing.assert_array_equal(restored[OBS], obs)
        assert restored[OBS].dtype == obs.dtype
        assert restored[OBS].flags.writeable

    def test_frames_shrink(self):
        frames = np.zeros((B, T, 84, 84, 4), dtype=np.uint8)
        frames[..., 10:20, 10:20, :] = 255
        packed = compress(SampleBatch(obs=frames))
        assert len(packed[OBS].data) < frames.nbytes / 50

    def test_decompress_is_idempotent(self):
        batch = make_batch()
        assert decompress(batch) is batch
        packed = compress(batch)
        assert compress(packed)[OBS] is packed[OBS]
        once = decompress(packed)
        assert decompress(once) is once

    def test_other_columns_and_empty(self):
        batch = make_batch()
        packed = compress(batch, columns=(REWARDS, "absent"), level=9)
        assert isinstance(packed[REWARDS], CompressedColumn)
        assert not isinstance(packed[OBS], CompressedColumn)
        assert packed.env_steps == B * T
        empty = SampleBatch(obs=np.zeros((0, 3), np.float32))
        np.testing.assert_array_equal(decompress(compress(empty))[OBS], empty[OBS])

    def test_object_dtype_rejected(self):
        with pytest.raises(ValueError, match="'obs'"):
            compress(SampleBatch(obs=np.array([object(), object()])))

    def test_slicing_compressed_rejected(self):
        with pytest.raises(ValueError, match="decompress"):
            compress(make_batch())[0:1]
