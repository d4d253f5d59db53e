"""The peers' V-trace test cases, in our own code: broadcasting and the rank-check errors.

DeepMind's scalable_agent (`vtrace_test.py`), trfl (`vtrace_ops_test.py`) and RLlib
(`rllib/algorithms/impala/tests/test_vtrace.py`) accept per-step inputs whose trailing dims
broadcast (`log_rhos`/`discounts` [T, B, 1] with `rewards`/`values` [T, B, k]) and match
"must have rank r" when a rank is wrong. Time-major: T is time, B is batch. Numeric tests run
eagerly, in a `tf.function` with unknown shapes and under XLA, against a numpy ground truth.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from impala_tf.learning import vtrace
from tests.vtrace_test import MODES, _log_softmax, _make_inputs, _paper_vtrace, _run

K = 42


def _broadcast_inputs(num_steps=5, batch=3, k=K, seed=3):
    """Inputs with log_rhos and discounts [T, B, 1], rewards and values [T, B, k]."""
    inputs = _make_inputs(num_steps=num_steps, batch=batch, trailing=(1,), seed=seed)
    rng = np.random.default_rng(seed + 1)
    inputs["rewards"] = rng.normal(size=(num_steps, batch, k)).astype(np.float32)
    inputs["values"] = rng.normal(size=(num_steps, batch, k)).astype(np.float32)
    inputs["bootstrap_value"] = rng.normal(size=(batch, k)).astype(np.float32)
    return inputs


def _ground_truth(inputs, rho_bar, pg_rho_bar):
    full = np.broadcast_shapes(*(inputs[n].shape for n in ("log_rhos", "discounts", "values")))
    return _paper_vtrace(
        **{n: np.broadcast_to(inputs[n], full) for n in ("log_rhos", "discounts")},
        rewards=inputs["rewards"],
        values=inputs["values"],
        bootstrap_value=inputs["bootstrap_value"],
        rho_bar=rho_bar,
        pg_rho_bar=pg_rho_bar,
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rho_bar, pg_rho_bar", [(1.0, 1.0), (2.0, 1.5), (None, None)])
def test_broadcast_log_rhos_against_k_values(mode, rho_bar, pg_rho_bar):
    inputs = _broadcast_inputs()
    vs, pg_advantages = _run(
        vtrace.from_importance_weights,
        mode,
        *inputs.values(),
        clip_rho_threshold=rho_bar,
        clip_pg_rho_threshold=pg_rho_bar,
    )
    expected_vs, expected_pg = _ground_truth(inputs, rho_bar, pg_rho_bar)
    assert vs.shape == (5, 3, K) and pg_advantages.shape == (5, 3, K)
    np.testing.assert_allclose(vs, expected_vs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(pg_advantages, expected_pg, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_broadcast_bootstrap_value_and_scan_baseline_agree(mode):
    """[B, 1] bootstrap values against [T, B, k] values; the RLlib scan formulation agrees."""
    inputs = _broadcast_inputs(k=4)
    inputs["bootstrap_value"] = inputs["bootstrap_value"][:, :1]
    ours = _run(vtrace.from_importance_weights, mode, *inputs.values())
    baseline = _run(vtrace.scan_vtrace_baseline, mode, *inputs.values())
    truth = dict(inputs, bootstrap_value=np.broadcast_to(inputs["bootstrap_value"], (3, 4)))
    expected_vs, expected_pg = _ground_truth(truth, 1.0, 1.0)
    for out in (ours, baseline):
        np.testing.assert_allclose(out.vs, expected_vs, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out.pg_advantages, expected_pg, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch, num_steps", [(1, 3), (2, 4)])
def test_higher_rank_inputs_for_importance_weights(batch, num_steps):
    """The peers' "higher rank inputs" case: the targets keep the trailing 42."""
    inputs = _broadcast_inputs(num_steps=num_steps, batch=batch)
    output = vtrace.from_importance_weights(**inputs)
    assert output.vs.shape.as_list()[-1] == K
    assert output.pg_advantages.shape.as_list() == [num_steps, batch, K]


def test_higher_rank_inputs_with_unknown_shapes():
    """scalable_agent's placeholders [None, None, 1] / [None, None, 42] / [None, 42]."""
    signature = dict(
        log_rhos=tf.TensorSpec([None, None, 1]),
        discounts=tf.TensorSpec([None, None, 1]),
        rewards=tf.TensorSpec([None, None, K]),
        values=tf.TensorSpec([None, None, K]),
        bootstrap_value=tf.TensorSpec([None, K]),
    )
    traced = tf.function(lambda **kw: vtrace.from_importance_weights(**kw).vs)
    concrete = traced.get_concrete_function(**signature)
    assert concrete.structured_outputs.shape.as_list()[-1] == K


@pytest.mark.parametrize("batch, num_steps", [(1, 3), (2, 4)])
def test_inconsistent_rank_inputs_for_importance_weights(batch, num_steps):
    """The peers' case: a [B] bootstrap value with [T, B, 42] values ("must have rank 2")."""
    inputs = _broadcast_inputs(num_steps=num_steps, batch=batch)
    inputs["bootstrap_value"] = np.zeros([batch], np.float32)
    with pytest.raises(ValueError, match="must have rank 2"):
        vtrace.from_importance_weights(**inputs)


def test_inconsistent_rank_inputs_with_unknown_shapes():
    signature = dict(
        log_rhos=tf.TensorSpec([None, None, 1]),
        discounts=tf.TensorSpec([None, None, 1]),
        rewards=tf.TensorSpec([None, None, K]),
        values=tf.TensorSpec([None, None, K]),
        bootstrap_value=tf.TensorSpec([None]),
    )
    traced = tf.function(lambda **kw: vtrace.from_importance_weights(**kw).vs)
    with pytest.raises(ValueError, match="must have rank 2"):
        traced.get_concrete_function(**signature)


@pytest.mark.parametrize("name", ["values", "discounts", "rewards"])
def test_per_step_rank_mismatch_matches_peer_message(name):
    inputs = _broadcast_inputs()
    inputs[name] = inputs[name][..., 0]
    with pytest.raises(ValueError, match=f"{name}: Shape .* must have rank 3"):
        vtrace.from_importance_weights(**inputs)


def test_shapes_that_do_not_broadcast_raise():
    inputs = _broadcast_inputs()
    inputs["discounts"] = np.ones([5, 3, 2], np.float32)  # 2 against 42
    with pytest.raises(ValueError, match="shape .* does not broadcast"):
        vtrace.from_importance_weights(**inputs)
    inputs = _broadcast_inputs()
    inputs["bootstrap_value"] = np.ones([3, 5], np.float32)
    with pytest.raises(ValueError, match="bootstrap_value shape .* does not broadcast"):
        vtrace.from_importance_weights(**inputs)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("batch", [1, 2])
def test_vtrace_from_logits(mode, batch):
    """The peers' from_logits case: log_rhos from the two policies' log-softmax, then V-trace."""
    num_steps, num_actions = 5, 3
    rng = np.random.default_rng(batch)
    behaviour_logits = rng.normal(size=(num_steps, batch, num_actions)).astype(np.float32)
    target_logits = rng.normal(size=(num_steps, batch, num_actions)).astype(np.float32)
    actions = rng.integers(0, num_actions, size=(num_steps, batch)).astype(np.int32)
    discounts = np.where(rng.random((num_steps, batch)) < 0.2, 0.0, 0.9).astype(np.float32)
    rewards = rng.normal(size=(num_steps, batch)).astype(np.float32)
    values = rng.normal(size=(num_steps, batch)).astype(np.float32)
    bootstrap_value = rng.normal(size=(batch,)).astype(np.float32)
    out = _run(
        vtrace.from_logits,
        mode,
        behaviour_logits,
        target_logits,
        actions,
        discounts,
        rewards,
        values,
        bootstrap_value,
        clip_rho_threshold=3.7,
        clip_pg_rho_threshold=2.2,
    )
    pick = np.arange(num_actions) == actions[..., None]
    target_logp = np.sum(_log_softmax(target_logits) * pick, axis=-1)
    behaviour_logp = np.sum(_log_softmax(behaviour_logits) * pick, axis=-1)
    expected_vs, expected_pg = _paper_vtrace(
        target_logp - behaviour_logp, discounts, rewards, values, bootstrap_value, 3.7, 2.2
    )
    np.testing.assert_allclose(out.target_action_log_probs, target_logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.behaviour_action_log_probs, behaviour_logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.log_rhos, target_logp - behaviour_logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.vs, expected_vs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.pg_advantages, expected_pg, rtol=1e-5, atol=1e-5)
