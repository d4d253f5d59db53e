"""Measures the memory of actor processes: a numpy-acting MLP actor vs a TensorFlow CNN actor.

Starts the driver's `EnvRunnerGroup` of N local actor processes for each kind, has each sample
a few fragments, and reads /proc/<pid>/smaps_rollup (no psutil) of every actor and of the fork
server: Rss (resident,
counting pages shared with the fork server), Pss (shared pages split between sharers) and
private (Private_Clean + Private_Dirty: what one more actor adds). The figures feed
`impala_tf.workers.memory`'s per-actor estimates.

`--estimate YAML` measures nothing: it prints what the guard estimates for that config's pool
(`impala_tf.workers.memory.estimate_pool_bytes`, from the figures above and the config's envs,
fragments and batches), once as TensorFlow actors (per-actor CNN/LSTM inference) and once as
actors without TensorFlow (numpy MLPs, or any model with `inference: central`), beside this
machine's `MemAvailable`: the figures `inference: auto` decides by.

Run from the repository root:
    .venv/bin/python -m tools.measure_actor_memory --kind=mlp|cnn [--actors=2]
    .venv/bin/python -m tools.measure_actor_memory --estimate configs/pong-impala.yaml
"""

from __future__ import annotations

import argparse
import os
import time

from impala_tf.config import ImpalaConfig
from impala_tf.config.policies import policy_config
from impala_tf.driver.plan import make_plan
from impala_tf.driver.sampling import EnvRunnerGroup
from impala_tf.driver.specs import sampling_spec
from impala_tf.workers.memory import estimate_pool_bytes, read_meminfo, read_smaps_rollup
from tests.support import envs
from tools import proclib

__all__ = ["main", "print_estimate"]


def _configs() -> dict[str, ImpalaConfig]:
    mlp = ImpalaConfig().environment("CartPole-v1")
    cnn = ImpalaConfig().environment(
        envs.stacked_frames, env_config={"size": 84, "k": 4, "episode_len": 200}
    )
    cnn.model.update({"vf_share_layers": True})  # RLlib's 84x84 filters, one conv tower.
    return {"numpy MLP (CartPole)": mlp, "TF CNN (84x84x4, RLlib filters)": cnn}


def _fork_server_pid() -> int | None:
    """The fork server is not a multiprocessing child: find it among this process's children."""
    for pid in proclib.children(os.getpid()):
        if any("forkserver" in arg for arg in proclib.cmdline(pid)):
            return pid
    return None


def print_estimate(path: str) -> None:
    """The guard's estimate for the pool of the YAML at `path`, with and without TensorFlow."""
    from impala_tf.driver.specs import probe_spaces

    config, _ = ImpalaConfig.from_yaml(path)
    space = probe_spaces(config).largest_observation_space()
    available = read_meminfo()["MemAvailable"]
    print(
        f"{path}: num_env_runners={config.num_env_runners}, num_envs_per_env_runner="
        f"{config.num_envs_per_env_runner}, observations {space.shape} {space.dtype}; "
        f"MemAvailable {available / 2**30:.1f} GiB"
    )
    for label, numpy_policy in (("TensorFlow actors", False), ("actors without TF", True)):
        e = estimate_pool_bytes(config, space, numpy_policy=numpy_policy)
        print(
            f"  {label:18s}: {e['per_actor'] / 2**20:7.1f} MiB per actor, fork server "
            f"{e['fork_server'] / 2**20:5.0f} MiB, learner reserve "
            f"{e['learner_reserve'] / 2**20:5.0f} MiB, total {e['total'] / 2**30:6.1f} GiB"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=("mlp", "cnn"))
    parser.add_argument("--estimate", metavar="YAML", help="print the guard's estimate only")
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--envs", type=int, default=5)
    parser.add_argument("--fragments", type=int, default=3)
    args = parser.parse_args()
    if args.estimate:
        print_estimate(args.estimate)
        return
    if args.kind is None:
        parser.error("one of --kind or --estimate is required")
    for name, config in _configs().items():
        if not name.startswith({"mlp": "numpy", "cnn": "TF"}[args.kind]):
            continue
        config.env_runners(
            num_env_runners=args.actors,
            num_envs_per_env_runner=args.envs,
            rollout_fragment_length=50,
        )
        from impala_tf.models import build_model  # TensorFlow: after the fork server starts.

        plan = make_plan(config)
        from impala_tf.driver.counters import Counters

        actors = EnvRunnerGroup(sampling_spec(config, plan), plan, Counters())
        try:
            weights = {
                pid: (build_model(obs, act, policy_config(config, pid).model).get_weights(), 0)
                for pid, (obs, act) in plan.spaces.policies.items()
            }
            actors.broadcast(weights, actors.healthy_ids())
            got, deadline = 0, time.time() + 300
            while got < args.actors * args.fragments and time.time() < deadline:
                actors.request_idle()
                fragments, failures = actors.fetch(1.0)
                if failures:
                    raise RuntimeError(failures)
                got += len(fragments)
            print(f"{name}: {args.actors} actors x {args.envs} envs, {got} fragments")
            for pid in actors.pids().values():
                m = read_smaps_rollup(pid)
                print(
                    f"  actor {pid}: rss {m['Rss'] / 2**20:7.1f} MiB  pss "
                    f"{m['Pss'] / 2**20:7.1f} MiB  private {m['Private'] / 2**20:7.1f} MiB"
                )
            server = _fork_server_pid()
            if server is not None:
                m = read_smaps_rollup(server)
                print(f"  fork server {server}: rss {m['Rss'] / 2**20:7.1f} MiB")
        finally:
            actors.stop()


if __name__ == "__main__":
    main()
