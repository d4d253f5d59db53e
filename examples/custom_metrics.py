"""RLlib callbacks: a custom metric per episode, summarised in every result.

    python -m examples.custom_metrics

The pole's mean angle over each CartPole episode, measured in the actors (`on_episode_step`,
`on_episode_end`), comes back as `result["custom_metrics"]["pole_angle_mean"]` (and `_min`,
`_max`), and TensorBoard shows it under `custom_metrics/`. docs/callbacks.md walks through it.
"""

from __future__ import annotations

import argparse

import numpy as np

from impala_tf import DefaultCallbacks, ImpalaConfig


class PoleAngle(DefaultCallbacks):
    """Records |pole angle| at every step of an episode; reports its mean as a custom metric."""

    def on_episode_start(self, *, worker, base_env, policies, episode, env_index, **kwargs):
        episode.user_data["angles"] = [abs(episode.last_raw_obs_for()[2])]

    def on_episode_step(self, *, worker, base_env, episode, env_index, **kwargs):
        episode.user_data["angles"].append(abs(episode.last_raw_obs_for()[2]))

    def on_episode_end(self, *, worker, base_env, policies, episode, env_index, **kwargs):
        angles = episode.user_data["angles"]
        episode.custom_metrics["pole_angle"] = float(np.mean(angles))
        episode.hist_data["pole_angles"] = [float(a) for a in angles]

    def on_train_result(self, *, algorithm, result, **kwargs):
        # Runs in the driver; what it adds to the result is logged with it.
        result["pole_angle_degrees"] = np.degrees(result["custom_metrics"]["pole_angle_mean"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stop-iters", type=int, default=10)
    args = parser.parse_args()
    config = (
        ImpalaConfig()
        .environment("CartPole-v1")
        .env_runners(num_env_runners=2, num_envs_per_env_runner=8)
        .training(lr=0.0005)
        .resources(num_gpus=0)
        .reporting(min_time_s_per_iteration=1)
        .callbacks(PoleAngle)
    )
    algo = config.build()
    try:
        for _ in range(args.stop_iters):
            result = algo.train()
            metrics = result["custom_metrics"]
            print(
                f"iter {result['training_iteration']}: return "
                f"{result['episode_reward_mean']:.1f}, pole angle mean "
                f"{metrics['pole_angle_mean']:.4f} rad [{metrics['pole_angle_min']:.4f}, "
                f"{metrics['pole_angle_max']:.4f}] = {result['pole_angle_degrees']:.2f} degrees"
            )
    finally:
        algo.stop()


if __name__ == "__main__":
    main()
