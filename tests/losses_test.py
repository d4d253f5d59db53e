"""Tests of the V-trace loss against a numpy computation written from RLlib's V-trace."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from impala_tf.learning import losses

T, B = 6, 3
GAMMA = 0.9


def _numpy_vtrace(log_rhos, discounts, rewards, values, bootstrap, rho_bar=1.0, pg_rho_bar=1.0):
    rhos = np.exp(log_rhos)
    clipped = np.minimum(rho_bar, rhos)
    cs = np.minimum(1.0, rhos)
    next_values = np.concatenate([values[1:], bootstrap[None]], 0)
    deltas = clipped * (rewards + discounts * next_values - values)
    acc = np.zeros_like(bootstrap)
    vs_minus_v = np.zeros_like(values)
    for t in reversed(range(len(values))):
        acc = deltas[t] + discounts[t] * cs[t] * acc
        vs_minus_v[t] = acc
    vs = vs_minus_v + values
    vs_next = np.concatenate([vs[1:], bootstrap[None]], 0)
    pg_adv = np.minimum(pg_rho_bar, rhos) * (rewards + discounts * vs_next - values)
    return vs, pg_adv


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    batch = dict(
        target_log_probs=rng.uniform(-2, -0.1, (T, B)).astype(np.float32),
        behaviour_log_probs=rng.uniform(-2, -0.1, (T, B)).astype(np.float32),
        entropy=rng.uniform(0.1, 0.7, (T, B)).astype(np.float32),
        values=rng.normal(size=(T, B)).astype(np.float32),
        rewards=rng.normal(size=(T, B)).astype(np.float32),
        terminateds=np.zeros((T, B), bool),
        truncateds=np.zeros((T, B), bool),
        values_bootstrapped=rng.normal(size=(T, B)).astype(np.float32),
    )
    batch["terminateds"][2, 0] = True  # termination mid-fragment
    batch["truncateds"][3, 1] = True  # time-limit truncation mid-fragment
    batch["truncateds"][T - 1, 2] = True  # truncation on the last step
    batch["values_bootstrapped"][2, 0] = 0.0
    return batch


def _numpy_loss(b, vf_coeff, ent_coeff, mask=None):
    term = b["terminateds"].astype(np.float32)
    trunc = b["truncateds"].astype(np.float32)
    discounts = GAMMA * (1 - np.maximum(term, trunc))
    rewards = b["rewards"] + GAMMA * trunc * b["values_bootstrapped"]
    vs, pg = _numpy_vtrace(
        b["target_log_probs"] - b["behaviour_log_probs"],
        discounts,
        rewards,
        b["values"],
        b["values_bootstrapped"][-1],
    )
    m = np.ones((T, B), np.float32) if mask is None else mask.astype(np.float32)
    pi = -np.sum(m * b["target_log_probs"] * pg)
    vf = 0.5 * np.sum(m * (b["values"] - vs) ** 2)
    ent = np.sum(m * b["entropy"])
    return pi + vf_coeff * vf - ent_coeff * ent, pi, vf, ent, vs


def test_loss_matches_numpy_with_termination_and_truncation():
    b = _batch()
    out = losses.vtrace_loss(**b, gamma=GAMMA, vf_loss_coeff=0.5, entropy_coeff=0.01)
    total, pi, vf, ent, vs = _numpy_loss(b, 0.5, 0.01)
    np.testing.assert_allclose(out.total_loss.numpy(), total, rtol=1e-5)
    np.testing.assert_allclose(out.sums.pi_loss.numpy(), pi, rtol=1e-5)
    np.testing.assert_allclose(out.sums.vf_loss.numpy(), vf, rtol=1e-5)
    np.testing.assert_allclose(out.sums.entropy.numpy(), ent, rtol=1e-5)
    np.testing.assert_allclose(out.vs.numpy(), vs, rtol=1e-5, atol=1e-6)


def test_truncation_bootstraps_and_termination_does_not():
    b = _batch()
    out = losses.vtrace_loss(**b, gamma=GAMMA)
    vs = out.vs.numpy()
    rhos = np.exp(b["target_log_probs"] - b["behaviour_log_probs"])
    rho = np.minimum(1.0, rhos)
    # Termination at (2, 0): the target is r + 0 (no bootstrap, no trace from step 3).
    expected_term = b["values"][2, 0] + rho[2, 0] * (b["rewards"][2, 0] - b["values"][2, 0])
    np.testing.assert_allclose(vs[2, 0], expected_term, rtol=1e-5)
    # Truncation at (3, 1): r + gamma * V(final obs), and nothing from the next episode.
    target = b["rewards"][3, 1] + GAMMA * b["values_bootstrapped"][3, 1]
    expected_trunc = b["values"][3, 1] + rho[3, 1] * (target - b["values"][3, 1])
    np.testing.assert_allclose(vs[3, 1], expected_trunc, rtol=1e-5)
    # Changing the next episode's values must not move the truncated step's target.
    b2 = dict(b)
    b2["values"] = b["values"].copy()
    b2["values"][4:, 1] += 10.0
    vs2 = losses.vtrace_loss(**b2, gamma=GAMMA).vs.numpy()
    np.testing.assert_allclose(vs2[:4, 1], vs[:4, 1], rtol=1e-6)


def test_mask_excludes_steps_from_sums_and_means():
    b = _batch()
    mask = np.ones((T, B), bool)
    mask[4:, 0] = False
    out = losses.vtrace_loss(**b, mask=mask, gamma=GAMMA, vf_loss_coeff=0.5, entropy_coeff=0.01)
    total, *_ = _numpy_loss(b, 0.5, 0.01, mask=mask)
    np.testing.assert_allclose(out.total_loss.numpy(), total, rtol=1e-5)
    assert out.sums.num_valid.numpy() == mask.sum()


def test_drop_last_ts_trains_on_t_minus_one_steps_bootstrapping_from_values():
    b = _batch()
    out = losses.vtrace_loss(**b, gamma=GAMMA, drop_last_ts=True)
    assert out.vs.shape == (T - 1, B)
    assert out.sums.num_valid.numpy() == (T - 1) * B
    term = b["terminateds"][:-1].astype(np.float32)
    trunc = b["truncateds"][:-1].astype(np.float32)
    vs, _ = _numpy_vtrace(
        (b["target_log_probs"] - b["behaviour_log_probs"])[:-1],
        GAMMA * (1 - np.maximum(term, trunc)),
        b["rewards"][:-1] + GAMMA * trunc * b["values_bootstrapped"][:-1],
        b["values"][:-1],
        b["values"][-1],
    )
    np.testing.assert_allclose(out.vs.numpy(), vs, rtol=1e-5, atol=1e-6)


def test_coefficients_weight_the_terms():
    b = _batch()
    base = losses.vtrace_loss(**b, gamma=GAMMA, vf_loss_coeff=0.0, entropy_coeff=0.0)
    more_vf = losses.vtrace_loss(**b, gamma=GAMMA, vf_loss_coeff=2.0, entropy_coeff=0.0)
    more_ent = losses.vtrace_loss(**b, gamma=GAMMA, vf_loss_coeff=0.0, entropy_coeff=0.5)
    np.testing.assert_allclose(
        more_vf.total_loss - base.total_loss, 2.0 * base.sums.vf_loss, rtol=1e-5
    )
    np.testing.assert_allclose(
        base.total_loss - more_ent.total_loss, 0.5 * base.sums.entropy, rtol=1e-5
    )


def test_gradients_flow_to_policy_and_values_but_not_through_targets():
    b = _batch()
    logp = tf.Variable(b["target_log_probs"])
    values = tf.Variable(b["values"])
    with tf.GradientTape() as tape:
        args = dict(b, target_log_probs=logp, values=values)
        out = losses.vtrace_loss(**args, gamma=GAMMA)
    g_logp, g_values = tape.gradient(out.sums.vf_loss, [logp, values])
    # The value loss depends on the values only through (V - vs), vs being a constant.
    assert g_logp is None or np.allclose(g_logp.numpy(), 0.0)
    vs = out.vs.numpy()
    np.testing.assert_allclose(g_values.numpy(), b["values"] - vs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("var_ratio", [0.0, 0.5])
def test_explained_variance(var_ratio):
    rng = np.random.default_rng(3)
    vs = rng.normal(size=1000).astype(np.float32)
    noise = np.sqrt(var_ratio) * np.std(vs) * rng.normal(size=1000)
    err = (-noise).astype(np.float32)
    sums = losses.LossSums(
        pi_loss=0.0,
        vf_loss=0.0,
        entropy=0.0,
        num_valid=tf.constant(1000.0),
        vs=tf.constant(vs.sum()),
        vs_sq=tf.constant((vs**2).sum()),
        err=tf.constant(err.sum()),
        err_sq=tf.constant((err**2).sum()),
    )
    expected = max(-1.0, 1 - np.var(err) / np.var(vs))
    np.testing.assert_allclose(losses.explained_variance(sums).numpy(), expected, atol=1e-3)


@pytest.mark.parametrize("rho_bar, pg_rho_bar", [(1.0, 1.0), (2.0, 0.5), (None, None)])
def test_diagnostic_sums_match_numpy(rho_bar, pg_rho_bar):
    b = _batch(seed=5)
    # Ratios above 1, between the two thresholds and above 2, and masked steps.
    b["target_log_probs"][0] = b["behaviour_log_probs"][0] + np.log([0.5, 1.5, 3.0])
    mask = np.ones((T, B), bool)
    mask[5, 2] = False
    out = losses.vtrace_loss(
        **b, mask=mask, gamma=GAMMA, clip_rho_threshold=rho_bar, clip_pg_rho_threshold=pg_rho_bar
    )
    term = b["terminateds"].astype(np.float32)
    trunc = b["truncateds"].astype(np.float32)
    log_rhos = b["target_log_probs"] - b["behaviour_log_probs"]
    _, pg = _numpy_vtrace(
        log_rhos,
        GAMMA * (1 - np.maximum(term, trunc)),
        b["rewards"] + GAMMA * trunc * b["values_bootstrapped"],
        b["values"],
        b["values_bootstrapped"][-1],
        rho_bar=np.inf if rho_bar is None else rho_bar,
        pg_rho_bar=np.inf if pg_rho_bar is None else pg_rho_bar,
    )
    m = mask.astype(np.float32)
    rhos = np.exp(log_rhos)
    sums = out.sums
    np.testing.assert_allclose(sums.rho.numpy(), np.sum(m * rhos), rtol=1e-5)
    expected_clipped = 0 if rho_bar is None else np.sum(m * (rhos > rho_bar))
    assert sums.rho_clipped.numpy() == expected_clipped
    expected_pg = 0 if pg_rho_bar is None else np.sum(m * (rhos > pg_rho_bar))
    assert sums.pg_rho_clipped.numpy() == expected_pg
    np.testing.assert_allclose(sums.pg_adv.numpy(), np.sum(m * pg), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(sums.pg_adv_sq.numpy(), np.sum(m * pg**2), rtol=1e-4)
