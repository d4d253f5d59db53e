"""Multi-agent IMPALA as RLlib runs it: several policies, a policy mapping, per-policy learners.

* `impala_tf.multi_agent.spec`: `PolicySpec`, `policy_mapping_fn` resolution, per-policy configs;
* `impala_tf.multi_agent.env`: the `MultiAgentEnv` interface, `MultiAgentCartPole`, PettingZoo;
* `impala_tf.multi_agent.batch`: `MultiAgentBatch` (env steps vs agent steps);
* `impala_tf.multi_agent.runner`: the actors' per-policy fragment collection;
* `impala_tf.multi_agent.algorithm`: `MultiAgentImpala`, the driver.

A config is multi-agent when it sets `policies` or `policy_mapping_fn`, or when its env is a
`MultiAgentEnv` (then every agent maps to `"default_policy"`, as in RLlib). Everything else runs
the single-agent `impala_tf.algorithm.Impala`, unchanged. This package imports neither
TensorFlow nor the algorithm until asked.
"""

from __future__ import annotations

from typing import Any

__all__ = ["algorithm_class", "is_multi_agent"]


def is_multi_agent(config: Any) -> bool:
    """Whether `config` needs the multi-agent runtime (see the package docstring).

    Decided without building an env: by the multi-agent keys, or by the class an env creator or
    a registered gymnasium id's entry point names.
    """
    if config.policies is not None or config.policy_mapping_fn is not None:
        return True
    from impala_tf.multi_agent.env import MultiAgentEnv

    env = config.env
    if isinstance(env, type):
        return issubclass(env, MultiAgentEnv)
    if isinstance(env, str):
        import gymnasium as gym

        import impala_tf.envs  # noqa: F401 - registers the shipped ids.

        if env not in gym.registry:
            return False
        entry = gym.registry[env].entry_point
        if isinstance(entry, str):
            try:
                module, _, name = entry.partition(":")
                import importlib

                entry = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError):
                return False
        return isinstance(entry, type) and issubclass(entry, MultiAgentEnv)
    return False


def algorithm_class(config: Any) -> type:
    """`MultiAgentImpala` for a multi-agent config, else `impala_tf.algorithm.Impala`."""
    if is_multi_agent(config):
        from impala_tf.multi_agent.algorithm import MultiAgentImpala

        return MultiAgentImpala
    from impala_tf.algorithm import Impala

    return Impala
