"""ImpalaConfig: RLlib's IMPALA settings, with their names, defaults, aliases and checks.

A config is a plain object whose attributes are RLlib's keys (old API stack, defaults as in
RLlib 2.5+, `learner_queue_size=16`). It is filled in three equivalent ways, all of which go
through `ImpalaConfig.update_from_dict`:

* RLlib-style builders that return `self`: `training`, `environment`, `env_runners`,
  `resources`, `debugging`, `reporting`, `fault_tolerance`, `evaluation`, `checkpointing`
  (plus `framework`, `api_stack` and the deprecated `rollouts`, kept so RLlib scripts run);
* `ImpalaConfig.from_dict(d)`;
* `ImpalaConfig.from_yaml(path)`, reading RLlib's tuned-example format.

Every key is resolved by one function against four tables (the last three, with the model
defaults and RLlib's stop criteria, live in `impala_tf.config_keys`):

* the dataclass fields of `ImpalaConfig` (each field's metadata names its builder group),
  and `MODEL_DEFAULTS` for the keys of the `model` dict;
* `ALIASES`: old RLlib names, applied to the new key with one `DeprecatedKeyWarning` per name;
* `IGNORED`: RLlib keys with no meaning here, accepted with one `ConfigWarning` per name;
* `UNSUPPORTED`: RLlib keys whose behaviour we do not have and that no other key reproduces;
  a non-None value is an error that says what to use instead.

Anything else is an error naming the key, with a "did you mean" suggestion. Values are checked
in one place, `ImpalaConfig.validate`, whose messages say what would go wrong and how to fix it.

Deliberate differences from RLlib:

* `num_gpus` counts learner devices. `num_gpus > 0` on a machine without a GPU is not an error
  (RLlib raises); the runtime falls back to one CPU device with a warning. With
  `_fake_gpus=True`, `num_gpus` logical CPU devices stand in for GPUs.
* `sgd_minibatch_size` / `minibatch_size` have no equivalent: old-stack IMPALA trains every pass
  on the whole train batch. `microbatch_size` is gradient accumulation (one update per train
  batch), not minibatching, so mapping one onto the other would change the number of updates.
* Only `batch_mode="truncate_episodes"` exists (fragments are always `rollout_fragment_length`
  steps long, T in the [T, B] learner batches).

This module holds no tensors and imports neither TensorFlow nor gymnasium at import time.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from impala_tf.config_keys import (
    ACTIVATIONS,
    ACTOR_BACKENDS,
    ALIASES,
    CUSTOM_MODELS,
    FILTER_NAMES,
    IGNORED,
    IGNORED_MODEL,
    MODEL_ALIASES,
    MODEL_DEFAULTS,
    OPTIMIZERS,
    RAY_ADDRESS,
    SYNONYMS,
    UNSUPPORTED,
    is_conv_filter,
    is_int,
    is_number,
    load_yaml,
    normalize_schedule,
    normalize_stop_criteria,
    suggest,
)

__all__ = [
    "MODEL_DEFAULTS",
    "ConfigWarning",
    "DeprecatedKeyWarning",
    "ImpalaConfig",
    "normalize_stop_criteria",
]


class ConfigWarning(UserWarning):
    """A config setting was ignored or adjusted (the message says which and why)."""


class DeprecatedKeyWarning(ConfigWarning, FutureWarning):
    """An old RLlib key name was used; its value went to the new key the message names."""


# Keys already warned about in this process (each warning is shown once per key).
_WARNED: set[str] = set()


def _caller_stacklevel() -> int:
    """Returns the `warnings.warn` stacklevel of the first frame outside this module."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename == __file__:
        frame, level = frame.f_back, level + 1
    return level


def _warn(message: str, category: type[Warning]) -> None:
    # Attributed to the user's line (builder call, from_yaml, validate), however deep the call.
    warnings.warn(message, category, stacklevel=_caller_stacklevel())


def _warn_once(key: str, message: str, category: type[Warning]) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        _warn(message, category)


def _key(default: Any, group: str) -> Any:
    """Declares one config key: its RLlib default and the builder method that sets it."""
    metadata = {"group": group}
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _module_available(name: str) -> bool:
    """Whether `name` can be imported (without importing it)."""
    if name in sys.modules:
        return sys.modules[name] is not None
    import importlib.util

    return importlib.util.find_spec(name) is not None


_UNSET: Any = object()


@dataclasses.dataclass(init=False, repr=False, eq=True)
class ImpalaConfig:
    """RLlib's IMPALA config: the keys as attributes, RLlib builders, aliases and validation.

    Construct with defaults (`ImpalaConfig()`), or with settings
    (`ImpalaConfig(env="CartPole-v1", lr=1e-3)`, the same as `update_from_dict`), then chain
    builders: `ImpalaConfig().environment("CartPole-v1").training(lr=1e-3)`. Values are not
    checked until `validate()` (called by `build()`).

    See SEMANTICS.md section 1 for the meaning of each IMPALA key; the fields below are grouped
    by the builder method that sets them.
    """

    # environment()
    env: str | Callable[[dict], Any] | None = _key(None, "environment")
    env_config: dict = _key({}, "environment")
    clip_rewards: bool | float | None = _key(None, "environment")
    # Box actions: the policy acts in [-1, 1], unsquashed to the bounds (see impala_tf.actions).
    normalize_actions: bool = _key(True, "environment")
    clip_actions: bool = _key(False, "environment")

    # env_runners()
    num_env_runners: int = _key(2, "env_runners")
    num_envs_per_env_runner: int = _key(1, "env_runners")
    rollout_fragment_length: int = _key(50, "env_runners")
    batch_mode: str = _key("truncate_episodes", "env_runners")
    explore: bool = _key(True, "env_runners")
    max_requests_in_flight_per_env_runner: int = _key(2, "env_runners")
    compress_observations: bool = _key(False, "env_runners")
    preprocessor_pref: str | None = _key("deepmind", "env_runners")
    observation_filter: str = _key("NoFilter", "env_runners")
    sample_timeout_s: float | None = _key(60.0, "env_runners")
    drop_nonfinite_episodes: bool = _key(False, "env_runners")
    # Where the acting policy runs (impala_tf.inference): in each actor, or in the driver for all
    # ("central", SEED RL style); "auto" keeps it in the actors unless TensorFlow actors would
    # not fit in memory (impala_tf.actors.local.central_inference).
    inference: str = _key("auto", "env_runners")
    # Ray resources of each actor (`actor_backend="ray"` only; see impala_tf.actors.ray_pool).
    num_cpus_per_env_runner: float = _key(1, "env_runners")
    custom_resources_per_env_runner: dict = _key({}, "env_runners")

    # training(): general
    gamma: float = _key(0.99, "training")
    lr: float = _key(0.0005, "training")
    train_batch_size: int = _key(500, "training")
    model: dict = _key(MODEL_DEFAULTS, "training")
    # training(): V-trace
    vtrace: bool = _key(True, "training")
    vtrace_clip_rho_threshold: float | None = _key(1.0, "training")
    vtrace_clip_pg_rho_threshold: float | None = _key(1.0, "training")
    vtrace_drop_last_ts: bool = _key(False, "training")
    # training(): data flow into the learner
    num_multi_gpu_tower_stacks: int = _key(1, "training")
    num_gpu_loader_threads: int = _key(8, "training")
    minibatch_buffer_size: int = _key(1, "training")
    num_sgd_iter: int = _key(1, "training")
    learner_queue_size: int = _key(16, "training")
    learner_queue_timeout: float = _key(300, "training")
    microbatch_size: int | None = _key(None, "training")
    timeout_s_sampler_manager: float = _key(0.0, "training")
    timeout_s_aggregator_manager: float = _key(0.0, "training")
    max_requests_in_flight_per_aggregator_worker: int = _key(2, "training")
    broadcast_interval: int = _key(1, "training")
    num_aggregation_workers: int = _key(0, "training")
    # training(): replay
    replay_proportion: float = _key(0.0, "training")
    replay_buffer_num_slots: int = _key(0, "training")
    # training(): optimisation
    grad_clip: float | None = _key(40.0, "training")
    opt_type: str = _key("adam", "training")
    lr_schedule: list | None = _key(None, "training")
    decay: float = _key(0.99, "training")
    momentum: float = _key(0.0, "training")
    epsilon: float = _key(0.1, "training")
    vf_loss_coeff: float = _key(0.5, "training")
    entropy_coeff: float = _key(0.01, "training")
    entropy_coeff_schedule: list | float | None = _key(None, "training")
    _separate_vf_optimizer: bool = _key(False, "training")
    _lr_vf: float = _key(0.0005, "training")
    # Not an RLlib key: updates with a non-finite loss or gradient are skipped; this many in a
    # row raise (`impala_tf.nonfinite`).
    max_nonfinite_updates: int = _key(10, "training")

    # resources()
    num_gpus: float = _key(1, "resources")
    _fake_gpus: bool = _key(False, "resources")
    # Not RLlib keys: where the actors and aggregation workers run. "local": local processes
    # (the default); "ray": Ray actors, on a Ray started here (`ray_address=None`) or on the
    # running cluster at `ray_address` ("auto" or "HOST:PORT").
    actor_backend: str = _key("local", "resources")
    ray_address: str | None = _key(None, "resources")

    # debugging()
    seed: int | None = _key(None, "debugging")

    # reporting()
    min_time_s_per_iteration: float | None = _key(10, "reporting")
    min_sample_timesteps_per_iteration: int | None = _key(0, "reporting")
    metrics_num_episodes_for_smoothing: int = _key(100, "reporting")

    # fault_tolerance()
    restart_failed_env_runners: bool = _key(True, "fault_tolerance")
    max_num_env_runner_restarts: int = _key(1000, "fault_tolerance")

    # evaluation()
    evaluation_interval: int | None = _key(None, "evaluation")
    evaluation_duration: int = _key(10, "evaluation")
    evaluation_config: dict | None = _key({}, "evaluation")

    # checkpointing()
    keep_checkpoints_num: int | None = _key(None, "checkpointing")
    checkpoint_freq: int = _key(1, "checkpointing")

    # multi_agent() (YAML: the `multiagent:` block; see impala_tf.multi_agent)
    policies: dict | list | set | tuple | None = _key(None, "multi_agent")
    policy_mapping_fn: Any = _key(None, "multi_agent")
    policies_to_train: list | None = _key(None, "multi_agent")

    def __init__(self, **settings: Any) -> None:
        for f in dataclasses.fields(self):
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            setattr(self, f.name, default)
        if settings:
            self.update_from_dict(settings)

    # Builders ---------------------------------------------------------------------------------

    def training(self, **kwargs: Any) -> ImpalaConfig:
        """Sets learning keys (V-trace, optimiser, queues, replay, `model`); returns self."""
        return self._apply(kwargs, group="training")

    def environment(self, env: Any = _UNSET, **kwargs: Any) -> ImpalaConfig:
        """Sets `env`, `env_config`, `clip_rewards`, `normalize_actions`, `clip_actions`."""
        if env is not _UNSET:
            kwargs = {"env": env, **kwargs}
        return self._apply(kwargs, group="environment")

    def env_runners(self, **kwargs: Any) -> ImpalaConfig:
        """Sets sampling keys (`num_env_runners`, `rollout_fragment_length`, ...); returns self."""
        return self._apply(kwargs, group="env_runners")

    def rollouts(self, **kwargs: Any) -> ImpalaConfig:
        """Deprecated RLlib name of `env_runners`."""
        _warn_once(
            "rollouts()",
            "`config.rollouts()` is deprecated; use `config.env_runners()`.",
            DeprecatedKeyWarning,
        )
        return self._apply(kwargs, group="env_runners")

    def resources(self, **kwargs: Any) -> ImpalaConfig:
        """Sets `num_gpus` (learner devices) and `_fake_gpus`; returns self."""
        return self._apply(kwargs, group="resources")

    def debugging(self, **kwargs: Any) -> ImpalaConfig:
        """Sets `seed`; returns self."""
        return self._apply(kwargs, group="debugging")

    def reporting(self, **kwargs: Any) -> ImpalaConfig:
        """Sets iteration length and metric smoothing keys; returns self."""
        return self._apply(kwargs, group="reporting")

    def fault_tolerance(self, **kwargs: Any) -> ImpalaConfig:
        """Sets `restart_failed_env_runners`, `max_num_env_runner_restarts`; returns self."""
        return self._apply(kwargs, group="fault_tolerance")

    def evaluation(self, **kwargs: Any) -> ImpalaConfig:
        """Sets `evaluation_interval`, `evaluation_duration`, `evaluation_config`; returns self."""
        return self._apply(kwargs, group="evaluation")

    def checkpointing(self, **kwargs: Any) -> ImpalaConfig:
        """Sets `keep_checkpoints_num` and `checkpoint_freq` (iterations); returns self."""
        return self._apply(kwargs, group="checkpointing")

    def multi_agent(self, **kwargs: Any) -> ImpalaConfig:
        """Sets `policies`, `policy_mapping_fn`, `policies_to_train` (`impala_tf.multi_agent`)."""
        from impala_tf.multi_agent.spec import multiagent_settings  # Lazy: light either way.

        return self._apply(multiagent_settings(kwargs), group="multi_agent")

    def framework(self, framework: Any = _UNSET, **kwargs: Any) -> ImpalaConfig:
        """Accepts RLlib's framework settings (`framework`, `eager_tracing`) and ignores them."""
        if framework is not _UNSET:
            kwargs = {"framework": framework, **kwargs}
        return self._apply(kwargs, group="framework")

    def api_stack(self, **kwargs: Any) -> ImpalaConfig:
        """Accepts RLlib's API-stack switches and ignores them (this is the old stack)."""
        return self._apply(kwargs, group="api_stack")

    def update_from_dict(self, config_dict: Mapping[str, Any]) -> ImpalaConfig:
        """Applies a flat RLlib config dict (any group, aliases allowed); returns self.

        `model` is merged into the current model dict, as in RLlib; other values replace the
        current ones (deep-copied, so later changes to `config_dict` do not leak in).

        Raises:
          ValueError: for an unknown key (with a suggestion), or an unsupported one.
        """
        return self._apply(config_dict, group=None)

    def _apply(self, settings: Mapping[str, Any], group: str | None) -> ImpalaConfig:
        set_by: dict[str, str] = {}
        if "multiagent" in settings or "replay_ratio" in settings:
            from impala_tf.multi_agent.spec import expand_rllib_keys

            settings = expand_rllib_keys(settings)
        for key, value in settings.items():
            name = key
            if key in ALIASES:
                name = ALIASES[key]
                if key not in SYNONYMS:
                    _warn_once(
                        key,
                        f"Config key `{key}` is deprecated; use `{name}` (value applied to it).",
                        DeprecatedKeyWarning,
                    )
            if name in IGNORED:
                _warn_once(name, f"Config key `{name}` is ignored: {IGNORED[name]}.", ConfigWarning)
                continue
            if name in UNSUPPORTED:
                if value is None:
                    _warn_once(name, f"Config key `{name}` is ignored (None).", ConfigWarning)
                    continue
                raise ValueError(f"Config key `{name}` is not supported: {UNSUPPORTED[name]}.")
            field = _FIELDS.get(name)
            if field is None:
                raise ValueError(f"Unknown IMPALA config key `{key}`.{suggest(key, _ALL_KEYS)}")
            if group is not None and field.metadata["group"] != group:
                raise TypeError(
                    f"`{key}` is not a setting of `.{group}()`; set it with "
                    f"`.{field.metadata['group']}({key}=...)`."
                )
            if name in set_by and set_by[name] != key and getattr(self, name) != value:
                raise ValueError(
                    f"Both `{set_by[name]}` and `{key}` set `{name}`, to different values; "
                    "keep one."
                )
            set_by[name] = key
            if name == "model":
                self._merge_model(value)
            else:
                setattr(self, name, copy.deepcopy(value))
        return self

    def _merge_model(self, model: Any) -> None:
        if not isinstance(model, Mapping):
            raise ValueError(f"`model` must be a dict of model settings, got {model!r}.")
        for key, value in model.items():
            if key in IGNORED_MODEL:
                _warn_once(
                    f"model.{key}",
                    f"Model key `{key}` is ignored: {IGNORED_MODEL[key]}.",
                    ConfigWarning,
                )
                continue
            if key in MODEL_ALIASES:
                targets = MODEL_ALIASES[key]
                _warn_once(
                    f"model.{key}",
                    f"Model key `{key}` is deprecated; use {' and '.join(targets)}.",
                    DeprecatedKeyWarning,
                )
            elif key in MODEL_DEFAULTS:
                targets = (key,)
            else:
                known = [*MODEL_DEFAULTS, *MODEL_ALIASES, *IGNORED_MODEL]
                raise ValueError(f"Unknown model key `{key}` in `model`.{suggest(key, known)}")
            for target in targets:
                self.model[target] = copy.deepcopy(value)

    # Serialisation ----------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, config_dict: Mapping[str, Any]) -> ImpalaConfig:
        """Builds a config from defaults updated with `config_dict` (aliases allowed)."""
        return cls().update_from_dict(config_dict)

    def to_dict(self) -> dict[str, Any]:
        """Returns every key as a plain dict (JSON-serialisable unless `env` is a callable).

        A callable `env` is kept as the object itself, so `from_dict(to_dict())` round-trips;
        code that writes the dict to JSON/YAML must handle that case.
        """
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def copy(self) -> ImpalaConfig:
        """Returns an independent deep copy."""
        return copy.deepcopy(self)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> tuple[ImpalaConfig, dict[str, float]]:
        """Reads an RLlib tuned example: `name: {env, run: IMPALA, stop: {...}, config: {...}}`.

        The file holds exactly one top entry. `env` may sit at the entry level or inside
        `config` (not both with different values). `checkpoint_freq` and `keep_checkpoints_num`
        may also sit at the entry level (Tune's place for them). The config is not validated
        here; `build()` does that.

        Args:
          path: Path of the YAML file.

        Returns:
          `(config, stop)`: the config, and the stop criteria normalised by
          `normalize_stop_criteria` (canonical keys only).

        Raises:
          ValueError: for a malformed file, `run` other than IMPALA, or a bad key.
        """
        with open(path, encoding="utf-8") as f:
            document = load_yaml(f)
        if not isinstance(document, Mapping) or len(document) != 1:
            raise ValueError(
                f"{path}: expected exactly one top-level experiment entry "
                "(`name: {env: ..., run: IMPALA, stop: {...}, config: {...}}`)."
            )
        ((name, entry),) = document.items()
        if not isinstance(entry, Mapping):
            raise ValueError(f"{path}: entry `{name}` must be a mapping.")
        unknown = set(entry) - {
            "env", "run", "stop", "config", "checkpoint_freq", "keep_checkpoints_num",
        }  # fmt: skip
        if unknown:
            raise ValueError(f"{path}: unknown keys {sorted(unknown)} in entry `{name}`.")
        run = entry.get("run")
        if not isinstance(run, str) or run.upper() != "IMPALA":
            raise ValueError(f"{path}: `run` must be IMPALA, got {run!r}.")
        if not isinstance(entry.get("config") or {}, Mapping):
            raise ValueError(f"{path}: `config` of entry `{name}` must be a mapping.")
        settings = dict(entry.get("config") or {})
        if "env" in entry:
            if "env" in settings and settings["env"] != entry["env"]:
                raise ValueError(
                    f"{path}: `env` is {entry['env']!r} in entry `{name}` but "
                    f"{settings['env']!r} in its config; keep one."
                )
            settings["env"] = entry["env"]
        for key in ("checkpoint_freq", "keep_checkpoints_num"):
            if key in entry:
                settings[key] = entry[key]
        return cls.from_dict(settings), normalize_stop_criteria(entry.get("stop"))

    # Derived values ---------------------------------------------------------------------------

    @property
    def num_learner_devices(self) -> int:
        """Devices the learner splits each train batch over: `max(1, int(num_gpus))`."""
        return max(1, int(self.num_gpus))

    @property
    def num_epochs(self) -> int:
        """RLlib's newer name for `num_sgd_iter`."""
        return self.num_sgd_iter

    @num_epochs.setter
    def num_epochs(self, value: int) -> None:
        self.num_sgd_iter = value

    def lr_schedule_points(self) -> list[list[float]] | None:
        """Returns `lr_schedule` as checked `[[timestep, lr], ...]`, or None for constant `lr`."""
        if self.lr_schedule is None:
            return None
        return normalize_schedule(self.lr_schedule, "lr_schedule")

    def entropy_coeff_schedule_points(self) -> list[list[float]] | None:
        """Returns `entropy_coeff_schedule` as `[[timestep, coeff], ...]`, or None.

        The legacy scalar form S means "decay `entropy_coeff` linearly to 0 at step S":
        `[[0, entropy_coeff], [S, 0.0]]`.
        """
        schedule = self.entropy_coeff_schedule
        if schedule is None:
            return None
        if is_number(schedule):
            schedule = [[0, self.entropy_coeff], [schedule, 0.0]]
        return normalize_schedule(schedule, "entropy_coeff_schedule")

    def get_evaluation_config(self) -> ImpalaConfig:
        """Returns a copy of this config with `evaluation_config` applied (and emptied)."""
        evaluation = self.copy()
        overrides = evaluation.evaluation_config or {}
        evaluation.evaluation_config = {}
        try:
            evaluation.update_from_dict(overrides)
        except (TypeError, ValueError) as e:
            raise ValueError(f"`evaluation_config`: {e}") from e
        return evaluation

    # Validation -------------------------------------------------------------------------------

    def validate(self, *, require_env: bool = False) -> None:
        """Checks every value, raising on the first bad one; may adjust `minibatch_buffer_size`.

        Args:
          require_env: Also require `env` to be set (as `build()` does).

        Raises:
          ValueError: naming the offending key, saying what would go wrong and how to fix it.
        """
        self._validate_env(require_env)
        self._validate_sampling()
        self._validate_learning()
        self._validate_runtime()
        self._validate_model()
        self._validate_multi_device()
        if self.policies is not None or self.policy_mapping_fn is not None:
            from impala_tf.multi_agent.spec import validate_multi_agent

            validate_multi_agent(self)
        if not isinstance(self.evaluation_config, (Mapping, type(None))):
            raise ValueError(
                f"`evaluation_config` must be a dict of overrides, got {self.evaluation_config!r}."
            )
        if self.evaluation_config:
            evaluation = self.get_evaluation_config()
            with warnings.catch_warnings():
                # The main config already warned about anything the overrides left unchanged.
                warnings.simplefilter("ignore", ConfigWarning)
                try:
                    evaluation.validate(require_env=False)
                except ValueError as e:
                    raise ValueError(f"`evaluation_config`: {e}") from e

    def _validate_env(self, require_env: bool) -> None:
        env = self.env
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
        if not isinstance(self.env_config, Mapping):
            raise ValueError(f"`env_config` must be a dict, got {self.env_config!r}.")
        clip = self.clip_rewards
        if not (clip is None or isinstance(clip, bool) or (is_number(clip) and clip > 0)):
            raise ValueError(
                f"`clip_rewards` must be None, a bool (True clips to sign) or a number > 0 "
                f"(clip to [-x, x]), got {clip!r}."
            )
        self._check_bool("normalize_actions")
        self._check_bool("clip_actions")

    def _validate_sampling(self) -> None:
        if self.batch_mode != "truncate_episodes":
            hint = (
                " IMPALA learns from fixed-length fragments (T = `rollout_fragment_length`); "
                "whole episodes are not supported."
                if self.batch_mode == "complete_episodes"
                else ""
            )
            raise ValueError(
                f"`batch_mode` must be 'truncate_episodes', got {self.batch_mode!r}.{hint}"
            )
        self._check_int("num_env_runners", minimum=0)
        self._check_int("num_envs_per_env_runner", minimum=1)
        self._check_int("rollout_fragment_length", minimum=1)
        self._check_int("max_requests_in_flight_per_env_runner", minimum=1)
        for key in (
            "explore", "compress_observations", "restart_failed_env_runners",
            "drop_nonfinite_episodes",
        ):  # fmt: skip
            self._check_bool(key)
        if self.preprocessor_pref not in ("deepmind", "rllib", None):
            raise ValueError(
                "`preprocessor_pref` must be 'deepmind' (DeepMind preprocessing of Atari envs), "
                f"'rllib' or None (no preprocessing), got {self.preprocessor_pref!r}."
            )
        if self.observation_filter not in FILTER_NAMES:
            raise ValueError(
                f"`observation_filter` must be one of {list(FILTER_NAMES)} (RLlib's names), "
                f"got {self.observation_filter!r}."
            )
        self._check_number("sample_timeout_s", minimum=0.0, strict=True, optional=True)
        if self.inference not in ("auto", "actor", "central"):
            raise ValueError(
                "`inference` must be 'auto', 'actor' (each actor runs the policy) or 'central' "
                f"(the driver runs it for every actor), got {self.inference!r}."
            )
        self._check_int("max_num_env_runner_restarts", minimum=0)
        self._check_int("seed", minimum=None, optional=True)

    def _validate_learning(self) -> None:
        if self.vtrace is not True:
            raise ValueError(
                "`vtrace`: IMPALA does not support vtrace=False (RLlib removed the A3C-style "
                "loss); set `vtrace=True`."
            )
        self._check_bool("vtrace_drop_last_ts")
        for key in ("vtrace_clip_rho_threshold", "vtrace_clip_pg_rho_threshold"):
            self._check_number(key, minimum=0.0, strict=True, optional=True)
        self._check_number("gamma", minimum=0.0, maximum=1.0)
        self._check_number("lr", minimum=0.0)
        self._check_int("train_batch_size", minimum=1)
        self._check_int("num_sgd_iter", minimum=1)
        self._check_number("grad_clip", minimum=0.0, strict=True, optional=True)
        if self.opt_type not in OPTIMIZERS:
            raise ValueError(f"`opt_type` must be one of {OPTIMIZERS}, got {self.opt_type!r}.")
        self._check_number("decay", minimum=0.0, maximum=1.0)
        self._check_number("momentum", minimum=0.0)
        self._check_number("epsilon", minimum=0.0, strict=True)
        self._check_number("vf_loss_coeff", minimum=0.0)
        if is_number(self.entropy_coeff) and self.entropy_coeff < 0:
            raise ValueError(
                f"`entropy_coeff` must be >= 0.0, got {self.entropy_coeff}; a negative "
                "coefficient would reward the policy for becoming deterministic."
            )
        self._check_number("entropy_coeff", minimum=0.0)
        self._check_bool("_separate_vf_optimizer")
        self._check_number("_lr_vf", minimum=0.0)
        if self._separate_vf_optimizer and self.opt_type == "rmsprop":
            raise ValueError(
                "`opt_type`='rmsprop' cannot be combined with `_separate_vf_optimizer=True` "
                "(the value optimiser is always Adam); use opt_type='adam'."
            )
        self.lr_schedule_points()
        schedule = self.entropy_coeff_schedule
        if is_number(schedule) and schedule < 0:
            raise ValueError(
                f"`entropy_coeff_schedule` as a number is the step where the coefficient "
                f"reaches 0 and must be >= 0, got {schedule}."
            )
        self.entropy_coeff_schedule_points()
        if self.microbatch_size is not None:
            self._check_int("microbatch_size", minimum=1)
            if self.microbatch_size >= self.train_batch_size:
                raise ValueError(
                    f"`microbatch_size` ({self.microbatch_size}) must be smaller than "
                    f"`train_batch_size` ({self.train_batch_size}): gradients of microbatches "
                    "are summed until a train batch is reached."
                )
        self._check_number("replay_proportion", minimum=0.0)
        self._check_int("replay_buffer_num_slots", minimum=0)

    def _validate_runtime(self) -> None:
        self._check_int("num_multi_gpu_tower_stacks", minimum=1)
        self._check_int("num_gpu_loader_threads", minimum=1)
        self._check_int("minibatch_buffer_size", minimum=1)
        self._check_int("learner_queue_size", minimum=1)
        self._check_number("learner_queue_timeout", minimum=0.0, strict=True)
        self._check_int("max_nonfinite_updates", minimum=1)
        self._check_number("timeout_s_sampler_manager", minimum=0.0)
        self._check_number("timeout_s_aggregator_manager", minimum=0.0)
        self._check_int("max_requests_in_flight_per_aggregator_worker", minimum=1)
        self._check_int("broadcast_interval", minimum=1)
        self._check_int("num_aggregation_workers", minimum=0)
        if self.num_aggregation_workers > self.num_env_runners:
            raise ValueError(
                f"`num_aggregation_workers` ({self.num_aggregation_workers}) must be <= "
                f"`num_env_runners` ({self.num_env_runners}); aggregation makes no sense "
                "otherwise."
            )
        if self.num_aggregation_workers > self.num_env_runners / 2:
            _warn(
                f"`num_aggregation_workers` ({self.num_aggregation_workers}) should be much "
                f"smaller than `num_env_runners` ({self.num_env_runners}); try at most half.",
                ConfigWarning,
            )
        self._check_number("num_gpus", minimum=0.0)
        self._check_bool("_fake_gpus")
        self._validate_backend()
        self._check_number("min_time_s_per_iteration", minimum=0.0, optional=True)
        self._check_int("min_sample_timesteps_per_iteration", minimum=0, optional=True)
        self._check_int("metrics_num_episodes_for_smoothing", minimum=1)
        self._check_int("evaluation_interval", minimum=0, optional=True)
        self._check_int("evaluation_duration", minimum=1)
        self._check_int("keep_checkpoints_num", minimum=1, optional=True)
        self._check_int("checkpoint_freq", minimum=0)

    def _validate_backend(self) -> None:
        if self.actor_backend not in ACTOR_BACKENDS:
            raise ValueError(
                f"`actor_backend` must be one of {list(ACTOR_BACKENDS)} (local processes, or "
                f"Ray actors), got {self.actor_backend!r}."
            )
        multi_agent = self.policies is not None or self.policy_mapping_fn is not None
        if multi_agent and self.actor_backend == "ray":
            raise ValueError(
                "`actor_backend='ray'` runs single-agent configs only for now; this config sets "
                "`multiagent` policies: use `actor_backend='local'`."
            )
        if multi_agent and self.inference == "central":
            raise ValueError(
                "`inference='central'` serves one policy; multi-agent actors run their policies "
                "themselves: set `inference` to 'actor' or 'auto'."
            )
        if self.actor_backend == "ray" and self.inference == "central":
            raise ValueError(
                "`inference='central'` runs the policy in the driver for local actor processes; "
                "with `actor_backend='ray'` each actor runs it: set `inference` to 'actor' or "
                "'auto'."
            )
        address = self.ray_address
        if address is not None and (
            not isinstance(address, str)
            or (address != "auto" and not RAY_ADDRESS.match(address))
            or (address != "auto" and int(address.rsplit(":", 1)[1]) > 65535)
        ):
            raise ValueError(
                "`ray_address` must be None (start a local Ray), 'auto' (the cluster running on "
                f"this machine) or 'HOST:PORT' (the head node's GCS address), got {address!r}."
            )
        self._check_number("num_cpus_per_env_runner", minimum=0.0)
        resources = self.custom_resources_per_env_runner
        if not isinstance(resources, Mapping) or not all(
            isinstance(k, str) and is_number(v) and math.isfinite(v) and v > 0
            for k, v in resources.items()
        ):
            raise ValueError(
                "`custom_resources_per_env_runner` must be a dict of Ray resource names to "
                f"amounts > 0 (e.g. {{'node2': 1}}), got {resources!r}."
            )
        if self.actor_backend == "local":
            unused = [k for k in ("ray_address",) if getattr(self, k) is not None]
            if resources:
                unused.append("custom_resources_per_env_runner")
            if unused:
                _warn(
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

    def _validate_model(self) -> None:
        model = self.model
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
        if model["custom_model"] not in CUSTOM_MODELS:
            raise ValueError(
                f"`model.custom_model` must be one of {CUSTOM_MODELS}, got "
                f"{model['custom_model']!r}."
            )
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
            "grayscale", "framestack", "free_log_std",
        ):  # fmt: skip
            if not isinstance(model[key], bool):
                raise ValueError(f"`model.{key}` must be a bool, got {model[key]!r}.")
        # What the model catalog refuses, refused here, before any process starts.
        if model["use_lstm"] and (model["lstm_use_prev_action"] or model["lstm_use_prev_reward"]):
            raise ValueError(
                "`model.lstm_use_prev_action` / `model.lstm_use_prev_reward` are not supported "
                "with `model.use_lstm=True` (the models take no previous actions or rewards)."
            )

    def _validate_multi_device(self) -> None:
        devices = self.num_learner_devices
        if self.train_batch_size % devices:
            raise ValueError(
                f"`train_batch_size` ({self.train_batch_size}) must divide evenly by the "
                f"{devices} learner devices (`num_gpus`), or the towers get unequal shards."
            )
        if self.microbatch_size is not None:
            horizon = self.rollout_fragment_length
            if self.microbatch_size % horizon:
                raise ValueError(
                    f"`microbatch_size` ({self.microbatch_size}) must be a multiple of "
                    f"`rollout_fragment_length` ({horizon}): microbatches are whole env sequences."
                )
            if (self.microbatch_size // horizon) % devices:
                raise ValueError(
                    f"`microbatch_size` ({self.microbatch_size}) is "
                    f"{self.microbatch_size // horizon} sequences of {horizon} steps, which do not "
                    f"divide evenly over the {devices} learner devices (`num_gpus`)."
                )
        if devices > 1 and self.minibatch_buffer_size != self.num_multi_gpu_tower_stacks:
            _warn(
                f"In multi-device mode the minibatch buffer is the ring of tower stacks; "
                f"setting `minibatch_buffer_size={self.num_multi_gpu_tower_stacks}` "
                f"(was {self.minibatch_buffer_size}) to match `num_multi_gpu_tower_stacks`.",
                ConfigWarning,
            )
            self.minibatch_buffer_size = self.num_multi_gpu_tower_stacks

    def _check_int(self, key: str, *, minimum: int | None, optional: bool = False) -> None:
        value = getattr(self, key)
        if optional and value is None:
            return
        if not is_int(value) or (minimum is not None and value < minimum):
            bound = "" if minimum is None else f" >= {minimum}"
            none = " or None" if optional else ""
            raise ValueError(f"`{key}` must be an int{bound}{none}, got {value!r}.")

    def _check_number(
        self,
        key: str,
        *,
        minimum: float,
        maximum: float | None = None,
        strict: bool = False,
        optional: bool = False,
    ) -> None:
        value = getattr(self, key)
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

    def _check_bool(self, key: str) -> None:
        value = getattr(self, key)
        if not isinstance(value, bool):
            raise ValueError(f"`{key}` must be True or False, got {value!r}.")

    # Building ---------------------------------------------------------------------------------

    def build(self, env: Any = None, logger_creator: Callable | None = None) -> Any:
        """Validates this config and returns the IMPALA algorithm built from it.

        Args:
          env: If given, sets `env` first (gymnasium id or `env_creator(env_config)`).
          logger_creator: Forwarded to the algorithm as a keyword argument when given.

        Returns:
          An `impala_tf.algorithm.Impala`, or a `MultiAgentImpala` for a multi-agent config.
        """
        if env is not None:
            self.environment(env)
        self.validate(require_env=True)
        # Start the actors' fork server first, so that its TensorFlow import overlaps ours.
        from impala_tf.actors.local import prestart_fork_server

        if self.actor_backend == "local":
            prestart_fork_server(self)
        # Lazy: the algorithm pulls in TensorFlow, which config users should not pay for.
        from impala_tf.multi_agent import algorithm_class

        algorithm = algorithm_class(self)  # Impala, or MultiAgentImpala for several policies.
        if logger_creator is None:
            return algorithm(self)
        return algorithm(self, logger_creator=logger_creator)

    # Python protocol --------------------------------------------------------------------------

    def __repr__(self) -> str:
        """Shows `env` and the keys that differ from the defaults (model keys by themselves)."""
        defaults = ImpalaConfig()
        changed = []
        for f in dataclasses.fields(self):
            value, default = getattr(self, f.name), getattr(defaults, f.name)
            if f.name == "model":
                changed += [f"model.{k}={v!r}" for k, v in value.items() if default.get(k) != v]
            elif f.name != "env" and value != default:
                changed.append(f"{f.name}={value!r}")
        more = f", ... {len(changed) - 6} more" if len(changed) > 6 else ""
        return f"ImpalaConfig({', '.join([f'env={self.env!r}', *changed[:6]])}{more})"


_FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(ImpalaConfig)}
_ALL_KEYS = [*_FIELDS, *ALIASES, *IGNORED, *UNSUPPORTED]


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
