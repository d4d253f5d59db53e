"""The one small-config builder of the tests.

`small_config()` is a seeded CartPole run that builds in seconds and iterates every 0.25 s:
2 actors x 4 envs, fragments of 10 steps, train batches of 80, a [16] MLP, one learner device.
`small_config(policies=2)` is the same on a two-agent `MultiAgentCartPole` with one policy per
agent (`p0`, `p1`, RLlib's example mapping); `backend="ray"` puts the actors on Ray. Every other
key is an override (`small_config(num_env_runners=1, lr=0.01)`), applied last.
"""

from __future__ import annotations

from typing import Any

from impala_tf.config import ImpalaConfig

__all__ = ["BACKENDS", "POLICY_COUNTS", "small_config"]

#: The placements every runtime scenario runs on (`tests/runtime_conformance_test.py`).
BACKENDS = ("local", "ray")
#: One policy (single-agent CartPole) and two (two-agent MultiAgentCartPole).
POLICY_COUNTS = (1, 2)


def small_config(policies: int = 1, backend: str = "local", **overrides: Any) -> ImpalaConfig:
    """A small seeded config (see the module docstring).

    Args:
      policies: 1 (CartPole-v1) or 2 (two-agent MultiAgentCartPole, policies p0 and p1).
      backend: `actor_backend`: "local" processes or "ray".
      **overrides: Any config keys, applied last.
    """
    if policies not in POLICY_COUNTS:
        raise ValueError(f"policies must be one of {POLICY_COUNTS}, got {policies}")
    config = (
        ImpalaConfig()
        .env_runners(num_env_runners=2, num_envs_per_env_runner=4, rollout_fragment_length=10)
        .training(train_batch_size=80, model={"fcnet_hiddens": [16]})
        .reporting(min_time_s_per_iteration=0.25)
        .resources(num_gpus=0, actor_backend=backend)
        .debugging(seed=0)
    )
    if policies == 1:
        config.environment("CartPole-v1")
    else:
        config.environment("impala_tf/MultiAgentCartPole", env_config={"num_agents": 2})
        config.multi_agent(
            policies=["p0", "p1"], policy_mapping_fn="impala_tf.config.policies.PolicyMappingFn"
        )
    return config.update_from_dict(overrides)
