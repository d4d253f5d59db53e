"""Per-actor TensorFlow CNN inference rate: what one actor process can act on by itself.

Runs `impala_tf.acting.tf_policy.ActorPolicy.step` (the actors' compiled acting function) on uint8
84x84x4 observations at batch = `num_envs_per_env_runner`, with TensorFlow limited to one
intra-op and one inter-op thread as actor processes are
(`impala_tf.workers.process.worker_env_vars`), and prints observations (env steps) acted on per
second for each model.

Run from the repository root:
    .venv/bin/python -m tools.bench_actor_inference [--batches=1,5,16] [--seconds=5]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from impala_tf.acting.tf_policy import ActorPolicy  # noqa: E402

__all__ = ["main"]

MODELS = {
    "rllib_84x84": {"vf_share_layers": True},
    "rllib_84x84_separate_vf": {"vf_share_layers": False},
    "nature_cnn": {"custom_model": "nature_cnn"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,5,16")
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    obs_space = gym.spaces.Box(0, 255, (84, 84, 4), np.uint8)
    rng = np.random.default_rng(0)
    print(
        f"threads intra={tf.config.threading.get_intra_op_parallelism_threads()} "
        f"inter={tf.config.threading.get_inter_op_parallelism_threads()}"
    )
    for name, model in MODELS.items():
        policy = ActorPolicy(obs_space, gym.spaces.Discrete(6), model, seed=0)
        params = sum(int(np.prod(w.shape)) for w in policy.get_weights())
        for batch in (int(b) for b in args.batches.split(",")):
            obs = rng.integers(0, 256, (batch, *obs_space.shape), dtype=np.uint8)
            for _ in range(10):
                policy.step(obs)
            steps, start = 0, time.perf_counter()
            while time.perf_counter() - start < args.seconds:
                policy.step(obs)
                steps += 1
            elapsed = time.perf_counter() - start
            print(
                f"{name:26s} params {params:9d} batch {batch:3d}: "
                f"{steps * batch / elapsed:8.0f} obs/s ({elapsed / steps * 1e3:6.2f} ms/call)"
            )


if __name__ == "__main__":
    main()
