"""Checking an `ImpalaConfig`'s values: pure functions that raise, naming the key, or warn.

`validate(config)` is what `AlgorithmConfig.validate()` runs. It never changes the config it
checks: settings that RLlib adjusts silently (the minibatch buffer in multi-device mode) are
derived values of the config (`AlgorithmConfig.minibatch_ring_size`), and a warning says so.
Messages say what would go wrong and how to fix it.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import warnings
from collections.abc import Mapping
from typing import Any

from impala_tf.config.keys import (
    ACTIVATIONS,
    ACTOR_BACKENDS,
    CUSTOM_MODELS,
    FILTER_NAMES,
    OPTIMIZERS,
    PRECISIONS,
    RAY_ADDRESS,
    ConfigWarning,
    is_conv_filter,
    is_int,
    is_number,
    warn,
    warn_once,
)

__all__ = ["check_bool", "check_int", "check_number", "validate"]


def validate(config: Any, require_env: bool = False) -> None:
    """Checks every value of `config`, raising on the first bad one; never changes `config`.

    Args:
      config: An `impala_tf.config.base.AlgorithmConfig`.
      require_env: Also require `env` to be set (as `build()` does).

    Raises:
      ValueError: naming the offending key, saying what would go wrong and how to fix it.
    """
    _env(config, require_env)
    _sampling(config)
    _learning(config)
    _runtime(config)
    _model(config)
    _multi_device(config)
    _video(config)
    if config.callbacks_class is not None:
        from impala_tf.config.callbacks import resolve_callbacks  # numpy only.

        resolve_callbacks(config.callbacks_class)
    if config.policies is not None or config.policy_mapping_fn is not None:
        from impala_tf.config.policies import validate_multi_agent

        validate_multi_agent(config)
    if not isinstance(config.evaluation_config, (Mapping, type(None))):
        raise ValueError(
            f"`evaluation_config` must be a dict of overrides, got {config.evaluation_config!r}."
        )
    if config.evaluation_config:
        evaluation = config.get_evaluation_config()
        with warnings.catch_warnings():
            # The main config already warned about anything the overrides left unchanged.
            warnings.simplefilter("ignore", ConfigWarning)
            try:
                validate(evaluation, require_env=False)
            except ValueError as e:
                raise ValueError(f"`evaluation_config`: {e}") from e


def _module_available(name: str) -> bool:
    """Whether `name` can be imported (without importing it)."""
    if name in sys.modules:
        return sys.modules[name] is not None
    return importlib.util.find_spec(name) is not None


def _env(config, require_env: bool) -> None:
    env = config.env
    if env is None:
        if require_env:
            raise ValueError(
                "`env` is not set: pass a gymnasium id or an `env_creator(env_config)` "
                "callable, e.g. `config.environment('CartPole-v1')`."
            )
    elif isinstance(env, str):
        _check_gymnasium_id(env)
    elif not callable(env):
        raise ValueError(
            f"`env` must be a gymnasium id (str) or a callable `env_creator(env_config) -> "
            f"gym.Env`, got {env!r}."
        )
    if not isinstance(config.env_config, Mapping):
        raise ValueError(f"`env_config` must be a dict, got {config.env_config!r}.")
    clip = config.clip_rewards
    if not (clip is None or isinstance(clip, bool) or (is_number(clip) and clip > 0)):
        raise ValueError(
            f"`clip_rewards` must be None, a bool (True clips to sign) or a number > 0 "
            f"(clip to [-x, x]), got {clip!r}."
        )
    check_bool(config, "normalize_actions")
    check_bool(config, "clip_actions")


def _sampling(config) -> None:
    if config.batch_mode != "truncate_episodes":
        hint = (
            " IMPALA learns from fixed-length fragments (T = `rollout_fragment_length`); "
            "whole episodes are not supported."
            if config.batch_mode == "complete_episodes"
            else ""
        )
        raise ValueError(
            f"`batch_mode` must be 'truncate_episodes', got {config.batch_mode!r}.{hint}"
        )
    check_int(config, "num_env_runners", minimum=0)
    check_int(config, "num_envs_per_env_runner", minimum=1)
    check_int(config, "rollout_fragment_length", minimum=1)
    check_int(config, "max_requests_in_flight_per_env_runner", minimum=1)
    for key in (
        "explore", "compress_observations", "restart_failed_env_runners",
        "drop_nonfinite_episodes",
    ):  # fmt: skip
        check_bool(config, key)
    if config.preprocessor_pref not in ("deepmind", "rllib", None):
        raise ValueError(
            "`preprocessor_pref` must be 'deepmind' (DeepMind preprocessing of Atari envs), "
            f"'rllib' or None (no preprocessing), got {config.preprocessor_pref!r}."
        )
    if config.observation_filter not in FILTER_NAMES:
        raise ValueError(
            f"`observation_filter` must be one of {list(FILTER_NAMES)} (RLlib's names), "
            f"got {config.observation_filter!r}."
        )
    check_number(config, "sample_timeout_s", minimum=0.0, strict=True, optional=True)
    if config.inference not in ("auto", "actor", "central"):
        raise ValueError(
            "`inference` must be 'auto', 'actor' (each actor runs the policy) or 'central' "
            f"(the driver runs it for every actor), got {config.inference!r}."
        )
    check_int(config, "max_num_env_runner_restarts", minimum=0)
    check_int(config, "seed", minimum=None, optional=True)


def _learning(config) -> None:
    if config.vtrace is not True:
        raise ValueError(
            f"`vtrace`: {config.algo_name} does not support vtrace=False (RLlib removed the "
            "A3C-style loss); set `vtrace=True`."
        )
    check_bool(config, "vtrace_drop_last_ts")
    for key in ("vtrace_clip_rho_threshold", "vtrace_clip_pg_rho_threshold"):
        check_number(config, key, minimum=0.0, strict=True, optional=True)
    check_number(config, "gamma", minimum=0.0, maximum=1.0)
    check_number(config, "lr", minimum=0.0)
    check_int(config, "train_batch_size", minimum=1)
    check_int(config, "num_sgd_iter", minimum=1)
    check_number(config, "grad_clip", minimum=0.0, strict=True, optional=True)
    if config.opt_type not in OPTIMIZERS:
        raise ValueError(f"`opt_type` must be one of {OPTIMIZERS}, got {config.opt_type!r}.")
    check_number(config, "decay", minimum=0.0, maximum=1.0)
    check_number(config, "momentum", minimum=0.0)
    check_number(config, "epsilon", minimum=0.0, strict=True)
    check_number(config, "vf_loss_coeff", minimum=0.0)
    if is_number(config.entropy_coeff) and config.entropy_coeff < 0:
        raise ValueError(
            f"`entropy_coeff` must be >= 0.0, got {config.entropy_coeff}; a negative "
            "coefficient would reward the policy for becoming deterministic."
        )
    check_number(config, "entropy_coeff", minimum=0.0)
    check_bool(config, "_separate_vf_optimizer")
    check_number(config, "_lr_vf", minimum=0.0)
    if config._separate_vf_optimizer and config.opt_type == "rmsprop":
        raise ValueError(
            "`opt_type`='rmsprop' cannot be combined with `_separate_vf_optimizer=True` "
            "(the value optimiser is always Adam); use opt_type='adam'."
        )
    config.lr_schedule_points()
    schedule = config.entropy_coeff_schedule
    if is_number(schedule) and schedule < 0:
        raise ValueError(
            f"`entropy_coeff_schedule` as a number is the step where the coefficient "
            f"reaches 0 and must be >= 0, got {schedule}."
        )
    config.entropy_coeff_schedule_points()
    if config.microbatch_size is not None:
        check_int(config, "microbatch_size", minimum=1)
        if config.microbatch_size >= config.train_batch_size:
            raise ValueError(
                f"`microbatch_size` ({config.microbatch_size}) must be smaller than "
                f"`train_batch_size` ({config.train_batch_size}): gradients of microbatches "
                "are summed until a train batch is reached."
            )
    check_number(config, "replay_proportion", minimum=0.0)
    check_int(config, "replay_buffer_num_slots", minimum=0)


def _runtime(config) -> None:
    check_int(config, "num_multi_gpu_tower_stacks", minimum=1)
    check_int(config, "num_gpu_loader_threads", minimum=1)
    jit = config.jit_compile_update
    if not (isinstance(jit, bool) or (isinstance(jit, str) and jit == "auto")):
        raise ValueError(
            f'`jit_compile_update` must be True, False or "auto" (XLA-compile the learner\'s '
            f"update, or not, or decide from the device), got {config.jit_compile_update!r}."
        )
    if config.precision not in PRECISIONS:
        raise ValueError(
            f"`precision` must be one of {PRECISIONS} (the Keras dtype policy the models are "
            f"built under; mixed_bfloat16: bfloat16 compute, float32 variables), got "
            f"{config.precision!r}."
        )
    if config.inference_precision is not None and config.inference_precision not in PRECISIONS:
        raise ValueError(
            f"`inference_precision` must be None (as `precision`) or one of {PRECISIONS} (the "
            f"Keras dtype policy the acting models are built under), got "
            f"{config.inference_precision!r}."
        )
    check_int(config, "minibatch_buffer_size", minimum=1)
    check_int(config, "learner_queue_size", minimum=1)
    check_number(config, "learner_queue_timeout", minimum=0.0, strict=True)
    check_int(config, "max_nonfinite_updates", minimum=1)
    check_number(config, "timeout_s_sampler_manager", minimum=0.0)
    check_number(config, "timeout_s_aggregator_manager", minimum=0.0)
    check_int(config, "max_requests_in_flight_per_aggregator_worker", minimum=1)
    check_int(config, "broadcast_interval", minimum=1)
    if config.min_time_s_per_broadcast != "auto":
        check_number(config, "min_time_s_per_broadcast", minimum=0.0)
    check_int(config, "num_aggregation_workers", minimum=0)
    if config.num_aggregation_workers > config.num_env_runners:
        raise ValueError(
            f"`num_aggregation_workers` ({config.num_aggregation_workers}) must be <= "
            f"`num_env_runners` ({config.num_env_runners}); aggregation makes no sense "
            "otherwise."
        )
    if config.num_aggregation_workers > config.num_env_runners / 2:
        warn(
            f"`num_aggregation_workers` ({config.num_aggregation_workers}) should be much "
            f"smaller than `num_env_runners` ({config.num_env_runners}); try at most half.",
            ConfigWarning,
        )
    check_number(config, "num_gpus", minimum=0.0)
    check_bool(config, "_fake_gpus")
    _backend(config)
    check_number(config, "min_time_s_per_iteration", minimum=0.0, optional=True)
    check_int(config, "min_sample_timesteps_per_iteration", minimum=0, optional=True)
    check_int(config, "metrics_num_episodes_for_smoothing", minimum=1)
    check_int(config, "evaluation_interval", minimum=0, optional=True)
    check_int(config, "evaluation_duration", minimum=1)
    check_int(config, "keep_checkpoints_num", minimum=1, optional=True)
    check_int(config, "checkpoint_freq", minimum=0)


def _video(config) -> None:
    """RLlib's `render_env` / `record_env` and the bounds of what they record
    (`impala_tf.envs.video`)."""
    check_bool(config, "render_env")
    record = config.record_env
    if not (isinstance(record, bool) or (isinstance(record, str) and record.strip())):
        raise ValueError(
            f"`record_env` must be True, False or a directory to write the videos to (relative "
            f"to the run's logdir, or absolute), got {record!r}."
        )
    check_int(config, "video_episodes", minimum=1)
    check_int(config, "video_max_frames", minimum=2)  # One frame would not move.
    check_int(config, "video_max_width", minimum=16, optional=True)
    check_int(config, "video_interval", minimum=1)
    key = "render_env" if config.render_env else "record_env" if record else None
    env_config = config.env_config if isinstance(config.env_config, Mapping) else {}
    render_mode = env_config.get("render_mode")
    if key and render_mode not in (None, "rgb_array"):
        raise ValueError(
            f"`{key}` records the env's rgb_array frames, but `env_config` sets "
            f"render_mode={render_mode!r}: remove it or set it to 'rgb_array'."
        )
    overrides = config.evaluation_config if isinstance(config.evaluation_config, Mapping) else {}
    if (key or overrides.get("render_env") or overrides.get("record_env")) and not (
        config.evaluation_interval
    ):
        warn_once(
            "render_env",
            "`render_env` / `record_env` record evaluation episodes (impala_tf.envs.video), "
            "but "
            "`evaluation_interval` is not set, so training runs no evaluation to record "
            "(`impala-evaluate --video` records after training).",
            ConfigWarning,
        )


def _backend(config) -> None:
    if config.actor_backend not in ACTOR_BACKENDS:
        raise ValueError(
            f"`actor_backend` must be one of {list(ACTOR_BACKENDS)} (local processes, or "
            f"Ray actors), got {config.actor_backend!r}."
        )
    address = config.ray_address
    if address is not None and (
        not isinstance(address, str)
        or (address != "auto" and not RAY_ADDRESS.match(address))
        or (address != "auto" and int(address.rsplit(":", 1)[1]) > 65535)
    ):
        raise ValueError(
            "`ray_address` must be None (start a local Ray), 'auto' (the cluster running on "
            f"this machine) or 'HOST:PORT' (the head node's GCS address), got {address!r}."
        )
    check_number(config, "num_cpus_per_env_runner", minimum=0.0)
    check_number(config, "num_cpus_for_main_process", minimum=0.0)
    resources = config.custom_resources_per_env_runner
    if not isinstance(resources, Mapping) or not all(
        isinstance(k, str) and is_number(v) and math.isfinite(v) and v > 0
        for k, v in resources.items()
    ):
        raise ValueError(
            "`custom_resources_per_env_runner` must be a dict of Ray resource names to "
            f"amounts > 0 (e.g. {{'node2': 1}}), got {resources!r}."
        )
    if config.actor_backend == "local":
        unused = [k for k in ("ray_address",) if getattr(config, k) is not None]
        if resources:
            unused.append("custom_resources_per_env_runner")
        if unused:
            warn(
                f"{', '.join(f'`{k}`' for k in unused)} only apply with "
                "`actor_backend='ray'`; ignored with local actor processes.",
                ConfigWarning,
            )
    elif not _module_available("ray"):
        raise ValueError(
            "`actor_backend='ray'` needs Ray, which is not installed here: run "
            "`pip install -e '.[ray]'` (or `pip install ray==2.60.0`), or set "
            "`actor_backend='local'`."
        )


def _model(config) -> None:
    model = config.model
    hiddens = model["fcnet_hiddens"]
    if not isinstance(hiddens, list) or not all(is_int(h) and h > 0 for h in hiddens):
        raise ValueError(
            f"`model.fcnet_hiddens` must be a list of positive layer sizes, got {hiddens!r}."
        )
    post = model["post_fcnet_hiddens"]
    if not isinstance(post, list) or not all(is_int(h) and h > 0 for h in post):
        raise ValueError(
            f"`model.post_fcnet_hiddens` must be a list of positive layer sizes, got {post!r}."
        )
    for key in ("fcnet_activation", "conv_activation", "post_fcnet_activation"):
        if model[key] not in ACTIVATIONS:
            raise ValueError(f"`model.{key}` must be one of {ACTIVATIONS}, got {model[key]!r}.")
    custom = model["custom_model"]
    if not (custom is None or isinstance(custom, str) or callable(custom)):
        raise ValueError(
            f"`model.custom_model` must be None, one of {CUSTOM_MODELS[1:]}, a name registered "
            "with ModelCatalog.register_custom_model, an import path `package.module:Name` or "
            f"a model class; got {custom!r}."
        )
    if not isinstance(model.get("custom_model_config", {}), dict):
        raise ValueError(
            "`model.custom_model_config` must be a dict (the custom model's keyword "
            f"arguments), got {model['custom_model_config']!r}."
        )
    from impala_tf.models.spec import resolve_custom_model  # No TensorFlow.

    resolve_custom_model(custom)  # An unknown name or an import path that does not resolve.
    filters = model["conv_filters"]
    if filters is not None and not (
        isinstance(filters, list) and filters and all(is_conv_filter(f) for f in filters)
    ):
        raise ValueError(
            "`model.conv_filters` must be None or a list of [out_channels, kernel, stride] "
            f"(kernel and stride an int or [h, w]), got {filters!r}."
        )
    for key in ("lstm_cell_size", "max_seq_len", "dim"):
        if not (is_int(model[key]) and model[key] > 0):
            raise ValueError(f"`model.{key}` must be a positive int, got {model[key]!r}.")
    for key in (
        "vf_share_layers", "use_lstm", "lstm_use_prev_action", "lstm_use_prev_reward",
        "grayscale", "framestack", "free_log_std", "center_pixels",
    ):  # fmt: skip
        if not isinstance(model[key], bool):
            raise ValueError(f"`model.{key}` must be a bool, got {model[key]!r}.")
    # What the model catalog refuses, refused here, before any process starts.
    if model["center_pixels"] and model["custom_model"] is not None:
        raise ValueError(
            f"`model.center_pixels` applies to RLlib's vision network; `model.custom_model="
            f"{model['custom_model']!r}` scales uint8 pixels to [0, 1] itself. Drop one of them."
        )
    if model["use_lstm"] and (model["lstm_use_prev_action"] or model["lstm_use_prev_reward"]):
        raise ValueError(
            "`model.lstm_use_prev_action` / `model.lstm_use_prev_reward` are not supported "
            "with `model.use_lstm=True` (the models take no previous actions or rewards)."
        )


def _multi_device(config) -> None:
    devices = config.num_learner_devices
    if config.train_batch_size % devices:
        raise ValueError(
            f"`train_batch_size` ({config.train_batch_size}) must divide evenly by the "
            f"{devices} learner devices (`num_gpus`), or the towers get unequal shards."
        )
    if config.microbatch_size is not None:
        horizon = config.rollout_fragment_length
        if config.microbatch_size % horizon:
            raise ValueError(
                f"`microbatch_size` ({config.microbatch_size}) must be a multiple of "
                f"`rollout_fragment_length` ({horizon}): microbatches are whole env sequences."
            )
        if (config.microbatch_size // horizon) % devices:
            raise ValueError(
                f"`microbatch_size` ({config.microbatch_size}) is "
                f"{config.microbatch_size // horizon} sequences of {horizon} steps, which do not "
                f"divide evenly over the {devices} learner devices (`num_gpus`)."
            )
    if devices > 1 and config.minibatch_buffer_size != config.num_multi_gpu_tower_stacks:
        warn(
            f"In multi-device mode the minibatch buffer is the ring of tower stacks: the learner "
            f"uses `num_multi_gpu_tower_stacks={config.num_multi_gpu_tower_stacks}` slots, not "
            f"`minibatch_buffer_size={config.minibatch_buffer_size}`.",
            ConfigWarning,
        )


def check_int(config: Any, key: str, *, minimum: int | None, optional: bool = False) -> None:
    """Raises ValueError naming `key` unless `config.<key>` is an int >= `minimum`."""
    value = getattr(config, key)
    if optional and value is None:
        return
    if not is_int(value) or (minimum is not None and value < minimum):
        bound = "" if minimum is None else f" >= {minimum}"
        none = " or None" if optional else ""
        raise ValueError(f"`{key}` must be an int{bound}{none}, got {value!r}.")


def check_number(
    config: Any,
    key: str,
    *,
    minimum: float,
    maximum: float | None = None,
    strict: bool = False,
    optional: bool = False,
) -> None:
    """Raises ValueError naming `key` unless `config.<key>` is a finite number in range."""
    value = getattr(config, key)
    if optional and value is None:
        return
    too_low = is_number(value) and (value <= minimum if strict else value < minimum)
    too_high = is_number(value) and maximum is not None and value > maximum
    if not is_number(value) or not math.isfinite(value) or too_low or too_high:
        bound = f"{'>' if strict else '>='} {minimum}"
        if maximum is not None:
            bound += f" and <= {maximum}"
        none = " or None" if optional else ""
        raise ValueError(f"`{key}` must be a number {bound}{none}, got {value!r}.")


def check_bool(config: Any, key: str) -> None:
    """Raises ValueError naming `key` unless `config.<key>` is True or False."""
    value = getattr(config, key)
    if not isinstance(value, bool):
        raise ValueError(f"`{key}` must be True or False, got {value!r}.")


def _check_gymnasium_id(env_id: str) -> None:
    """Raises ValueError naming `env` if `env_id` is not a registered gymnasium id."""
    import gymnasium  # Lazy: keeps `import impala_tf.config` fast.

    import impala_tf.envs  # noqa: F401 - registers the shipped envs' ids.
    from impala_tf.envs.atari import ensure_registered

    hint = ""
    if env_id.startswith("ALE/") or env_id not in gymnasium.registry:
        try:
            import ale_py  # noqa: F401 - only probes that Atari ids can be registered.
        except ImportError:
            hint = " Atari ids need the `ale-py` package (pip install ale-py)."
        ensure_registered(env_id)
    try:
        gymnasium.spec(env_id)
    except (gymnasium.error.Error, ImportError) as e:
        raise ValueError(
            f"`env` {env_id!r} is not a registered gymnasium environment: {e}{hint} Pass a "
            "registered id or an `env_creator(env_config)` callable."
        ) from e
