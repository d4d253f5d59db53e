"""A full disk during a checkpoint write: a clear error, the previous checkpoint kept loadable."""

from __future__ import annotations

import errno
import inspect
import os

import numpy as np
import pytest
import tensorflow as tf

from impala_tf import checkpoints
from impala_tf.checkpoints import CheckpointWriteError, read_driver_state, restore_model, store
from tests.checkpoints_test import _learner


def _fill_then_fail(real):
    """Stands in for `real` (`json.dump`, `pickle.dump`): takes what it takes, writes part of
    the output to its file, then fails as a full disk does."""
    signature = inspect.signature(real)

    def write(*args, **kwargs):
        f = signature.bind(*args, **kwargs).args[1]  # (obj, fp) or (obj, file).
        f.write(b"\x80partial" if "b" in f.mode else "{partial")
        f.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    return write


def _tf_full(self, file_prefix, options=None):
    """`tf.train.Checkpoint.write` on a full disk (TensorFlow's error for ENOSPC)."""
    raise tf.errors.ResourceExhaustedError(None, None, f"{file_prefix}: No space left on device")


@pytest.mark.parametrize("where", ["json", "pickle", "tensorflow"])
def test_no_space_keeps_the_previous_checkpoint(tmp_path, monkeypatch, where):
    config, learner = _learner([4])
    path = str(tmp_path / "ckpt")
    learner.set_policy_weights([w * 0 + 1 for w in learner.get_policy_weights()])
    checkpoints.write_checkpoint(path, learner, config, {"iteration": 1}, {"x": 1})
    before = sorted(os.listdir(tmp_path))
    learner.set_policy_weights([w * 0 + 2 for w in learner.get_policy_weights()])
    if where == "json":
        monkeypatch.setattr(store.json, "dump", _fill_then_fail(store.json.dump))
    elif where == "pickle":
        monkeypatch.setattr(store.pickle, "dump", _fill_then_fail(store.pickle.dump))
    else:
        monkeypatch.setattr(tf.train.Checkpoint, "write", _tf_full)
    with pytest.raises(CheckpointWriteError) as info:
        checkpoints.write_checkpoint(path, learner, config, {"iteration": 2}, {"x": 2})
    monkeypatch.undo()
    assert info.value.errno == errno.ENOSPC
    message = str(info.value)
    assert "No space left on device" in message and path in message
    assert "previous checkpoint" in message and "still loadable" in message
    # Nothing left behind, and the previous checkpoint loads with its own weights.
    assert sorted(os.listdir(tmp_path)) == before
    assert read_driver_state(path)["iteration"] == 1
    _, fresh = _learner([4])
    restore_model(fresh.model, path)
    for w in fresh.get_policy_weights():
        np.testing.assert_array_equal(w, np.ones_like(w))


def test_no_space_for_a_new_numbered_checkpoint_names_the_newest_earlier_one(tmp_path, monkeypatch):
    config, learner = _learner([4])
    root = str(tmp_path / "checkpoints")
    first = checkpoints.write_checkpoint(
        checkpoints.checkpoint_path(root, 1), learner, config, {"iteration": 1}
    )
    monkeypatch.setattr(store.json, "dump", _fill_then_fail(store.json.dump))
    second = checkpoints.checkpoint_path(root, 2)
    with pytest.raises(CheckpointWriteError, match="No space left on device") as info:
        checkpoints.write_checkpoint(second, learner, config, {"iteration": 2})
    assert f"newest earlier checkpoint {first}" in str(info.value)
    assert checkpoints.list_checkpoints(root) == [first]
    assert not os.path.exists(second)


def test_other_write_errors_are_named_too(tmp_path, monkeypatch):
    config, learner = _learner([4])

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(store.json, "dump", denied)
    with pytest.raises(CheckpointWriteError, match="PermissionError.*no earlier checkpoint"):
        checkpoints.write_checkpoint(str(tmp_path / "c"), learner, config, {})
