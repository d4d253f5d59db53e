"""`max_seq_len` sequences: layout, mask and padding, carried state, per-sequence V-trace."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from impala_tf.config import ImpalaConfig
from impala_tf.data.layouts import time_major
from impala_tf.driver.specs import runner_spec
from impala_tf.learning import losses, vtrace
from impala_tf.learning.learner import ImpalaLearner
from impala_tf.learning.sequences import chunk_time_major, num_sequences, state_column_shapes
from impala_tf.rollout.env_runner import EnvRunner


def test_num_sequences_and_state_shapes():
    assert num_sequences(50, 20) == 3 and num_sequences(40, 20) == 2 and num_sequences(5, 20) == 1
    assert state_column_shapes(50, 20, ((8,), (8,))) == ((3, 8), (3, 8))
    assert state_column_shapes(50, 20, ()) == ()
    with pytest.raises(ValueError, match="max_seq_len"):
        num_sequences(50, 0)


def test_chunk_layout_mask_and_padding():
    t, b, length = 7, 2, 3  # C = 3 sequences of 3, 3 and 1 valid steps.
    steps = np.arange(t * b, dtype=np.float32).reshape(t, b)  # steps[t, b] = 2 t + b
    obs = np.stack([steps, -steps], axis=-1)  # [T, B, 2]
    state = np.arange(b * 3 * 4, dtype=np.float32).reshape(b, 3, 4)
    batch = {
        "rewards": steps,
        "obs": obs,
        "terminateds": np.zeros((t, b), bool),
        "state_in_0": state,
    }
    columns, mask, ends = chunk_time_major(batch, length)
    assert columns["rewards"].shape == (3, 6) and columns["obs"].shape == (3, 6, 2)
    assert columns["state_in_0"].shape == (6, 4)
    for env in range(b):
        for c in range(3):
            col = env * 3 + c
            valid = min(length, t - c * length)
            expected = steps[c * length : c * length + valid, env]
            np.testing.assert_array_equal(columns["rewards"][:valid, col], expected)
            np.testing.assert_array_equal(columns["obs"][:valid, col, 1], -expected)
            # Padding is zeros and masked out.
            np.testing.assert_array_equal(columns["rewards"][valid:, col], 0.0)
            np.testing.assert_array_equal(mask[:, col], [1.0] * valid + [0.0] * (length - valid))
            np.testing.assert_array_equal(ends[:, col], [i == valid - 1 for i in range(length)])
            np.testing.assert_array_equal(columns["state_in_0"][col], state[env, c])
    assert not columns["terminateds"].numpy()[1:, 2::3].any()


def test_one_sequence_per_fragment_is_unchanged():
    batch = {"rewards": np.ones((5, 2), np.float32), "state_in_0": np.ones((2, 4), np.float32)}
    columns, mask, ends = chunk_time_major(batch, 20)
    assert columns["rewards"].shape == (5, 2) and columns["state_in_0"].shape == (2, 4)
    np.testing.assert_array_equal(mask, np.ones((5, 2)))
    np.testing.assert_array_equal(ends.numpy()[:, 0], [False] * 4 + [True])


def test_state_columns_must_match_the_number_of_sequences():
    rewards = np.ones((50, 2), np.float32)
    with pytest.raises(ValueError, match="max_seq_len"):
        chunk_time_major({"rewards": rewards, "state_in_0": np.ones((2, 4), np.float32)}, 20)
    with pytest.raises(ValueError, match="need 3"):
        chunk_time_major({"rewards": rewards, "state_in_0": np.ones((2, 2, 4), np.float32)}, 20)


def _lstm_runner_and_learner(horizon: int, max_seq_len: int, envs: int = 3):
    config = (
        ImpalaConfig()
        .environment("CartPole-v1")
        .env_runners(num_envs_per_env_runner=envs, rollout_fragment_length=horizon)
        .training(
            model={
                "fcnet_hiddens": [16],
                "use_lstm": True,
                "lstm_cell_size": 8,
                "max_seq_len": max_seq_len,
            }
        )
        .debugging(seed=3)
    )
    runner = EnvRunner(runner_spec(config), worker_index=1)
    keras.utils.set_random_seed(0)
    learner = ImpalaLearner(config, runner.observation_space, runner.action_space)
    runner.set_weights({"default_policy": (learner.get_policy_weights(), 0)})
    return runner, learner


def test_carried_states_reproduce_the_actor_and_the_whole_fragment_unroll():
    horizon, length = 23, 5  # C = 5 sequences, the last with 3 steps.
    runner, learner = _lstm_runner_and_learner(horizon, length)
    saw_episode_end = False
    for _ in range(4):  # Random weights end CartPole episodes inside these fragments.
        batch = runner.sample().batches["default_policy"]
        assert batch["state_in_0"].shape == (3, 5, 8)
        saw_episode_end |= bool(batch["terminateds"].any() or batch["truncateds"].any())
        tm = time_major(batch)
        columns, mask, _ = chunk_time_major(tm, length)
        dones = np.logical_or(columns["terminateds"], columns["truncateds"])
        resets = tf.concat([tf.zeros_like(dones[:1]), dones[:-1]], 0)
        state = (columns["state_in_0"], columns["state_in_1"])
        logits, values, _ = learner.model.unroll(columns["obs"], resets, state)

        # Undo the chunking: [L, B * C] -> [B, C * L] -> the first T steps.
        def unchunk(x):
            x = np.asarray(x).reshape(length, 3, 5, *x.shape[2:])
            return np.moveaxis(x, 0, 2).reshape(3, 5 * length, *x.shape[3:])[:, :horizon]

        np.testing.assert_allclose(unchunk(logits), batch["action_dist_inputs"], atol=1e-5)
        np.testing.assert_allclose(unchunk(values), batch["vf_preds"], atol=1e-5)
        assert unchunk(mask).all() and np.asarray(mask).sum() == 3 * horizon
        # Stepping the LSTM through the whole fragment from the first state gives the same.
        whole_dones = np.logical_or(tm["terminateds"], tm["truncateds"])
        whole_resets = np.concatenate([np.zeros_like(whole_dones[:1]), whole_dones[:-1]], 0)
        whole_state = (batch["state_in_0"][:, 0], batch["state_in_1"][:, 0])
        whole_logits, _, _ = learner.model.unroll(tm["obs"], whole_resets, whole_state)
        np.testing.assert_allclose(unchunk(logits), np.swapaxes(whole_logits, 0, 1), atol=1e-5)
    assert saw_episode_end


def test_each_sequence_is_its_own_trace_bootstrapped_at_its_end():
    rng = np.random.default_rng(0)
    t, b, length = 7, 2, 3
    tm = {
        "rewards": rng.normal(size=(t, b)).astype(np.float32),
        "values": rng.normal(size=(t, b)).astype(np.float32),
        "values_bootstrapped": rng.normal(size=(t, b)).astype(np.float32),
        "log_rhos": rng.normal(scale=0.5, size=(t, b)).astype(np.float32),
        "terminateds": np.zeros((t, b), bool),
        "truncateds": np.zeros((t, b), bool),
    }
    tm["terminateds"][1, 0] = True  # a termination inside the first sequence of env 0
    columns, mask, ends = chunk_time_major(tm, length)
    out = losses.vtrace_loss(
        target_log_probs=columns["log_rhos"],
        behaviour_log_probs=tf.zeros_like(columns["log_rhos"]),
        entropy=tf.zeros_like(columns["log_rhos"]),
        values=columns["values"],
        rewards=columns["rewards"],
        terminateds=columns["terminateds"],
        truncateds=tf.logical_or(columns["truncateds"], ends),
        values_bootstrapped=columns["values_bootstrapped"],
        mask=mask,
        gamma=0.9,
    )
    # Ground truth: V-trace over each unpadded sequence alone, bootstrapped from the behaviour
    # value after its last step.
    for env in range(b):
        for c in range(3):
            lo, hi = c * length, min(t, (c + 1) * length)
            term = tm["terminateds"][lo:hi, env]
            ref = vtrace.from_importance_weights(
                log_rhos=tm["log_rhos"][lo:hi, env, None],
                discounts=(0.9 * (1.0 - term))[:, None].astype(np.float32),
                rewards=tm["rewards"][lo:hi, env, None],
                values=tm["values"][lo:hi, env, None],
                bootstrap_value=tm["values_bootstrapped"][hi - 1, env, None],
            )
            got = np.asarray(out.vs)[: hi - lo, env * 3 + c]
            np.testing.assert_allclose(got, ref.vs.numpy()[:, 0], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(
                np.asarray(out.pg_advantages)[: hi - lo, env * 3 + c],
                ref.pg_advantages.numpy()[:, 0],
                rtol=1e-5,
                atol=1e-5,
            )
    assert float(out.sums.num_valid) == t * b


def test_learner_trains_on_sequences_and_counts_only_real_steps():
    runner, learner = _lstm_runner_and_learner(horizon=12, max_seq_len=5, envs=2)
    batch = runner.sample().batches["default_policy"]
    tm = {k: tf.constant(v) for k, v in time_major(batch).items() if k != "policy_version"}
    before = [w.copy() for w in learner.model.get_weights()]
    stats = {k: float(v) for k, v in tf.function(learner.train_step)(tm).items()}
    assert stats["num_agent_steps_trained"] == 24
    assert np.isfinite(stats["total_loss"])
    changed = [not np.allclose(a, b) for a, b in zip(before, learner.model.get_weights())]
    assert all(changed)
