"""NumpyPolicy must compute what the Keras ActorCritic computes, for every MLP it accepts."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import tensorflow as tf

from impala_tf.acting.factory import make_policy
from impala_tf.acting.numpy_policy import NumpyPolicy, supports
from impala_tf.acting.tf_policy import ActorPolicy
from impala_tf.models import build_model, distributions

BOX_OBS = gym.spaces.Box(-2.0, 2.0, (3, 2), np.float32)

CASES = [
    (BOX_OBS, gym.spaces.Discrete(3), {"fcnet_hiddens": [8, 8], "fcnet_activation": "tanh"}),
    (BOX_OBS, gym.spaces.Discrete(2), {"fcnet_hiddens": [8], "vf_share_layers": True}),
    (
        gym.spaces.Discrete(5),
        gym.spaces.Discrete(2),
        {"fcnet_hiddens": [6], "fcnet_activation": "relu"},
    ),
    (gym.spaces.MultiDiscrete([3, 2]), gym.spaces.MultiDiscrete([2, 4]), {"fcnet_hiddens": [7]}),
    (
        gym.spaces.MultiBinary(4),
        gym.spaces.Box(-1, 1, (2,), np.float32),
        {"fcnet_activation": "elu"},
    ),
    (
        BOX_OBS,
        gym.spaces.Box(-1, 1, (3,), np.float32),
        {"fcnet_hiddens": [5, 5], "fcnet_activation": "swish"},
    ),
    (BOX_OBS, gym.spaces.Discrete(4), {"fcnet_hiddens": [], "fcnet_activation": "linear"}),
    (
        BOX_OBS,
        gym.spaces.Box(-2, 2, (2,), np.float32),
        {"fcnet_hiddens": [6, 6], "free_log_std": True},
    ),
    (
        BOX_OBS,
        gym.spaces.Box(-2, 2, (3,), np.float32),
        {"fcnet_hiddens": [6], "free_log_std": True, "vf_share_layers": True},
    ),
]


def _randomize(model, seed):
    rng = np.random.default_rng(seed)
    model.set_weights(
        [rng.normal(scale=0.1, size=w.shape).astype(np.float32) for w in model.get_weights()]
    )


@pytest.mark.parametrize("obs_space, act_space, model_config", CASES)
def test_forward_matches_the_keras_model(obs_space, act_space, model_config):
    assert supports(obs_space, act_space, model_config)
    model = build_model(obs_space, act_space, model_config)
    _randomize(model, 0)
    policy = NumpyPolicy(obs_space, act_space, model_config)
    policy.set_weights(model.get_weights())
    obs_space.seed(1)
    obs = np.stack([obs_space.sample() for _ in range(6)])
    logits, values, _ = model.step(tf.constant(obs), ())
    np_logits, np_values = policy.forward(obs)
    np.testing.assert_allclose(np_logits, logits.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np_values, values.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("obs_space, act_space, model_config", CASES)
def test_log_probs_match_the_learners_distributions(obs_space, act_space, model_config):
    model = build_model(obs_space, act_space, model_config)
    _randomize(model, 2)
    policy = NumpyPolicy(obs_space, act_space, model_config, seed=3)
    policy.set_weights(model.get_weights())
    obs_space.seed(4)
    obs = np.stack([obs_space.sample() for _ in range(5)])
    step = policy.step(obs)
    dist = distributions.make_distribution(act_space, tf.constant(step.logits))
    expected = dist.log_prob(tf.constant(step.actions)).numpy()
    np.testing.assert_allclose(step.logp, expected, rtol=1e-4, atol=1e-4)
    assert step.actions.shape == (5, *distributions.action_shape(act_space))
    assert all(act_space.contains(a) for a in step.actions) or isinstance(act_space, gym.spaces.Box)


def test_sampling_follows_the_distribution_and_mode_is_greedy():
    obs_space, act_space = BOX_OBS, gym.spaces.Discrete(3)
    policy = NumpyPolicy(obs_space, act_space, {"fcnet_hiddens": []}, seed=0)
    # Zero torso: logits = bias of the logits head.
    weights = [
        np.zeros((6, 3), np.float32),
        np.log(np.array([0.2, 0.3, 0.5], np.float32)),
        np.zeros((6, 1), np.float32),
        np.zeros(1, np.float32),
    ]
    policy.set_weights(weights)
    actions = policy.step(np.zeros((20_000, 3, 2), np.float32)).actions
    np.testing.assert_allclose(np.bincount(actions) / len(actions), [0.2, 0.3, 0.5], atol=0.015)
    greedy = NumpyPolicy(obs_space, act_space, {"fcnet_hiddens": []}, explore=False)
    greedy.set_weights(weights)
    assert set(greedy.step(np.zeros((50, 3, 2), np.float32)).actions) == {2}


def test_wrong_weights_and_missing_weights_are_clear_errors():
    policy = NumpyPolicy(BOX_OBS, gym.spaces.Discrete(2), {"fcnet_hiddens": [4]})
    with pytest.raises(RuntimeError, match="set_weights"):
        policy.step(np.zeros((1, 3, 2), np.float32))
    with pytest.raises(ValueError, match="do not belong"):
        policy.set_weights([np.zeros((2, 2))])


def test_make_policy_picks_numpy_for_mlps_and_tensorflow_otherwise():
    act = gym.spaces.Discrete(2)
    assert isinstance(make_policy(BOX_OBS, act, {}), NumpyPolicy)
    assert isinstance(
        make_policy(BOX_OBS, act, {"use_lstm": True, "lstm_cell_size": 8}), ActorPolicy
    )
    image = gym.spaces.Box(0, 255, (42, 42, 3), np.uint8)
    assert not supports(image, act, {})
