"""Using a trained policy from Python: load a checkpoint, act, look at the Keras model.

    impala-train --config=configs/cartpole-impala.yaml --logdir=runs/cartpole
    python -m examples.use_trained_policy --checkpoint=runs/cartpole

Without `--checkpoint` it trains CartPole for a few iterations first and saves a checkpoint in
a temporary directory. No actor process starts to load or use a checkpoint.
docs/using-a-policy.md walks through it.
"""

from __future__ import annotations

import argparse
import tempfile

import gymnasium as gym
import numpy as np

from impala_tf import Impala, ImpalaConfig


def train_a_little(directory: str, iterations: int) -> str:
    """A short CartPole run, saved to `directory`; returns the checkpoint."""
    config = (
        ImpalaConfig()
        .environment("CartPole-v1")
        .env_runners(num_env_runners=2, num_envs_per_env_runner=8)
        .resources(num_gpus=0)
        .reporting(min_time_s_per_iteration=1)
        .debugging(seed=7)
    )
    algo = config.build()
    try:
        for _ in range(iterations):
            algo.train()
        return algo.save(directory)
    finally:
        algo.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None, help="a checkpoint or training logdir")
    parser.add_argument("--episodes", type=int, default=3)
    parser.add_argument("--train-iters", type=int, default=5)
    args = parser.parse_args()
    checkpoint = args.checkpoint or train_a_little(tempfile.mkdtemp(), args.train_iters)

    algo = Impala.from_checkpoint(checkpoint)  # RLlib's Algorithm.from_checkpoint.
    policy = algo.get_policy()  # "default_policy"
    policy.model.summary()  # The Keras model the learner trained.

    env = gym.make("CartPole-v1")
    for episode in range(args.episodes):
        obs, _ = env.reset(seed=episode)
        done, total = False, 0.0
        while not done:
            # The observation filter, the policy and the action's unsquashing, as the actors.
            action = algo.compute_single_action(obs, explore=False)
            obs, reward, terminated, truncated, _ = env.step(action)
            total, done = total + reward, terminated or truncated
        print(f"episode {episode}: return {total:.0f}")

    # A batch at once, with the extra fetches (logits, values, log-probabilities).
    batch = np.stack([env.observation_space.sample() for _ in range(4)])
    actions, _, extra = policy.compute_actions(batch, explore=False)
    print("actions", actions, "values", np.round(extra["vf_preds"], 2))
    weights = algo.get_weights()["default_policy"]  # numpy arrays, get_weights() order.
    print(f"{len(weights)} weight arrays, {sum(w.size for w in weights):,} numbers")


if __name__ == "__main__":
    main()
