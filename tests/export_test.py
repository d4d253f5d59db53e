"""Tests of the impala-export binary: SavedModels that act like the checkpoint's policy.

The binary runs as a subprocess; the CartPole export is loaded in a second, fresh process with
TensorFlow alone (no impala_tf) and acts for one episode there. Both exports run at once to keep
the file fast (each subprocess spends seconds importing TensorFlow).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": REPO}
_TIMEOUT_S = 120

# Runs in a fresh process: loads the SavedModel with TensorFlow only and plays one seeded
# CartPole episode with its `actions`.
_ACT_IN_CARTPOLE = """
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


def write_test_checkpoint(directory, env, model, seed=0):
    """Writes a checkpoint of a learner with random (not initial) weights; returns the learner."""
    from impala_tf.actors.env_runner import make_env
    from impala_tf.checkpoints import write_checkpoint
    from impala_tf.config import ImpalaConfig
    from impala_tf.learner import ImpalaLearner

    config = ImpalaConfig().environment(env).training(model=model).debugging(seed=seed)
    probe = make_env(config)
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
    """Exports a CartPole MLP and a Pendulum LSTM checkpoint, both binaries running at once."""
    root = tmp_path_factory.mktemp("export")
    cases = {
        # Weight seed 4 balances the pole for 85 steps, pushing both ways (with a value tower:
        # the weights drawn depend on the layout).
        "cartpole": ("CartPole-v1", {"fcnet_hiddens": [16], "vf_share_layers": False}, 4),
        "pendulum_lstm": (
            "Pendulum-v1",
            {"fcnet_hiddens": [16], "use_lstm": True, "lstm_cell_size": 8},
            0,
        ),
    }
    procs = {}
    for name, (env, model, seed) in cases.items():
        write_test_checkpoint(root / name / "checkpoint", env, model, seed)
        procs[name] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "impala_tf.bin.export",
                f"--checkpoint={root / name}",  # A logdir: its checkpoint/ is found.
                f"--out={root / name / 'saved_model'}",
            ],
            cwd=REPO,
            env=_ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    outputs = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=_TIMEOUT_S)
        assert proc.returncode == 0, stderr[-3000:]
        outputs[name] = stdout
    return root, outputs


def test_export_acts_like_the_policy_in_a_fresh_process(exports):
    from impala_tf.checkpoints import load_policy

    root, outputs = exports
    assert "serving_default: obs[None, 4] float32 -> actions, logits, values" in outputs["cartpole"]
    proc = subprocess.run(
        [sys.executable, "-c", _ACT_IN_CARTPOLE, str(root / "cartpole" / "saved_model")],
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

    _, policy = load_policy(str(root / "cartpole"), explore=False)
    step = policy.step(np.array(record["obs"], np.float32))
    np.testing.assert_array_equal(actions, step.actions)
    np.testing.assert_allclose(record["logits"], step.logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(record["values"], step.values, rtol=1e-5, atol=1e-5)


def test_recurrent_export_threads_the_state(exports):
    import tensorflow as tf

    from impala_tf.checkpoints import load_policy

    root, outputs = exports
    assert "state_in_0[None, 8] float32, state_in_1[None, 8] float32" in outputs["pendulum_lstm"]
    loaded = tf.saved_model.load(str(root / "pendulum_lstm" / "saved_model"))
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

    _, policy = load_policy(str(root / "pendulum_lstm"), explore=False)
    space = gym.spaces.Box(-8.0, 8.0, (3,), np.float32)
    space.seed(0)
    want_state = policy.initial_state(3)
    got_state = (state["state_in_0"], state["state_in_1"])
    for _ in range(4):
        obs = np.stack([space.sample() for _ in range(3)])
        want = policy.step(obs, want_state)
        got = serve(obs=tf.constant(obs), state_in_0=got_state[0], state_in_1=got_state[1])
        assert got["actions"].dtype == tf.float32 and got["actions"].shape == (3, 1)
        # Box actions: the mode is the Normal's mean, the first half of the logits.
        np.testing.assert_allclose(got["actions"], want.logits[:, :1], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["actions"], want.actions, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["values"], want.values, rtol=1e-5, atol=1e-6)
        got_state = (got["state_out_0"], got["state_out_1"])
        want_state = want.state
        np.testing.assert_allclose(got_state[0], want_state[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got_state[1], want_state[1], rtol=1e-5, atol=1e-6)
    assert np.abs(want_state[1]).max() > 0.01  # The state moved away from zero.


def test_export_explains_a_missing_checkpoint(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "impala_tf.bin.export",
            f"--checkpoint={tmp_path / 'missing'}",
            f"--out={tmp_path / 'out'}",
        ],
        cwd=REPO,
        env=_ENV,
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
    )
    assert proc.returncode == 1
    assert "No checkpoint at" in proc.stderr
    assert not (tmp_path / "out").exists()
