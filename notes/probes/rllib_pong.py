"""RLlib 2.60's IMPALA on Pong with `pong-impala-small.yaml`'s settings: its curve (session 22).

Does RLlib's own IMPALA learn Pong faster per env step than impala_tf with the same settings, or
is the flat start near -20 (1.4-3.1M env steps in impala_tf's runs) the settings' own? Run with
the side virtualenv of `tools.bench_cartpole --make-rllib-venv /tmp/rllib-venv`, alone on the
machine, from the repository root:

    /tmp/rllib-venv/bin/pip install ale-py==0.12.1 opencv-python-headless
    /tmp/rllib-venv/bin/python notes/probes/rllib_pong.py --seed 100 > runs/rllib-pong-100.jsonl

Session 22 ran it on seed 100 (2026-11-28, 13:04-14:10, alone on the machine; stopped by hand at
2.99M env steps): `rllib_pong-seed100.jsonl`. Mean return -19.8 at 0.49M env steps, -20.7 at
0.99M, -20.8 at 1.49M, -19.5 at 2.00M, -18.9 at 2.50M, -19.0 at 2.99M; entropy 1.78 (ln 6 = 1.79)
until 2.3M, 1.70 at the end; ~760 env steps/s sampled. impala_tf's kept runs of this YAML (seeds
100-102, notes/learning-suite-runs/pong-impala-small) were at -17.5, -13.8 and -20.2 at 2.2M env
steps and reached -19 at 1.80M, 1.80M and 2.53M.

Settings as the YAML's: 2 env runners x 16 envs, fragments of 50, train batches of 500, lr
0.0006, grad_clip 40, vf_loss_coeff 0.5, entropy_coeff 0.01, 42x42 gray frames, a stack of 4,
action repeat 4, 30 no-ops, FIRE on reset, rewards clipped to their sign, no sticky actions, and
RLlib's old vision net for 42x42 (16 4x4/2, 32 4x4/2, 256 11x11/1 valid, linear heads, shared
torso). What differs is RLlib's: its new API stack and torch loss (means over the batch, not
the old stack's sums, so its grad_clip of 40 seldom binds), its Atari wrappers (pixels
scaled to [-1, 1], episodic life, which Pong does not use), its initialisers. Prints one JSON line
per iteration: seconds since start, env steps sampled, the mean return of the last episodes and
the learner's entropy.
"""

import argparse
import json
import time

start = time.time()

import gymnasium as gym  # noqa: E402
import ray  # noqa: E402
from ray import tune  # noqa: E402
from ray.rllib.algorithms.impala import IMPALAConfig  # noqa: E402
from ray.rllib.env.wrappers.atari_wrappers import wrap_atari_for_new_api_stack  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--seed", type=int, default=100)
parser.add_argument("--max-steps", type=int, default=3_000_000)
parser.add_argument("--target", type=float, default=18.0)
args = parser.parse_args()

# Logical CPUs beyond the cores: the runners take one each, RLlib's learner and aggregator actors
# need theirs (PLATFORM.md).
ray.init(include_dashboard=False, num_cpus=4)
tune.register_env(
    "pong",
    lambda cfg: wrap_atari_for_new_api_stack(
        gym.make(
            "ale_py:ALE/Pong-v5",
            frameskip=1,
            full_action_space=False,
            repeat_action_probability=0.0,
        ),  # fmt: skip
        dim=42,
        frameskip=4,
        framestack=4,
    ),
)
config = (
    IMPALAConfig()
    .environment("pong", clip_rewards=True)
    .env_runners(num_env_runners=2, num_envs_per_env_runner=16, rollout_fragment_length=50)
    .training(
        train_batch_size_per_learner=500,
        lr=0.0006,
        grad_clip=40.0,
        vf_loss_coeff=0.5,
        entropy_coeff=0.01,
    )  # fmt: skip
    .rl_module(
        model_config={
            "vf_share_layers": True,
            "conv_activation": "relu",
            "conv_filters": [[16, 4, 2], [32, 4, 2], [256, 11, 1, "valid"]],
            "head_fcnet_hiddens": [],
        }
    )
    .reporting(min_time_s_per_iteration=10)
    .debugging(seed=args.seed)
)
algo = config.build_algo()
while True:
    r = algo.train()
    runners = r.get("env_runners", {})
    steps = runners.get("num_env_steps_sampled_lifetime")
    if steps is None:  # Iterations before the first sample report no env-runner metrics.
        continue
    ret = runners.get("episode_return_mean", float("nan"))
    learner = r.get("learners", {}).get("default_policy", {})
    row = {"t": round(time.time() - start, 1), "steps": steps, "return": ret}
    row["entropy"] = learner.get("entropy")
    print(json.dumps(row), flush=True)
    if steps >= args.max_steps or (ret == ret and ret >= args.target):
        break
algo.stop()
