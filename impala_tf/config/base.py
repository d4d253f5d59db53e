"""`AlgorithmConfig`: RLlib's IMPALA settings as data, with their names, defaults and aliases.

`impala_tf.config.ImpalaConfig` is this class plus `build()`; everything the runtime needs of a
config is here, so the runtime imports this module and never the one that builds it (no import
circle). A config is a plain object whose attributes are RLlib's keys (old API stack, defaults as
in RLlib 2.5+, `learner_queue_size=16`). It is filled in three equivalent ways, all of which go
through `update_from_dict`:

* RLlib-style builders that return `self`: `training`, `environment`, `env_runners`,
  `resources`, `debugging`, `reporting`, `fault_tolerance`, `evaluation`, `checkpointing`,
  `multi_agent` (plus `framework`, `api_stack` and the deprecated `rollouts`, kept so RLlib
  scripts run);
* `from_dict(d)`;
* `from_yaml(path)`, reading RLlib's tuned-example format (`read_experiment(path)` also returns
  the entry's name and the learning suite's `pass_criteria`; `impala_tf.config.experiments`).

Every key is resolved against the fields and RLlib's old, ignored and refused names by one
function (`impala_tf.config.resolution`). Values are checked in one place, `validate()`
(`impala_tf.config.validation`), which never changes the config.

Where keys depart from RLlib's: `docs/differences.md` and `docs/configs.md`.

This module holds no tensors and imports neither TensorFlow nor gymnasium at import time.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from impala_tf.config.experiments import Experiment, read_experiment_file
from impala_tf.config.keys import (
    IGNORED,
    MODEL_DEFAULTS,
    UNSUPPORTED,
    DeprecatedKeyWarning,
    is_number,
    normalize_schedule,
    warn_once,
)
from impala_tf.config.resolution import apply_settings
from impala_tf.config.validation import validate

__all__ = ["AlgorithmConfig", "config_key"]


def config_key(default: Any, group: str) -> Any:
    """Declares one config key: its RLlib default and the builder method that sets it (an
    algorithm's config class declares its own keys with it, `impala_tf.appo.config`)."""
    metadata = {"group": group}
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


_UNSET: Any = object()


@dataclasses.dataclass(init=False, repr=False, eq=True)
class AlgorithmConfig:
    """RLlib's IMPALA config: the keys as attributes, RLlib builders, aliases and validation.

    Construct with defaults (`ImpalaConfig()`), or with settings
    (`ImpalaConfig(env="CartPole-v1", lr=1e-3)`, the same as `update_from_dict`), then chain
    builders: `ImpalaConfig().environment("CartPole-v1").training(lr=1e-3)`. Values are not
    checked until `validate()` (called by `build()`).

    Every key, its default and its RLlib name: `docs/configs.md`. The fields below are grouped
    by the builder method that sets them.
    """

    # environment()
    env: str | Callable[[dict], Any] | None = config_key(None, "environment")
    env_config: dict = config_key({}, "environment")
    clip_rewards: bool | float | None = config_key(None, "environment")
    # Box actions: the policy acts in [-1, 1], unsquashed to the bounds (see
    # impala_tf.acting.actions).
    normalize_actions: bool = config_key(True, "environment")
    clip_actions: bool = config_key(False, "environment")
    # RLlib's `render_env` and RLlib 1.x's `record_env` (True or a directory): here they record
    # evaluation episodes only, as GIFs in TensorBoard and, with `record_env`, in files
    # (impala_tf.envs.video); training env runners never render.
    render_env: bool = config_key(False, "environment")
    record_env: bool | str = config_key(False, "environment")

    # env_runners()
    num_env_runners: int = config_key(2, "env_runners")
    num_envs_per_env_runner: int = config_key(1, "env_runners")
    rollout_fragment_length: int = config_key(50, "env_runners")
    batch_mode: str = config_key("truncate_episodes", "env_runners")
    explore: bool = config_key(True, "env_runners")
    max_requests_in_flight_per_env_runner: int = config_key(2, "env_runners")
    compress_observations: bool = config_key(False, "env_runners")
    preprocessor_pref: str | None = config_key("deepmind", "env_runners")
    observation_filter: str = config_key("NoFilter", "env_runners")
    sample_timeout_s: float | None = config_key(60.0, "env_runners")
    drop_nonfinite_episodes: bool = config_key(False, "env_runners")
    # Where the acting policy runs (impala_tf.acting.inference): in each actor, or in the driver for
    # all ("central", SEED RL style); "auto" keeps it in the actors unless local TensorFlow actors
    # would not fit in memory (impala_tf.driver.plan decides, once per build).
    inference: str = config_key("auto", "env_runners")
    # Ray resources of each actor (Ray actors, impala_tf.workers.ray_backend; Tune trials).
    num_cpus_per_env_runner: float = config_key(1, "env_runners")
    custom_resources_per_env_runner: dict = config_key({}, "env_runners")

    # training(): general
    gamma: float = config_key(0.99, "training")
    lr: float = config_key(0.0005, "training")
    train_batch_size: int = config_key(500, "training")
    model: dict = config_key(MODEL_DEFAULTS, "training")
    # training(): V-trace
    vtrace: bool = config_key(True, "training")
    vtrace_clip_rho_threshold: float | None = config_key(1.0, "training")
    vtrace_clip_pg_rho_threshold: float | None = config_key(1.0, "training")
    vtrace_drop_last_ts: bool = config_key(False, "training")
    # training(): data flow into the learner
    num_multi_gpu_tower_stacks: int = config_key(1, "training")
    # The private thread pool of the loader's `tf.data` pipeline that prefetches and copies onto
    # the learner devices, as RLlib's loader threads (`impala_tf.learning.pipeline`); no effect
    # on one CPU device, where the loader is a plain prefetching dataset.
    num_gpu_loader_threads: int = config_key(8, "training")
    minibatch_buffer_size: int = config_key(1, "training")
    num_sgd_iter: int = config_key(1, "training")
    learner_queue_size: int = config_key(16, "training")
    learner_queue_timeout: float = config_key(300, "training")
    microbatch_size: int | None = config_key(None, "training")
    timeout_s_sampler_manager: float = config_key(0.0, "training")
    timeout_s_aggregator_manager: float = config_key(0.0, "training")
    max_requests_in_flight_per_aggregator_worker: int = config_key(2, "training")
    broadcast_interval: int = config_key(1, "training")
    # Not an RLlib key: the least seconds between two weight broadcasts, so that weight traffic
    # stays bounded however fast the learner updates (`impala_tf.driver.broadcast`). "auto":
    # the weights' bytes / 40 MB/s; 0 sends after every training step with a new update, as
    # RLlib does. Ignored in deterministic (lockstep) runs.
    min_time_s_per_broadcast: float | str = config_key("auto", "training")
    num_aggregation_workers: int = config_key(0, "training")
    # training(): replay
    replay_proportion: float = config_key(0.0, "training")
    replay_buffer_num_slots: int = config_key(0, "training")
    # training(): optimisation
    grad_clip: float | None = config_key(40.0, "training")
    opt_type: str = config_key("adam", "training")
    lr_schedule: list | None = config_key(None, "training")
    decay: float = config_key(0.99, "training")
    momentum: float = config_key(0.0, "training")
    epsilon: float = config_key(0.1, "training")
    vf_loss_coeff: float = config_key(0.5, "training")
    entropy_coeff: float = config_key(0.01, "training")
    entropy_coeff_schedule: list | float | None = config_key(None, "training")
    _separate_vf_optimizer: bool = config_key(False, "training")
    _lr_vf: float = config_key(0.0005, "training")
    # Not an RLlib key: updates with a non-finite loss or gradient are skipped; this many in a
    # row raise (`impala_tf.learning.nonfinite`).
    max_nonfinite_updates: int = config_key(10, "training")
    # Not an RLlib key: XLA-compile each device's part of the update (forward, V-trace,
    # backward; the all-reduce and the optimizer step stay outside XLA). True, False, or "auto"
    # (`impala_tf.learning.devices.resolve_jit_compile`: off on a CPU, where it measured slower).
    jit_compile_update: bool | str = config_key("auto", "training")
    # Not an RLlib key (RLlib's TF policies have no mixed precision): the Keras dtype policy the
    # learner's model is built under, and the acting models' (TF actors, the inference server,
    # evaluation, export) unless `inference_precision` is set. "mixed_bfloat16": torsos compute
    # in bfloat16, variables, heads, LSTM core, V-trace and the loss stay float32
    # (`impala_tf.models.precision`). Numpy MLP actors act in float32 either way.
    precision: str = config_key("float32", "training")
    # Not an RLlib key: the dtype policy of the models that act (TF actors, the inference
    # server, evaluation, export) when it differs from the learner's `precision`; None: the
    # same as `precision` (`acting_precision`): bfloat16 pays at the learner's batch of
    # hundreds and can cost at an actor's batch of 16 (docs/differences.md).
    inference_precision: str | None = config_key(None, "training")

    # resources()
    num_gpus: float = config_key(1, "resources")
    _fake_gpus: bool = config_key(False, "resources")
    num_cpus_for_main_process: float = config_key(1, "resources")  # A Tune trial's driver.
    # Not RLlib keys: where the actors and aggregation workers run. "local": local processes
    # (the default); "ray": Ray actors, on a Ray started here (`ray_address=None`) or on the
    # running cluster at `ray_address` ("auto" or "HOST:PORT").
    actor_backend: str = config_key("local", "resources")
    ray_address: str | None = config_key(None, "resources")

    # debugging()
    seed: int | None = config_key(None, "debugging")

    # reporting()
    min_time_s_per_iteration: float | None = config_key(10, "reporting")
    min_sample_timesteps_per_iteration: int | None = config_key(0, "reporting")
    metrics_num_episodes_for_smoothing: int = config_key(100, "reporting")

    # fault_tolerance()
    restart_failed_env_runners: bool = config_key(True, "fault_tolerance")
    max_num_env_runner_restarts: int = config_key(1000, "fault_tolerance")

    # evaluation()
    evaluation_interval: int | None = config_key(None, "evaluation")
    evaluation_duration: int = config_key(10, "evaluation")
    evaluation_config: dict | None = config_key({}, "evaluation")
    # Not RLlib keys: the bounds of the videos `render_env` / `record_env` record
    # (impala_tf.envs.video): episodes per evaluation, frames per episode, frame width in pixels
    # (None: the env's), and every how many evaluations one records.
    video_episodes: int = config_key(1, "evaluation")
    video_max_frames: int = config_key(500, "evaluation")
    video_max_width: int | None = config_key(256, "evaluation")
    video_interval: int = config_key(1, "evaluation")

    # checkpointing()
    keep_checkpoints_num: int | None = config_key(None, "checkpointing")
    checkpoint_freq: int = config_key(1, "checkpointing")

    # callbacks() (YAML and dicts: `callbacks`): RLlib's DefaultCallbacks subclass, an import
    # path to one, or a list of them (impala_tf.config.callbacks); None: no callbacks.
    callbacks_class: Any = config_key(None, "callbacks")

    # multi_agent() (YAML: the `multiagent:` block; see impala_tf.multi_agent)
    policies: dict | list | set | tuple | None = config_key(None, "multi_agent")
    policy_mapping_fn: Any = config_key(None, "multi_agent")
    policies_to_train: list | None = config_key(None, "multi_agent")

    #: The algorithm's name: a YAML's `run:` and the checkpoints' `"algorithm"`
    #: (`impala_tf.config.registry`).
    algo_name: ClassVar[str] = "IMPALA"
    #: RLlib keys accepted and ignored, with the reason the warning gives (`keys.IGNORED`).
    ignored_keys: ClassVar[Mapping[str, str]] = IGNORED
    #: RLlib keys refused unless None, with the reason (`keys.UNSUPPORTED`).
    unsupported_keys: ClassVar[Mapping[str, str]] = UNSUPPORTED

    def __init__(self, **settings: Any) -> None:
        for f in dataclasses.fields(self):
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            setattr(self, f.name, default)
        if settings:
            self.update_from_dict(settings)

    # Builders ---------------------------------------------------------------------------------

    def training(self, **kwargs: Any) -> AlgorithmConfig:
        """Sets learning keys (V-trace, optimiser, queues, replay, `model`); returns self."""
        return self._apply(kwargs, group="training")

    def environment(self, env: Any = _UNSET, **kwargs: Any) -> AlgorithmConfig:
        """Sets `env`, `env_config`, `clip_rewards`, `normalize_actions`, `clip_actions`,
        `render_env`, `record_env`; returns self."""
        if env is not _UNSET:
            kwargs = {"env": env, **kwargs}
        return self._apply(kwargs, group="environment")

    def env_runners(self, **kwargs: Any) -> AlgorithmConfig:
        """Sets sampling keys (`num_env_runners`, `rollout_fragment_length`, ...); returns self."""
        return self._apply(kwargs, group="env_runners")

    def rollouts(self, **kwargs: Any) -> AlgorithmConfig:
        """Deprecated RLlib name of `env_runners`."""
        warn_once(
            "rollouts()",
            "`config.rollouts()` is deprecated; use `config.env_runners()`.",
            DeprecatedKeyWarning,
        )
        return self._apply(kwargs, group="env_runners")

    def resources(self, **kwargs: Any) -> AlgorithmConfig:
        """Sets `num_gpus` (learner devices) and `_fake_gpus`; returns self."""
        return self._apply(kwargs, group="resources")

    def debugging(self, **kwargs: Any) -> AlgorithmConfig:
        """Sets `seed`; returns self."""
        return self._apply(kwargs, group="debugging")

    def reporting(self, **kwargs: Any) -> AlgorithmConfig:
        """Sets iteration length and metric smoothing keys; returns self."""
        return self._apply(kwargs, group="reporting")

    def fault_tolerance(self, **kwargs: Any) -> AlgorithmConfig:
        """Sets `restart_failed_env_runners`, `max_num_env_runner_restarts`; returns self."""
        return self._apply(kwargs, group="fault_tolerance")

    def evaluation(self, **kwargs: Any) -> AlgorithmConfig:
        """Sets `evaluation_interval`, `evaluation_duration`, `evaluation_config` and the video
        bounds (`video_episodes`, `video_max_frames`, `video_max_width`, `video_interval`);
        returns self."""
        return self._apply(kwargs, group="evaluation")

    def callbacks(self, callbacks_class: Any = _UNSET, **kwargs: Any) -> AlgorithmConfig:
        """Sets `callbacks_class` (RLlib's `callbacks`: a `DefaultCallbacks` subclass, an import
        path to one, or a list of them); returns self."""
        if callbacks_class is not _UNSET:
            kwargs = {"callbacks_class": callbacks_class, **kwargs}
        return self._apply(kwargs, group="callbacks")

    def checkpointing(self, **kwargs: Any) -> AlgorithmConfig:
        """Sets `keep_checkpoints_num` and `checkpoint_freq` (iterations); returns self."""
        return self._apply(kwargs, group="checkpointing")

    def multi_agent(self, **kwargs: Any) -> AlgorithmConfig:
        """Sets `policies`, `policy_mapping_fn`, `policies_to_train` (`impala_tf.multi_agent`)."""
        from impala_tf.config.policies import multiagent_settings  # Lazy: light either way.

        return self._apply(multiagent_settings(kwargs), group="multi_agent")

    def framework(self, framework: Any = _UNSET, **kwargs: Any) -> AlgorithmConfig:
        """Accepts RLlib's framework settings (`framework`, `eager_tracing`) and ignores them."""
        if framework is not _UNSET:
            kwargs = {"framework": framework, **kwargs}
        return self._apply(kwargs, group="framework")

    def api_stack(self, **kwargs: Any) -> AlgorithmConfig:
        """Accepts RLlib's API-stack switches and ignores them (this is the old stack)."""
        return self._apply(kwargs, group="api_stack")

    def update_from_dict(self, config_dict: Mapping[str, Any]) -> AlgorithmConfig:
        """Applies a flat RLlib config dict (any group, aliases allowed); returns self.

        `model` is merged into the current model dict, as in RLlib; other values replace the
        current ones (deep-copied, so later changes to `config_dict` do not leak in).

        Raises:
          ValueError: for an unknown key (with a suggestion), or an unsupported one.
        """
        return self._apply(config_dict, group=None)

    def _apply(self, settings: Mapping[str, Any], group: str | None) -> AlgorithmConfig:
        apply_settings(self, settings, group)
        return self

    # Serialisation ----------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, config_dict: Mapping[str, Any]) -> AlgorithmConfig:
        """Builds a config from defaults updated with `config_dict` (aliases allowed)."""
        return cls().update_from_dict(config_dict)

    def to_dict(self) -> dict[str, Any]:
        """Returns every key as a plain dict (JSON-serialisable unless `env` is a callable).

        A callable `env` is kept as the object itself, so `from_dict(to_dict())` round-trips;
        code that writes the dict to JSON/YAML must handle that case.
        """
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def copy(self) -> AlgorithmConfig:
        """Returns an independent deep copy."""
        return copy.deepcopy(self)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> tuple[AlgorithmConfig, dict[str, float]]:
        """Reads an RLlib tuned example: `name: {env, run: IMPALA, stop: {...}, config: {...}}`.

        The file holds exactly one top entry. Its `run` picks the config class, whichever class
        this is called on: `run: APPO` gives an `impala_tf.appo.APPOConfig`
        (`impala_tf.config.registry`). `env` may sit at the entry level or inside
        `config` (not both with different values). `checkpoint_freq` and `keep_checkpoints_num`
        may also sit at the entry level (Tune's place for them). A `pass_criteria` block (the
        learning suite's, see `read_experiment`) is checked and otherwise ignored. The config is
        not validated here; `build()` does that.

        Args:
          path: Path of the YAML file, or the name of a shipped config (`cartpole-impala`:
            `impala_tf.config.shipped`).

        Returns:
          `(config, stop)`: the config, and the stop criteria normalised by
          `normalize_stop_criteria` (canonical keys only).

        Raises:
          ValueError: for a malformed file, a `run` that names no algorithm, or a bad key.
        """
        experiment = cls.read_experiment(path)
        return experiment.config, experiment.stop

    @classmethod
    def read_experiment(cls, path: str | os.PathLike) -> Experiment:
        """Reads a tuned example as `from_yaml` does, with its name and its pass criteria.

        Args:
          path: Path of the YAML file.

        Returns:
          An `Experiment` (`impala_tf.config.experiments`): the entry's name, the config, the
          stop criteria and the pass criteria (`normalize_pass_criteria`; empty when the file
          has none).

        Raises:
          ValueError: as `from_yaml`, and for a malformed `pass_criteria` block (the message
            names the file).
        """
        return read_experiment_file(path)

    # Derived values ---------------------------------------------------------------------------

    @property
    def acting_precision(self) -> str:
        """The dtype policy the acting models are built under: `inference_precision`, or
        `precision` when that is None."""
        return self.precision if self.inference_precision is None else self.inference_precision

    @property
    def num_learner_devices(self) -> int:
        """Devices the learner splits each train batch over: `max(1, int(num_gpus))`."""
        return max(1, int(self.num_gpus))

    @property
    def minibatch_ring_size(self) -> int:
        """Slots of the learner's minibatch buffer: `minibatch_buffer_size`, except with several
        learner devices, where the buffer is the ring of `num_multi_gpu_tower_stacks`."""
        if self.num_learner_devices > 1:
            return int(self.num_multi_gpu_tower_stacks)
        return int(self.minibatch_buffer_size)

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

    def get_evaluation_config(self) -> AlgorithmConfig:
        """Returns a copy of this config with `evaluation_config` applied (and emptied)."""
        evaluation = self.copy()
        overrides = evaluation.evaluation_config or {}
        evaluation.evaluation_config = {}
        try:
            evaluation.update_from_dict(overrides)
        except (TypeError, ValueError) as e:
            raise ValueError(f"`evaluation_config`: {e}") from e
        return evaluation

    # What the runtime is built from ------------------------------------------------------------

    def learner_class(self) -> type:
        """The learner this algorithm trains with: `impala_tf.learning.learner.ImpalaLearner`, built
        from `learner_spec()` (an algorithm's config class returns its own subclass)."""
        from impala_tf.learning.learner import ImpalaLearner

        return ImpalaLearner

    def learner_spec(self, model: Any = None) -> Any:
        """The learner settings of this (policy's) config: a `LearnerSpec`
        (`impala_tf.learning.spec`), which also makes the learner thread's queue.

        Args:
          model: The policy's resolved `ModelSpec` (None: resolves `model` here).
        """
        from impala_tf.learning.spec import learner_spec

        return learner_spec(self, model)

    def lockstep_problems(self) -> list[str]:
        """What this config's algorithm needs, beyond the runtime's own needs, to train in
        lockstep (`deterministic=True`), each as "needs ..." would end; empty for IMPALA."""
        return []

    # Validation -------------------------------------------------------------------------------

    def validate(self, *, require_env: bool = False) -> None:
        """Checks every value, raising on the first bad one; never changes the config.

        Args:
          require_env: Also require `env` to be set (as `build()` does).

        Raises:
          ValueError: naming the offending key, saying what would go wrong and how to fix it.
        """
        validate(self, require_env=require_env)

    # Python protocol --------------------------------------------------------------------------

    def __repr__(self) -> str:
        """Shows `env` and the keys that differ from the defaults (model keys by themselves)."""
        defaults = type(self)()
        changed = []
        for f in dataclasses.fields(self):
            value, default = getattr(self, f.name), getattr(defaults, f.name)
            if f.name == "model":
                changed += [f"model.{k}={v!r}" for k, v in value.items() if default.get(k) != v]
            elif f.name != "env" and value != default:
                changed.append(f"{f.name}={value!r}")
        more = f", ... {len(changed) - 6} more" if len(changed) > 6 else ""
        return f"{type(self).__name__}({', '.join([f'env={self.env!r}', *changed[:6]])}{more})"
