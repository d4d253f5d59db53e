"""`RuntimePlan`: every mode of a run, decided once per build from the config and the env.

The only reader of `actor_backend`, `inference` and deterministic mode. A plan holds the env's
spaces (probed once, `impala_tf.envs.spaces`), each policy's model resolved once
(`impala_tf.models.spec.ModelSpec`: what the actors, the inference server, the learners and
evaluation build), the `callbacks` class resolved once, the trained policies, where the actors run
(`"process"`: local processes, the embedded default; `"ray"`: Ray actors), where they act
(central inference or each actor), whether their processes need TensorFlow, and the schedule
(asynchronous, or lockstep for deterministic runs). The driver's collaborators read the plan;
none of them looks at those keys again.

`inference: "auto"` keeps acting in each actor: MLPs act in numpy there, and on an idle 2-core
machine per-actor CNN inference trained 1.6x the env steps/s of central inference, since the
driver also runs the learner (`tools/bench_atari.py --compare_inference`, BENCHMARKS.md). Only
when TensorFlow actors would not fit in this machine's memory (`impala_tf.workers.memory`:
RLlib's 128-worker Pong on a 24 GB machine) does "auto" pick central inference, whose actors
never import TensorFlow, rather than refuse the pool. On Ray, "auto" always acts in the actors
(they are spread over the cluster's memory).

This module imports no TensorFlow: `impala_tf.driver.factory` makes the plan, then starts the
actors' fork server, then imports TensorFlow, so that the two imports overlap.
"""

from __future__ import annotations

import dataclasses

from impala_tf.acting.numpy_policy import supports
from impala_tf.config.base import AlgorithmConfig
from impala_tf.config.callbacks import resolve_callbacks
from impala_tf.config.policies import policy_config, policy_ids_to_train
from impala_tf.config.portable import Portable
from impala_tf.driver.specs import probe_spaces, runner_spec
from impala_tf.envs.spaces import EnvSpaces
from impala_tf.models.spec import ModelSpec, check_transport, model_spec
from impala_tf.rollout.spec import RunnerSpec
from impala_tf.workers.memory import ActorMemoryError, check_actor_memory

__all__ = [
    "TENSORFLOW_PRELOAD",
    "RuntimePlan",
    "check_deterministic",
    "make_plan",
    "policy_model",
]

#: Fork-server preload of actors that act in numpy or through the inference server.
_NUMPY_PRELOAD = ("impala_tf.rollout.host",)
#: Fork-server preload of actors that run TensorFlow policies (imported once, quietly).
TENSORFLOW_PRELOAD = (
    "impala_tf.workers._quiet_tf",
    "impala_tf.acting.tf_policy",
    "impala_tf.rollout.host",
)


@dataclasses.dataclass(frozen=True)
class RuntimePlan:
    """The modes of one run (see the module docstring).

    Attributes:
      spaces: The env's policies and spaces, probed once.
      runner: What every actor's env runner is built from (`impala_tf.driver.specs.runner_spec`):
        the actors receive it instead of the config. It holds each policy's resolved model
        (`models`) and the resolved `callbacks` class, which the driver's parts read from it.
      trained: The ids of the policies the learners update (`policies_to_train`).
      backend: Where actors and aggregation workers run: "process" or "ray".
      central_inference: The driver's inference server acts for every actor.
      actors_need_tensorflow: Some policy runs in TensorFlow inside the actors.
      deterministic: Lockstep sampling and training (reproducible seeded runs).
    """

    spaces: EnvSpaces
    runner: RunnerSpec
    trained: tuple[str, ...]
    backend: str
    central_inference: bool
    actors_need_tensorflow: bool
    deterministic: bool

    @property
    def policy_ids(self) -> list[str]:
        return self.spaces.policy_ids

    @property
    def multi_agent(self) -> bool:
        return self.spaces.multi_agent

    @property
    def models(self) -> dict[str, ModelSpec]:
        """{policy_id: the policy's resolved model}."""
        return {pid: acting.model for pid, acting in self.runner.policies.items()}

    @property
    def callbacks(self) -> Portable | None:
        """The resolved `callbacks` class (None: none), for the runners and the driver."""
        return self.runner.callbacks

    @property
    def preload(self) -> tuple[str, ...]:
        """Modules the actors' fork server imports once for every actor."""
        return TENSORFLOW_PRELOAD if self.actors_need_tensorflow else _NUMPY_PRELOAD


def make_plan(
    config: AlgorithmConfig, deterministic: bool = False, spaces: EnvSpaces | None = None
) -> RuntimePlan:
    """Decides the run's modes for a validated `config` (probing the env once unless `spaces`).

    Raises:
      ValueError: `deterministic` with a config that cannot run in lockstep (the message lists
        what to change), or a policy mapping that names an unknown policy.
      impala_tf.models.spec.ModelError: a `custom_model` that names nothing, or one that
        cannot be sent to the actor processes (a ValueError).
    """
    if deterministic:
        check_deterministic(config)
    spaces = probe_spaces(config) if spaces is None else spaces
    backend = "ray" if config.actor_backend == "ray" else "process"
    models = {pid: policy_model(config, pid) for pid in spaces.policies}
    for pid, spec in models.items():
        check_transport(spec, pid)
    callbacks = resolve_callbacks(config.callbacks_class)
    if callbacks is not None:
        callbacks.check_sendable(f"`callbacks` {callbacks.label}")
    numpy_actors = all(
        supports(obs, act, models[pid]) for pid, (obs, act) in spaces.policies.items()
    )
    central = _central_inference(config, spaces, backend, numpy_actors)
    return RuntimePlan(
        spaces=spaces,
        runner=runner_spec(config, spaces, models, callbacks),
        trained=tuple(p for p in policy_ids_to_train(config) if p in spaces.policies),
        backend=backend,
        central_inference=central,
        actors_need_tensorflow=not (central or numpy_actors),
        deterministic=bool(deterministic),
    )


def policy_model(config: AlgorithmConfig, policy_id: str) -> ModelSpec:
    """The resolved model of one policy: its `model` config, per-policy overrides applied."""
    where = "model" if config.policies is None else f"policies[{policy_id!r}].config.model"
    return model_spec(policy_config(config, policy_id).model, where)


def _central_inference(
    config: AlgorithmConfig, spaces: EnvSpaces, backend: str, numpy_actors: bool
) -> bool:
    if config.inference != "auto":
        return config.inference == "central"
    if backend == "ray" or numpy_actors:
        return False
    try:
        check_actor_memory(config, spaces.largest_observation_space(), numpy_policy=False)
    except ActorMemoryError:
        return True
    return False


def check_deterministic(config: AlgorithmConfig) -> None:
    """Raises ValueError listing what keeps `config` from running in lockstep (deterministic)."""
    problems = []
    if config.seed is None:
        problems.append("a `seed`")
    if config.num_env_runners > 1:
        problems.append(f"one actor (`num_env_runners` <= 1, got {config.num_env_runners})")
    if config.num_aggregation_workers:
        problems.append("`num_aggregation_workers=0`")
    if config.min_time_s_per_iteration:
        problems.append(
            "`min_time_s_per_iteration=0` (iterations must end on sample counts, "
            "`min_sample_timesteps_per_iteration`, not on wall-clock time)"
        )
    if config.minibatch_ring_size > 1 and config.num_sgd_iter > 1:
        problems.append(
            "`minibatch_buffer_size=1` or `num_sgd_iter=1` (the buffer would wait for "
            "further batches before finishing the passes over the first)"
        )
    problems += config.lockstep_problems()
    if problems:
        raise ValueError("deterministic=True needs " + "; ".join(problems) + ".")
