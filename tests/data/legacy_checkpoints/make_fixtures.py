"""Writes the legacy checkpoint fixtures with the code at commit 3b2ca7c (before one runtime)."""

import json
import os
import shutil
import sys

from impala_tf.config import ImpalaConfig

out = sys.argv[1]
shutil.rmtree(out, ignore_errors=True)
os.makedirs(out)

single = (
    ImpalaConfig()
    .environment("CartPole-v1")
    .env_runners(
        num_env_runners=1,
        num_envs_per_env_runner=2,
        rollout_fragment_length=10,
        observation_filter="MeanStdFilter",
    )
    .training(train_batch_size=40, model={"fcnet_hiddens": [8]})
    .reporting(min_time_s_per_iteration=0, min_sample_timesteps_per_iteration=200)
    .resources(num_gpus=0)
    .debugging(seed=11)
)
multi = ImpalaConfig(
    env="impala_tf/MultiAgentCartPole",
    env_config={"num_agents": 2},
    num_env_runners=1,
    num_envs_per_env_runner=2,
    rollout_fragment_length=10,
    train_batch_size=40,
    model={"fcnet_hiddens": [8]},
    min_time_s_per_iteration=0,
    min_sample_timesteps_per_iteration=200,
    seed=12,
    num_gpus=0,
    observation_filter="MeanStdFilter",
)
multi.multi_agent(
    policies=["p0", "p1"], policy_mapping_fn="impala_tf.multi_agent.spec.PolicyMappingFn"
)
expected = {}
for name, config in (("single_agent", single), ("multi_agent", multi)):
    algo = config.build()
    try:
        for _ in range(3):
            result = algo.train()
        path = algo.save(os.path.join(out, name))
        expected[name] = {
            "training_iteration": result["training_iteration"],
            "num_env_steps_sampled": result["num_env_steps_sampled"],
            "num_agent_steps_sampled": result["num_agent_steps_sampled"],
            "episodes_total": result["episodes_total"],
        }
        print(name, path, expected[name])
    finally:
        algo.stop()
with open(os.path.join(out, "expected.json"), "w") as f:
    json.dump(expected, f, indent=2)
