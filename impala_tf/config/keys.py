"""RLlib's IMPALA config keys as tables: model defaults, old names, ignored and refused keys.

`impala_tf.config.base.AlgorithmConfig` resolves every key it is given against these tables
(`impala_tf.config.resolution` says how), and checks values with the helpers here. Also here:
RLlib's stop criteria in their old and new spellings (`normalize_stop_criteria`), the pass
criteria of the learning suite (`normalize_pass_criteria`) and the YAML loader of tuned examples
(`load_yaml`).

Also the config warnings (`ConfigWarning`, each shown once per key). This module holds data
and pure functions only; it imports neither TensorFlow nor gymnasium.
"""

from __future__ import annotations

import difflib
import math
import numbers
import os
import re
import sys
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "ConfigWarning",
    "DeprecatedKeyWarning",
    "ACTIVATIONS",
    "ACTOR_BACKENDS",
    "ALIASES",
    "CUSTOM_MODELS",
    "FILTER_NAMES",
    "IGNORED",
    "IGNORED_MODEL",
    "MODEL_ALIASES",
    "MODEL_DEFAULTS",
    "OPTIMIZERS",
    "PASS_LIMITS",
    "PRECISIONS",
    "RAY_ADDRESS",
    "STOP_KEYS",
    "SYNONYMS",
    "UNSUPPORTED",
    "is_conv_filter",
    "is_int",
    "is_number",
    "load_yaml",
    "normalize_pass_criteria",
    "normalize_schedule",
    "normalize_stop_criteria",
    "suggest",
    "warn",
    "warn_once",
]

# RLlib's MODEL_DEFAULTS, restricted to the keys our model catalog understands, and ours.
MODEL_DEFAULTS: dict[str, Any] = {
    "fcnet_hiddens": [256, 256],
    "fcnet_activation": "tanh",
    "vf_share_layers": True,
    "conv_filters": None,
    "conv_activation": "relu",
    "post_fcnet_hiddens": [],
    "post_fcnet_activation": "relu",
    "custom_model": None,
    "use_lstm": False,
    "lstm_cell_size": 256,
    "max_seq_len": 20,
    "lstm_use_prev_action": False,
    "lstm_use_prev_reward": False,
    "dim": 84,
    "grayscale": False,
    "framestack": True,
    "free_log_std": False,
    # Ours: uint8 pixels enter RLlib's vision network as x - 128 (-128..127) instead of 0..255.
    "center_pixels": False,
    # Keyword arguments of a custom model's constructor (`custom_model`).
    "custom_model_config": {},
}

ACTIVATIONS = ("relu", "tanh", "elu", "swish", "linear")
ACTOR_BACKENDS = ("local", "ray")
#: A Ray GCS address, HOST:PORT (a host name, IPv4 address or bracketed IPv6 address).
RAY_ADDRESS = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?:[1-9][0-9]{0,4})$")
#: The catalog's own `custom_model` names (any other string is a registered name or import path).
CUSTOM_MODELS = (None, "nature_cnn", "impala_resnet")
OPTIMIZERS = ("adam", "rmsprop")
#: The `precision` key's values, each the name of the Keras dtype policy it builds models under.
PRECISIONS = ("float32", "mixed_bfloat16")

# Old name -> new name. A key listed in SYNONYMS is a current RLlib name too, so it is
# applied without a deprecation warning.
ALIASES: dict[str, str] = {
    "num_workers": "num_env_runners",
    "num_rollout_workers": "num_env_runners",
    "num_envs_per_worker": "num_envs_per_env_runner",
    "num_epochs": "num_sgd_iter",
    "num_data_loader_buffers": "num_multi_gpu_tower_stacks",
    "max_sample_requests_in_flight_per_worker": "max_requests_in_flight_per_env_runner",
    "num_cpus_per_worker": "num_cpus_per_env_runner",
    "num_cpus_for_driver": "num_cpus_for_main_process",
    "custom_resources_per_worker": "custom_resources_per_env_runner",
    "ignore_worker_failures": "restart_failed_env_runners",
    "ignore_env_runner_failures": "restart_failed_env_runners",
    "recreate_failed_workers": "restart_failed_env_runners",
    "recreate_failed_env_runners": "restart_failed_env_runners",
    "sample_batch_size": "rollout_fragment_length",
    "callbacks": "callbacks_class",
    "evaluation_num_episodes": "evaluation_duration",
    "metrics_smoothing_episodes": "metrics_num_episodes_for_smoothing",
    "min_time_s_per_reporting": "min_time_s_per_iteration",
    "min_iter_time_s": "min_time_s_per_iteration",
    "min_sample_timesteps_per_reporting": "min_sample_timesteps_per_iteration",
    "timesteps_per_iteration": "min_sample_timesteps_per_iteration",
}
SYNONYMS = frozenset({"num_epochs", "callbacks"})

# Old model key -> the model keys it sets.
MODEL_ALIASES: dict[str, tuple[str, ...]] = {
    "lstm_use_prev_action_reward": ("lstm_use_prev_action", "lstm_use_prev_reward"),
}

#: `observation_filter` values (`impala_tf.acting.filters.FILTER_NAMES`; not imported, to
#: stay light).
FILTER_NAMES = ("NoFilter", "MeanStdFilter", "ConcurrentMeanStdFilter")

# RLlib keys accepted and ignored, with the reason shown in the warning.
IGNORED: dict[str, str] = {
    "framework": "impala_tf always runs TensorFlow 2",
    "eager_tracing": "the learner step is always a tf.function",
    "eager_max_retraces": "the learner step is always a tf.function",
    "tf_session_args": "there are no TF1 sessions",
    "local_tf_session_args": "there are no TF1 sessions",
    "log_level": "use Python logging / absl verbosity",
    "logger_config": "results are written by Keras callbacks",
    "_disable_execution_plan_api": "there is one execution path",
    "_enable_new_api_stack": "impala_tf reproduces the old API stack only",
    "enable_rl_module_and_learner": "impala_tf reproduces the old API stack only",
    "enable_env_runner_and_connector_v2": "impala_tf reproduces the old API stack only",
    "_tf_policy_handles_more_than_one_loss": "two losses are always supported",
    "_dont_auto_sync_env_runner_states": "weights are always broadcast by the driver",
    "simple_optimizer": "the learner picks its device strategy from `num_gpus`",
    "num_learners": "there is one learner process; `num_gpus` sets its devices",
    "num_gpus_per_learner": "there is one learner process; `num_gpus` sets its devices",
    "num_cpus_per_learner": "there is no resource scheduler",
    "num_gpus_per_worker": "env runners always run on CPU",
    "num_gpus_per_env_runner": "env runners always run on CPU",
    "placement_strategy": "a Tune trial packs its bundles as its actors need (impala_tf.tune)",
    "create_env_on_driver": "the driver never steps an environment",
    "exploration_config": "actions are always sampled from the policy (`explore`)",
    "grad_clip_by": "RLlib's old stack, like us, always clips by global norm",
    "evaluation_num_workers": "evaluation runs in the driver process",
    "evaluation_num_env_runners": "evaluation runs in the driver process",
    "disable_env_checking": "environments are not pre-checked",
}

# Model keys accepted and ignored.
IGNORED_MODEL: dict[str, str] = {
    "_disable_preprocessor_api": "observations are preprocessed by the model",
    "_disable_action_flattening": "actions are never flattened",
    "_time_major": "the learner is always time-major",
    "_use_default_native_models": "models come from impala_tf.models",
    "zero_mean": (
        "[-1, 1] scaling in RLlib's generic pixel preprocessor, not its DeepMind path; see "
        "`center_pixels`"
    ),
}

# RLlib keys with no faithful equivalent: a non-None value is an error with this explanation.
UNSUPPORTED: dict[str, str] = {
    "sgd_minibatch_size": (
        "IMPALA (old API stack) trains each of the `num_sgd_iter` passes on the whole train "
        "batch and never splits it into minibatches. Lower `train_batch_size` for smaller "
        "updates, or set `microbatch_size` to accumulate gradients over parts of the batch "
        "(still one update per train batch)"
    ),
    "minibatch_size": (
        "IMPALA (old API stack) never splits a train batch into minibatches. Lower "
        "`train_batch_size` for smaller updates, or set `microbatch_size` to accumulate "
        "gradients over parts of the batch (still one update per train batch)"
    ),
    "train_batch_size_per_learner": (
        "there is one learner; set `train_batch_size` (it is split across `num_gpus` devices)"
    ),
}


def suggest(key: str, candidates: Iterable[str]) -> str:
    matches = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
    return f" Did you mean '{matches[0]}'?" if matches else ""


def is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def normalize_schedule(value: Any, key: str) -> list[list[float]]:
    """Checks a piecewise-linear schedule and returns it as a fresh list of pairs.

    Args:
      value: `[[timestep, value], ...]` with numeric entries and non-decreasing timesteps
        (timesteps count agent steps trained). Values are interpolated linearly between points
        and the last value is held after the last point; start at timestep 0 so that the value
        before the first point is not a question.
      key: The config key the schedule came from, for the error message.

    Returns:
      The schedule as a list of `[timestep, float(value)]` pairs.

    Raises:
      ValueError: naming `key`, if `value` is not such a list.
    """
    fix = f"write `{key}` as [[timestep, value], ...], e.g. [[0, 0.0005], [1000000, 0.0]]"
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise ValueError(f"`{key}` must be a list of [timestep, value] pairs, got {value!r}; {fix}")
    points = []
    for point in value:
        if (
            isinstance(point, (str, bytes, Mapping))
            or not isinstance(point, Iterable)
            or len(point := list(point)) != 2
            or not all(is_number(x) and math.isfinite(x) for x in point)
        ):
            raise ValueError(
                f"`{key}` entry {point!r} is not a [timestep, value] pair of finite numbers; {fix}"
            )
        points.append([point[0], float(point[1])])
    if not points:
        raise ValueError(f"`{key}` is an empty schedule; use None for a constant, or {fix}")
    timesteps = [t for t, _ in points]
    if timesteps[0] < 0 or any(b < a for a, b in zip(timesteps, timesteps[1:], strict=False)):
        raise ValueError(
            f"`{key}` timesteps must be >= 0 and non-decreasing, got {timesteps}; "
            "a decreasing schedule cannot be interpolated"
        )
    return points


# Stop criteria: every accepted spelling -> the canonical (old RLlib result) key.
STOP_KEYS: dict[str, str] = {
    "episode_reward_mean": "episode_reward_mean",
    "episode_return_mean": "episode_reward_mean",
    "env_runners/episode_return_mean": "episode_reward_mean",
    "sampler_results/episode_reward_mean": "episode_reward_mean",
    "timesteps_total": "timesteps_total",
    "num_env_steps_sampled": "timesteps_total",
    "num_env_steps_sampled_lifetime": "timesteps_total",
    "env_runners/num_env_steps_sampled_lifetime": "timesteps_total",
    "training_iteration": "training_iteration",
    "time_total_s": "time_total_s",
}


def normalize_stop_criteria(stop: Mapping[str, Any] | None) -> dict[str, float]:
    """Maps RLlib stop criteria, old or new spelling, onto our result keys.

    Training stops when any criterion is reached (result >= value), as in Tune. Canonical keys
    (those our `train()` results carry) and the spellings mapped onto them:

    * `episode_reward_mean` <- `env_runners/episode_return_mean`, `episode_return_mean`,
      `sampler_results/episode_reward_mean`;
    * `timesteps_total` <- `num_env_steps_sampled_lifetime`,
      `env_runners/num_env_steps_sampled_lifetime`, `num_env_steps_sampled`;
    * `training_iteration`, `time_total_s` (same in every version).

    Args:
      stop: The `stop` mapping of a tuned example, or None.

    Returns:
      A new dict keyed by canonical names only.

    Raises:
      ValueError: for an unknown criterion, a non-numeric value, or two spellings of one
        criterion with different values.
    """
    normalised: dict[str, float] = {}
    spelled: dict[str, str] = {}
    for key, value in (stop or {}).items():
        if key not in STOP_KEYS:
            raise ValueError(
                f"Unknown stop criterion `{key}`.{suggest(key, STOP_KEYS)} "
                f"Supported: {sorted(STOP_KEYS)}."
            )
        if not is_number(value):
            raise ValueError(f"Stop criterion `{key}` must be a number, got {value!r}.")
        canonical = STOP_KEYS[key]
        if canonical in normalised and normalised[canonical] != value:
            raise ValueError(
                f"Stop criteria `{spelled[canonical]}` and `{key}` both set `{canonical}` "
                f"({normalised[canonical]} vs {value}); keep one."
            )
        normalised[canonical] = value
        spelled[canonical] = key
    return normalised


#: The limits a pass criterion may set (canonical stop keys): the return must be reached at or
#: before each one that is given.
PASS_LIMITS = ("timesteps_total", "time_total_s", "training_iteration")


def normalize_pass_criteria(criteria: Any) -> list[dict[str, float]]:
    """Checks a tuned example's `pass_criteria` block and maps its keys onto our result keys.

    `pass_criteria` is RLlib's name for the block of its release learning tests; the learning
    suite (`tools.learning_suite`) reads it, training ignores it. Each criterion is a mapping
    with the return to reach, `episode_reward_mean` (any spelling `normalize_stop_criteria`
    accepts), and at least one limit from `PASS_LIMITS`: the criterion is met when a result's
    `episode_reward_mean` first reaches the return while `timesteps_total`, `time_total_s`
    (seconds of training) and `training_iteration` are all within their limits ("450 within 2M
    env steps"). RLlib's release harness reads a `timesteps_total` there as a minimum number of
    steps done instead; a run here passes when the return comes soon enough. A list holds
    several criteria, all of which a run must meet (Pong: 18 within 5M env steps, and 0 within
    20 minutes).

    Args:
      criteria: The block: a mapping (one criterion), a list of mappings, or None.

    Returns:
      A list of criteria, each keyed by canonical names only (empty for None).

    Raises:
      ValueError: for a block that is not a mapping or a list of them, a criterion without
        `episode_reward_mean` or without a limit, a key that is not a return or a limit, or a
        limit that is not positive.
    """
    if criteria is None:
        return []
    items = [criteria] if isinstance(criteria, Mapping) else criteria
    if not isinstance(items, list) or not all(isinstance(c, Mapping) for c in items):
        raise ValueError(
            "`pass_criteria` must be a mapping ({episode_reward_mean: R, timesteps_total: N}) "
            f"or a list of them, got {criteria!r}."
        )
    normalised = []
    for criterion in items:
        canonical = normalize_stop_criteria(criterion)
        if "episode_reward_mean" not in canonical:
            raise ValueError(
                f"A pass criterion needs the return to reach (`episode_reward_mean`), got "
                f"{dict(criterion)!r}."
            )
        others = sorted(set(canonical) - {"episode_reward_mean", *PASS_LIMITS})
        if others:
            raise ValueError(
                f"A pass criterion holds the return and its limits ({list(PASS_LIMITS)}), "
                f"not {others}."
            )
        limits = {k: v for k, v in canonical.items() if k in PASS_LIMITS}
        if not limits:
            raise ValueError(
                f"The pass criterion {dict(criterion)!r} sets no limit: add one of "
                f"{list(PASS_LIMITS)} (the return must be reached within it)."
            )
        for key, value in limits.items():
            if value <= 0:
                raise ValueError(f"Pass criterion limit `{key}` must be > 0, got {value!r}.")
        normalised.append(canonical)
    return normalised


def is_conv_filter(spec: Any) -> bool:
    def size(x: Any) -> bool:
        return (is_int(x) and x > 0) or (
            isinstance(x, list) and len(x) == 2 and all(is_int(v) and v > 0 for v in x)
        )

    return (
        isinstance(spec, list)
        and len(spec) == 3
        and is_int(spec[0])
        and spec[0] > 0
        and size(spec[1])
        and size(spec[2])
    )


# YAML 1.1 (PyYAML) reads `5e-4` as a string; RLlib users write learning rates that way, so
# floats are also recognised without a dot or with an exponent sign missing.
YAML_FLOAT = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.VERBOSE,
)


def load_yaml(stream: Any) -> Any:
    import yaml  # Lazy: only YAML users pay for the import.

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver("tag:yaml.org,2002:float", YAML_FLOAT, list("-+0123456789."))
    return yaml.load(stream, Loader=Loader)  # A SafeLoader: no arbitrary objects.


# Warnings --------------------------------------------------------------------------------------


class ConfigWarning(UserWarning):
    """A config setting was ignored or adjusted (the message says which and why)."""


class DeprecatedKeyWarning(ConfigWarning, FutureWarning):
    """An old RLlib key name was used; its value went to the new key the message names."""


#: Keys already warned about in this process (each warning is shown once per key).
WARNED: set[str] = set()
_CONFIG_DIR = os.path.dirname(os.path.abspath(__file__))


def _caller_stacklevel() -> int:
    """The `warnings.warn` stacklevel of the first frame outside the `impala_tf.config` package."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.dirname(frame.f_code.co_filename) == _CONFIG_DIR:
        frame, level = frame.f_back, level + 1
    return level


def warn(message: str, category: type[Warning]) -> None:
    """Warns, attributed to the user's line (builder call, from_yaml, validate)."""
    warnings.warn(message, category, stacklevel=_caller_stacklevel())


def warn_once(key: str, message: str, category: type[Warning]) -> None:
    """`warn`, once per `key` and process."""
    if key not in WARNED:
        WARNED.add(key)
        warn(message, category)
