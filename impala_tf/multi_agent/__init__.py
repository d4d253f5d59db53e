"""Multi-agent environments: RLlib's `MultiAgentEnv` interface, `MultiAgentCartPole`, PettingZoo.

Multi-agent IMPALA is not a second runtime: the driver (`impala_tf.driver.algorithm.Impala`) runs
any number of policies, a single-agent config being the one-policy case (`"default_policy"`). What
is specific to several agents lives where its layer is:

* `impala_tf.multi_agent.env`: the `MultiAgentEnv` interface, `MultiAgentCartPole`, PettingZoo;
* `impala_tf.config.policies`: RLlib's `policies` (`PolicySpec`), `policy_mapping_fn` and
  `policies_to_train`, and each policy's config;
* `impala_tf.envs.spaces`: each policy's spaces, probed once per build;
* `impala_tf.rollout.multi_agent_runner`: stepping a `MultiAgentEnv` with several policies.

A config is multi-agent when its env is a `MultiAgentEnv` (every agent maps to
`"default_policy"` unless `policies`/`policy_mapping_fn` say otherwise, as in RLlib).
"""

from __future__ import annotations

__all__: list[str] = []
