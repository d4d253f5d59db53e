"""A user's own module, named in a YAML, through every binary: impala-train builds the model and
the callbacks in the actors and the learner, impala-evaluate and impala-export rebuild the model
in fresh processes from the checkpoint, and a registered name survives into them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.support.processes import EXIT_WITHOUT_TEARDOWN

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

USER_MODULE = """
import keras
from impala_tf import DefaultCallbacks


def my_model(obs_space, action_space, num_outputs, model_config, name, hidden=8):
    obs = keras.Input(obs_space.shape)
    x = keras.layers.Dense(hidden, activation="tanh")(obs)
    return keras.Model(obs, [keras.layers.Dense(num_outputs)(x), keras.layers.Dense(1)(x)])


class Lengths(DefaultCallbacks):
    def on_episode_end(self, *, episode, **kwargs):
        episode.custom_metrics["my_length"] = episode.length
"""

YAML = """
user-cartpole:
    env: CartPole-v1
    run: IMPALA
    config:
        num_env_runners: 1
        num_envs_per_env_runner: 4
        rollout_fragment_length: 10
        train_batch_size: 80
        num_gpus: 0
        min_time_s_per_iteration: 0.5
        seed: 3
        callbacks: user_models:Lengths
        model:
            custom_model: {model}
            custom_model_config: {{hidden: 6}}
"""


def _run(cwd, *args, timeout=240):
    out = subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": REPO},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A user's directory with their module and a YAML naming it."""
    root = tmp_path_factory.mktemp("project")
    (root / "user_models.py").write_text(USER_MODULE, encoding="utf-8")
    (root / "user.yaml").write_text(YAML.format(model="user_models:my_model"), encoding="utf-8")
    return root


def test_the_binaries_build_a_model_of_the_users_module(project):
    logdir = project / "run"
    _run(project, "-m", "impala_tf.bin.train", "--config=user.yaml", f"--logdir={logdir}",
         "--stop_iters=2")  # fmt: skip
    results = [json.loads(line) for line in (logdir / "result.json").read_text().splitlines()]
    assert results[-1]["custom_metrics"]["my_length_mean"] > 0
    summary = json.loads(
        _run(project, "-m", "impala_tf.bin.evaluate", f"--checkpoint={logdir}", "--episodes=2")
        .strip()
        .splitlines()[-1]
    )
    assert summary["episodes"] == 2
    out = project / "saved"
    _run(project, "-m", "impala_tf.bin.export", f"--checkpoint={logdir}", f"--out={out}")
    import tensorflow as tf  # Loading needs TensorFlow alone, not the user's module.

    serve = tf.saved_model.load(str(out)).signatures["serving_default"]
    assert serve(obs=tf.zeros([3, 4]))["logits"].shape == (3, 2)


def test_a_registered_name_is_rebuilt_in_a_fresh_process(project, tmp_path):
    checkpoint = tmp_path / "ckpt"
    _run(
        project,
        "-c",
        textwrap.dedent(
            f"""
            from impala_tf import ImpalaConfig
            from impala_tf.models import ModelCatalog
            import user_models

            ModelCatalog.register_custom_model("registered_mlp", user_models.my_model)
            config = ImpalaConfig.from_yaml("user.yaml")[0]
            config.training(model={{"custom_model": "registered_mlp"}})
            algo = config.build()
            try:
                algo.save({str(checkpoint)!r})
            finally:
                algo.stop()
            """
        )
        + EXIT_WITHOUT_TEARDOWN,
    )
    state = json.loads((checkpoint / "driver_state.json").read_text())
    assert state["custom_models"] == {"registered_mlp": "user_models:my_model"}
    assert state["config"]["model"]["custom_model"] == "registered_mlp"
    loaded = _run(
        project,
        "-c",
        textwrap.dedent(
            f"""
            import numpy as np
            from impala_tf import Impala
            algo = Impala.from_checkpoint({str(checkpoint)!r})
            print(type(algo.get_policy().model.net).__name__, algo.compute_single_action(
                np.zeros(4, np.float32), explore=False))
            """
        )
        + EXIT_WITHOUT_TEARDOWN,
    )
    name, action = loaded.strip().splitlines()[-1].split()
    assert name == "Functional" and int(action) in (0, 1)
