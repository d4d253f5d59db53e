"""Tests for impala_tf.models: torsos, shapes, the LSTM unroll, resets and variable partitions."""

from __future__ import annotations

import gymnasium as gym
import keras
import numpy as np
import pytest
import tensorflow as tf

from impala_tf.models import (
    ConvStack,
    CoveringConv2D,
    ImpalaResNet,
    NatureCNN,
    NormcInitializer,
    ObservationPreprocessor,
    build_model,
    get_filter_config,
)

RNG = np.random.default_rng(0)
CARTPOLE_OBS = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
ATARI_OBS = gym.spaces.Box(0, 255, (84, 84, 4), np.uint8)
SMALL_MLP = {"fcnet_hiddens": [16, 16]}


def _obs(space: gym.Space, lead: tuple[int, ...]) -> np.ndarray:
    return np.stack([space.sample() for _ in range(int(np.prod(lead)))]).reshape(
        *lead, *space.shape
    )


def _check_shapes(model, obs_space, num_outputs, t=3, b=2):
    obs = _obs(obs_space, (t, b))
    state = model.initial_state(b)
    logits, values, final = model.unroll(obs, np.zeros((t, b), bool), state)
    assert logits.shape == (t, b, num_outputs) and logits.dtype == tf.float32
    assert values.shape == (t, b) and values.dtype == tf.float32
    logits1, values1, new_state = model.step(obs[0], state)
    assert logits1.shape == (b, num_outputs) and values1.shape == (b,)
    call_logits, call_values = model(obs[0])
    assert call_logits.shape == (b, num_outputs) and call_values.shape == (b,)
    # The first unrolled step equals one step from the same state.
    np.testing.assert_allclose(logits[0], logits1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(values[0], values1, rtol=1e-5, atol=1e-6)
    return final, new_state


def _assert_partition(model, expected_value_vars):
    policy = {id(v) for v in model.policy_variables}
    value = {id(v) for v in model.value_variables}
    every = {id(v) for v in model.trainable_variables}
    assert policy.isdisjoint(value)
    assert policy | value == every
    assert len(model.value_variables) == expected_value_vars
    assert len(model.policy_variables) == len(model.trainable_variables) - expected_value_vars


# ------------------------------------------------------------------------ MLP and spaces


def test_cartpole_mlp_defaults():
    model = build_model(CARTPOLE_OBS, gym.spaces.Discrete(2))
    assert model.num_outputs == 2 and not model.is_recurrent
    assert model.initial_state(5) == ()
    assert model.torso.hiddens == [256, 256]
    assert model.value_torso is None  # RLlib's MODEL_DEFAULTS: vf_share_layers=True.
    final, new_state = _check_shapes(model, CARTPOLE_OBS, 2, t=4, b=5)
    assert final == () and new_state == ()
    # Non-recurrent unroll is the per-step forward applied at every t.
    obs = _obs(CARTPOLE_OBS, (4, 5))
    logits, values, _ = model.unroll(obs, np.zeros((4, 5), bool), ())
    for t in range(4):
        step_logits, step_values, _ = model.step(obs[t], ())
        np.testing.assert_allclose(logits[t], step_logits, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(values[t], step_values, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "action_space, num_outputs",
    [
        (gym.spaces.MultiDiscrete([3, 4]), 7),
        (gym.spaces.Box(-1.0, 1.0, (3,), np.float32), 6),
        (gym.spaces.Discrete(5), 5),
    ],
)
def test_action_spaces_set_num_outputs(action_space, num_outputs):
    model = build_model(CARTPOLE_OBS, action_space, SMALL_MLP)
    assert model.num_outputs == num_outputs
    _check_shapes(model, CARTPOLE_OBS, num_outputs)


def test_discrete_obs_is_one_hot():
    space = gym.spaces.Discrete(5)
    model = build_model(
        space, gym.spaces.Discrete(3), {"fcnet_hiddens": [], "vf_share_layers": True}
    )
    obs = np.array([[0, 3], [4, 1]], np.int64)
    logits, values, _ = model.unroll(obs, np.zeros((2, 2), bool), ())
    # With no hidden layers the heads are linear in the one-hot: row k of the kernel plus bias.
    w, bias = (v.numpy() for v in model.logits_head.weights)
    np.testing.assert_allclose(logits, w[obs] + bias, rtol=1e-5, atol=1e-7)
    wv, bv = (v.numpy() for v in model.value_head.weights)
    np.testing.assert_allclose(values, (wv[obs] + bv)[..., 0], rtol=1e-5, atol=1e-7)


def test_preprocessor_per_space():
    onehot = ObservationPreprocessor(gym.spaces.Discrete(3, start=1))(tf.constant([1, 3]))
    np.testing.assert_array_equal(onehot, [[1, 0, 0], [0, 0, 1]])
    multi = ObservationPreprocessor(gym.spaces.MultiDiscrete([2, 3]))(tf.constant([[1, 2]]))
    np.testing.assert_array_equal(multi, [[0, 1, 0, 0, 1]])
    image = np.full((1, 4, 4, 2), 255, np.uint8)
    cast = ObservationPreprocessor(gym.spaces.Box(0, 255, (4, 4, 2), np.uint8))(image)
    assert cast.dtype == tf.float32 and cast.shape == (1, 4, 4, 2)
    np.testing.assert_allclose(cast, 255.0)  # RLlib's VisionNetwork casts without scaling.
    float_image = ObservationPreprocessor(gym.spaces.Box(0, 9, (4, 4, 2), np.float32))
    np.testing.assert_allclose(float_image(np.full((1, 4, 4, 2), 9.0, np.float32)), 9.0)
    flat = ObservationPreprocessor(gym.spaces.Box(0, 1, (2, 3), np.float64))(np.ones((5, 2, 3)))
    assert flat.shape == (5, 6) and flat.dtype == tf.float32
    with pytest.raises(ValueError, match="Dict"):
        ObservationPreprocessor(gym.spaces.Dict({"a": CARTPOLE_OBS}))


def test_mlp_config_keys_change_the_network():
    relu = build_model(CARTPOLE_OBS, gym.spaces.Discrete(2), {"fcnet_hiddens": [8, 6, 4]})
    assert [layer.units for layer in relu.torso.dense_layers] == [8, 6, 4]
    assert relu.logits_head.kernel.shape == (4, 2)
    x = tf.constant(RNG.normal(size=(3, 4)).astype(np.float32) * 10)
    for name, fn in (("tanh", np.tanh), ("relu", lambda z: np.maximum(z, 0.0))):
        model = build_model(
            CARTPOLE_OBS, gym.spaces.Discrete(2), {"fcnet_hiddens": [8], "fcnet_activation": name}
        )
        kernel, bias = (v.numpy() for v in model.torso.dense_layers[0].weights)
        np.testing.assert_allclose(model.torso(x), fn(x.numpy() @ kernel + bias), atol=1e-5)


def test_normc_init_column_norms():
    kernel = NormcInitializer(0.01, seed=3)((50, 7)).numpy()
    np.testing.assert_allclose(np.linalg.norm(kernel, axis=0), 0.01, rtol=1e-5)
    model = build_model(CARTPOLE_OBS, gym.spaces.Discrete(3), SMALL_MLP)
    for head in (model.logits_head, model.value_head):
        np.testing.assert_allclose(np.linalg.norm(head.kernel.numpy(), axis=0), 0.01, rtol=1e-4)
    np.testing.assert_allclose(
        np.linalg.norm(model.torso.dense_layers[0].kernel.numpy(), axis=0), 1.0, rtol=1e-4
    )


# ------------------------------------------------------------------------------- vision


def _count(layer) -> int:
    return sum(int(np.prod(v.shape)) for v in layer.trainable_variables)


def test_nature_cnn_by_name_on_atari_frames():
    model = build_model(ATARI_OBS, gym.spaces.Discrete(6), {"custom_model": "nature_cnn"})
    assert isinstance(model.torso, NatureCNN) and model.value_torso is None
    # conv 8x8x4x32, 4x4x32x64, 3x3x64x64 and a 3136 -> 512 dense, with biases.
    assert _count(model.torso) == 8224 + 32832 + 36928 + 1606144
    _check_shapes(model, ATARI_OBS, 6, t=2, b=2)
    _assert_partition(model, expected_value_vars=2)


def test_impala_resnet_on_atari_frames():
    model = build_model(ATARI_OBS, gym.spaces.Discrete(6), {"custom_model": "impala_resnet"})
    assert isinstance(model.torso, ImpalaResNet)
    # Sections of 16, 32, 32 channels (a conv and two residual blocks of two convs each) on
    # 84 -> 42 -> 21 -> 11 pixels, then an 11*11*32 -> 256 dense.
    sections = (4 * 9 * 16 + 16) + 4 * (16 * 9 * 16 + 16)
    sections += (16 * 9 * 32 + 32) + 4 * (32 * 9 * 32 + 32)
    sections += (32 * 9 * 32 + 32) + 4 * (32 * 9 * 32 + 32)
    assert _count(model.torso) == sections + 11 * 11 * 32 * 256 + 256
    _check_shapes(model, ATARI_OBS, 6, t=2, b=2)
    _assert_partition(model, expected_value_vars=2)


def test_conv_filters_rllib_format_on_42x42():
    obs_space = gym.spaces.Box(0, 255, (42, 42, 4), np.uint8)
    filters = [[8, [4, 4], 2], [16, 4, 2], [32, [11, 11], 1]]
    model = build_model(
        obs_space, gym.spaces.Discrete(3), {"conv_filters": filters, "vf_share_layers": False}
    )
    assert isinstance(model.torso, ConvStack)
    # "same" padding then a "valid" last layer: 42 -> 21 -> 11 -> 1, so 32 features.
    assert model.logits_head.kernel.shape == (32, 3)
    assert [c.padding for c in model.torso.convs] == ["same", "same", "valid"]
    _check_shapes(model, obs_space, 3, t=2, b=2)
    # vf_share_layers=False: a value conv tower of the same filters.
    assert isinstance(model.value_torso, ConvStack)
    _assert_partition(model, expected_value_vars=2 + 6)


@pytest.mark.parametrize("precision", ["float32", "mixed_bfloat16"])
def test_a_conv_covering_its_input_is_a_matmul_with_the_convolutions_results(precision):
    # RLlib's last vision layer on 42x42 or 84x84 frames: 11x11 filters on 11x11 maps, valid.
    x = tf.constant(RNG.uniform(0.0, 50.0, (3, 11, 11, 8)).astype(np.float32))
    policy = keras.mixed_precision.dtype_policy()
    keras.mixed_precision.set_dtype_policy(precision)
    try:
        plain = keras.layers.Conv2D(5, 11, padding="valid", activation="relu")
        covering = CoveringConv2D(5, 11, padding="valid", activation="relu")
        same = CoveringConv2D(5, 11, padding="same")  # Not a 1x1 output: the convolution.
        for layer in (plain, covering, same):
            layer.build(x.shape)
    finally:
        keras.mixed_precision.set_dtype_policy(policy)
    covering.set_weights(plain.get_weights())
    assert [w.shape for w in covering.weights] == [(11, 11, 8, 5), (5,)]

    def forward_backward(layer, inputs):
        with tf.GradientTape() as tape:
            tape.watch(inputs)
            out = layer(inputs)
            loss = tf.reduce_sum(tf.square(tf.cast(out, tf.float32)))
        return out, tape.gradient(loss, [inputs, *layer.trainable_variables])

    (want, want_grads), (got, got_grads) = (
        forward_backward(layer, x) for layer in (plain, covering)
    )
    assert got.shape == want.shape == (3, 1, 1, 5) and got.dtype == want.dtype
    tol = 1e-5 if precision == "float32" else 2e-2
    scale = float(tf.reduce_max(tf.abs(tf.cast(want, tf.float32))))
    np.testing.assert_allclose(got, want, atol=tol * scale, rtol=tol)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, atol=tol * float(tf.reduce_max(tf.abs(w))), rtol=tol)
    # The matmul serves only the covering shape; others (a larger map, "same") convolve.
    assert same(x).shape == (3, 11, 11, 5)
    big = tf.constant(RNG.uniform(0.0, 1.0, (2, 13, 13, 8)).astype(np.float32))
    np.testing.assert_allclose(covering(big), plain(big), rtol=1e-5, atol=1e-5)
    assert covering(big).shape == (2, 3, 3, 5)


def test_rllibs_vision_net_builds_its_last_conv_as_a_covering_conv():
    obs_space = gym.spaces.Box(0, 255, (42, 42, 4), np.uint8)
    model = build_model(obs_space, gym.spaces.Discrete(6), {"dim": 42})
    assert all(isinstance(c, CoveringConv2D) for c in model.torso.convs)
    assert model.torso.convs[-1].kernel.shape == (11, 11, 32, 256)


def test_empty_conv_filters_means_rllibs_default_filters():
    model = build_model(ATARI_OBS, gym.spaces.Discrete(2), {"conv_filters": []})
    assert isinstance(model.torso, ConvStack)
    assert [c.filters for c in model.torso.convs] == [16, 32, 256]


def test_image_too_small_for_torso_raises():
    obs = gym.spaces.Box(0, 255, (16, 16, 1), np.uint8)
    with pytest.raises(ValueError, match="too small"):
        build_model(obs, gym.spaces.Discrete(2), {"custom_model": "nature_cnn"})


# ------------------------------------------------------------- RLlib's vision network


def _conv(k: int, c_in: int, c_out: int) -> int:
    return k * k * c_in * c_out + c_out


@pytest.mark.parametrize(
    "hw, expected",
    [
        ((84, 84), [[16, [8, 8], 4], [32, [4, 4], 2], [256, [11, 11], 1]]),
        ((64, 64), [[32, [4, 4], 2], [64, [4, 4], 2], [128, [4, 4], 2], [256, [4, 4], 2]]),
        ((42, 42), [[16, [4, 4], 2], [32, [4, 4], 2], [256, [11, 11], 1]]),
        ((96, 96), [[16, [8, 8], 4], [32, [4, 4], 2], [256, [11, 11], 2]]),
        ((10, 10), [[16, [5, 5], 2], [32, [5, 5], 2]]),
    ],
)
def test_default_filters_per_image_size_are_rllibs(hw, expected):
    assert get_filter_config((*hw, 4)) == expected
    model = build_model(gym.spaces.Box(0, 255, (*hw, 4), np.uint8), gym.spaces.Discrete(3))
    got = [[c.filters, list(c.kernel_size), c.strides[0]] for c in model.torso.convs]
    assert got == expected


def test_image_size_without_default_filters_names_conv_filters():
    obs = gym.spaces.Box(0, 255, (50, 50, 4), np.uint8)
    with pytest.raises(ValueError, match="conv_filters"):
        build_model(obs, gym.spaces.Discrete(3))
    model = build_model(obs, gym.spaces.Discrete(3), {"conv_filters": [[8, 5, 2], [16, 25, 1]]})
    assert model.logits_head.kernel.shape == (16, 3)


def test_default_84x84_parameter_counts_with_and_without_vf_share_layers():
    # 84 -> 21 (8x8/4 same) -> 11 (4x4/2 same) -> 1 (11x11 valid): 256 features, RLlib's
    # 1x1 logits conv is our 256 -> 6 logits head.
    convs = _conv(8, 4, 16) + _conv(4, 16, 32) + _conv(11, 32, 256)
    assert convs == 4112 + 8224 + 991488
    separate = build_model(ATARI_OBS, gym.spaces.Discrete(6), {"vf_share_layers": False})
    assert _count(separate.torso) == convs and _count(separate.value_torso) == convs
    assert separate.logits_head.kernel.shape == (256, 6)
    assert separate.count_params() == 2 * convs + 256 * 6 + 6 + 256 + 1
    _check_shapes(separate, ATARI_OBS, 6, t=2, b=2)
    shared = build_model(ATARI_OBS, gym.spaces.Discrete(6))  # RLlib's default: shared.
    assert shared.value_torso is None
    assert shared.count_params() == convs + 256 * 6 + 6 + 256 + 1
    _assert_partition(shared, expected_value_vars=2)


def test_default_64x64_filters_flatten_a_3x3_output():
    obs = gym.spaces.Box(0, 255, (64, 64, 3), np.uint8)
    model = build_model(obs, gym.spaces.Discrete(6), {"vf_share_layers": True})
    # 64 -> 32 -> 16 -> 8 (same) -> 3 (4x4/2 valid): RLlib's old stack raises here without
    # post_fcnet_hiddens; we flatten the 3x3x256 output.
    convs = _conv(4, 3, 32) + _conv(4, 32, 64) + _conv(4, 64, 128) + _conv(4, 128, 256)
    assert _count(model.torso) == convs
    assert model.logits_head.kernel.shape == (3 * 3 * 256, 6)


def test_post_fcnet_hiddens_as_rllib_builds_them():
    obs = gym.spaces.Box(0, 255, (42, 42, 4), np.uint8)
    config = {"post_fcnet_hiddens": [128, 64], "vf_share_layers": True}
    model = build_model(obs, gym.spaces.Discrete(6), config)
    convs = _conv(4, 4, 16) + _conv(4, 16, 32) + _conv(11, 32, 256)
    # A 1x1 conv of 128 ("conv_out"), then a 128 -> 64 dense, then the 64 -> 6 logits.
    assert _count(model.torso) == convs + _conv(1, 256, 128) + 128 * 64 + 64
    assert model.logits_head.kernel.shape == (64, 6)
    # The separate value tower ignores post_fcnet_hiddens, as RLlib's.
    separate = build_model(
        obs, gym.spaces.Discrete(6), {"post_fcnet_hiddens": [128, 64], "vf_share_layers": False}
    )
    assert _count(separate.value_torso) == convs
    assert separate.value_head.kernel.shape == (256, 1)
    # Inside the LSTM the first post layer is a dense layer on the flattened convs.
    lstm = build_model(obs, gym.spaces.Discrete(6), {**config, "use_lstm": True})
    assert _count(lstm.torso) == convs + 256 * 128 + 128 + 128 * 64 + 64
    _check_shapes(lstm, obs, 6, t=2, b=2)


def _is_affine(fn, x: np.ndarray) -> bool:
    # f(x) + f(-x) == 2 f(0) holds for affine maps, not for relu ones (relu is homogeneous, so
    # scaling x would not tell them apart).
    zero = fn(np.zeros_like(x)).numpy()
    return np.allclose(fn(x).numpy() + fn(-x).numpy(), 2 * zero, atol=1e-4)


@pytest.mark.parametrize("key", ["conv_activation", "post_fcnet_activation"])
def test_vision_activations_are_honoured(key):
    obs = gym.spaces.Box(-1.0, 1.0, (10, 10, 2), np.float32)
    x = RNG.normal(size=(4, 10, 10, 2)).astype(np.float32)
    base = {"post_fcnet_hiddens": [8, 8], "conv_activation": "linear"}
    linear = build_model(obs, gym.spaces.Discrete(2), {**base, "post_fcnet_activation": "linear"})
    assert _is_affine(linear.torso, x)
    relu = build_model(obs, gym.spaces.Discrete(2), {**base, key: "relu"})
    assert not _is_affine(relu.torso, x)


# ------------------------------------------------------------------------------ compiled


def test_unroll_under_tf_function_with_unknown_time_and_batch():
    model = build_model(CARTPOLE_OBS, gym.spaces.Discrete(2), SMALL_MLP)
    sig = [tf.TensorSpec([None, None, 4], tf.float32), tf.TensorSpec([None, None], tf.bool), ()]
    unroll = tf.function(model.unroll, input_signature=sig)
    xla_unroll = tf.function(model.unroll, jit_compile=True)
    for t, b in ((3, 2), (5, 7)):
        obs = _obs(CARTPOLE_OBS, (t, b))
        resets = np.zeros((t, b), bool)
        eager = model.unroll(obs, resets, ())
        for fn in (unroll, xla_unroll):
            logits, values, _ = fn(tf.constant(obs), tf.constant(resets), ())
            np.testing.assert_allclose(logits, eager[0], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(values, eager[1], rtol=1e-5, atol=1e-6)
    assert unroll.experimental_get_tracing_count() == 1  # One trace serves every T and B.


def test_cnn_unroll_under_tf_function_with_unknown_time_and_batch():
    obs_space = gym.spaces.Box(0, 255, (42, 42, 2), np.uint8)
    model = build_model(
        obs_space, gym.spaces.Discrete(3), {"conv_filters": [[4, 4, 2], [8, 21, 1]]}
    )
    sig = [
        tf.TensorSpec([None, None, 42, 42, 2], tf.uint8),
        tf.TensorSpec([None, None], tf.bool),
        (),
    ]
    unroll = tf.function(model.unroll, input_signature=sig)
    obs = _obs(obs_space, (2, 3))
    logits, values, _ = unroll(obs, np.zeros((2, 3), bool), ())
    eager = model.unroll(obs, np.zeros((2, 3), bool), ())
    np.testing.assert_allclose(logits, eager[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(values, eager[1], rtol=1e-5, atol=1e-6)


def test_mirrored_strategy_builds_and_unrolls():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = build_model(CARTPOLE_OBS, gym.spaces.Discrete(2), {"fcnet_hiddens": [8]})
    obs = tf.constant(_obs(CARTPOLE_OBS, (3, 2)))
    resets = tf.zeros((3, 2), tf.bool)
    result = strategy.run(tf.function(lambda o, r: model.unroll(o, r, ())[0]), args=(obs, resets))
    expected = model.unroll(obs, resets, ())[0]
    for logits in strategy.experimental_local_results(result):
        np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------- LSTM

LSTM_CONFIG = {"fcnet_hiddens": [16], "use_lstm": True, "lstm_cell_size": 8}


def _loop_steps(model, obs, resets, state):
    """The reference: step() T times, zeroing the state rows where resets[t]."""
    logits, values = [], []
    h, c = (s.numpy() for s in state)
    for t in range(obs.shape[0]):
        h, c = h.copy(), c.copy()
        h[resets[t]] = 0.0
        c[resets[t]] = 0.0
        step_logits, step_values, (h, c) = model.step(obs[t], (h, c))
        h, c = h.numpy(), c.numpy()
        logits.append(step_logits)
        values.append(step_values)
    return np.stack(logits), np.stack(values), (h, c)


def test_lstm_initial_state_and_shapes():
    model = build_model(CARTPOLE_OBS, gym.spaces.Discrete(2), LSTM_CONFIG)
    assert model.is_recurrent
    h, c = model.initial_state(3)
    assert h.shape == (3, 8) and c.shape == (3, 8) and h.dtype == tf.float32
    assert not np.any(h) and not np.any(c)
    final, new_state = _check_shapes(model, CARTPOLE_OBS, 2, t=4, b=3)
    assert [s.shape for s in final] == [(3, 8), (3, 8)]
    assert [s.shape for s in new_state] == [(3, 8), (3, 8)]
    # The LSTM is shared: no value tower, only the value head is value-only.
    _assert_partition(model, expected_value_vars=2)


def test_lstm_unroll_equals_looped_steps_with_resets():
    model = build_model(CARTPOLE_OBS, gym.spaces.Discrete(2), LSTM_CONFIG)
    t, b = 6, 3
    obs = _obs(CARTPOLE_OBS, (t, b)).astype(np.float32)
    resets = np.zeros((t, b), bool)
    resets[2, 0] = resets[4, 1] = resets[5, 0] = True
    state = tuple(tf.constant(RNG.normal(size=(b, 8)).astype(np.float32)) for _ in range(2))
    ref_logits, ref_values, ref_state = _loop_steps(model, obs, resets, state)

    sig = [
        tf.TensorSpec([None, None, 4], tf.float32),
        tf.TensorSpec([None, None], tf.bool),
        (tf.TensorSpec([None, 8], tf.float32), tf.TensorSpec([None, 8], tf.float32)),
    ]
    for fn in (
        model.unroll,
        tf.function(model.unroll, input_signature=sig),
        tf.function(model.unroll, jit_compile=True),
    ):
        logits, values, final = fn(tf.constant(obs), tf.constant(resets), state)
        np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(values, ref_values, rtol=1e-5, atol=1e-6)
        for got, want in zip(final, ref_state, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_lstm_reset_cuts_dependence_on_earlier_inputs():
    model = build_model(CARTPOLE_OBS, gym.spaces.Discrete(2), LSTM_CONFIG)
    t, b, cut = 5, 2, 3
    resets = np.zeros((t, b), bool)
    resets[cut, :] = True
    obs_a = _obs(CARTPOLE_OBS, (t, b)).astype(np.float32)
    obs_b = obs_a.copy()
    obs_b[:cut] = _obs(CARTPOLE_OBS, (cut, b))  # Different inputs before the reset only.
    state_b = tuple(tf.ones((b, 8)) for _ in range(2))
    out_a = model.unroll(obs_a, resets, model.initial_state(b))
    out_b = model.unroll(obs_b, resets, state_b)
    assert not np.allclose(out_a[0][:cut], out_b[0][:cut])
    np.testing.assert_allclose(out_a[0][cut:], out_b[0][cut:], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(out_a[1][cut:], out_b[1][cut:], rtol=1e-6, atol=1e-7)
    # Without the reset the later outputs do depend on the earlier inputs.
    no_reset = np.zeros((t, b), bool)
    later_a = model.unroll(obs_a, no_reset, model.initial_state(b))[0][cut:]
    later_b = model.unroll(obs_b, no_reset, state_b)[0][cut:]
    assert not np.allclose(later_a, later_b)


def test_lstm_on_images_with_impala_resnet():
    model = build_model(
        ATARI_OBS,
        gym.spaces.Discrete(4),
        {"custom_model": "impala_resnet", "use_lstm": True, "lstm_cell_size": 16},
    )
    final, _ = _check_shapes(model, ATARI_OBS, 4, t=2, b=2)
    assert [s.shape for s in final] == [(2, 16), (2, 16)]


# ------------------------------------------------------------------------ partition, config


@pytest.mark.parametrize("share, value_vars", [(False, 2 * 2 + 2), (True, 2)])
def test_policy_value_partition_mlp(share, value_vars):
    model = build_model(
        CARTPOLE_OBS, gym.spaces.Discrete(2), {"fcnet_hiddens": [8, 8], "vf_share_layers": share}
    )
    _assert_partition(model, expected_value_vars=value_vars)
    assert (model.value_torso is None) == share
    # The policy variables alone determine the logits, the value variables alone the values:
    # perturbing the value variables leaves the logits unchanged.
    obs = _obs(CARTPOLE_OBS, (2,))
    before_logits, before_values = model(obs)
    for v in model.value_variables:
        v.assign(v + 0.5)
    after_logits, after_values = model(obs)
    np.testing.assert_allclose(after_logits, before_logits)
    assert not np.allclose(after_values, before_values)


@pytest.mark.parametrize(
    "config, match",
    [
        ({"use_attention": True}, "use_attention"),
        ({"use_lstm": True, "lstm_use_prev_action": True}, "not supported yet"),
        ({"use_lstm": True, "lstm_use_prev_reward": True}, "not supported yet"),
        ({"custom_model": "my_net"}, "custom_model"),
        ({"custom_model": "nature_cnn"}, "needs image observations"),
        ({"fcnet_activation": "sigmoidal"}, "fcnet_activation"),
        ({"conv_activation": "nope"}, "conv_activation"),
        ({"fcnet_hiddens": [16, -1]}, "fcnet_hiddens"),
        ({"lstm_cell_size": 0}, "lstm_cell_size"),
        ({"conv_filters": [[16, [4, 4]]]}, "conv_filters"),
        ({"post_fcnet_hiddens": [0]}, "post_fcnet_hiddens"),
        ({"post_fcnet_activation": "nope"}, "post_fcnet_activation"),
        ({"conv_filters": [[16, [4, 4, 4], 2]]}, "kernel"),
    ],
)
def test_invalid_config_raises_naming_the_key(config, match):
    with pytest.raises(ValueError, match=match):
        build_model(CARTPOLE_OBS, gym.spaces.Discrete(2), config)


def test_prev_action_keys_are_ignored_without_lstm_and_unknown_keys_pass():
    model = build_model(
        CARTPOLE_OBS,
        gym.spaces.Discrete(2),
        {**SMALL_MLP, "lstm_use_prev_action": True, "some_future_key": 1, "max_seq_len": 7},
    )
    assert not model.is_recurrent
    assert model.model_config["max_seq_len"] == 7


def test_unsupported_spaces_raise():
    with pytest.raises(ValueError, match="Tuple"):
        build_model(gym.spaces.Tuple((CARTPOLE_OBS,)), gym.spaces.Discrete(2))
    with pytest.raises(ValueError, match="Dict"):
        build_model(CARTPOLE_OBS, gym.spaces.Dict({"a": gym.spaces.Discrete(2)}))


def test_the_vision_networks_first_policy_is_near_uniform_on_every_seed():
    # With RLlib's Glorot logits on 0..255 pixels, some seeds start nearly deterministic (on
    # Pong's frames entropy 1e-6 for seed 100) and a policy gradient through such a softmax
    # vanishes: Pong stayed at -21 with entropy ~1e-8. Bright and dark frames, 42x42 and 84x84.
    frames = np.random.default_rng(0).integers(0, 256, (8, 42, 42, 4)).astype(np.float32)
    frames[:4] = np.where(frames[:4] > 127, 236.0, 0.0)  # Pong-like: a few levels of gray.
    for shape, seeds in (((42, 42, 4), range(8)), ((84, 84, 4), range(3))):
        space = gym.spaces.Box(0, 255, shape, np.uint8)
        batch = tf.image.resize(frames, shape[:2], method="nearest")
        for seed in seeds:
            keras.utils.set_random_seed(seed)
            model = build_model(space, gym.spaces.Discrete(6))
            p = tf.nn.softmax(model(batch)[0]).numpy()
            entropy = -(p * np.log(np.maximum(p, 1e-30))).sum(-1)
            assert entropy.min() > 0.95 * np.log(6), (shape, seed, entropy)


def test_image_scaling_and_head_init_follow_each_networks_source():
    # RLlib's VisionNetwork: pixels 0..255, normc(0.01) shared value head; our logits head is
    # normc(0.01) too (RLlib's 1x1 conv is Glorot: the test above says why not).
    rllib = build_model(ATARI_OBS, gym.spaces.Discrete(6))
    assert float(np.std(rllib.logits_head.kernel.numpy())) < 0.01  # Glorot would be ~0.1.
    assert float(np.std(rllib.value_head.kernel.numpy())) < 0.01
    # DeepMind's torsos scale uint8 to [0, 1] themselves; 255s in equal 1s in.
    for name in ("nature_cnn", "impala_resnet"):
        model = build_model(ATARI_OBS, gym.spaces.Discrete(6), {"custom_model": name})
        assert model.torso.input_scale == pytest.approx(1 / 255)
        as_uint8 = model.torso(tf.fill((1, *ATARI_OBS.shape), 255.0))
        unscaled = type(model.torso)(name="same_weights")
        unscaled(tf.zeros((1, *ATARI_OBS.shape)))
        unscaled.set_weights(model.torso.get_weights())
        np.testing.assert_allclose(
            as_uint8, unscaled(tf.ones((1, *ATARI_OBS.shape))), rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize("share", [True, False])
def test_center_pixels_feeds_both_conv_stacks_pixels_minus_128(share):
    # `center_pixels` (ours): the same layers and variables; uint8 pixels enter as x - 128.
    space = gym.spaces.Box(0, 255, (42, 42, 4), np.uint8)
    config = {"vf_share_layers": share}
    plain = build_model(space, gym.spaces.Discrete(6), config)
    centered = build_model(space, gym.spaces.Discrete(6), {**config, "center_pixels": True})
    assert [v.shape for v in centered.weights] == [v.shape for v in plain.weights]
    centered.set_weights(plain.get_weights())
    frames = _obs(space, (3,)).astype(np.float32)
    logits, values = centered(frames)
    want_logits, want_values = plain(frames - 128.0)
    np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(values, want_values, rtol=1e-5, atol=1e-4)
    assert not np.allclose(logits, plain(frames)[0], atol=1e-4)
    towers = [centered.torso] + ([] if share else [centered.value_torso])
    assert [t.input_shift for t in towers] == [128.0] * len(towers)


def test_center_pixels_leaves_float_images_and_vectors_as_they_come():
    floats = build_model(
        gym.spaces.Box(0.0, 1.0, (42, 42, 4), np.float32),
        gym.spaces.Discrete(6),
        {"center_pixels": True},
    )
    assert floats.torso.input_shift == 0.0
    build_model(CARTPOLE_OBS, gym.spaces.Discrete(2), {**SMALL_MLP, "center_pixels": True})


def test_center_pixels_with_a_custom_model_is_refused():
    with pytest.raises(ValueError, match="center_pixels"):
        build_model(
            ATARI_OBS, gym.spaces.Discrete(6), {"custom_model": "nature_cnn", "center_pixels": True}
        )
