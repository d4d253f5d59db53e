"""Tests of the checkpoint layout: one learner per policy under `policies/<id>/`, numbered
checkpoints, pruning, finding the newest, the runtime-state pickle, and atomic writes under
SIGKILL.

(`write_checkpoint` / `restore_model` round trips are in tests/evaluate_test.py; checkpoints of
the older layouts in tests/legacy_checkpoint_test.py.)
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time

import numpy as np
import pytest

from impala_tf import checkpoints
from impala_tf.checkpoints import (
    DRIVER_STATE_FILE,
    RUNTIME_STATE_FILE,
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    prune_checkpoints,
    read_driver_state,
    read_runtime_state,
    resolve_checkpoint_dir,
)
from tests.support.processes import kill_session, log_tail, run_in_background, wait_for_line

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def stub(path, iteration=0):
    """A directory that passes for a checkpoint (it holds driver_state.json)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, DRIVER_STATE_FILE), "w") as f:
        json.dump({"iteration": iteration}, f)
    return str(path)


def test_checkpoint_path_and_numeric_order(tmp_path):
    assert checkpoint_path("/x/checkpoints", 12) == "/x/checkpoints/checkpoint_000012"
    root = tmp_path / "checkpoints"
    paths = [stub(checkpoint_path(str(root), i)) for i in (999_999, 7, 1_000_000, 20)]
    (root / "notes").mkdir()  # Not a checkpoint: ignored.
    assert list_checkpoints(str(root)) == [paths[1], paths[3], paths[0], paths[2]]
    assert list_checkpoints(str(tmp_path / "missing")) == []


def test_unfinished_and_replaced_writes(tmp_path):
    root = tmp_path / "checkpoints"
    done = stub(root / "checkpoint_000002", 2)
    # A write killed after its driver_state.json but before its rename: never a checkpoint.
    stub(root / "checkpoint_000003.tmp-k1ll", 3)
    assert list_checkpoints(str(root)) == [done]
    # A re-save of iteration 2 killed between its renames: `.old` stands in for the missing one.
    os.rename(done, done + ".old")
    assert list_checkpoints(str(root)) == [done + ".old"]
    assert resolve_checkpoint_dir(done) == done + ".old"
    # Both present: the finished new one wins.
    stub(done, 2)
    assert list_checkpoints(str(root)) == [done]


def test_prune_keeps_the_newest_and_the_protected(tmp_path):
    root = str(tmp_path)
    paths = [stub(checkpoint_path(root, i)) for i in range(1, 6)]
    stub(paths[0] + ".old")
    os.makedirs(os.path.join(root, "checkpoint_000006.tmp-x"))
    assert prune_checkpoints(root, None) == []  # Keeps all; removes the temporary directory.
    assert sorted(os.listdir(root)) == sorted(
        [os.path.basename(p) for p in paths] + ["checkpoint_000001.old"]
    )
    removed = prune_checkpoints(root, 2, protect=paths[1])
    assert removed == [paths[0], paths[2]]
    assert list_checkpoints(root) == [paths[1], paths[3], paths[4]]
    assert not os.path.exists(paths[0] + ".old")  # Its twin went with it.
    with pytest.raises(ValueError, match="keep_checkpoints_num"):
        prune_checkpoints(root, 0)


def test_resolve_finds_the_newest_in_a_logdir(tmp_path):
    legacy = stub(tmp_path / "old_run" / "checkpoint")
    assert resolve_checkpoint_dir(str(tmp_path / "old_run")) == legacy
    run = tmp_path / "run"
    stub(run / "checkpoints" / "checkpoint_000009")
    newest = stub(run / "checkpoints" / "checkpoint_000010")
    stub(run / "best")  # BestCheckpoint's: found only when asked for by name.
    assert resolve_checkpoint_dir(str(run)) == newest
    assert resolve_checkpoint_dir(str(run / "checkpoints")) == newest
    assert resolve_checkpoint_dir(str(run / "best")) == str(run / "best")
    assert latest_checkpoint(str(tmp_path / "nothing")) is None
    with pytest.raises(FileNotFoundError, match="No checkpoint at"):
        resolve_checkpoint_dir(str(tmp_path / "nothing"))


def _learner(hiddens):
    from impala_tf.config import ImpalaConfig
    from impala_tf.driver.specs import env_spec
    from impala_tf.envs.make import make_env
    from impala_tf.learning.learner import ImpalaLearner

    config = ImpalaConfig().environment("CartPole-v1").training(model={"fcnet_hiddens": hiddens})
    env = make_env(env_spec(config))
    learner = ImpalaLearner(config, env.observation_space, env.action_space)
    env.close()
    return config, learner


def test_every_policy_has_its_learner_under_policies(tmp_path):
    config, first = _learner([4])
    _, second = _learner([4])
    second.set_policy_weights([w * 0 + 2 for w in second.get_policy_weights()])
    path = checkpoints.write_checkpoint(
        str(tmp_path / "ckpt"), {"p1": second, "p0": first}, config, {"iteration": 5}
    )
    assert sorted(os.listdir(path)) == [DRIVER_STATE_FILE, checkpoints.POLICIES_DIR]
    for pid in ("p0", "p1"):
        assert checkpoints.learner_prefix(path, pid) == os.path.join(
            path, "policies", pid, "learner"
        )
    state = read_driver_state(path)
    assert (state["format"], state["policy_ids"], state["iteration"]) == (2, ["p0", "p1"], 5)
    _, fresh = _learner([4])
    checkpoints.learner_checkpoint(fresh).read(
        checkpoints.learner_prefix(path, "p1")
    ).assert_consumed()
    for weight in fresh.get_policy_weights():
        np.testing.assert_array_equal(weight, 2)
    with pytest.raises(ValueError, match=r"No policy 'p2'.*\['p0', 'p1'\]"):
        checkpoints.learner_prefix(path, "p2")
    # One learner is the single-agent run's "default_policy".
    single = checkpoints.write_checkpoint(str(tmp_path / "single"), first, config)
    assert read_driver_state(single)["policy_ids"] == ["default_policy"]
    assert os.path.isfile(checkpoints.learner_prefix(single) + ".index")


def test_runtime_state_is_written_only_when_given(tmp_path):
    config, learner = _learner([4])
    plain = checkpoints.write_checkpoint(str(tmp_path / "a"), learner, config, {"iteration": 1})
    assert RUNTIME_STATE_FILE not in os.listdir(plain)
    assert read_runtime_state(plain) == {}
    runtime = {"pending": np.arange(3), "actors": {0: {"envs": b"\x00"}}}
    full = checkpoints.write_checkpoint(str(tmp_path / "b"), learner, config, {}, runtime)
    state = read_runtime_state(full)
    np.testing.assert_array_equal(state["pending"], np.arange(3))
    assert state["actors"] == {0: {"envs": b"\x00"}}


# One saver process: checkpoints of a learner whose weights and update counter equal the save
# number i, numbered (pruned to 2) or always to the same directory, "saved i" after each.
_SAVER = r"""
import os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
from tests.checkpoints_test import _learner
from impala_tf import checkpoints
root, mode = sys.argv[1], sys.argv[2]
config, learner = _learner([1024, 1024])
i = 0
while True:
    i += 1
    learner.set_policy_weights([w * 0 + i for w in learner.get_policy_weights()])
    learner.num_grad_updates.assign(i)
    if mode == "numbered":
        path = checkpoints.write_checkpoint(
            checkpoints.checkpoint_path(root, i), learner, config, {"iteration": i}
        )
        checkpoints.prune_checkpoints(root, 2, protect=path)
    else:
        path = os.path.join(root, "latest")
        checkpoints.write_checkpoint(path, learner, config, {"iteration": i})
    print("saved", i, flush=True)
"""


def test_sigkill_during_saves_leaves_the_previous_checkpoint_loadable(tmp_path):
    """Savers of ~12 MB checkpoints are SIGKILLed at random moments (mostly mid-write)."""
    rng = random.Random()
    env = {**os.environ, "PYTHONPATH": REPO, "TF_CPP_MIN_LOG_LEVEL": "2"}
    procs = {}
    for mode in ("numbered", "same_dir"):
        root = tmp_path / mode
        root.mkdir()
        argv = [sys.executable, "-c", _SAVER, str(root), mode]
        procs[mode] = run_in_background(argv, REPO, env, tmp_path / f"{mode}.log")
    last_saved = {}
    try:
        for mode, proc in procs.items():
            log = tmp_path / f"{mode}.log"
            # Two complete saves, then a kill at a random moment of the saves that follow.
            wait_for_line(log, r"^saved 2$", timeout_s=120, process=proc)
            time.sleep(rng.uniform(0.0, 0.6))
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(timeout=30) == -signal.SIGKILL, log_tail(log)
            saved = [line.split() for line in log.read_text().splitlines()]
            last_saved[mode] = max(int(w[1]) for w in saved if len(w) == 2 and w[0] == "saved")
    finally:
        for proc in procs.values():
            kill_session(proc)

    _, fresh = _learner([1024, 1024])
    for mode, saved in last_saved.items():
        directory = resolve_checkpoint_dir(str(tmp_path / mode))
        iteration = read_driver_state(directory)["iteration"]
        # The last completed save, or the one being renamed into place when the kill came.
        assert iteration in (saved, saved + 1), (mode, saved, iteration)
        prefix = checkpoints.learner_prefix(directory)
        assert prefix == os.path.join(directory, "policies", "default_policy", "learner")
        checkpoints.learner_checkpoint(fresh).read(prefix).assert_consumed()
        assert int(fresh.num_grad_updates.numpy()) == iteration
        for weight in fresh.get_policy_weights():
            np.testing.assert_array_equal(weight, iteration)
        if mode == "numbered":
            assert len(list_checkpoints(str(tmp_path / mode))) <= 3


def test_restoring_across_a_change_of_center_pixels_is_refused_by_name():
    from impala_tf.config import ImpalaConfig
    from impala_tf.config.policies import PolicySpec
    from impala_tf.driver.specs import checkpoint_spec
    from impala_tf.driver.state import check_pixel_centering

    def centering(config, ids=("default_policy",)):  # As the driver resolves it.
        return checkpoint_spec(config, ids).center_pixels

    plain = ImpalaConfig(env="CartPole-v1")
    centered = ImpalaConfig(env="CartPole-v1", model={"center_pixels": True})
    before_the_key = plain.to_dict()
    del before_the_key["model"]["center_pixels"]  # A checkpoint written before it existed.
    check_pixel_centering(centering(plain), before_the_key)
    check_pixel_centering(centering(centered), centered.to_dict())
    check_pixel_centering(centering(centered), None)  # Trained on an env callable: no config.
    for config, stored in ((centered, before_the_key), (plain, centered.to_dict())):
        with pytest.raises(ValueError, match=r"'default_policy'.*model\.center_pixels"):
            check_pixel_centering(centering(config), stored)
    # One policy of several, by its own override.
    policies = {"a": PolicySpec(), "b": PolicySpec(config={"model": {"center_pixels": True}})}
    multi = ImpalaConfig(env="CartPole-v1", policies=policies)
    stored = ImpalaConfig(env="CartPole-v1", policies={"a": PolicySpec(), "b": PolicySpec()})
    with pytest.raises(ValueError, match="'b'"):
        check_pixel_centering(centering(multi, ["a", "b"]), checkpoints.storable_config(stored))
