"""`RunnerSpec`: everything an env runner is built from, resolved once by the driver.

The driver resolves the config into a `RunnerSpec` (`impala_tf.driver.specs.runner_spec`, for
the actors and for evaluation) and each actor builds its runner from it: the actors never receive
the algorithm config, and nothing here re-reads a config key. A spec is plain data and pickles
(a user object in it, such as a custom model or the callbacks class, travels as an
`impala_tf.config.portable.Portable`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import gymnasium as gym

from impala_tf.config.portable import Portable
from impala_tf.envs.make import EnvSpec
from impala_tf.models.spec import ModelSpec

__all__ = ["PolicyActing", "RunnerSpec"]


@dataclasses.dataclass(frozen=True)
class PolicyActing:
    """How one policy acts in a runner.

    Attributes:
      observation_space: The policy's observation space (probed once by the driver).
      action_space: The policy's action space.
      model: The policy's resolved model.
      precision: The acting policy's precision (`acting_precision`; TensorFlow policies only).
    """

    observation_space: gym.Space
    action_space: gym.Space
    model: ModelSpec
    precision: str = "float32"

    @property
    def spaces(self) -> tuple[gym.Space, gym.Space]:
        return self.observation_space, self.action_space


@dataclasses.dataclass(frozen=True)
class RunnerSpec:
    """What an env runner is built from (RLlib's keys in brackets).

    Attributes:
      env: How the runner's envs are made (`env`, `env_config`, `num_envs_per_env_runner`,
        `seed`, Atari preprocessing).
      multi_agent: The env is a `MultiAgentEnv` (stepped by `MultiAgentEnvRunner`).
      policies: {policy_id: how it acts}, sorted by id.
      policy_mapping_fn: The resolved mapping of agents to policies (`policy_mapping_fn`;
        multi-agent runners only).
      horizon: Steps per fragment (`rollout_fragment_length`).
      explore: Sample actions (True) or take the most likely one (`explore`).
      observation_filter: The observation filter's name (`observation_filter`).
      normalize_actions: Unsquash actions into the env's bounds (`normalize_actions`).
      clip_actions: Clip actions to the env's bounds (`clip_actions`).
      drop_nonfinite_episodes: Drop episodes with non-finite values instead of failing
        (`drop_nonfinite_episodes`).
      compress_observations: zlib-compress the observations an actor sends
        (`compress_observations`).
      frame_stacks: {policy_id: (k, s)} of the policies whose frames are sent once each
        (`impala_tf.models.frames`; the driver's probe of the env).
      callbacks: The resolved `callbacks` class (None: none).
    """

    env: EnvSpec
    multi_agent: bool
    policies: Mapping[str, PolicyActing]
    policy_mapping_fn: Callable[..., Any] | None = None
    horizon: int = 50
    explore: bool = True
    observation_filter: str = "NoFilter"
    normalize_actions: bool = True
    clip_actions: bool = False
    drop_nonfinite_episodes: bool = False
    compress_observations: bool = False
    frame_stacks: Mapping[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    callbacks: Portable | None = None

    @property
    def policy_ids(self) -> list[str]:
        return sorted(self.policies)

    @property
    def num_envs(self) -> int:
        return self.env.num_envs

    @property
    def seed(self) -> int | None:
        return self.env.seed
