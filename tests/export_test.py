"""Tests of the impala-export binary: SavedModels that act like the checkpoint's policy.

The binary's runs go one after another through its flags and `main` in one subprocess (each
start spends seconds importing TensorFlow); the CartPole export is loaded in a second, fresh
process with TensorFlow alone (no impala_tf) and acts for one episode there. A checkpoint of
several policies exports the one `--policy_id` names (and needs it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest

from tests.evaluate_test import write_multi_agent_checkpoint
from tests.support.binaries import run_binary_in_one_process
from tests.support.processes import EXIT_WITHOUT_TEARDOWN

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": REPO}
_TIMEOUT_S = 120

# Runs in a fresh process: loads the SavedModel with TensorFlow only and plays one seeded
# CartPole episode with its `actions`.
_ACT_IN_CARTPOLE = (
    """
import json, sys
import gymnasium as gym
import numpy as np
import tensorflow as tf

serve = tf.saved_model.load(sys.argv[1]).signatures["serving_default"]
env = gym.make("CartPole-v1")
obs, _ = env.reset(seed=11)
record = {"obs": [], "actions": [], "logits": [], "values": [], "return": 0.0}
done = False
while not done:
    out = serve(obs=tf.constant(obs[None], tf.float32))
    action = int(out["actions"][0])
    record["obs"].append(obs.tolist())
    record["actions"].append(action)
    record["logits"].append(out["logits"][0].numpy().tolist())
    record["values"].append(float(out["values"][0]))
    obs, reward, terminated, truncated, _ = env.step(action)
    record["return"] += float(reward)
    done = terminated or truncated
record["imported_impala_tf"] = any(m.startswith("impala_tf") for m in sys.modules)
print(json.dumps(record))
"""
    + EXIT_WITHOUT_TEARDOWN
)


def write_test_checkpoint(directory, env, model, seed=0):
    """Writes a checkpoint of a learner with random (not initial) weights; returns the learner."""
    from impala_tf.checkpoints import write_checkpoint
    from impala_tf.config import ImpalaConfig
    from impala_tf.driver.specs import env_spec
    from impala_tf.envs.make import make_env
    from impala_tf.learning.learner import ImpalaLearner

    config = ImpalaConfig().environment(env).training(model=model).debugging(seed=seed)
    probe = make_env(env_spec(config))
    learner = ImpalaLearner(config, probe.observation_space, probe.action_space)
    probe.close()
    rng = np.random.default_rng(seed)
    learner.set_policy_weights(
        [rng.normal(scale=0.5, size=w.shape).astype(w.dtype) for w in learner.get_policy_weights()]
    )
    write_checkpoint(str(directory), learner, config)
    return learner


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Runs impala-export on the checkpoints below, one after another in one process (each
    start of the binary imports TensorFlow).

    Returns:
      (root, {run name: (exit status, its output)}).
    """
    root = tmp_path_factory.mktemp("export")
    # Weight seed 4 balances the pole for 85 steps, pushing both ways (with a value tower: the
    # weights drawn depend on the layout).
    cartpole = {"fcnet_hiddens": [16], "vf_share_layers": False}
    write_test_checkpoint(root / "cartpole" / "checkpoint", "CartPole-v1", cartpole, 4)
    lstm = {"fcnet_hiddens": [16], "use_lstm": True, "lstm_cell_size": 8}
    write_test_checkpoint(root / "pendulum_lstm" / "checkpoint", "Pendulum-v1", lstm, 0)
    write_multi_agent_checkpoint(root / "multi")
    runs = {
        # A logdir: its checkpoint/ is found.
        "cartpole": [f"--checkpoint={root / 'cartpole'}", f"--out={root / 'cartpole_export'}"],
        "pendulum_lstm": [
            f"--checkpoint={root / 'pendulum_lstm'}",
            f"--out={root / 'pendulum_lstm_export'}",
        ],
        "multi_p1": [f"--checkpoint={root / 'multi'}", f"--out={root / 'p1'}", "--policy_id=p1"],
        "multi": [f"--checkpoint={root / 'multi'}", f"--out={root / 'multi_export'}"],
        "missing": [f"--checkpoint={root / 'missing'}", f"--out={root / 'missing_export'}"],
    }
    return root, run_binary_in_one_process(
        "impala_tf.bin.export", runs, cwd=REPO, env=_ENV, log_dir=root, timeout_s=_TIMEOUT_S
    )


def load_policy(logdir):
    """The checkpoint's model and action space, as impala-export loads them."""
    from impala_tf.checkpoints import load_config
    from impala_tf.driver.evaluation import load_policy_model

    model, action_space, obs_filter = load_policy_model(str(logdir), load_config(str(logdir)))
    assert obs_filter is None  # NoFilter: the SavedModel takes raw observations.
    return model, action_space


def test_export_acts_like_the_policy_in_a_fresh_process(exports):
    from impala_tf.models import distributions

    root, runs = exports
    code, output = runs["cartpole"]
    assert code == 0, output[-3000:]
    assert "serving_default: obs[None, 4] float32 -> actions, logits, values" in output
    proc = subprocess.run(
        [sys.executable, "-c", _ACT_IN_CARTPOLE, str(root / "cartpole_export")],
        cwd=REPO,
        env=_ENV,
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not record["imported_impala_tf"]
    actions = np.array(record["actions"])
    assert record["return"] == len(actions) == 85  # CartPole pays 1 per step.
    assert set(actions) == {0, 1}  # Both actions occur, so the comparison below can fail.

    model, action_space = load_policy(root / "cartpole")
    logits, values, _ = model.step(np.array(record["obs"], np.float32), ())
    mode = distributions.make_distribution(action_space, logits).mode()
    np.testing.assert_array_equal(actions, mode)  # The deterministic action (explore=False).
    np.testing.assert_allclose(record["logits"], logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(record["values"], values, rtol=1e-5, atol=1e-5)


def test_recurrent_export_threads_the_state(exports):
    import tensorflow as tf

    root, runs = exports
    code, output = runs["pendulum_lstm"]
    assert code == 0, output[-3000:]
    assert "state_in_0[None, 8] float32, state_in_1[None, 8] float32" in output
    loaded = tf.saved_model.load(str(root / "pendulum_lstm_export"))
    serve = loaded.signatures["serving_default"]
    assert set(serve.structured_outputs) == {
        "actions",
        "logits",
        "values",
        "state_out_0",
        "state_out_1",
    }
    state = loaded.signatures["initial_state"](batch_size=tf.constant(3))
    assert state["state_in_0"].shape == (3, 8)
    np.testing.assert_array_equal(state["state_in_1"], np.zeros((3, 8), np.float32))

    model, _ = load_policy(root / "pendulum_lstm")
    space = gym.spaces.Box(-8.0, 8.0, (3,), np.float32)
    space.seed(0)
    want_state = model.initial_state(3)
    got_state = (state["state_in_0"], state["state_in_1"])
    for _ in range(4):
        obs = np.stack([space.sample() for _ in range(3)])
        logits, values, want_state = model.step(obs, want_state)
        got = serve(obs=tf.constant(obs), state_in_0=got_state[0], state_in_1=got_state[1])
        assert got["actions"].dtype == tf.float32 and got["actions"].shape == (3, 1)
        # Box actions: the mode is the Normal's mean, the first half of the logits.
        np.testing.assert_allclose(got["actions"], logits[:, :1], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["values"], values, rtol=1e-5, atol=1e-6)
        got_state = (got["state_out_0"], got["state_out_1"])
        np.testing.assert_allclose(got_state[0], want_state[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got_state[1], want_state[1], rtol=1e-5, atol=1e-6)
    assert np.abs(want_state[1]).max() > 0.01  # The state moved away from zero.


def test_a_checkpoint_of_several_policies_exports_the_one_named(exports):
    import tensorflow as tf

    from impala_tf.checkpoints import load_config
    from impala_tf.driver.evaluation import load_policy_model

    root, runs = exports
    code, output = runs["multi"]
    assert code == 1
    assert "several policies ['p0', 'p1']: pass --policy_id" in output
    assert not (root / "multi_export").exists()
    code, output = runs["multi_p1"]
    assert code == 0, output[-3000:]

    serve = tf.saved_model.load(str(root / "p1")).signatures["serving_default"]
    obs = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)
    served = serve(obs=tf.constant(obs))["logits"]
    config = load_config(str(root / "multi"))
    logits = {}
    for pid in ("p0", "p1"):
        model, _, _ = load_policy_model(str(root / "multi"), config, pid)
        logits[pid] = model.step(obs, ())[0]
    np.testing.assert_allclose(served, logits["p1"], rtol=1e-5, atol=1e-5)
    assert not np.allclose(served, logits["p0"], atol=1e-3)  # p1's policy, not p0's.


def test_export_explains_a_missing_checkpoint(exports):
    root, runs = exports
    code, output = runs["missing"]
    assert code == 1
    assert "impala-export: error: No checkpoint at" in output
    assert not (root / "missing_export").exists()
