"""The config resolved into the frozen specs the run's parts are built from.

This is where the keys that make envs and env runners are read, once per build: the driver
sends the specs to the actors (`impala_tf.rollout.spec.RunnerSpec`, holding an
`impala_tf.envs.make.EnvSpec`), so no worker receives the algorithm config or decides again what
the driver decided (the spaces, each policy's model and acting precision, the frame transport,
the policy mapping).

* `env_spec(config)`: how the envs are made (`env`, `env_config`, `num_envs_per_env_runner`,
  `num_env_runners`, `seed`, `preprocessor_pref`, `model.dim`, `model.framestack`,
  `clip_rewards`);
* `probe_spaces(config)`: one env of the spec, made in the driver, and its policies' spaces;
* `runner_spec(config, spaces, models, callbacks)`: an env runner's spec (the actors' comes
  from the run's plan, `impala_tf.driver.plan.RuntimePlan.runner`; evaluation resolves its own
  from the evaluation config);
* `aggregator_spec(config, rows)`: what the aggregators (the driver's and the aggregation
  workers') are built from (`replay_proportion`, `replay_buffer_num_slots` per policy, `seed`),
  and the aggregation stage (`num_aggregation_workers`,
  `max_requests_in_flight_per_aggregator_worker`);
* `sampling_spec(config, plan)`: the driver's side of sampling, what the actors' client
  (`impala_tf.driver.sampling.EnvRunnerGroup`) and the workers' backend are built from, after
  checking that local actors fit in memory;
* `policy_learners(config, models)`: each policy's learner settings and learner class, what
  `impala_tf.driver.learners.LearnerGroup` builds the learners from;
* `checkpoint_spec(config, policy_ids)`: what the driver's checkpoints need of the config
  (`impala_tf.driver.state.SavedState`): the config as stored, `seed`, each policy's
  `model.center_pixels`;
* `evaluator_spec(config, ...)`: what an evaluator is built from
  (`impala_tf.driver.evaluation.Evaluator`): the evaluation config's env runner, with one env,
  and its video settings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from impala_tf.checkpoints.stored_config import StoredConfig
from impala_tf.config.callbacks import resolve_callbacks
from impala_tf.config.policies import policy_config, resolve_mapping_fn
from impala_tf.config.portable import Portable
from impala_tf.data.replay import replay_ratio_from_proportion
from impala_tf.driver.aggregation import AggregatorSpec
from impala_tf.envs import atari
from impala_tf.envs.faults import env_name
from impala_tf.envs.make import EnvSpec
from impala_tf.envs.spaces import EnvSpaces, probe_env_spaces
from impala_tf.envs.video import VideoSettings, rendering_env_config
from impala_tf.learning.spec import LearnerSpec
from impala_tf.models.spec import ModelSpec, model_spec
from impala_tf.rollout.spec import PolicyActing, RunnerSpec
from impala_tf.workers.memory import check_actor_memory

__all__ = [
    "CheckpointSpec",
    "EvaluatorSpec",
    "PolicyLearner",
    "SamplingSpec",
    "aggregator_spec",
    "checkpoint_spec",
    "env_spec",
    "evaluator_spec",
    "policy_learners",
    "probe_spaces",
    "runner_spec",
    "sampling_spec",
]

_MISSING: Any = object()


def env_spec(config: Any) -> EnvSpec:
    """How `config`'s envs are made (see the module docstring)."""
    model = config.model or {}
    return EnvSpec(
        env=config.env,
        env_config=dict(config.env_config or {}),
        num_envs=int(config.num_envs_per_env_runner),
        num_workers=int(config.num_env_runners),
        seed=None if config.seed is None else int(config.seed),
        deepmind=config.preprocessor_pref == atari.DEEPMIND,
        dim=int(model.get("dim", 84)),
        frame_stack=atari.STACK if model.get("framestack", True) is True else 1,
        clip_rewards=config.clip_rewards,
    )


def probe_spaces(config: Any) -> EnvSpaces:
    """Builds one env of `config` in this process and reads its policies' spaces
    (`impala_tf.envs.spaces.probe_env_spaces`).

    Raises:
      ValueError: `policies`/`policy_mapping_fn` are set for an env that is not multi-agent, or
        an agent maps to a policy that `policies` does not name.
    """
    return probe_env_spaces(
        env_spec(config), config.policies, config.policy_mapping_fn, config.observation_filter
    )


def runner_spec(
    config: Any,
    spaces: EnvSpaces | None = None,
    models: Mapping[str, ModelSpec] | None = None,
    callbacks: Portable | None | Any = _MISSING,
) -> RunnerSpec:
    """An env runner's spec for `config` (the algorithm's, or the evaluation config).

    Args:
      config: A validated config.
      spaces: The env's probed spaces (None: probes them here).
      models: {policy_id: resolved model} (None: resolves each policy's `model` here).
      callbacks: The resolved `callbacks` class (default: resolved from `callbacks_class`).
    """
    spaces = probe_spaces(config) if spaces is None else spaces
    policies = {}
    for pid, (obs, act) in sorted(spaces.policies.items()):
        pconfig = policy_config(config, pid)
        model = models[pid] if models is not None else model_spec(pconfig.model)
        policies[pid] = PolicyActing(obs, act, model, str(pconfig.acting_precision))
    if callbacks is _MISSING:
        callbacks = resolve_callbacks(config.callbacks_class)
    return RunnerSpec(
        env=env_spec(config),
        multi_agent=spaces.multi_agent,
        policies=policies,
        policy_mapping_fn=(
            resolve_mapping_fn(config.policy_mapping_fn) if spaces.multi_agent else None
        ),
        horizon=int(config.rollout_fragment_length),
        explore=bool(config.explore),
        observation_filter=str(config.observation_filter),
        normalize_actions=bool(config.normalize_actions),
        clip_actions=bool(config.clip_actions),
        drop_nonfinite_episodes=bool(config.drop_nonfinite_episodes),
        compress_observations=bool(config.compress_observations),
        frame_stacks=dict(spaces.frame_stacks),
        callbacks=callbacks,
    )


def aggregator_spec(config: Any, rows: Mapping[str, int]) -> AggregatorSpec:
    """What the aggregators of `config` are built from, for the trained policies' `rows`
    ({policy_id: sequences per train batch})."""
    replay = {}
    for pid in rows:
        pconfig = policy_config(config, pid)
        if pconfig.replay_proportion > 0:
            ratio = replay_ratio_from_proportion(pconfig.replay_proportion)
            replay[pid] = (int(pconfig.replay_buffer_num_slots), float(ratio))
    seed = None if config.seed is None else int(config.seed)
    return AggregatorSpec(
        rows=dict(rows),
        replay=replay,
        seed=seed,
        num_workers=int(config.num_aggregation_workers),
        max_in_flight=int(config.max_requests_in_flight_per_aggregator_worker),
    )


@dataclasses.dataclass(frozen=True)
class SamplingSpec:
    """The driver's side of sampling (RLlib's keys in brackets).

    Attributes:
      num_actors: Actor processes (`num_env_runners`, at least 1).
      env_name: The env's name, for messages.
      observation_filter: `observation_filter`.
      max_requests_in_flight: Sample requests out per actor
        (`max_requests_in_flight_per_env_runner`).
      restart_failed: Restart failed actors (`restart_failed_env_runners`).
      max_restarts: Restarts over the run at most (`max_num_env_runner_restarts`).
      sample_timeout_s: Seconds an actor may take for a fragment (`sample_timeout_s`).
      num_cpus: Each actor's Ray CPUs (`num_cpus_per_env_runner`).
      resources: Each actor's Ray custom resources (`custom_resources_per_env_runner`).
      num_aggregation_workers: `num_aggregation_workers` (their fragments' batches stay in the
        backend's store, and they share the actors' backend).
      ray_address: `ray_address` (Ray backend).
      seed: `seed` (a restarted actor's env seeds).
    """

    num_actors: int
    env_name: str
    observation_filter: str = "NoFilter"
    max_requests_in_flight: int = 2
    restart_failed: bool = True
    max_restarts: int = 1000
    sample_timeout_s: float | None = 60.0
    num_cpus: float = 1.0
    resources: Mapping[str, float] = dataclasses.field(default_factory=dict)
    num_aggregation_workers: int = 0
    ray_address: str | None = None
    seed: int | None = None


def sampling_spec(config: Any, plan: Any) -> SamplingSpec:
    """The sampling keys of `config`, for the run's `plan`.

    Raises:
      impala_tf.workers.memory.ActorMemoryError: local actor processes would not fit in
        memory (checked here, before any actor starts).
    """
    if plan.backend == "process":
        check_actor_memory(
            config,
            plan.spaces.largest_observation_space(),
            numpy_policy=not plan.actors_need_tensorflow,
        )
    return SamplingSpec(
        num_actors=max(1, int(config.num_env_runners)),
        env_name=env_name(config.env),
        observation_filter=str(config.observation_filter),
        max_requests_in_flight=int(config.max_requests_in_flight_per_env_runner),
        restart_failed=bool(config.restart_failed_env_runners),
        max_restarts=int(config.max_num_env_runner_restarts),
        sample_timeout_s=config.sample_timeout_s,
        num_cpus=float(config.num_cpus_per_env_runner),
        resources={k: float(v) for k, v in config.custom_resources_per_env_runner.items()},
        num_aggregation_workers=int(config.num_aggregation_workers),
        ray_address=config.ray_address,
        seed=None if config.seed is None else int(config.seed),
    )


@dataclasses.dataclass(frozen=True)
class PolicyLearner:
    """One policy's learner, resolved (what `impala_tf.driver.learners.LearnerGroup` builds).

    Attributes:
      spec: The policy's learner settings: `AlgorithmConfig.learner_spec` of its config
        (`PolicySpec` overrides applied) for its resolved model, an
        `impala_tf.learning.spec.LearnerSpec` (APPO's: its subclass).
      learner_class: `AlgorithmConfig.learner_class()`: `ImpalaLearner` or an algorithm's
        subclass, built as `learner_class(spec, obs_space, action_space, name=...)`.
    """

    spec: LearnerSpec
    learner_class: type


def policy_learners(config: Any, models: Mapping[str, ModelSpec]) -> dict[str, PolicyLearner]:
    """Each policy's learner settings and class.

    Imports TensorFlow (the learner classes' modules): call it where the learners are built,
    not while planning the run.

    Args:
      config: The algorithm config.
      models: {policy_id: the policy's resolved model} (`RuntimePlan.models`), for every policy.
    """
    out = {}
    for pid, model in models.items():
        pconfig = policy_config(config, pid)
        out[pid] = PolicyLearner(pconfig.learner_spec(model), pconfig.learner_class())
    return out


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
    """What the driver's checkpoints need of the config (`impala_tf.driver.state.SavedState`).

    Attributes:
      config: The config as every checkpoint of the run stores it
        (`impala_tf.checkpoints.stored_config.StoredConfig`: the `"config"` and `"algorithm"`
        of `driver_state.json`).
      seed: `seed`: the replay's and the actors' seeds after a restore derive from it.
      center_pixels: {policy_id: its `model.center_pixels`}, compared with the checkpoint's
        when restoring.
    """

    config: StoredConfig
    seed: int | None
    center_pixels: Mapping[str, bool]


def checkpoint_spec(config: Any, policy_ids: Sequence[str]) -> CheckpointSpec:
    """What the checkpoints of a run of `config` with the policies `policy_ids` need."""
    return CheckpointSpec(
        config=StoredConfig.of(config),
        seed=None if config.seed is None else int(config.seed),
        center_pixels={
            pid: bool(policy_config(config, pid).model.get("center_pixels")) for pid in policy_ids
        },
    )


@dataclasses.dataclass(frozen=True)
class EvaluatorSpec:
    """What an evaluator is built from (`impala_tf.driver.evaluation.Evaluator`).

    Attributes:
      runner: Its env runner: the evaluation config's `runner_spec` with one env
        (`num_envs_per_env_runner=1`), made with `render_mode="rgb_array"` when `video` is
        set, acting with the evaluation's `explore`.
      video: What is recorded (`VideoSettings.from_config`: `render_env`, `record_env`,
        `video_*`); None records nothing.
    """

    runner: RunnerSpec
    video: VideoSettings | None = None


def evaluator_spec(
    config: Any,
    spaces: EnvSpaces | None = None,
    models: Mapping[str, ModelSpec] | None = None,
    callbacks: Portable | None | Any = _MISSING,
    explore: bool | None = None,
) -> EvaluatorSpec:
    """What an evaluator of `config` is built from.

    Args:
      config: The evaluation config (`AlgorithmConfig.get_evaluation_config()` applied).
      spaces: The env's probed spaces (None: probes them here).
      models: {policy_id: the policy's resolved model} (`RuntimePlan.models`); None resolves
        them from `config`.
      callbacks: The resolved `callbacks` class, whose episode hooks run in evaluation episodes
        too, as in RLlib's evaluation workers (default: resolved from `callbacks_class`).
      explore: Overrides the config's `explore`.
    """
    config = config.copy()
    config.env_runners(num_envs_per_env_runner=1)
    video = VideoSettings.from_config(config)
    if video is not None:
        config.env_config = rendering_env_config(config.env_config)
    runner = runner_spec(config, spaces, models, callbacks)
    if explore is not None:
        runner = dataclasses.replace(runner, explore=bool(explore))
    return EvaluatorSpec(runner, video)
