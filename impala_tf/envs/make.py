"""Making envs from an `EnvSpec`: a gymnasium id or an `env_creator(env_config)`, seeded as RLlib.

`EnvSpec` is what a run's envs are made from, resolved once from the config
(`impala_tf.driver.specs.env_spec`) and sent to every actor. `make_env(spec, worker_index,
vector_index)` builds one env (DeepMind preprocessing for Atari, `impala_tf.envs.atari`);
`make_env_batch` builds an env runner's envs as one `EnvBatch` (ale-py's native vector env where
it covers the spec), seeded as RLlib seeds env j of runner i (`impala_tf.utils.seeds.env_seed`). A
user's env creator receives an `EnvContext`: its `env_config` with RLlib's `worker_index`,
`vector_index` and `num_workers`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import gymnasium as gym

from impala_tf.envs import atari
from impala_tf.envs.atari_vector import AtariVectorEnvBatch
from impala_tf.envs.batch import (
    EnvBatch,
    GymEnvBatch,
    GymVectorEnvBatch,
    resets_in_the_ending_step,
)
from impala_tf.envs.faults import EnvGuard
from impala_tf.utils.seeds import env_seed

__all__ = ["EnvContext", "EnvSpec", "make_env", "make_env_batch"]


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """What a run's envs are made from (RLlib's keys in brackets).

    Attributes:
      env: A registered gymnasium id or an env creator (`env`).
      env_config: `gym.make` kwargs for an id, or the creator's `EnvContext` (`env_config`).
      num_envs: Envs per env runner (`num_envs_per_env_runner`).
      num_workers: Env runners in the run (`num_env_runners`; `EnvContext.num_workers`).
      seed: The run's seed (`seed`); None: unseeded.
      deepmind: DeepMind preprocessing of Atari envs (`preprocessor_pref: deepmind`).
      dim: The preprocessed Atari screen's side (`model.dim`).
      frame_stack: Frames per preprocessed Atari observation (`model.framestack`: 4, or 1).
      clip_rewards: The `clip_rewards` setting (None: sign-clip preprocessed Atari, as RLlib).
    """

    env: str | Callable[..., Any] | None
    env_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    num_envs: int = 1
    num_workers: int = 0
    seed: int | None = None
    deepmind: bool = True
    dim: int = 84
    frame_stack: int = atari.STACK
    clip_rewards: bool | float | None = None

    def clip_rewards_for(self, is_atari: bool) -> bool | float | None:
        """The effective `clip_rewards`: None means True (sign) for preprocessed Atari, as in
        RLlib."""
        if self.clip_rewards is None and is_atari and self.deepmind:
            return True
        return self.clip_rewards


class EnvContext(dict):
    """The `env_config` dict handed to a user's env creator, with RLlib's extra attributes.

    Attributes:
      worker_index: 1-based index of the env runner (0 is the driver/evaluation).
      vector_index: Index of the env within its runner.
      num_workers: Number of env runners.
      num_envs: Envs per env runner (`num_envs_per_env_runner`; ours): the size of the
        `gymnasium.vector.VectorEnv` a creator may return for all of a runner's envs.
    """

    def __init__(
        self,
        env_config: dict,
        worker_index: int,
        vector_index: int,
        num_workers: int,
        num_envs: int = 1,
    ):
        super().__init__(env_config or {})
        self.worker_index = worker_index
        self.vector_index = vector_index
        self.num_workers = num_workers
        self.num_envs = num_envs


def make_env(
    spec: EnvSpec, worker_index: int = 0, vector_index: int = 0
) -> gym.Env | gym.vector.VectorEnv:
    """Creates one env from `spec.env`: a registered gymnasium id or an `env_creator` callable.

    A gymnasium id is made with `gym.make(id, **env_config)`; a callable is called with an
    `EnvContext` holding `env_config` (RLlib's convention). An Atari env gets DeepMind
    preprocessing when `spec.deepmind` (`impala_tf.envs.atari`), with
    episodic life only for training runners (`worker_index >= 1`; 0 is evaluation). A creator
    may return a `gymnasium.vector.VectorEnv` of `context.num_envs` envs instead: it is
    returned as it is, and `make_env_batch` steps it whole.
    """
    env = spec.env
    if env is None:
        raise ValueError("`env` is not set: pass a gymnasium id or an env_creator(env_config)")
    if callable(env):
        context = EnvContext(
            dict(spec.env_config), worker_index, vector_index, spec.num_workers, spec.num_envs
        )
        made = env(context)
        if isinstance(made, gym.vector.VectorEnv):
            return made
        if not isinstance(made, gym.Env):
            raise TypeError(
                f"env_creator {env!r} returned {type(made).__name__}, not a gym.Env (or a "
                "gymnasium.vector.VectorEnv)"
            )
        if spec.deepmind and atari.is_atari(made):
            return atari.wrap_deepmind(made, spec.dim, spec.frame_stack, training=worker_index > 0)
        return made
    import impala_tf.envs  # noqa: F401 - registers the shipped envs in this (actor) process.

    if atari.is_atari(env, spec.env_config):
        return atari.make_atari_env(env, spec, training=worker_index > 0)
    return gym.make(env, **spec.env_config)


def make_env_batch(spec: EnvSpec, worker_index: int, guard: EnvGuard | None = None) -> EnvBatch:
    """The `spec.num_envs` envs of env runner `worker_index`, as one `EnvBatch`.

    Training runners (`worker_index >= 1`) of an Atari config that ale-py's `AtariVectorEnv`
    covers (`atari.vector_env_kwargs`) get it; those of a gymnasium id with a vector entry point
    (CartPole's numpy-vectorised `CartPoleVectorEnv`) get `gymnasium.make_vec` of it, seeded
    with the first env's seed; a creator that returns a `gymnasium.vector.VectorEnv` gets it
    stepped whole (`GymVectorEnvBatch`); everything else, evaluation included, gets `make_env`
    envs.
    `guard` calls and checks the envs (`impala_tf.envs.faults.EnvGuard`).
    """
    num_envs = spec.num_envs
    seeds = [env_seed(spec.seed, worker_index, j) for j in range(num_envs)]
    if worker_index >= 1 and all(s is None or s > 0 for s in seeds):
        kwargs = atari.vector_env_kwargs(spec, training=True, num_envs=num_envs)
        if kwargs is not None:
            return AtariVectorEnvBatch(guard=guard, **kwargs)
    if worker_index >= 1 and _has_vector_entry_point(spec):
        made = gym.make_vec(
            spec.env,
            num_envs=num_envs,
            vectorization_mode="vector_entry_point",
            **spec.env_config,
        )
        if resets_in_the_ending_step(made):
            return GymVectorEnvBatch(made, guard)
        made.close()  # A NEXT_STEP vector env: the per-env path below.
    first = make_env(spec, worker_index, 0)
    if isinstance(first, gym.vector.VectorEnv):
        if first.num_envs != num_envs:
            first.close()
            raise ValueError(
                f"env_creator {spec.env!r} returned a VectorEnv of {first.num_envs} envs for "
                f"a runner of {num_envs} (`num_envs_per_env_runner`); size it by the "
                "context's `num_envs`."
            )
        return GymVectorEnvBatch(first, guard)
    rest = [make_env(spec, worker_index, j) for j in range(1, num_envs)]
    return GymEnvBatch([first, *rest], guard)


def _has_vector_entry_point(spec: EnvSpec) -> bool:
    """Whether `spec.env` is a gymnasium id whose spec names a vector entry point (a class
    that steps all envs at once, such as CartPole's) taking every key of `env_config`."""
    if not isinstance(spec.env, str) or atari.is_atari(spec.env, spec.env_config):
        return False  # ale-py's vector env: where `atari.vector_env_kwargs` covers the spec.
    try:
        registered = gym.spec(spec.env)
    except gym.error.Error:
        return False
    if not registered.vector_entry_point:
        return False
    entry = registered.vector_entry_point
    if isinstance(entry, str):
        entry = gym.envs.registration.load_env_creator(entry)
    params = inspect.signature(entry).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    return takes_any or all(key in params for key in spec.env_config)
