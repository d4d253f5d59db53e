"""A policy you can call: `Impala.from_checkpoint` (no process started), `get_policy`,
`compute_single_action` / `compute_actions`, `get_weights` / `set_weights`, and the same actions
as `impala-evaluate` takes with the same seed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import gymnasium as gym
import numpy as np
import pytest

from impala_tf import Impala
from tests.support.configs import small_config
from tests.support.processes import EXIT_WITHOUT_TEARDOWN

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": REPO}
SEED = 21


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A CartPole run of two iterations, saved, with `seed` 21 stored."""
    algo = small_config(seed=SEED).build()
    try:
        for _ in range(2):
            result = algo.train()
        path = algo.save(str(tmp_path_factory.mktemp("policy") / "ckpt"))
    finally:
        algo.stop()
    return path, result


def _script(body: str) -> dict:
    """Runs `body` in a fresh Python process; returns the JSON it prints last."""
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(body) + EXIT_WITHOUT_TEARDOWN],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_checkpoint_loads_in_a_fresh_process_and_acts_as_impala_evaluate(checkpoint):
    path, _ = checkpoint
    mine = _script(
        f"""
        import json, multiprocessing
        import gymnasium as gym
        from impala_tf import Impala
        from impala_tf.utils.seeds import env_seed

        out = {{}}
        for explore in (False, True):
            algo = Impala.from_checkpoint({path!r})
            env = gym.make("CartPole-v1")
            obs, _ = env.reset(seed=env_seed({SEED}, 0, 0))
            returns = []
            for _ in range(3):
                done, ret = False, 0.0
                while not done:
                    action = algo.compute_single_action(obs, explore=explore)
                    obs, reward, terminated, truncated, _ = env.step(action)
                    ret, done = ret + reward, terminated or truncated
                returns.append(ret)
                obs, _ = env.reset()
            out[str(explore)] = returns
        out["children"] = len(multiprocessing.active_children())
        out["started"] = algo.actors is not None
        # impala-evaluate's own path (`impala_tf.driver.evaluation.evaluate_checkpoint`).
        from impala_tf import checkpoints
        from impala_tf.driver.evaluation import evaluate_checkpoint

        config = checkpoints.load_config({path!r}).get_evaluation_config()
        config.env_runners(num_envs_per_env_runner=1)
        for explore in (False, True):
            episodes = evaluate_checkpoint({path!r}, config, 3, explore)
            out[f"evaluated {{explore}}"] = [e.ret for e in episodes]
        print(json.dumps(out))
        """
    )
    assert mine["children"] == 0 and not mine["started"]
    assert mine["False"] == mine["evaluated False"]  # Greedy: every episode is the same.
    # Sampled actions: the same draws as long as the calls come in the same order.
    assert mine["True"] == mine["evaluated True"]


def test_get_policy_gives_the_model_weights_and_actions(checkpoint):
    path, _ = checkpoint
    algo = Impala.from_checkpoint(path)
    policy = algo.get_policy()
    assert policy is algo.get_policy("default_policy")
    assert policy.model.count_params() > 0 and not policy.is_recurrent()
    weights = algo.get_weights()["default_policy"]
    for a, b in zip(weights, policy.model.get_weights()):
        np.testing.assert_array_equal(a, b)
    obs = np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32)
    actions, state, extra = policy.compute_actions(obs, explore=False)
    logits, values = policy.model(obs)
    np.testing.assert_array_equal(actions, np.argmax(logits, -1))
    np.testing.assert_allclose(extra["vf_preds"], values, rtol=1e-5, atol=1e-6)
    assert state == []
    batch = algo.compute_actions(obs, explore=False)
    keyed = algo.compute_actions({"a": obs[0], "b": obs[1]}, explore=False)
    assert keyed == {"a": batch[0], "b": batch[1]}
    action, state_out, fetches = algo.compute_single_action(obs[0], full_fetch=True, explore=False)
    assert action == batch[0] and state_out == [] and fetches["action_dist_inputs"].shape == (2,)
    with pytest.raises(KeyError, match="no_such_policy"):
        algo.get_policy("no_such_policy")


def test_weights_set_before_training_are_what_training_starts_from(checkpoint):
    path, saved = checkpoint
    algo = Impala.from_checkpoint(path)
    zeros = [np.zeros_like(w) for w in algo.get_weights()["default_policy"]]
    algo.set_weights({"default_policy": zeros})
    assert algo.compute_single_action(np.ones(4, np.float32), explore=False) == 0  # Equal logits.
    try:
        result = algo.train()  # Starts the actors and learners, restores, then sets the weights.
    finally:
        algo.stop()  # The learner thread updates no more: its weights stay put below.
    assert result["training_iteration"] == saved["training_iteration"] + 1
    assert result["timesteps_total"] > saved["timesteps_total"]
    trained = algo.get_weights()["default_policy"]
    # Adam moves each weight by about `lr` (5e-4) per update: still near zero.
    assert max(float(np.abs(w).max()) for w in trained) < 0.1
    policy = algo.get_policy()  # Now the learner's.
    for a, b in zip(policy.get_weights(), trained):
        np.testing.assert_array_equal(a, b)


def test_box_actions_come_unsquashed_as_the_env_steps_them(tmp_path):
    config = small_config(num_env_runners=1).environment("Pendulum-v1")
    algo = config.build()
    try:
        algo.train()
    finally:
        algo.stop()
    obs = np.array([1.0, 0.0, 0.0], np.float32)
    raw = algo.compute_single_action(obs, explore=False, unsquash_action=False)
    env_action = algo.compute_single_action(obs, explore=False)
    expected = np.clip(-2.0 + (np.clip(raw, -1, 1) + 1.0) * 2.0, -2.0, 2.0)
    np.testing.assert_allclose(env_action, expected, atol=1e-6)
    space = gym.make("Pendulum-v1").action_space
    assert space.contains(env_action.astype(np.float32))


def test_a_recurrent_policy_takes_and_returns_its_state(tmp_path):
    config = small_config(num_env_runners=1).training(
        model={"use_lstm": True, "lstm_cell_size": 8, "fcnet_hiddens": [8]}
    )
    algo = config.build()
    try:
        algo.train()
        path = algo.save(str(tmp_path / "ckpt"))
    finally:
        algo.stop()
    loaded = Impala.from_checkpoint(path)
    policy = loaded.get_policy()
    state = policy.get_initial_state()
    assert policy.is_recurrent() and [s.shape for s in state] == [(8,), (8,)]
    obs = np.zeros(4, np.float32)
    action, state_1, _ = loaded.compute_single_action(obs, state, explore=False)
    _, state_2, _ = loaded.compute_single_action(obs, state_1, explore=False)
    assert action in (0, 1) and not np.allclose(state_1[0], state_2[0])
