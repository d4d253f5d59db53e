"""Tests for impala_tf.models.distributions against numpy references."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import tensorflow as tf

from impala_tf.models import distributions as D

RNG = np.random.default_rng(0)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _cat_entropy(logits: np.ndarray) -> np.ndarray:
    logp = _log_softmax(logits)
    return -(np.exp(logp) * logp).sum(-1)


def _gather(logp: np.ndarray, actions: np.ndarray) -> np.ndarray:
    return np.take_along_axis(logp, actions[..., None], axis=-1)[..., 0]


# ---------------------------------------------------------------------------------- helpers


def test_logits_size_dtype_and_shape():
    box = gym.spaces.Box(-1.0, 1.0, (2, 3), np.float64)
    cases = [
        (gym.spaces.Discrete(5), 5, np.int64, ()),
        (gym.spaces.MultiDiscrete([3, 4, 2]), 9, np.int64, (3,)),
        (box, 12, np.float32, (2, 3)),
        (gym.spaces.Box(-1.0, 1.0, (), np.float32), 2, np.float32, ()),
    ]
    for space, size, dtype, shape in cases:
        assert D.logits_size(space) == size
        assert D.action_dtype(space) == np.dtype(dtype)
        assert D.action_shape(space) == shape


@pytest.mark.parametrize(
    "space",
    [
        gym.spaces.Dict({"a": gym.spaces.Discrete(2)}),
        gym.spaces.Tuple((gym.spaces.Discrete(2), gym.spaces.Discrete(3))),
        gym.spaces.MultiBinary(3),
        gym.spaces.MultiDiscrete([[2, 3], [4, 5]]),
    ],
)
def test_unsupported_spaces_raise_naming_the_space(space):
    for fn in (D.logits_size, D.action_dtype, D.action_shape):
        with pytest.raises(ValueError, match="Unsupported action space"):
            fn(space)
    with pytest.raises(ValueError, match=type(space).__name__):
        D.make_distribution(space, tf.zeros([2, 4]))


# ----------------------------------------------------------------------------- categorical


def test_categorical_log_prob_entropy_mode_vs_numpy():
    space = gym.spaces.Discrete(4)
    logits = RNG.normal(size=(3, 5, 4)).astype(np.float32) * 2
    actions = RNG.integers(0, 4, size=(3, 5))
    dist = D.make_distribution(space, logits)
    np.testing.assert_allclose(
        dist.log_prob(actions), _gather(_log_softmax(logits), actions), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(dist.entropy(), _cat_entropy(logits), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(dist.mode(), logits.argmax(-1))
    sample = dist.sample(seed=1)
    assert sample.dtype == tf.int64 and sample.shape == (3, 5)
    # int32 actions are accepted too (the env or a test may give them).
    np.testing.assert_allclose(dist.log_prob(actions.astype(np.int32)), dist.log_prob(actions))


def test_categorical_under_xla_and_unknown_shapes():
    space = gym.spaces.Discrete(3)

    def fn(logits, actions):
        dist = D.make_distribution(space, logits)
        return dist.log_prob(actions), dist.entropy()

    logits = RNG.normal(size=(4, 6, 3)).astype(np.float32)
    actions = RNG.integers(0, 3, size=(4, 6))
    expected = (_gather(_log_softmax(logits), actions), _cat_entropy(logits))
    sig = [tf.TensorSpec([None, None, 3], tf.float32), tf.TensorSpec([None, None], tf.int64)]
    for compiled in (
        tf.function(fn, jit_compile=True),
        tf.function(fn, input_signature=sig),
    ):
        logp, ent = compiled(tf.constant(logits), tf.constant(actions))
        np.testing.assert_allclose(logp, expected[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ent, expected[1], rtol=1e-5, atol=1e-6)


# -------------------------------------------------------------------------- multi-discrete


def test_multi_discrete_sums_components():
    space = gym.spaces.MultiDiscrete([3, 2, 4])
    logits = RNG.normal(size=(2, 5, 9)).astype(np.float32)
    actions = np.stack([RNG.integers(0, n, size=(2, 5)) for n in (3, 2, 4)], axis=-1)  # [T, B, 3]
    parts = np.split(logits, [3, 5], axis=-1)
    expected_logp = sum(_gather(_log_softmax(p), actions[..., i]) for i, p in enumerate(parts))
    expected_ent = sum(_cat_entropy(p) for p in parts)
    dist = D.make_distribution(space, logits)
    np.testing.assert_allclose(dist.log_prob(actions), expected_logp, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dist.entropy(), expected_ent, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(dist.mode(), np.stack([p.argmax(-1) for p in parts], -1))

    # A stateless (tensor pair) seed is split per component and gives reproducible draws.
    sample = dist.sample(seed=tf.constant([3, 4]))
    assert sample.dtype == tf.int64 and sample.shape == (2, 5, 3)
    assert np.all(sample.numpy() >= 0) and np.all(sample.numpy() < np.array([3, 2, 4]))
    np.testing.assert_array_equal(sample, dist.sample(seed=tf.constant([3, 4])))
    assert dist.sample().shape == (2, 5, 3)

    # Each component's draws follow its own softmax.
    wide = D.make_distribution(space, np.tile(logits[0, :1], (20000, 1)))
    draws = wide.sample(seed=tf.constant([5, 6])).numpy()
    for i, p in enumerate(parts):
        freq = np.bincount(draws[:, i], minlength=p.shape[-1]) / len(draws)
        np.testing.assert_allclose(freq, np.exp(_log_softmax(p[0, 0])), atol=0.02)


def test_multi_discrete_under_xla_and_mirrored_strategy():
    space = gym.spaces.MultiDiscrete([2, 3])
    logits = RNG.normal(size=(4, 5)).astype(np.float32)
    actions = np.stack([RNG.integers(0, 2, 4), RNG.integers(0, 3, 4)], -1)
    expected = D.make_distribution(space, logits).log_prob(actions).numpy()

    def fn(lg, a):
        return D.make_distribution(space, lg).log_prob(a)

    np.testing.assert_allclose(
        tf.function(fn, jit_compile=True)(logits, actions), expected, rtol=1e-5
    )
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    per_replica = strategy.run(tf.function(fn), args=(tf.constant(logits), tf.constant(actions)))
    for value in strategy.experimental_local_results(per_replica):
        np.testing.assert_allclose(value, expected, rtol=1e-5)


def test_split_logits():
    logits = tf.reshape(tf.range(2 * 3 * 7, dtype=tf.float32), [2, 3, 7])
    parts = D.split_logits(gym.spaces.MultiDiscrete([3, 4]), logits)
    assert [p.shape for p in parts] == [(2, 3, 3), (2, 3, 4)]
    np.testing.assert_array_equal(tf.concat(parts, -1), logits)
    (single,) = D.split_logits(gym.spaces.Discrete(7), logits)
    np.testing.assert_array_equal(single, logits)
    with pytest.raises(ValueError, match="Discrete or MultiDiscrete"):
        D.split_logits(gym.spaces.Box(-1, 1, (2,)), tf.zeros([3, 4]))


# ------------------------------------------------------------------------------- gaussian


def test_diag_gaussian_vs_numpy_formula():
    space = gym.spaces.Box(-1.0, 1.0, (2, 3), np.float32)
    logits = RNG.normal(size=(4, 5, 12)).astype(np.float32)
    actions = RNG.normal(size=(4, 5, 2, 3)).astype(np.float32)
    mean = logits[..., :6].reshape(4, 5, 2, 3)
    log_std = logits[..., 6:].reshape(4, 5, 2, 3)
    std = np.exp(log_std)
    logp = -0.5 * ((actions - mean) / std) ** 2 - log_std - 0.5 * np.log(2 * np.pi)
    ent = 0.5 + 0.5 * np.log(2 * np.pi) + log_std

    dist = D.make_distribution(space, logits)
    np.testing.assert_allclose(dist.log_prob(actions), logp.sum((-2, -1)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dist.entropy(), ent.sum((-2, -1)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dist.mode(), mean, rtol=1e-6)
    assert dist.sample(seed=2).shape == (4, 5, 2, 3)

    compiled = tf.function(lambda lg, a: D.make_distribution(space, lg).log_prob(a))
    np.testing.assert_allclose(
        compiled(tf.constant(logits[0]), tf.constant(actions[0])),
        logp[0].sum((-2, -1)),
        rtol=1e-5,
        atol=1e-5,
    )
