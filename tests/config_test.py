"""Tests for impala_tf.config: defaults, builders, aliases, validation, YAML, stop criteria and
`build()` (real builds: the one factory behind `build()` and `impala-train`).

`ForkServerProbe` below is loaded by `impala-train --learner_callbacks` as
`tests.config_test:ForkServerProbe`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import pickle
import re
import subprocess
import sys
import warnings
from importlib.util import find_spec

import gymnasium as gym
import keras
import pytest

from impala_tf.config import (
    MODEL_DEFAULTS,
    ConfigWarning,
    DeprecatedKeyWarning,
    ImpalaConfig,
    normalize_stop_criteria,
)
from impala_tf.config.experiments import read_search_file, search_space_paths
from impala_tf.config.registry import config_class
from tests.support.binaries import run_binary_in_one_process
from tests.support.configs import small_config
from tests.support.envs import HugeRewardCartPole
from tests.support.processes import (
    EXIT_WITHOUT_TEARDOWN,
    descendants,
    kill_session,
    log_tail,
    run_in_background,
)
from tools import proclib

REPO = pathlib.Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"
#: Each config key's builder group (the dataclass field metadata that `ImpalaConfig` declares).
GROUPS = {f.name: f.metadata["group"] for f in dataclasses.fields(ImpalaConfig)}


# Defaults ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, rllib_default",
    [
        ("vtrace", True),
        ("vtrace_clip_rho_threshold", 1.0),
        ("vtrace_clip_pg_rho_threshold", 1.0),
        ("vtrace_drop_last_ts", False),
        ("gamma", 0.99),
        ("lr", 0.0005),
        ("train_batch_size", 500),
        ("rollout_fragment_length", 50),
        ("batch_mode", "truncate_episodes"),
        ("num_env_runners", 2),
        ("num_envs_per_env_runner", 1),
        ("num_gpus", 1),
        ("_fake_gpus", False),
        ("num_multi_gpu_tower_stacks", 1),
        ("num_gpu_loader_threads", 8),
        ("minibatch_buffer_size", 1),
        ("num_sgd_iter", 1),
        ("learner_queue_size", 16),
        ("learner_queue_timeout", 300),
        ("max_requests_in_flight_per_env_runner", 2),
        ("timeout_s_sampler_manager", 0.0),
        ("timeout_s_aggregator_manager", 0.0),
        ("broadcast_interval", 1),
        ("num_aggregation_workers", 0),
        ("replay_proportion", 0.0),
        ("replay_buffer_num_slots", 0),
        ("grad_clip", 40.0),
        ("opt_type", "adam"),
        ("lr_schedule", None),
        ("decay", 0.99),
        ("momentum", 0.0),
        ("epsilon", 0.1),
        ("vf_loss_coeff", 0.5),
        ("entropy_coeff", 0.01),
        ("entropy_coeff_schedule", None),
        ("_separate_vf_optimizer", False),
        ("_lr_vf", 0.0005),
        ("min_time_s_per_iteration", 10),
        ("metrics_num_episodes_for_smoothing", 100),
        ("microbatch_size", None),
        ("env", None),
        ("env_config", {}),
        ("explore", True),
        ("restart_failed_env_runners", True),
        ("evaluation_interval", None),
        ("evaluation_duration", 10),
        ("render_env", False),
        ("record_env", False),
        ("checkpoint_freq", 1),
    ],
)
def test_defaults_match_rllib(key, rllib_default):
    assert getattr(ImpalaConfig(), key) == rllib_default


def test_model_defaults_match_rllib_and_are_not_shared():
    a, b = ImpalaConfig(), ImpalaConfig()
    assert a.model == MODEL_DEFAULTS
    assert a.model["fcnet_hiddens"] == [256, 256]
    assert a.model["fcnet_activation"] == "tanh"
    assert a.model["lstm_cell_size"] == 256
    assert a.model["max_seq_len"] == 20
    # RLlib 2.60's MODEL_DEFAULTS shares the torso between the policy and value heads.
    assert a.model["vf_share_layers"] is True
    a.model["fcnet_hiddens"].append(8)
    a.env_config["x"] = 1
    assert b.model["fcnet_hiddens"] == [256, 256]
    assert b.env_config == {}
    assert MODEL_DEFAULTS["fcnet_hiddens"] == [256, 256]


def test_default_config_validates_without_a_gpu_or_env():
    # num_gpus=1 with no GPU is not an error here: the runtime falls back to a CPU device.
    config = ImpalaConfig()
    config.validate()
    assert config.num_learner_devices == 1


def test_import_does_not_pull_in_tensorflow_or_gymnasium():
    code = (
        "import sys; import impala_tf.config; "
        "assert 'tensorflow' not in sys.modules and 'gymnasium' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# Builders ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "builder, kwargs",
    [
        ("training", {"lr": 0.001, "gamma": 0.9, "num_sgd_iter": 3, "grad_clip": None}),
        ("environment", {"env": "CartPole-v1", "env_config": {"a": 1}, "clip_rewards": True}),
        (
            "env_runners",
            {
                "num_env_runners": 4,
                "num_envs_per_env_runner": 8,
                "rollout_fragment_length": 20,
                "batch_mode": "truncate_episodes",
                "explore": False,
                "max_requests_in_flight_per_env_runner": 3,
            },
        ),
        ("resources", {"num_gpus": 2, "_fake_gpus": True}),
        ("debugging", {"seed": 7}),
        (
            "reporting",
            {"min_time_s_per_iteration": 0, "metrics_num_episodes_for_smoothing": 5},
        ),
        ("fault_tolerance", {"restart_failed_env_runners": False}),
        (
            "evaluation",
            {"evaluation_interval": 2, "evaluation_duration": 3, "evaluation_config": {}},
        ),
        ("checkpointing", {"keep_checkpoints_num": 2, "checkpoint_freq": 5}),
    ],
)
def test_builder_sets_keys_and_returns_self(builder, kwargs):
    config = ImpalaConfig()
    assert getattr(config, builder)(**kwargs) is config
    for key, value in kwargs.items():
        assert getattr(config, key) == value


def test_environment_accepts_env_positionally():
    config = ImpalaConfig().environment("CartPole-v1", env_config={"k": 2})
    assert config.env == "CartPole-v1"
    assert config.env_config == {"k": 2}


@pytest.mark.parametrize(
    "builder, key, right_builder",
    [
        ("env_runners", "lr", "training"),
        ("training", "num_env_runners", "env_runners"),
        ("resources", "seed", "debugging"),
        ("evaluation", "checkpoint_freq", "checkpointing"),
        ("framework", "lr", "training"),
    ],
)
def test_builder_rejects_keys_of_other_groups(builder, key, right_builder):
    with pytest.raises(TypeError, match=rf"`{key}`.*\.{right_builder}\("):
        getattr(ImpalaConfig(), builder)(**{key: 1})


def test_chained_builders():
    config = (
        ImpalaConfig()
        .environment("CartPole-v1")
        .env_runners(num_env_runners=1)
        .training(lr=0.01)
        .resources(num_gpus=0)
    )
    assert (config.env, config.num_env_runners, config.lr, config.num_gpus) == (
        "CartPole-v1",
        1,
        0.01,
        0,
    )


def test_training_model_merges_into_model_dict():
    config = ImpalaConfig().training(model={"fcnet_hiddens": [32]})
    config.training(model={"fcnet_activation": "relu"})
    assert config.model["fcnet_hiddens"] == [32]
    assert config.model["fcnet_activation"] == "relu"
    assert config.model["lstm_cell_size"] == 256


def test_unknown_model_key_suggests():
    with pytest.raises(ValueError, match=r"`fcnet_hidden`.*Did you mean 'fcnet_hiddens'"):
        ImpalaConfig().training(model={"fcnet_hidden": [32]})


def test_model_must_be_a_dict():
    with pytest.raises(ValueError, match="`model`"):
        ImpalaConfig().training(model=[32])


def test_model_alias_sets_both_keys_and_warns():
    with pytest.warns(DeprecatedKeyWarning, match="lstm_use_prev_action_reward"):
        config = ImpalaConfig().training(model={"lstm_use_prev_action_reward": True})
    assert config.model["lstm_use_prev_action"] is True
    assert config.model["lstm_use_prev_reward"] is True


def test_ignored_model_key_warns_and_is_dropped():
    with pytest.warns(ConfigWarning, match="_time_major"):
        config = ImpalaConfig().training(model={"_time_major": True})
    assert "_time_major" not in config.model


def test_values_are_copied_in():
    hiddens = [16]
    env_config = {"a": [1]}
    config = ImpalaConfig(model={"fcnet_hiddens": hiddens}, env_config=env_config)
    hiddens.append(4)
    env_config["a"].append(2)
    assert config.model["fcnet_hiddens"] == [16]
    assert config.env_config == {"a": [1]}


# Aliases, ignored and unknown keys --------------------------------------------------------------

ALIASES = [
    ("num_workers", "num_env_runners", 5),
    ("num_rollout_workers", "num_env_runners", 5),
    ("num_envs_per_worker", "num_envs_per_env_runner", 4),
    ("num_data_loader_buffers", "num_multi_gpu_tower_stacks", 2),
    ("max_sample_requests_in_flight_per_worker", "max_requests_in_flight_per_env_runner", 3),
    ("ignore_worker_failures", "restart_failed_env_runners", False),
    ("recreate_failed_workers", "restart_failed_env_runners", False),
    ("evaluation_num_episodes", "evaluation_duration", 7),
    ("metrics_smoothing_episodes", "metrics_num_episodes_for_smoothing", 9),
    ("min_time_s_per_reporting", "min_time_s_per_iteration", 3),
    ("sample_batch_size", "rollout_fragment_length", 25),
]


@pytest.mark.parametrize("old, new, value", ALIASES)
def test_alias_in_from_dict_maps_and_warns_naming_new_key(old, new, value):
    with pytest.warns(DeprecatedKeyWarning, match=rf"`{old}`.*`{new}`"):
        config = ImpalaConfig.from_dict({old: value})
    assert getattr(config, new) == value
    assert old not in config.to_dict()


@pytest.mark.parametrize("old, new, value", ALIASES)
def test_alias_in_builder_of_its_group(old, new, value):
    group = GROUPS[new]
    with pytest.warns(DeprecatedKeyWarning):
        config = getattr(ImpalaConfig(), group)(**{old: value})
    assert getattr(config, new) == value


def test_alias_warns_once_per_key():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ImpalaConfig(num_workers=1)
        ImpalaConfig(num_workers=3)
    assert len(caught) == 1
    assert "`num_workers`" in str(caught[0].message)
    # Attributed to the caller's line, not to a line of impala_tf.config.
    assert caught[0].filename == __file__


def test_num_epochs_is_a_silent_synonym_of_num_sgd_iter():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = ImpalaConfig().training(num_epochs=4)
    assert config.num_sgd_iter == 4
    assert config.num_epochs == 4
    config.num_epochs = 2
    assert config.num_sgd_iter == 2


def test_alias_and_new_name_with_different_values_conflict():
    with (
        pytest.warns(DeprecatedKeyWarning),
        pytest.raises(ValueError, match=r"Both `num_workers` and `num_env_runners`"),
    ):
        ImpalaConfig.from_dict({"num_workers": 2, "num_env_runners": 4})
    # Equal values are fine (the alias warning was already shown above).
    same = ImpalaConfig.from_dict({"num_workers": 4, "num_env_runners": 4})
    assert same.num_env_runners == 4


@pytest.mark.parametrize(
    "key, value",
    [
        ("framework", "tf2"),
        ("_disable_execution_plan_api", True),
        ("num_gpus_per_worker", 0),
        ("num_cpus_for_driver", 1),
        ("eager_tracing", True),
        ("log_level", "WARN"),
        ("_enable_new_api_stack", False),
        ("enable_rl_module_and_learner", False),
        ("enable_env_runner_and_connector_v2", False),
        ("create_env_on_driver", False),
        ("simple_optimizer", False),
    ],
)
def test_ignored_key_warns_once_and_changes_nothing(key, value):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = ImpalaConfig.from_dict({key: value})
        ImpalaConfig.from_dict({key: value})
    assert len(caught) == 1
    assert issubclass(caught[0].category, ConfigWarning)
    assert f"`{key}`" in str(caught[0].message)
    assert config == ImpalaConfig()


def test_ignored_keys_accepted_by_any_builder():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = ImpalaConfig().framework("tf2", eager_tracing=True)
        config.api_stack(enable_rl_module_and_learner=False)
        config.env_runners(num_gpus_per_env_runner=0)
    named = [str(w.message).split("`")[1] for w in caught]
    assert named == [
        "framework",
        "eager_tracing",
        "enable_rl_module_and_learner",
        "num_gpus_per_env_runner",
    ]
    assert all(issubclass(w.category, ConfigWarning) for w in caught)
    assert config == ImpalaConfig()


def test_rollouts_is_a_deprecated_env_runners():
    with pytest.warns(DeprecatedKeyWarning, match="env_runners"):
        config = ImpalaConfig().rollouts(num_rollout_workers=3)
    assert config.num_env_runners == 3


@pytest.mark.parametrize(
    "key, suggestion",
    [
        ("lrr", "lr"),
        ("num_env_runner", "num_env_runners"),
        ("entropy_coef", "entropy_coeff"),
        ("num_worker", "num_workers"),
        ("vtrace_clip_rho", "vtrace_clip_rho_threshold"),
    ],
)
def test_unknown_key_names_it_and_suggests(key, suggestion):
    with pytest.raises(ValueError, match=rf"`{key}`.*Did you mean '{suggestion}'\?"):
        ImpalaConfig.from_dict({key: 1})


def test_unknown_key_without_close_match():
    with pytest.raises(ValueError, match="`zzzz_qqq`") as info:
        ImpalaConfig().training(zzzz_qqq=1)
    assert "Did you mean" not in str(info.value)


@pytest.mark.parametrize("key", ["sgd_minibatch_size", "minibatch_size"])
def test_minibatch_keys_have_no_equivalent(key):
    with pytest.raises(ValueError, match=rf"`{key}`.*not supported.*microbatch_size"):
        ImpalaConfig.from_dict({key: 128})
    with pytest.warns(ConfigWarning, match=key):
        config = ImpalaConfig.from_dict({key: None})
    assert config == ImpalaConfig()


# Validation -------------------------------------------------------------------------------------

INVALID = [
    # (settings, key named in the message)
    ({"vtrace": False}, "IMPALA does not support vtrace=False"),
    ({"entropy_coeff": -0.1}, "entropy_coeff"),
    ({"num_env_runners": 2, "num_aggregation_workers": 3}, "num_aggregation_workers"),
    ({"opt_type": "rmsprop", "_separate_vf_optimizer": True}, "_separate_vf_optimizer"),
    ({"opt_type": "sgd"}, "opt_type"),
    ({"num_gpus": 2, "train_batch_size": 501}, "train_batch_size"),
    ({"num_gpus": 3, "_fake_gpus": True, "train_batch_size": 500}, "train_batch_size"),
    ({"microbatch_size": 500}, "microbatch_size"),
    ({"microbatch_size": 0}, "microbatch_size"),
    ({"batch_mode": "complete_episodes"}, "batch_mode"),
    ({"batch_mode": "whatever"}, "batch_mode"),
    ({"lr": -1e-3}, "lr"),
    ({"lr": "fast"}, "lr"),
    ({"lr": float("nan")}, "lr"),
    ({"_lr_vf": -1.0}, "_lr_vf"),
    ({"train_batch_size": 0}, "train_batch_size"),
    ({"train_batch_size": 10.5}, "train_batch_size"),
    ({"rollout_fragment_length": 0}, "rollout_fragment_length"),
    ({"num_envs_per_env_runner": 0}, "num_envs_per_env_runner"),
    ({"num_env_runners": -1}, "num_env_runners"),
    ({"num_sgd_iter": 0}, "num_sgd_iter"),
    ({"learner_queue_size": 0}, "learner_queue_size"),
    ({"learner_queue_timeout": 0}, "learner_queue_timeout"),
    ({"minibatch_buffer_size": 0}, "minibatch_buffer_size"),
    ({"num_multi_gpu_tower_stacks": 0}, "num_multi_gpu_tower_stacks"),
    ({"num_gpu_loader_threads": 0}, "num_gpu_loader_threads"),
    ({"precision": "bfloat16"}, "precision"),
    ({"broadcast_interval": 0}, "broadcast_interval"),
    ({"max_requests_in_flight_per_env_runner": 0}, "max_requests_in_flight_per_env_runner"),
    ({"max_requests_in_flight_per_aggregator_worker": 0}, "max_requests_in_flight_per_aggre"),
    ({"timeout_s_sampler_manager": -1}, "timeout_s_sampler_manager"),
    ({"timeout_s_aggregator_manager": -1}, "timeout_s_aggregator_manager"),
    ({"grad_clip": 0.0}, "grad_clip"),
    ({"grad_clip": -5}, "grad_clip"),
    ({"gamma": 1.5}, "gamma"),
    ({"gamma": -0.1}, "gamma"),
    ({"replay_proportion": -0.5}, "replay_proportion"),
    ({"replay_buffer_num_slots": -1}, "replay_buffer_num_slots"),
    ({"vtrace_clip_rho_threshold": 0.0}, "vtrace_clip_rho_threshold"),
    ({"vtrace_clip_pg_rho_threshold": -1.0}, "vtrace_clip_pg_rho_threshold"),
    ({"vtrace_drop_last_ts": "yes"}, "vtrace_drop_last_ts"),
    ({"decay": 1.5}, "decay"),
    ({"momentum": -0.1}, "momentum"),
    ({"epsilon": 0.0}, "epsilon"),
    ({"vf_loss_coeff": -1}, "vf_loss_coeff"),
    ({"num_gpus": -1}, "num_gpus"),
    ({"_fake_gpus": 1}, "_fake_gpus"),
    ({"explore": "no"}, "explore"),
    ({"compress_observations": None}, "compress_observations"),
    ({"restart_failed_env_runners": 0}, "restart_failed_env_runners"),
    ({"seed": 1.5}, "seed"),
    ({"min_time_s_per_iteration": -1}, "min_time_s_per_iteration"),
    ({"min_sample_timesteps_per_iteration": -1}, "min_sample_timesteps_per_iteration"),
    ({"metrics_num_episodes_for_smoothing": 0}, "metrics_num_episodes_for_smoothing"),
    ({"evaluation_interval": -1}, "evaluation_interval"),
    ({"evaluation_duration": 0}, "evaluation_duration"),
    ({"evaluation_duration": "auto"}, "evaluation_duration"),
    ({"evaluation_config": [1]}, "evaluation_config"),
    ({"evaluation_config": {"lrr": 0.1}}, "evaluation_config"),
    ({"evaluation_config": {"explore": "no"}}, "evaluation_config"),
    ({"render_env": "yes"}, "render_env"),
    ({"record_env": 1}, "record_env"),
    ({"record_env": " "}, "record_env"),
    ({"render_env": True, "env_config": {"render_mode": "human"}}, "render_env"),
    ({"record_env": "clips", "env_config": {"render_mode": "ansi"}}, "record_env"),
    ({"video_episodes": 0}, "video_episodes"),
    ({"video_max_frames": 1}, "video_max_frames"),
    ({"video_max_width": 8}, "video_max_width"),
    ({"video_max_width": 64.5}, "video_max_width"),
    ({"video_interval": 0}, "video_interval"),
    ({"evaluation_config": {"render_env": "yes"}}, "`evaluation_config`: `render_env`"),
    ({"evaluation_config": {"video_max_frames": 0}}, "`evaluation_config`: `video_max_frames`"),
    ({"keep_checkpoints_num": 0}, "keep_checkpoints_num"),
    ({"checkpoint_freq": -1}, "checkpoint_freq"),
    ({"env_config": [1, 2]}, "env_config"),
    ({"env": 42}, "env"),
    ({"env": "CartPole-v9"}, "env"),
    ({"env": "NoSuchEnvironment-v0"}, "env"),
    ({"env": "ALE/NoSuchGame-v5"}, "env"),
    ({"clip_rewards": -1.0}, "clip_rewards"),
    ({"clip_rewards": "sign"}, "clip_rewards"),
    ({"lr_schedule": [[0, 1e-3], [-10, 1e-4]]}, "lr_schedule"),
    ({"lr_schedule": [[100, 1e-3], [10, 1e-4]]}, "lr_schedule"),
    ({"lr_schedule": [[0, 1e-3, 5]]}, "lr_schedule"),
    ({"lr_schedule": [[0, "x"]]}, "lr_schedule"),
    ({"lr_schedule": []}, "lr_schedule"),
    ({"lr_schedule": 0.001}, "lr_schedule"),
    ({"lr_schedule": "0.001"}, "lr_schedule"),
    ({"entropy_coeff_schedule": [[0, 0.01], [10]]}, "entropy_coeff_schedule"),
    ({"entropy_coeff_schedule": -5}, "entropy_coeff_schedule"),
    ({"entropy_coeff_schedule": {"0": 0.01}}, "entropy_coeff_schedule"),
    ({"model": {"fcnet_activation": "gelu"}}, "fcnet_activation"),
    ({"model": {"conv_activation": "sigmoid"}}, "conv_activation"),
    ({"model": {"post_fcnet_activation": "sigmoid"}}, "post_fcnet_activation"),
    ({"model": {"post_fcnet_hiddens": [64, -1]}}, "post_fcnet_hiddens"),
    ({"model": {"fcnet_hiddens": [64, 0]}}, "fcnet_hiddens"),
    ({"model": {"fcnet_hiddens": 64}}, "fcnet_hiddens"),
    ({"model": {"lstm_cell_size": 0}}, "lstm_cell_size"),
    ({"model": {"max_seq_len": 0}}, "max_seq_len"),
    ({"model": {"dim": -84}}, "dim"),
    ({"model": {"custom_model": "my_net"}}, "custom_model"),
    ({"model": {"conv_filters": [[16, 8]]}}, "conv_filters"),
    ({"model": {"conv_filters": []}}, "conv_filters"),
    ({"model": {"use_lstm": "yes"}}, "use_lstm"),
    ({"model": {"center_pixels": 1}}, "center_pixels"),
    ({"model": {"center_pixels": True, "custom_model": "nature_cnn"}}, "center_pixels"),
]


@pytest.mark.parametrize("settings, named", INVALID, ids=[str(s) for s, _ in INVALID])
def test_validate_rejects_and_names_the_key(settings, named):
    config = ImpalaConfig.from_dict(settings)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        with pytest.raises(ValueError) as info:
            config.validate()
    assert named in str(info.value)


def test_unknown_env_id_message_passes_on_gymnasium_hint():
    with pytest.raises(ValueError, match=r"`env` 'CartPol-v1'.*CartPole"):
        ImpalaConfig(env="CartPol-v1").validate()


@pytest.mark.parametrize(
    "settings",
    [
        {"vtrace_clip_rho_threshold": None, "vtrace_clip_pg_rho_threshold": None},
        {"grad_clip": None},
        {"opt_type": "rmsprop"},
        {"_separate_vf_optimizer": True, "_lr_vf": 0.00075},
        {"num_env_runners": 0, "num_envs_per_env_runner": 3},
        {"microbatch_size": 100},
        {"num_gpus": 0},
        {"num_gpus": 0.5},
        {"num_gpus": 2, "_fake_gpus": True, "train_batch_size": 500},
        {"num_aggregation_workers": 1, "num_env_runners": 4},
        {"entropy_coeff_schedule": 1000},
        {"lr_schedule": [[0, 1e-3], [0, 5e-4], [1000, 0.0]]},
        {"model": {"custom_model": "impala_resnet", "conv_filters": [[16, [8, 8], 4], [32, 4, 2]]}},
        {"model": {"fcnet_hiddens": [], "fcnet_activation": "linear"}},
        {"model": {"center_pixels": True}},
        {"evaluation_interval": 0},
        {"evaluation_config": None},
        {"evaluation_config": {"explore": False}},
        {
            "evaluation_interval": 1,
            "evaluation_config": {
                "render_env": True,
                "record_env": "clips",
                "video_max_width": None,
            },
        },
        {"evaluation_interval": 2, "record_env": True, "env_config": {"render_mode": "rgb_array"}},
        {"env": "CartPole-v1", "clip_rewards": True},
        {"clip_rewards": 5.0},
        {"min_time_s_per_iteration": None},
        {"seed": 0},
    ],
)
def test_validate_accepts_legal_settings(settings):
    ImpalaConfig.from_dict(settings).validate()


def test_require_env():
    with pytest.raises(ValueError, match="`env` is not set"):
        ImpalaConfig().validate(require_env=True)
    ImpalaConfig(env="CartPole-v1").validate(require_env=True)


def test_env_callable_and_env_class_are_accepted():
    def make_env(env_config):
        return gym.make("CartPole-v1", **env_config)

    config = ImpalaConfig().environment(make_env)
    config.validate(require_env=True)
    assert config.env is make_env
    assert config.copy().env is make_env
    assert ImpalaConfig.from_dict(config.to_dict()) == config

    class MyEnv(gym.Env):
        def __init__(self, env_config):
            super().__init__()

    ImpalaConfig(env=MyEnv).validate(require_env=True)


@pytest.mark.parametrize(
    "settings",
    [{"render_env": True}, {"evaluation_config": {"record_env": "clips"}}],
)
def test_recording_without_evaluation_during_training_warns(settings):
    with pytest.warns(ConfigWarning, match="`evaluation_interval` is not set"):
        ImpalaConfig.from_dict(settings).validate()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        ImpalaConfig.from_dict({**settings, "evaluation_interval": 3}).validate()


def test_aggregation_workers_above_half_warns():
    config = ImpalaConfig(num_env_runners=4, num_aggregation_workers=3)
    with pytest.warns(ConfigWarning, match="num_aggregation_workers"):
        config.validate()


def test_multi_device_derives_the_minibatch_ring_and_warns_without_changing_the_config():
    config = ImpalaConfig(
        num_gpus=2, _fake_gpus=True, num_multi_gpu_tower_stacks=3, minibatch_buffer_size=1
    )
    message = r"num_multi_gpu_tower_stacks=3.*minibatch_buffer_size=1"
    with pytest.warns(ConfigWarning, match=message):
        config.validate()
    assert config.minibatch_buffer_size == 1  # RLlib's value stays; the ring is derived.
    assert config.minibatch_ring_size == 3
    assert config.num_learner_devices == 2


def test_single_device_keeps_minibatch_buffer_size():
    config = ImpalaConfig(num_gpus=1, num_multi_gpu_tower_stacks=3, minibatch_buffer_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        config.validate()
    assert config.minibatch_buffer_size == 2
    assert config.minibatch_ring_size == 2


@pytest.mark.parametrize(
    "settings",
    [
        # Adjusted in place by validate() before the one runtime (minibatch_buffer_size := 3).
        {"num_gpus": 2, "_fake_gpus": True, "num_multi_gpu_tower_stacks": 3},
        {"num_gpus": 4, "_fake_gpus": True, "minibatch_buffer_size": 5, "train_batch_size": 400},
        {
            "env": "impala_tf/MultiAgentCartPole",
            "env_config": {"num_agents": 2},
            "policies": ["p0", "p1"],
            "policy_mapping_fn": "impala_tf.config.policies.PolicyMappingFn",
            "policies_to_train": ["p0"],
        },
        {"evaluation_config": {"explore": False, "num_env_runners": 1}, "evaluation_interval": 2},
        {"entropy_coeff_schedule": 1000, "lr_schedule": ((0, 1e-3), (100, 1e-4))},
        {"num_env_runners": 4, "num_aggregation_workers": 3, "ray_address": "auto"},
    ],
)
def test_validate_never_changes_the_config(settings):
    config = ImpalaConfig.from_dict(settings)
    before = config.to_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        config.validate(require_env="env" in settings)
        config.validate()
    assert config.to_dict() == before
    assert config == ImpalaConfig.from_dict(settings)


@pytest.mark.parametrize("num_gpus, devices", [(0, 1), (0.5, 1), (1, 1), (2, 2), (4.0, 4)])
def test_num_learner_devices(num_gpus, devices):
    assert ImpalaConfig(num_gpus=num_gpus).num_learner_devices == devices


def test_evaluation_config_applies_overrides_with_aliases():
    config = ImpalaConfig(evaluation_config={"explore": False, "num_workers": 1})
    with pytest.warns(DeprecatedKeyWarning):
        evaluation = config.get_evaluation_config()
    assert evaluation.explore is False
    assert evaluation.num_env_runners == 1
    assert evaluation.evaluation_config == {}
    assert config.explore is True


# Schedules --------------------------------------------------------------------------------------


def test_schedule_points():
    config = ImpalaConfig()
    assert config.lr_schedule_points() is None
    assert config.entropy_coeff_schedule_points() is None
    config.training(lr_schedule=[[0, 1e-3], [1000, 1e-4]], entropy_coeff=0.02)
    assert config.lr_schedule_points() == [[0, 1e-3], [1000, 1e-4]]
    config.training(entropy_coeff_schedule=5000)
    assert config.entropy_coeff_schedule_points() == [[0, 0.02], [5000, 0.0]]
    config.training(entropy_coeff_schedule=((0, 1), (10, 0.5)))
    points = config.entropy_coeff_schedule_points()
    assert points == [[0, 1.0], [10, 0.5]]
    assert all(isinstance(v, float) for _, v in points)


def test_schedule_points_are_fresh_lists():
    config = ImpalaConfig(lr_schedule=[[0, 1e-3]])
    config.lr_schedule_points()[0][1] = 99.0
    assert config.lr_schedule == [[0, 1e-3]]


# Serialisation ----------------------------------------------------------------------------------


def test_to_dict_is_json_serialisable_and_round_trips():
    config = (
        ImpalaConfig()
        .environment("CartPole-v1", env_config={"x": 1})
        .training(lr_schedule=[[0, 1e-3], [10, 0.0]], model={"use_lstm": True}, _lr_vf=0.1)
        .resources(num_gpus=0)
    )
    as_dict = config.to_dict()
    assert set(as_dict) == set(GROUPS)
    restored = ImpalaConfig.from_dict(json.loads(json.dumps(as_dict)))
    assert restored == config
    assert restored is not config
    as_dict["model"]["fcnet_hiddens"].append(1)
    assert config.model["fcnet_hiddens"] == [256, 256]


def test_pickle_round_trip():
    # Configs travel to actor processes by pickle.
    config = ImpalaConfig(env="CartPole-v1", lr=0.1, model={"use_lstm": True})
    assert pickle.loads(pickle.dumps(config)) == config


def test_copy_is_deep_and_equality_compares_values():
    config = ImpalaConfig(env="CartPole-v1")
    clone = config.copy()
    assert clone == config
    clone.model["fcnet_hiddens"] = [8]
    assert clone != config
    assert config.model["fcnet_hiddens"] == [256, 256]
    assert ImpalaConfig(lr=0.1) != ImpalaConfig()
    assert ImpalaConfig() != {"lr": 0.0005}


def test_repr_is_short_and_shows_changes():
    assert repr(ImpalaConfig()) == "ImpalaConfig(env=None)"
    text = repr(ImpalaConfig(env="CartPole-v1", lr=0.1, model={"fcnet_hiddens": [8]}))
    assert text == "ImpalaConfig(env='CartPole-v1', lr=0.1, model.fcnet_hiddens=[8])"
    many = ImpalaConfig(lr=0.1, gamma=0.5, seed=1, decay=0.5, momentum=0.1, epsilon=1.0, _lr_vf=1.0)
    assert repr(many).endswith("... 1 more)")


# YAML and stop criteria -------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_yaml_reads_and_validates(path):
    search = read_search_file(path)
    if search.scheduler is None and not search_space_paths(search.settings):
        config, _ = ImpalaConfig.from_yaml(path)
        config.validate(require_env=True)
        return
    from impala_tf.tune.search import make_scheduler, resolved_points

    points = resolved_points(search.settings)  # A search: every trial's config validates.
    assert len(points) > 1 or search.scheduler is not None
    for point in points:
        config_class(search.algo_name).from_dict(point).validate(require_env=True)
    if search.scheduler is None:
        return
    if str(search.scheduler.get("type", "")).lower() == "pb2" and not find_spec("sklearn"):
        # The test extra leaves scikit-learn out (see setup.py): the PB2 config reads and
        # validates up to the error that names the extra it needs.
        with pytest.raises(ImportError, match=r"impala_tf\[pb2\]"):
            make_scheduler(search.scheduler)
        return
    make_scheduler(search.scheduler)


def test_from_yaml_cartpole():
    config, stop = ImpalaConfig.from_yaml(CONFIGS / "cartpole-impala.yaml")
    config.validate(require_env=True)
    assert config.env == "CartPole-v1"
    assert stop == {"episode_reward_mean": 450, "timesteps_total": 2000000}
    assert config.num_env_runners == 2
    assert config.num_envs_per_env_runner == 32
    assert config.train_batch_size == 1000
    assert config.lr == 0.002
    assert config.min_time_s_per_iteration == 1
    assert config.clip_rewards == 0.1
    assert config.entropy_coeff == 0.005
    assert config.model["fcnet_hiddens"] == [64, 64]


def test_from_yaml_separate_losses_with_new_stop_keys():
    config, stop = ImpalaConfig.from_yaml(CONFIGS / "cartpole-impala-separate-losses.yaml")
    config.validate(require_env=True)
    assert stop == {"episode_reward_mean": 150, "timesteps_total": 200000}
    assert config._separate_vf_optimizer is True
    assert config._lr_vf == 0.00075
    assert config.num_sgd_iter == 6
    assert config.vf_loss_coeff == 0.01
    assert config.train_batch_size == 500


def _write(tmp_path, text):
    path = tmp_path / "experiment.yaml"
    path.write_text(text)
    return path


def test_from_yaml_new_style_keys_aliases_and_ignored_keys(tmp_path):
    path = _write(
        tmp_path,
        """
my-impala:
    run: impala
    checkpoint_freq: 5
    stop:
        env_runners/episode_return_mean: 200
        num_env_steps_sampled_lifetime: 100000
        training_iteration: 30
        time_total_s: 600
    config:
        env: CartPole-v1
        framework: tf2
        num_workers: 3
        num_epochs: 2
        lr: 5e-4
        _lr_vf: 1.5E-3
        lr_schedule: [[0, 1e-3], [1e6, 0]]
        model: {fcnet_hiddens: [64], vf_share_layers: true}
""",
    )
    with pytest.warns(ConfigWarning) as record:
        config, stop = ImpalaConfig.from_yaml(path)
    messages = " ".join(str(w.message) for w in record)
    assert "`framework`" in messages and "`num_workers`" in messages
    assert stop == {
        "episode_reward_mean": 200,
        "timesteps_total": 100000,
        "training_iteration": 30,
        "time_total_s": 600,
    }
    assert config.env == "CartPole-v1"
    assert config.num_env_runners == 3
    assert config.num_sgd_iter == 2
    assert config.checkpoint_freq == 5
    # PyYAML alone would read these as strings.
    assert config.lr == 5e-4 and config._lr_vf == 1.5e-3
    assert config.lr_schedule_points() == [[0, 1e-3], [1e6, 0.0]]
    assert config.model["vf_share_layers"] is True
    config.validate(require_env=True)


@pytest.mark.parametrize(
    "text, message",
    [
        ("a:\n  run: PPO\n  env: CartPole-v1\n", "`run` must be one of IMPALA, APPO, got 'PPO'"),
        ("a:\n  env: CartPole-v1\n", "`run` must be one of IMPALA, APPO, got None"),
        ("a:\n  run: IMPALA\nb:\n  run: IMPALA\n", "exactly one"),
        ("", "exactly one"),
        ("a: 3\n", "must be a mapping"),
        ("a:\n  run: IMPALA\n  num_samples: 4\n", "num_samples"),
        ("a:\n  run: IMPALA\n  config: [1]\n", "`config`"),
        (
            "a:\n  run: IMPALA\n  env: CartPole-v1\n  config: {env: Pendulum-v1}\n",
            "`env`",
        ),
        ("a:\n  run: IMPALA\n  stop: {reward: 1}\n", "`reward`"),
        ("a:\n  run: IMPALA\n  config: {lrr: 0.1}\n", "Did you mean 'lr'"),
    ],
)
def test_from_yaml_errors(tmp_path, text, message):
    with pytest.raises(ValueError, match=message):
        ImpalaConfig.from_yaml(_write(tmp_path, text))


def test_read_experiment_reads_pass_criteria_in_any_spelling_and_from_yaml_accepts_them(tmp_path):
    path = _write(
        tmp_path,
        """
pong:
    run: IMPALA
    env: CartPole-v1
    stop: {episode_reward_mean: 18}
    pass_criteria:
        - {sampler_results/episode_reward_mean: 18, num_env_steps_sampled_lifetime: 5000000}
        - {episode_reward_mean: 0, time_total_s: 1200, training_iteration: 300}
""",
    )
    experiment = ImpalaConfig.read_experiment(path)
    assert experiment.name == "pong" and isinstance(experiment.config, ImpalaConfig)
    assert experiment.stop == {"episode_reward_mean": 18}
    assert experiment.pass_criteria == [
        {"episode_reward_mean": 18, "timesteps_total": 5000000},
        {"episode_reward_mean": 0, "time_total_s": 1200, "training_iteration": 300},
    ]
    config, stop = ImpalaConfig.from_yaml(path)
    assert config.env == "CartPole-v1" and stop == {"episode_reward_mean": 18}
    one = _write(tmp_path, "a:\n  run: IMPALA\n  pass_criteria: {episode_reward_mean: 1, "
                 "timesteps_total: 10}\n")  # fmt: skip
    assert ImpalaConfig.read_experiment(one).pass_criteria == [
        {"episode_reward_mean": 1, "timesteps_total": 10}
    ]
    with pytest.warns(DeprecatedKeyWarning):  # RLlib's file, old key names and all.
        assert ImpalaConfig.read_experiment(CONFIGS / "pong-impala.yaml").pass_criteria == []


@pytest.mark.parametrize(
    "block, message",
    [
        ("{timesteps_total: 10}", "needs the return to reach"),
        ("{episode_reward_mean: 1}", "sets no limit"),
        ("{episode_reward_mean: 1, timesteps_total: 0}", "must be > 0"),
        ("{episode_reward_mean: 1, timesteps_total: 10, episode_len_mean: 3}", "episode_len_mean"),
        ("{episode_reward_mean: 1, timesteps_total: 10, time_total_s: x}", "must be a number"),
        ("[1, 2]", "a list of them"),
    ],
)
def test_pass_criteria_errors_name_the_file_and_what_is_wrong(tmp_path, block, message):
    path = _write(tmp_path, f"a:\n  run: IMPALA\n  pass_criteria: {block}\n")
    with pytest.raises(ValueError, match=message) as error:
        ImpalaConfig.read_experiment(path)
    assert str(path) in str(error.value)
    with pytest.raises(ValueError, match=message):  # Training refuses the file too.
        ImpalaConfig.from_yaml(path)


def test_from_yaml_env_in_both_places_when_equal(tmp_path):
    path = _write(tmp_path, "a:\n  run: IMPALA\n  env: CartPole-v1\n  config: {env: CartPole-v1}\n")
    config, stop = ImpalaConfig.from_yaml(path)
    assert config.env == "CartPole-v1"
    assert stop == {}


@pytest.mark.parametrize(
    "stop, expected",
    [
        ({"episode_reward_mean": 1}, {"episode_reward_mean": 1}),
        ({"env_runners/episode_return_mean": 2}, {"episode_reward_mean": 2}),
        ({"sampler_results/episode_reward_mean": 3}, {"episode_reward_mean": 3}),
        ({"num_env_steps_sampled_lifetime": 4}, {"timesteps_total": 4}),
        ({"num_env_steps_sampled": 5}, {"timesteps_total": 5}),
        (
            {"timesteps_total": 6, "training_iteration": 7},
            {"timesteps_total": 6, "training_iteration": 7},
        ),
        ({"time_total_s": 8.5}, {"time_total_s": 8.5}),
        (
            {"episode_reward_mean": 9, "env_runners/episode_return_mean": 9},
            {"episode_reward_mean": 9},
        ),
        (None, {}),
    ],
)
def test_normalize_stop_criteria(stop, expected):
    assert normalize_stop_criteria(stop) == expected


@pytest.mark.parametrize(
    "stop, message",
    [
        ({"episode_reward_men": 1}, "Did you mean 'episode_reward_mean'"),
        ({"timesteps_total": "many"}, "`timesteps_total` must be a number"),
        ({"timesteps_total": 1, "num_env_steps_sampled_lifetime": 2}, "keep one"),
    ],
)
def test_normalize_stop_criteria_errors(stop, message):
    with pytest.raises(ValueError, match=message):
        normalize_stop_criteria(stop)


# build ------------------------------------------------------------------------------------------


def test_build_validates_before_building_anything():
    config = ImpalaConfig()
    with pytest.raises(ValueError, match="`env` is not set"):
        config.build()
    with pytest.raises(ValueError, match="entropy_coeff"):
        config.training(entropy_coeff=-1.0).build(env="CartPole-v1")
    assert config.env == "CartPole-v1"  # `env=` is set first, as in RLlib.


class _RLlibLogger:
    """What RLlib's `logger_creator` returns: a logger whose `logdir` is the run's directory."""

    def __init__(self, logdir: str):
        self.logdir = logdir


def test_build_takes_the_run_directory_from_the_loggers_logdir(tmp_path):
    # Every 25th step pays 3e38: the squared value error overflows, so updates are skipped and
    # their train batches saved to <logdir>/nonfinite/.
    config = small_config(env=HugeRewardCartPole, num_env_runners=1, max_nonfinite_updates=1000)
    logdir = str(tmp_path / "run")
    given = []

    def logger_creator(config_dict):
        given.append(config_dict)
        return _RLlibLogger(logdir)

    algo = config.build(logger_creator=logger_creator)
    try:
        assert given == [config.to_dict()]  # Called once, with the config as a dict (RLlib's).
        assert algo.logdir == logdir
        for _ in range(10):
            if algo.train()["num_nonfinite_updates_skipped"]:
                break
        saved = sorted((tmp_path / "run" / "nonfinite").glob("batch_*.npz"))
        assert saved, os.listdir(tmp_path)
    finally:
        algo.stop()
    with pytest.raises(ValueError, match="pass one"):
        config.build(logger_creator=logger_creator, logdir=str(tmp_path / "other"))


def test_build_ignores_a_logger_without_logdir_with_a_warning():
    config = small_config(num_env_runners=1, env=None)
    with pytest.warns(ConfigWarning, match=r"`logger_creator` returned object.*no `logdir`"):
        algo = config.build("CartPole-v1", logger_creator=lambda config_dict: object())
    try:
        assert algo.logdir is None
        assert algo.train()["num_env_steps_trained"] > 0
    finally:
        algo.stop()


class ForkServerProbe(keras.callbacks.Callback):
    """A learner callback that ends the build once the learners are made, reporting in its
    ValueError whether this process runs a multiprocessing fork server (for local actors)."""

    def set_model(self, model):
        super().set_model(model)
        running = any(
            "multiprocessing.forkserver" in " ".join(proclib.cmdline(pid))
            for pid in descendants(os.getpid())
        )
        raise ValueError(f"ForkServerProbe: fork server running={running}")


# `ImpalaConfig.build()` as a user's script calls it, once per backend named on the command line
# (Ray first: a local build leaves the fork server running in this process). It ends as the
# binaries do, without the interpreter's teardown.
_BUILD_SCRIPT = (
    """
import sys
from tests.config_test import ForkServerProbe
from tests.support.configs import small_config

for backend in sys.argv[1:]:
    try:
        small_config(backend=backend, num_env_runners=1).build(callbacks=[ForkServerProbe()])
    except ValueError as e:
        print(f"build-{backend}: {e}", flush=True)
"""
    + EXIT_WITHOUT_TEARDOWN
)


def test_build_and_impala_train_go_through_one_factory_that_honours_actor_backend(tmp_path):
    """Both start the local actors' fork server only for `actor_backend: local` (the train
    binary used to start one for Ray actors too). Each runs Ray first, then local, in one
    process of its own (a local build leaves the fork server running in its process)."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "HOME": str(tmp_path),  # Ray writes its auth token under ~/.ray.
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    env.pop("RAY_ADDRESS", None)
    log = tmp_path / "build.log"
    build = run_in_background([sys.executable, "-c", _BUILD_SCRIPT, "ray", "local"], REPO, env, log)
    try:
        train_runs = run_binary_in_one_process(
            "impala_tf.bin.train",
            {
                backend: [
                    f"--logdir={tmp_path / backend}",
                    "--set=num_env_runners=1",
                    "--set=num_gpus=0",
                    f"--set=actor_backend={backend}",
                    "--learner_callbacks=tests.config_test:ForkServerProbe",
                ]
                for backend in ("ray", "local")
            },
            cwd=REPO,
            env=env,
            log_dir=tmp_path,
        )
        build.wait(timeout=240)
        text = log.read_text()
    finally:
        kill_session(build)
    for backend, expected in (("ray", "False"), ("local", "True")):
        line = f"build-{backend}: ForkServerProbe: fork server running={expected}"
        assert line in text, log_tail(log)
        code, output = train_runs[backend]
        assert f"ForkServerProbe: fork server running={expected}" in output, (backend, output)
        assert code == 1 and "impala-train: error: ForkServerProbe" in output, (backend, output)


@pytest.mark.parametrize(
    "settings, key",
    [
        ({"lr": {"grid_search": [0.001, 0.002]}}, "lr"),
        ({"model": {"fcnet_hiddens": {"grid_search": [[64], [256, 256]]}}}, "model.fcnet_hiddens"),
    ],
)
def test_a_tune_grid_search_is_refused_with_an_error_that_names_the_key(settings, key):
    with pytest.raises(ValueError, match=rf"`{re.escape(key)}` is a Ray Tune search space"):
        ImpalaConfig.from_dict({"env": "CartPole-v1", **settings})
