"""The spaces of a run's policies, probed once per build from one env.

`probe_env_spaces(spec, policies, policy_mapping_fn, observation_filter)` builds one env of an
`impala_tf.envs.make.EnvSpec` (worker index 0; `impala_tf.driver.specs.probe_spaces(config)`
calls it with a config's settings) and returns `EnvSpaces`: whether the env
is multi-agent (`impala_tf.multi_agent.env.MultiAgentEnv`) and each policy's (observation
space, action space). A single-agent env has one policy, `"default_policy"`, with the env's
spaces. For a multi-agent env, agents are mapped with `policy_mapping_fn` (episode 0); a
policy's `PolicySpec` spaces win, else it takes the spaces of the first agent mapped to it, else
(no agent maps to it) the env's common spaces. Everything the driver builds (learners, the
actors' memory guard, the inference server, evaluation) reads these, so a build makes its env
once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import gymnasium as gym
import numpy as np

import impala_tf.config.policies as policy_specs
from impala_tf.envs.batch import declared_frame_stack, sent_frame_stack
from impala_tf.envs.make import EnvSpec, make_env
from impala_tf.multi_agent.env import MultiAgentEnv

__all__ = ["EnvSpaces", "policy_spaces", "probe_env_spaces"]


@dataclasses.dataclass(frozen=True)
class EnvSpaces:
    """What a build needs to know about its env.

    Attributes:
      multi_agent: The env is a `MultiAgentEnv` (its runners step it per agent).
      policies: {policy_id: (observation_space, action_space)}, sorted by policy id.
      frame_stacks: {policy_id: (k, s)} of the policies whose train batches carry
        `obs_frames` instead of `obs` (`impala_tf.models.frames`; single-agent frame-stacking envs).
    """

    multi_agent: bool
    policies: dict[str, tuple[gym.Space, gym.Space]]
    frame_stacks: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)

    @property
    def policy_ids(self) -> list[str]:
        return sorted(self.policies)

    def largest_observation_space(self) -> gym.Space:
        """The policies' observation space with the most bytes (what sizes an actor's
        fragments)."""

        def size(space: gym.Space) -> int:
            return int(np.prod(space.shape or ())) * np.dtype(space.dtype or np.float32).itemsize

        return max((obs for obs, _ in self.policies.values()), key=size)


def probe_env_spaces(
    spec: EnvSpec,
    policies: Any = None,
    policy_mapping_fn: Any = None,
    observation_filter: str = "NoFilter",
) -> EnvSpaces:
    """Builds one env of `spec` and reads its policies' spaces (see the module docstring).

    Args:
      spec: How the env is made.
      policies: The `policies` setting (multi-agent envs).
      policy_mapping_fn: The `policy_mapping_fn` setting (multi-agent envs).
      observation_filter: The `observation_filter` (a filtering run sends whole stacks).

    Raises:
      ValueError: `policies`/`policy_mapping_fn` are set for an env that is not multi-agent, or
        an agent maps to a policy that `policies` does not name.
    """
    env = make_env(spec, 0, 0)
    try:
        if isinstance(env.unwrapped, MultiAgentEnv):  # Also behind wrappers (a video recorder).
            return EnvSpaces(True, policy_spaces(policies, policy_mapping_fn, env.unwrapped))
        if policies is not None or policy_mapping_fn is not None:
            raise ValueError(
                f"The env {spec.env!r} is not a MultiAgentEnv (impala_tf.multi_agent.env), "
                "but `policies`/`policy_mapping_fn` are set."
            )
        if isinstance(env, gym.vector.VectorEnv):  # An env_creator's: its envs' spaces.
            spaces = (env.single_observation_space, env.single_action_space)
        else:
            spaces = (env.observation_space, env.action_space)
        pid = policy_specs.DEFAULT_POLICY_ID
        stack = sent_frame_stack(declared_frame_stack(env), observation_filter)
        return EnvSpaces(False, {pid: spaces}, {pid: stack} if stack else {})
    finally:
        env.close()


def policy_spaces(
    policies: Any, policy_mapping_fn: Any, env: MultiAgentEnv
) -> dict[str, tuple[gym.Space, gym.Space]]:
    """{policy_id: (observation_space, action_space)} of a multi-agent env's policies, from the
    `policies` and `policy_mapping_fn` settings.

    Raises:
      ValueError: an agent maps to a policy that `policies` does not name.
    """
    specs = policy_specs.normalize_policies(policies)
    mapping = policy_specs.resolve_mapping_fn(policy_mapping_fn)
    episode = policy_specs.EpisodeInfo(0)
    by_policy: dict[str, Any] = {}
    for agent in env.possible_agents:
        pid = mapping(agent, episode, worker=None)
        if pid not in specs:
            raise ValueError(
                f"`policy_mapping_fn` maps agent {agent!r} to {pid!r}, which is not in "
                f"`policies` {sorted(specs)}."
            )
        by_policy.setdefault(pid, agent)
    out = {}
    for pid, spec in sorted(specs.items()):
        agent = by_policy.get(pid)
        obs = spec.observation_space or (
            env.get_observation_space(agent) if agent is not None else env.observation_space
        )
        act = spec.action_space or (
            env.get_action_space(agent) if agent is not None else env.action_space
        )
        out[pid] = (obs, act)
    return out
