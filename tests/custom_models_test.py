"""Custom models: RLlib's TFModelV2 / RecurrentNetwork, Keras models, the spec that carries them,
and the errors a bad model gets when it is built (never from inside a training step)."""

from __future__ import annotations

import pickle
import threading

import gymnasium as gym
import keras
import numpy as np
import pytest
import tensorflow as tf

from impala_tf.acting.factory import make_policy
from impala_tf.acting.numpy_policy import supports
from impala_tf.config import ImpalaConfig
from impala_tf.driver.plan import make_plan
from impala_tf.models import ModelCatalog, ModelError, build_model, model_spec
from impala_tf.models.custom import model_input_space
from tests.support import models

OBS = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
ACT = gym.spaces.Discrete(2)

#: (custom_model setting, extra model keys) of every way to bring a feed-forward model.
FEED_FORWARD = {
    "tfmodelv2": ("tests.support.models:TwoHeadedModel", {}),
    "functional": ("tests.support.models:functional_model", {"custom_model_config": {"hidden": 8}}),
    "subclassed": (models.SubclassedModel, {}),
}
RECURRENT = {
    "recurrent_network": ("tests.support.models:KerasLSTMModel", {}),
    "use_lstm": ("tests.support.models:functional_model", {"use_lstm": True, "lstm_cell_size": 8}),
    "tfmodelv2_use_lstm": ("tests.support.models:WrappableModel", {"use_lstm": True}),
}


def _build(custom, **keys):
    return build_model(OBS, ACT, {"custom_model": custom, **keys})


@pytest.mark.parametrize("name", sorted(FEED_FORWARD))
def test_a_feed_forward_custom_model_steps_and_unrolls_alike(name):
    custom, keys = FEED_FORWARD[name]
    model = _build(custom, **keys)
    assert not model.is_recurrent and model.num_outputs == 2
    obs = np.random.default_rng(0).normal(size=(5, 3, 4)).astype(np.float32)
    logits, values, state = model.unroll(obs, np.zeros((5, 3), bool), ())
    assert logits.shape == (5, 3, 2) and values.shape == (5, 3) and state == ()
    step_logits, step_values, _ = model.step(obs[2], ())
    np.testing.assert_allclose(logits[2], step_logits, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(values[2], step_values, rtol=1e-5, atol=1e-6)


def test_the_keras_model_inside_a_tfmodelv2_is_the_one_trained():
    model = _build("tests.support.models:TwoHeadedModel")
    names = sorted(v.path for v in model.trainable_variables)
    assert any("hidden" in n for n in names) and any("value_head" in n for n in names)
    assert len(model.get_weights()) == 6  # Three Dense layers: kernels and biases.


@pytest.mark.parametrize("name", sorted(RECURRENT))
def test_a_recurrent_model_unrolls_as_it_steps_with_resets(name):
    custom, keys = RECURRENT[name]
    model = _build(custom, **keys)
    assert model.is_recurrent
    t, b = 6, 3
    obs = np.random.default_rng(1).normal(size=(t, b, 4)).astype(np.float32)
    resets = np.zeros((t, b), bool)
    resets[3, 1] = True
    initial = model.initial_state(b)
    logits, values, final = tf.function(model.unroll)(obs, resets, initial)
    state, outs = initial, []
    for i in range(t):
        state = tuple(np.where(resets[i][:, None], s0, s) for s, s0 in zip(state, initial))
        step_logits, _, state = model.step(obs[i], state)
        outs.append(step_logits)
    np.testing.assert_allclose(logits, np.stack(outs), rtol=1e-5, atol=1e-6)
    for a, b_ in zip(final, state):
        np.testing.assert_allclose(a, b_, rtol=1e-5, atol=1e-6)


def test_a_recurrent_model_restarts_from_its_own_initial_state():
    model = _build("tests.support.models:Counter")
    (state,) = model.initial_state(2)
    np.testing.assert_array_equal(state, [[1.0], [1.0]])
    obs = np.zeros((4, 2, 4), np.float32)
    resets = np.zeros((4, 2), bool)
    resets[2, 0] = True  # Env 0 starts an episode at step 2: its count starts again.
    logits, _, _ = model.unroll(obs, resets, (state,))
    np.testing.assert_array_equal(logits[:, :, 0], [[2, 2], [3, 3], [2, 4], [3, 5]])


def test_custom_model_config_reaches_the_constructor():
    small = _build("tests.support.models:functional_model", custom_model_config={"hidden": 3})
    assert small.net.layers[1].units == 3
    with pytest.raises(ModelError, match="NoKwargs.*hidden"):
        _build("tests.support.models:NoKwargs", custom_model_config={"hidden": 3})


def test_every_way_to_name_a_model_resolves_to_the_same_class():
    ModelCatalog.register_custom_model("keras_model_for_tests", models.TwoHeadedModel)
    names = ("keras_model_for_tests", "tests.support.models:TwoHeadedModel", models.TwoHeadedModel)
    for name in names:
        assert model_spec({"custom_model": name}).custom.obj is models.TwoHeadedModel
    assert model_spec({"custom_model": "nature_cnn"}).custom is None
    with pytest.raises(ValueError, match="built-in"):
        ModelCatalog.register_custom_model("nature_cnn", models.TwoHeadedModel)


def test_a_spec_travels_by_import_path_or_by_value():
    by_path = model_spec({"custom_model": models.SubclassedModel})
    assert b"tests.support.models" in pickle.dumps(by_path)
    assert pickle.loads(pickle.dumps(by_path)).custom.obj is models.SubclassedModel

    def local_model(obs_space, action_space, num_outputs, model_config, name):
        return models.functional_model(obs_space, action_space, num_outputs, model_config, name)

    by_value = pickle.loads(pickle.dumps(model_spec({"custom_model": local_model})))
    assert build_model(OBS, ACT, by_value).num_outputs == 2


def test_custom_models_act_as_their_keras_model_does():
    spec = model_spec({"custom_model": "tests.support.models:TwoHeadedModel"})
    assert not supports(OBS, ACT, spec)  # Not the catalog's numpy MLP: its traced step.
    policy = make_policy(OBS, ACT, spec, explore=False, seed=0)
    model = build_model(OBS, ACT, spec)
    policy.set_weights(model.get_weights())
    obs = np.random.default_rng(2).normal(size=(7, 4)).astype(np.float32)
    step = policy.step(obs)
    logits, _ = model(obs)
    np.testing.assert_allclose(step.logits, logits, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(step.actions, np.argmax(logits, axis=-1))


def test_observations_are_preprocessed_as_rllib_does():
    obs_space = gym.spaces.Discrete(5)
    assert model_input_space(obs_space).shape == (5,)
    model = build_model(obs_space, ACT, {"custom_model": models.SubclassedModel})
    logits, values = model(np.array([0, 4]))
    assert logits.shape == (2, 2) and values.shape == (2,)


def test_a_custom_model_builds_in_bfloat16_with_float32_outputs():
    model = build_model(
        OBS, ACT, {"custom_model": models.SubclassedModel}, precision="mixed_bfloat16"
    )
    logits, values = model(np.zeros((2, 4), np.float32))
    assert logits.dtype == tf.float32 and values.dtype == tf.float32
    assert model.net.hidden.compute_dtype == "bfloat16"


def test_checkpoints_hold_every_variable_of_a_tfmodelv2(tmp_path):
    model = _build("tests.support.models:KerasLSTMModel")
    path = tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt"))
    other = _build("tests.support.models:KerasLSTMModel")
    tf.train.Checkpoint(model=other).read(path).assert_consumed()
    for a, b in zip(model.get_weights(), other.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_layers_kept_in_a_list_are_in_the_checkpoint_too(tmp_path):
    from impala_tf.models.tracking import untracked_variables

    model = _build("tests.support.models:ListedLayersModel")
    assert untracked_variables(model) == [] and len(model.get_weights()) == 8
    path = tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt"))
    other = _build("tests.support.models:ListedLayersModel")
    tf.train.Checkpoint(model=other).read(path).assert_consumed()
    for a, b in zip(model.get_weights(), other.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "custom, keys, message",
    [
        ("tests.support.models:wrong_logits", {}, r"logits have shape \(2, 3\).*\(2, 2\)"),
        ("tests.support.models:wrong_values", {}, r"values have shape \(2, 3\).*\[B\]"),
        ("tests.support.models:one_output", {}, r"must return \(logits, values\)"),
        ("tests.support.models:NotAModel", {}, "neither a TFModelV2 .* nor a keras.Model"),
        ("tests.support.models:WithCustomLoss", {}, "custom_loss"),
        ("tests.support.models:TwoHeadedModel", {"use_lstm": True}, "num_outputs=None"),
        ("tests.support.models:no_such_model", {}, "does not resolve"),
        ("no.such.module:Model", {}, "does not resolve"),
        ("unregistered_name", {}, "not a registered custom model"),
    ],
)
def test_a_bad_model_is_refused_at_build_time_naming_it(custom, keys, message):
    with pytest.raises(ModelError, match=message) as info:
        _build(custom, **keys)
    if "no_such" not in custom and "unregistered" not in custom:
        assert custom.split(":")[1] in str(info.value)


def test_a_model_that_cannot_reach_the_actors_is_refused_before_any_actor_starts():
    config = (
        ImpalaConfig()
        .environment("CartPole-v1")
        .training(model={"custom_model": models.Unpicklable})
    )
    make_plan(config)  # A module-level class travels by its import path, lock and all.

    class Local(models.TwoHeadedModel):  # Travels by value: its lock cannot be pickled.
        lock = threading.Lock()

    config.training(model={"custom_model": Local})
    with pytest.raises(ModelError, match="Local.*cannot be sent to the worker processes"):
        make_plan(config)


def test_config_validation_names_a_bad_custom_model_key():
    config = ImpalaConfig().environment("CartPole-v1")
    config.training(model={"custom_model": 3})
    with pytest.raises(ValueError, match="model.custom_model"):
        config.validate()
    config.training(model={"custom_model": None, "custom_model_config": [1]})
    with pytest.raises(ValueError, match="custom_model_config"):
        config.validate()
    config.training(model={"custom_model": "no_such_model", "custom_model_config": {}})
    with pytest.raises(ValueError, match="no_such_model"):
        config.validate()


def test_each_policy_of_a_multi_agent_config_gets_its_own_model():
    config = (
        ImpalaConfig()
        .environment("impala_tf/MultiAgentCartPole", env_config={"num_agents": 2})
        .multi_agent(
            policies={
                "p0": (None, None, None, {"model": {"custom_model": models.SubclassedModel}}),
                "p1": (None, None, None, {"model": {"fcnet_hiddens": [8]}}),
            },
            policy_mapping_fn="impala_tf.config.policies.PolicyMappingFn",
        )
    )
    plan = make_plan(config)
    assert plan.models["p0"].custom.obj is models.SubclassedModel
    assert plan.models["p1"].custom is None
    assert plan.actors_need_tensorflow  # p0 acts in TensorFlow.
    assert keras.Model in type(build_model(OBS, ACT, plan.models["p0"]).net).__mro__
