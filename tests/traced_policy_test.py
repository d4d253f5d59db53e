"""Custom models acting in numpy: the traced step run op by op (`impala_tf.acting.graph_numpy`)
gives the model's own outputs, actions and state; models whose graph numpy cannot run keep
TensorFlow."""

from __future__ import annotations

import gymnasium as gym
import keras
import numpy as np
import pytest
import tensorflow as tf

from impala_tf.acting.factory import make_policy
from impala_tf.acting.graph_numpy import GraphProgram, UnsupportedGraph
from impala_tf.acting.tf_policy import ActorPolicy
from impala_tf.acting.traced_policy import TracedNumpyPolicy, numpy_acting
from impala_tf.models import build_model, model_spec
from tests.support import models

BOX = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)


def activations_model(obs_space, action_space, num_outputs, model_config, name):
    """Every activation Keras users reach for, a concatenation and a softmax-normalised head."""
    obs = keras.Input(obs_space.shape)
    x = keras.layers.Flatten()(obs)
    parts = [
        keras.layers.Dense(5, activation=act)(x)
        for act in ("relu", "tanh", "sigmoid", "elu", "selu", "softplus", "swish", "linear")
    ]
    x = keras.layers.Concatenate()(parts)
    logits = keras.layers.Dense(num_outputs)(keras.layers.Dropout(0.5)(x))
    logits = keras.layers.Activation("log_softmax")(logits)
    return keras.Model(obs, [logits, keras.layers.Dense(1)(x)])


CASES = {
    "functional_box": (BOX, gym.spaces.Discrete(3), models.functional_model),
    "subclassed_discrete_obs": (
        gym.spaces.Discrete(6),
        gym.spaces.Discrete(2),
        models.SubclassedModel,
    ),
    "tfmodelv2_multidiscrete": (
        gym.spaces.MultiDiscrete([3, 4]),
        gym.spaces.MultiDiscrete([2, 3]),
        models.TwoHeadedModel,
    ),
    "activations_image_box": (
        gym.spaces.Box(0, 255, (3, 2, 2), np.uint8),
        gym.spaces.Box(-1.0, 1.0, (2,), np.float32),
        activations_model,
    ),
    "recurrent_counter": (BOX, gym.spaces.Discrete(3), models.Counter),
}


def _assert_float32_close(actual, desired):
    # Numpy and TensorFlow sum in different orders: float32 rounding scales with the batch's
    # largest output (the image case's values reach ~100, so one near 0 can be off by 2e-5).
    scale = max(1.0, float(np.max(np.abs(desired))))
    np.testing.assert_allclose(actual, desired, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_traced_custom_model_acts_in_numpy_exactly_as_in_tensorflow(name):
    obs_space, act_space, factory = CASES[name]
    spec = model_spec({"custom_model": factory})
    policy = make_policy(obs_space, act_space, spec, explore=True, seed=5)
    assert isinstance(policy, TracedNumpyPolicy)
    reference = ActorPolicy(obs_space, act_space, spec, explore=True, seed=5)
    weights = [
        np.random.default_rng(i).normal(scale=0.3, size=w.shape).astype(np.float32)
        for i, w in enumerate(reference.get_weights())
    ]
    policy.set_weights(weights)
    reference.set_weights(weights)
    state, ref_state = policy.initial_state(7), reference.initial_state(7)
    obs_space.seed(0)
    for _ in range(3):
        obs = np.stack([obs_space.sample() for _ in range(7)])
        step, ref = policy.step(obs, state), reference.step(obs, ref_state)
        _assert_float32_close(step.logits, ref.logits)
        _assert_float32_close(step.values, ref.values)
        # The same draws (Box actions: the same noise on means equal to float rounding).
        np.testing.assert_allclose(step.actions, ref.actions, rtol=1e-5, atol=1e-5)
        for a, b in zip(step.state, ref.state):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        state, ref_state = step.state, ref.state
    for a, b in zip(policy.get_weights(), weights):
        np.testing.assert_array_equal(a, b)


def test_models_numpy_cannot_run_keep_tensorflow():
    for custom, obs_space in (
        (models.KerasLSTMModel, BOX),  # A recurrent layer's While loop.
        (models.functional_model, BOX),  # Acts in bfloat16 below.
    ):
        spec = model_spec({"custom_model": custom})
        precision = "mixed_bfloat16" if custom is models.functional_model else "float32"
        policy = make_policy(obs_space, gym.spaces.Discrete(2), spec, precision=precision)
        assert isinstance(policy, ActorPolicy), custom


def test_a_program_refuses_ops_it_does_not_run():
    conv = keras.layers.Conv2D(2, 3)
    fn = tf.function(lambda x: conv(x), autograph=False)
    concrete = fn.get_concrete_function(tf.TensorSpec([None, 5, 5, 1], tf.float32))
    with pytest.raises(UnsupportedGraph, match="Conv2D"):
        GraphProgram(concrete, conv.weights)


def test_numpy_acting_keeps_tensorflow_when_the_results_would_differ(monkeypatch):
    actor = ActorPolicy(
        BOX, gym.spaces.Discrete(2), model_spec({"custom_model": models.SubclassedModel})
    )
    monkeypatch.setattr(TracedNumpyPolicy, "forward", lambda self, obs, state=(): (
        np.zeros((len(obs), 2), np.float32), np.zeros(len(obs), np.float32), ()))  # fmt: skip
    assert numpy_acting(actor) is actor


def test_a_built_in_lstm_model_is_not_affected():
    spec = model_spec({"use_lstm": True, "lstm_cell_size": 4})
    assert isinstance(make_policy(BOX, gym.spaces.Discrete(2), spec), ActorPolicy)
    assert build_model(BOX, gym.spaces.Discrete(2), spec).is_recurrent
