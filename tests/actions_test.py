"""Box actions: RLlib's `normalize_actions` / `clip_actions` semantics, `free_log_std`, and a
Box-action config that trains without NaN. Batches are [B, *action_shape]."""

from __future__ import annotations

import gymnasium as gym
import keras
import numpy as np
import pytest
import tensorflow as tf

from impala_tf.acting.actions import ActionAdapter, clip_action, unsquash_action
from impala_tf.config import ImpalaConfig
from impala_tf.data.layouts import time_major
from impala_tf.data.sample_batch import concat_samples
from impala_tf.driver.specs import runner_spec
from impala_tf.learning.learner import ImpalaLearner
from impala_tf.models import build_model
from impala_tf.rollout.env_runner import EnvRunner

BOX = gym.spaces.Box(np.array([-2.0, 0.0], np.float32), np.array([2.0, 10.0], np.float32))


def test_unsquash_maps_minus_one_one_to_the_bounds_and_clips():
    actions = np.array([[-1.0, -1.0], [0.0, 0.0], [1.0, 1.0], [0.5, -0.5], [3.0, -7.0]])
    # low + (a + 1) * (high - low) / 2, by hand: dim 0 is 2a, dim 1 is 5a + 5.
    expected = np.array([[-2.0, 0.0], [0.0, 5.0], [2.0, 10.0], [1.0, 2.5], [2.0, 0.0]])
    out = unsquash_action(actions, BOX)
    np.testing.assert_allclose(out, expected)
    assert out.dtype == np.float32


def test_unsquash_leaves_unbounded_integer_and_discrete_spaces_alone():
    actions = np.array([[3.0, -4.0]])
    half_open = gym.spaces.Box(np.array([0.0, -np.inf]), np.array([1.0, 1.0]))
    np.testing.assert_array_equal(unsquash_action(actions, half_open), actions)
    ints = gym.spaces.Box(0, 5, (2,), np.int64)
    np.testing.assert_array_equal(unsquash_action(np.array([[1, 2]]), ints), [[1, 2]])
    discrete = np.array([0, 2])
    assert unsquash_action(discrete, gym.spaces.Discrete(3)) is discrete


def test_clip_action_clips_to_the_bounds():
    actions = np.array([[-3.0, 11.0], [1.5, 4.0], [2.5, -1.0]])
    np.testing.assert_allclose(clip_action(actions, BOX), [[-2.0, 10.0], [1.5, 4.0], [2.0, 0.0]])


@pytest.mark.parametrize(
    "normalize, clip, expected",
    [
        (True, False, [[1.0, 7.5], [2.0, 0.0]]),  # unsquash (then clip), as RLlib
        (True, True, [[1.0, 7.5], [2.0, 0.0]]),  # normalize wins, as RLlib
        (False, True, [[0.5, 0.5], [2.0, 0.0]]),  # clip only
        (False, False, [[0.5, 0.5], [3.0, -2.0]]),  # as sampled
    ],
)
def test_adapter_follows_rllib_precedence(normalize, clip, expected):
    adapter = ActionAdapter(BOX, normalize_actions=normalize, clip_actions=clip)
    np.testing.assert_allclose(adapter(np.array([[0.5, 0.5], [3.0, -2.0]])), expected)


class _RecordingEnv(gym.Env):
    """A one-dimensional env with action space [-2, 2] that records the actions it receives."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Box(-2.0, 2.0, (1,), np.float32)
    received: list = []

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        type(self).received.append(np.array(action, np.float32))
        return np.zeros(2, np.float32), 0.0, False, False, {}


@pytest.mark.parametrize("normalize, clip", [(True, False), (False, True), (False, False)])
def test_env_runner_sends_transformed_actions_and_logs_the_policy_ones(normalize, clip):
    _RecordingEnv.received = []
    config = ImpalaConfig(
        env=lambda ctx: _RecordingEnv(),
        normalize_actions=normalize,
        clip_actions=clip,
        rollout_fragment_length=20,
        num_envs_per_env_runner=1,
        seed=0,
        model={"fcnet_hiddens": [4]},
    )
    runner = EnvRunner(runner_spec(config), worker_index=1)
    model = build_model(_RecordingEnv.observation_space, _RecordingEnv.action_space, config.model)
    weights = model.get_weights()
    weights[-3] = weights[-3] + np.array([0.0, 1.0], np.float32)  # log-std 1: std e
    runner.set_weights({"default_policy": (weights, 0)})
    fragment = runner.sample()
    logged = fragment.batches["default_policy"]["actions"].reshape(-1, 1)
    sent = np.stack(_RecordingEnv.received)
    assert np.abs(logged).max() > 2.0  # the policy's own samples, unbounded
    expected = ActionAdapter(_RecordingEnv.action_space, normalize, clip)(logged)
    np.testing.assert_allclose(sent, expected, rtol=1e-6)
    if normalize:
        np.testing.assert_allclose(sent, np.clip(2.0 * logged, -2.0, 2.0), rtol=1e-6)
    runner.close()


@pytest.mark.parametrize("key", ["normalize_actions", "clip_actions"])
def test_action_keys_must_be_bools(key):
    with pytest.raises(ValueError, match=key):
        ImpalaConfig(env="Pendulum-v1", **{key: "yes"}).validate()


def test_defaults_are_rllibs():
    config = ImpalaConfig()
    assert config.normalize_actions is True and config.clip_actions is False
    assert config.model["free_log_std"] is False


def test_free_log_std_is_a_state_independent_policy_variable():
    obs_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
    model = build_model(obs_space, BOX, {"fcnet_hiddens": [8], "free_log_std": True})
    log_std = model.free_log_std.log_std
    assert log_std.shape == (2,)
    assert any(v is log_std for v in model.policy_variables)
    log_std.assign([0.3, -1.2])
    obs = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)
    logits, _ = model(obs)
    np.testing.assert_allclose(logits[:, 2:], np.tile([0.3, -1.2], (4, 1)), rtol=1e-6)
    assert not np.allclose(logits[0, :2], logits[1, :2])  # the means still depend on x


def test_free_log_std_needs_a_box_action_space():
    obs_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
    with pytest.raises(ValueError, match="free_log_std"):
        build_model(obs_space, gym.spaces.Discrete(4), {"free_log_std": True})


@pytest.mark.parametrize("free_log_std", [False, True])
def test_pendulum_config_trains_without_nan(free_log_std):
    """The shipped Pendulum settings (smaller net): a few on-policy updates stay finite."""
    config, _ = ImpalaConfig.from_yaml("configs/pendulum-impala.yaml")
    config.model = {**config.model, "fcnet_hiddens": [32, 32], "free_log_std": free_log_std}
    config.seed = 0
    config.validate()
    keras.utils.set_random_seed(0)
    runners = [EnvRunner(runner_spec(config), worker_index=i + 1) for i in range(2)]
    learner = ImpalaLearner(config, runners[0].observation_space, runners[0].action_space)
    step = tf.function(learner.train_step)
    for _ in range(5):
        weights = {"default_policy": (learner.get_policy_weights(), 0)}
        for runner in runners:
            runner.set_weights(weights)
        fragments = [r.sample().batches["default_policy"] for r in runners]
        batch = time_major(concat_samples(fragments))
        stats = step({k: tf.constant(v) for k, v in batch.items()})
        for key in ("total_loss", "grad_gnorm", "grad_gnorm_unclipped", "entropy"):
            assert np.isfinite(float(stats[key])), key
    for runner in runners:
        runner.close()
    assert all(np.isfinite(w).all() for w in learner.get_policy_weights())


def test_shipped_pendulum_yaml_loads_and_validates():
    """The shipped Pendulum YAML: RLlib's stop criterion and example keys, plus the departures
    its comments document (and nothing that validation rejects)."""
    config, stop = ImpalaConfig.from_yaml("configs/pendulum-impala.yaml")
    config.validate()
    assert config.env == "Pendulum-v1"
    assert stop == {"episode_reward_mean": -200, "timesteps_total": 5_000_000}
    # RLlib's `pendulum_impala.py`, unchanged.
    assert (config.num_env_runners, config.num_envs_per_env_runner) == (2, 5)
    assert (config.train_batch_size, config.grad_clip, config.vf_loss_coeff) == (256, 40.0, 0.05)
    assert config.entropy_coeff_schedule == [[0, 0.1], [2000000, 0.0]]
    assert config.model["fcnet_hiddens"] == [512, 512]
    assert config.normalize_actions and not config.clip_actions
    # The documented departures.
    assert config.model["free_log_std"] and not config.model["vf_share_layers"]
    assert config._separate_vf_optimizer and config._lr_vf == 0.003
    assert config.gamma == 0.95
    assert config.lr_schedule_points() == [[0, 0.0001], [5000000, 0.00001]]
    assert config.observation_filter == "MeanStdFilter"
