"""Tests for impala_tf.learning.vtrace against a slow numpy ground truth written from the IMPALA
paper.

Shapes are time-major: T is time, B is batch. Every numeric test runs eagerly, inside
`tf.function` with unknown T and B, and under `tf.function(jit_compile=True)`.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from impala_tf.learning import recursion, vtrace

MODES = ["eager", "function", "xla"]
RHO_BAR = 2.0
PG_RHO_BAR = 1.5


def _paper_vtrace(log_rhos, discounts, rewards, values, bootstrap_value, rho_bar, pg_rho_bar):
    """V-trace by the paper's definition (eq. 1), with per-step discounts, in float64 loops.

    v_s = V(x_s) + sum_{t>=s} (prod_{i=s}^{t-1} gamma_i c_i) delta_t V, where
    delta_t V = min(rho-bar, rho_t) (r_t + gamma_t V(x_{t+1}) - V(x_t)) and c_i = min(1, rho_i).
    """
    log_rhos, discounts, rewards, values, bootstrap_value = (
        np.asarray(x, np.float64) for x in (log_rhos, discounts, rewards, values, bootstrap_value)
    )
    num_steps = len(values)
    rhos = np.exp(log_rhos)
    clipped_rhos = rhos if rho_bar is None else np.minimum(rho_bar, rhos)
    cs = np.minimum(1.0, rhos)
    next_values = np.concatenate([values[1:], bootstrap_value[None]])
    deltas = clipped_rhos * (rewards + discounts * next_values - values)
    vs = np.zeros_like(values)
    for s in range(num_steps):
        total = np.zeros_like(values[s])
        for t in range(s, num_steps):
            trace = np.ones_like(values[s])
            for i in range(s, t):
                trace = trace * discounts[i] * cs[i]
            total = total + trace * deltas[t]
        vs[s] = values[s] + total
    next_vs = np.concatenate([vs[1:], bootstrap_value[None]])
    pg_rhos = rhos if pg_rho_bar is None else np.minimum(pg_rho_bar, rhos)
    pg_advantages = pg_rhos * (rewards + discounts * next_vs - values)
    return vs, pg_advantages


def _make_inputs(num_steps=9, batch=6, trailing=(), seed=0):
    """Inputs whose rhos fall in every clipping region, with zero discounts mid-trace.

    The last batch column never decays (gamma_t = 1, c_t = 1), so that every term of a long trace
    matters; the first has a zero discount in the middle of the trace.
    """
    rng = np.random.default_rng(seed)
    shape = (num_steps, batch, *trailing)
    # Three regions: rho < 1, 1 < rho < rho-bar (straddling pg rho-bar), rho > rho-bar.
    lows = np.array([0.2, 1.1, 2.5])
    highs = np.array([0.9, 1.9, 5.0])
    region = rng.integers(0, 3, size=shape)
    region[:, -1] = rng.integers(1, 3, size=region[:, -1].shape)
    rhos = rng.uniform(lows[region], highs[region])
    discounts = np.full(shape, 0.9)
    discounts[rng.random(shape) < 0.15] = 0.0
    discounts[num_steps // 2, 0] = 0.0
    discounts[:, -1] = 1.0
    return dict(
        log_rhos=np.log(rhos).astype(np.float32),
        discounts=discounts.astype(np.float32),
        rewards=rng.normal(size=shape).astype(np.float32),
        values=rng.normal(size=shape).astype(np.float32),
        bootstrap_value=rng.normal(size=shape[1:]).astype(np.float32),
    )


_COMPILED = {}


def _run(fn, mode, *args, **constants):
    """Calls fn(*args, **constants) eagerly, in a shape-generic tf.function, or under XLA."""
    tensors = [tf.convert_to_tensor(a) for a in args]
    if mode == "eager":
        out = fn(*tensors, **constants)
    else:
        signature = tuple(tf.TensorSpec([None] * t.shape.rank, t.dtype) for t in tensors)
        key = (fn, mode, signature, tuple(sorted(constants.items())))
        if key not in _COMPILED:  # One trace per signature; XLA still compiles per shape.
            _COMPILED[key] = tf.function(
                lambda *xs: fn(*xs, **constants),
                input_signature=signature,
                jit_compile=mode == "xla",
            )
        out = _COMPILED[key](*tensors)
    return tf.nest.map_structure(lambda x: x.numpy(), out)


def _log_softmax(logits):
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _gather_last(x, index):
    return np.take_along_axis(x, index[..., None], axis=-1)[..., 0]


def test_inputs_reach_every_branch():
    inputs = _make_inputs()
    rhos = np.exp(inputs["log_rhos"])
    assert (rhos < 1.0).any()
    assert ((rhos > 1.0) & (rhos < PG_RHO_BAR)).any()
    assert ((rhos > PG_RHO_BAR) & (rhos < RHO_BAR)).any()
    assert (rhos > RHO_BAR).any()
    mid_trace = inputs["discounts"][1:-1]
    assert (mid_trace == 0.0).any() and (mid_trace > 0.0).any()
    assert (inputs["discounts"][:, -1] == 1.0).all() and (rhos[:, -1] > 1.0).all()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "rho_bar, pg_rho_bar", [(RHO_BAR, PG_RHO_BAR), (1.0, 1.0), (None, None), (None, 1.0)]
)
def test_from_importance_weights_matches_paper(mode, rho_bar, pg_rho_bar):
    inputs = _make_inputs()
    expected_vs, expected_pg = _paper_vtrace(**inputs, rho_bar=rho_bar, pg_rho_bar=pg_rho_bar)
    vs, pg_advantages = _run(
        vtrace.from_importance_weights,
        mode,
        *inputs.values(),
        clip_rho_threshold=rho_bar,
        clip_pg_rho_threshold=pg_rho_bar,
    )
    np.testing.assert_allclose(vs, expected_vs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(pg_advantages, expected_pg, rtol=1e-5, atol=1e-5)
    # Clipping changes the answer, so the threshold arguments are really used.
    unclipped_vs, _ = _paper_vtrace(**inputs, rho_bar=None, pg_rho_bar=None)
    assert (rho_bar is None) == np.allclose(vs, unclipped_vs, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_steps", [1, 7, 64, 100])
def test_matches_rllib_scan_baseline(mode, num_steps):
    inputs = _make_inputs(num_steps=num_steps, batch=5, seed=num_steps)
    ours = _run(vtrace.from_importance_weights, mode, *inputs.values())
    baseline = _run(vtrace.scan_vtrace_baseline, mode, *inputs.values())
    np.testing.assert_allclose(ours.vs, baseline.vs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ours.pg_advantages, baseline.pg_advantages, rtol=1e-5, atol=1e-5)
    if num_steps <= 7:
        expected_vs, _ = _paper_vtrace(**inputs, rho_bar=1.0, pg_rho_bar=1.0)
        np.testing.assert_allclose(ours.vs, expected_vs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_trailing_dims(mode):
    inputs = _make_inputs(num_steps=6, batch=4, trailing=(3,))
    expected_vs, expected_pg = _paper_vtrace(**inputs, rho_bar=RHO_BAR, pg_rho_bar=PG_RHO_BAR)
    vs, pg_advantages = _run(
        vtrace.from_importance_weights,
        mode,
        *inputs.values(),
        clip_rho_threshold=RHO_BAR,
        clip_pg_rho_threshold=PG_RHO_BAR,
    )
    assert vs.shape == (6, 4, 3)
    np.testing.assert_allclose(vs, expected_vs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(pg_advantages, expected_pg, rtol=1e-5, atol=1e-5)


def test_float64_tensors_stay_float64():
    inputs = {k: tf.constant(v, tf.float64) for k, v in _make_inputs().items()}
    vs, pg_advantages = vtrace.from_importance_weights(**inputs)
    assert vs.dtype == tf.float64 and pg_advantages.dtype == tf.float64
    expected_vs, expected_pg = _paper_vtrace(
        **{k: v.numpy() for k, v in inputs.items()}, rho_bar=1.0, pg_rho_bar=1.0
    )
    np.testing.assert_allclose(vs.numpy(), expected_vs, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(pg_advantages.numpy(), expected_pg, rtol=1e-12, atol=1e-12)


def test_numpy_inputs_compute_in_float32():
    inputs = {k: v.astype(np.float64) for k, v in _make_inputs().items()}
    assert vtrace.from_importance_weights(**inputs).vs.dtype == tf.float32


@pytest.mark.parametrize("mode", MODES)
def test_zero_discount_splits_trace(mode):
    """V-trace over a trace cut by a zero discount equals V-trace over the two pieces.

    The first piece ends with discount 0, so its bootstrap value (values[cut + 1] in the whole
    trace, or anything else) has no effect.
    """
    inputs = _make_inputs(num_steps=10, batch=5, seed=3)
    cut = 4
    inputs["discounts"][cut] = 0.0
    clip = dict(clip_rho_threshold=RHO_BAR, clip_pg_rho_threshold=PG_RHO_BAR)
    whole = _run(vtrace.from_importance_weights, mode, *inputs.values(), **clip)
    per_step = ("log_rhos", "discounts", "rewards", "values")
    first = [inputs[k][: cut + 1] for k in per_step]
    second = [inputs[k][cut + 1 :] for k in per_step]
    tail = _run(vtrace.from_importance_weights, mode, *second, inputs["bootstrap_value"], **clip)
    for first_bootstrap in (inputs["values"][cut + 1], np.full((5,), 123.0, np.float32)):
        head = _run(vtrace.from_importance_weights, mode, *first, first_bootstrap, **clip)
        np.testing.assert_allclose(
            whole.vs, np.concatenate([head.vs, tail.vs]), rtol=1e-5, atol=1e-5
        )
        np.testing.assert_allclose(
            whole.pg_advantages,
            np.concatenate([head.pg_advantages, tail.pg_advantages]),
            rtol=1e-5,
            atol=1e-5,
        )


def test_no_gradient_through_targets():
    inputs = {k: tf.Variable(v) for k, v in _make_inputs().items()}
    with tf.GradientTape(persistent=True) as tape:
        returns = vtrace.from_importance_weights(**inputs)
        loss = tf.reduce_sum(returns.vs) + tf.reduce_sum(returns.pg_advantages)
        # A live path from the inputs, so a None below is not a disconnected tape.
        control = tf.reduce_sum(inputs["values"] * inputs["log_rhos"])
    gradients = tape.gradient(loss, list(inputs.values()))
    assert all(g is None for g in gradients)
    assert tape.gradient(control, inputs["values"]) is not None


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(log_rhos=np.zeros([5], np.float32)), "log_rhos must have a known rank >= 2"),
        (dict(values=np.zeros([5, 4, 1], np.float32)), r"values: Shape \(5, 4, 1\) must"),
        (dict(discounts=np.zeros([5], np.float32)), "discounts: Shape .* must have rank 2"),
        (dict(rewards=np.zeros([5, 4, 2], np.float32)), "rewards: Shape .* must have rank 2"),
        (dict(bootstrap_value=np.zeros([5, 4], np.float32)), "bootstrap_value: .* rank 1"),
        (dict(values=np.zeros([6, 4], np.float32)), "values shape"),
        (dict(bootstrap_value=np.zeros([3], np.float32)), "bootstrap_value shape"),
        (dict(clip_rho_threshold=np.ones([2], np.float32)), "clip_rho_threshold must be a scalar"),
        (dict(clip_pg_rho_threshold=[1.0]), "clip_pg_rho_threshold must be a scalar"),
    ],
)
def test_inconsistent_inputs_raise(change, message):
    inputs = _make_inputs(num_steps=5, batch=4)
    inputs.update(change)
    with pytest.raises(ValueError, match=message):
        vtrace.from_importance_weights(**inputs)


def test_rank_error_raised_while_tracing():
    signature = [tf.TensorSpec([None, None])] * 4 + [tf.TensorSpec([None, None])]
    traced = tf.function(vtrace.from_importance_weights, input_signature=signature)
    with pytest.raises(ValueError, match="bootstrap_value: .* must have rank 1"):
        traced.get_concrete_function()


@pytest.mark.parametrize("leading", [(), (5,), (5, 4), (5, 4, 2)])
def test_log_probs_from_logits_and_actions(leading):
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(*leading, 3, 7)).astype(np.float32)
    actions = rng.integers(0, 7, size=(*leading, 3))
    log_probs = vtrace.log_probs_from_logits_and_actions(logits, actions).numpy()
    assert log_probs.shape == actions.shape
    np.testing.assert_allclose(log_probs, _gather_last(_log_softmax(logits), actions), atol=1e-5)


def test_log_probs_rank_errors():
    with pytest.raises(ValueError, match="actions one rank less"):
        vtrace.log_probs_from_logits_and_actions(np.zeros([5, 4, 3]), np.zeros([5, 4, 1], int))
    with pytest.raises(ValueError, match="rank >= 2"):
        vtrace.log_probs_from_logits_and_actions(np.zeros([3]), np.zeros([], int))
    with pytest.raises(ValueError, match="equal length"):
        vtrace.multi_log_probs_from_logits_and_actions([np.zeros([5, 4, 3])], [])


def _logits_inputs(num_components, seed=0, num_steps=7, batch=5):
    rng = np.random.default_rng(seed)
    sizes = [4, 3, 6][:num_components]
    inputs = _make_inputs(num_steps=num_steps, batch=batch, seed=seed)
    del inputs["log_rhos"]
    behaviour = [rng.normal(size=(num_steps, batch, n)).astype(np.float32) for n in sizes]
    target = [rng.normal(scale=2.0, size=(num_steps, batch, n)).astype(np.float32) for n in sizes]
    actions = [rng.integers(0, n, size=(num_steps, batch)).astype(np.int32) for n in sizes]
    return behaviour, target, actions, inputs


@pytest.mark.parametrize("mode", MODES)
def test_from_logits_matches_from_importance_weights(mode):
    (behaviour,), (target,), (actions,), inputs = _logits_inputs(1)
    returns = _run(
        vtrace.from_logits,
        mode,
        behaviour,
        target,
        actions,
        *inputs.values(),
        clip_rho_threshold=RHO_BAR,
        clip_pg_rho_threshold=PG_RHO_BAR,
    )
    target_log_probs = _gather_last(_log_softmax(target), actions)
    behaviour_log_probs = _gather_last(_log_softmax(behaviour), actions)
    log_rhos = target_log_probs - behaviour_log_probs
    np.testing.assert_allclose(returns.target_action_log_probs, target_log_probs, atol=1e-5)
    np.testing.assert_allclose(returns.behaviour_action_log_probs, behaviour_log_probs, atol=1e-5)
    np.testing.assert_allclose(returns.log_rhos, log_rhos, atol=1e-5)
    expected_vs, expected_pg = _paper_vtrace(
        log_rhos, **inputs, rho_bar=RHO_BAR, pg_rho_bar=PG_RHO_BAR
    )
    np.testing.assert_allclose(returns.vs, expected_vs, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(returns.pg_advantages, expected_pg, rtol=1e-4, atol=1e-4)


def test_multi_from_logits_sums_component_log_rhos():
    behaviour, target, actions, inputs = _logits_inputs(2, seed=4)
    returns = vtrace.multi_from_logits(behaviour, target, actions, **inputs)
    component_log_rhos = [
        _gather_last(_log_softmax(t), a) - _gather_last(_log_softmax(b), a)
        for b, t, a in zip(behaviour, target, actions, strict=True)
    ]
    log_rhos = sum(component_log_rhos)
    np.testing.assert_allclose(returns.log_rhos.numpy(), log_rhos, atol=1e-5)
    assert len(returns.target_action_log_probs) == 2
    assert len(returns.behaviour_action_log_probs) == 2
    single = vtrace.from_importance_weights(log_rhos.astype(np.float32), **inputs)
    np.testing.assert_allclose(returns.vs.numpy(), single.vs.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        returns.pg_advantages.numpy(), single.pg_advantages.numpy(), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("num_components", [1, 2])
def test_multi_from_logits_uses_given_behaviour_log_probs(num_components):
    behaviour, target, actions, inputs = _logits_inputs(num_components, seed=5)
    # NaN logits would poison the result if the behaviour log-probs were recomputed from them.
    behaviour = [np.full_like(b, np.nan) for b in behaviour]
    given = np.random.default_rng(6).normal(size=actions[0].shape).astype(np.float32)
    returns = vtrace.multi_from_logits(
        behaviour, target, actions, **inputs, behaviour_action_log_probs=given
    )
    target_log_probs = sum(
        _gather_last(_log_softmax(t), a) for t, a in zip(target, actions, strict=True)
    )
    np.testing.assert_allclose(returns.log_rhos.numpy(), target_log_probs - given, atol=1e-5)
    np.testing.assert_allclose(returns.behaviour_action_log_probs[0].numpy(), given)
    assert np.isfinite(returns.vs.numpy()).all()


def test_multi_from_logits_rejects_mismatched_components():
    behaviour, target, actions, inputs = _logits_inputs(2)
    with pytest.raises(ValueError, match="one entry per action component"):
        vtrace.multi_from_logits(behaviour[:1], target, actions, **inputs)


def test_xla_context_detection():
    """The XLA-specific recursion must be picked under jit_compile and only there."""
    probe = lambda: tf.constant(recursion.in_xla_context())  # noqa: E731
    assert not recursion.in_xla_context()
    assert not tf.function(probe)().numpy()
    assert tf.function(probe, jit_compile=True)().numpy()
