"""How many actors one driver feeds: measured per-actor, learner and driver figures, and a
paper model from them.

    .venv/bin/python -m tools.bench_scaling                     # Pong, pong-impala-small.yaml
    .venv/bin/python -m tools.bench_scaling --sample_time 30 --no-write

Run from the repository root (the parts run there as `python -m tools.bench_scaling`,
`python -m tools.bench_atari` and `python -m tools.bench_driver`).

Measured here, each part in a fresh process:

* **actor** - one `EnvRunner` as an actor runs it (TensorFlow on 1 intra-op and 1 inter-op
  thread, the config's envs, fragments and vector-env threads): env steps per second of wall
  time and per second of the process's CPU time (the second is what one dedicated core would
  give), and the size of one fragment: its observations as stacks would be, as sent (each frame
  once, `impala_tf.models.frames`), zlib-compressed (`compress_observations`), and the pickle of the
  fragment as sent; zlib's CPU cost both ways; the bytes of the policy weights.
* **learner** - `ImpalaLearner.train_step` samples/s at `train_batch_size` on this machine's
  CPU, all cores (`tools.bench_atari`'s learner case). No GPU here.
* **driver** - env steps per driver-core second the real driver takes from fake actors
  replaying Pong-42 fragments, local processes and Ray (`tools.bench_driver`).

From these the tool prints a paper model (arithmetic, not a measurement): actors per driver
core, the split of a 16-core machine with one GPU, what limits first on a Ray cluster. Results
go to BENCHMARKS.md (section "bench_scaling"), with the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import time

from tools import benchlib

__all__ = ["case_actor", "estimate", "main", "pickled_size"]

# Inherited by the case processes; TensorFlow is not imported up to here.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULT_CONFIG = os.path.join(ROOT, "configs", "pong-impala-small.yaml")
FRAME_SKIP = 4


def pickled_size(obj: object) -> int:
    """Bytes of `obj` pickled with protocol 5, out-of-band buffers included (Ray's serializer)."""
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return len(head) + sum(memoryview(b).nbytes for b in buffers)


def _nbytes(batch) -> int:
    return sum(int(getattr(v, "nbytes", 0)) for v in batch.values())


def case_actor(path: str, seconds: float) -> dict:
    """One env runner, as a Ray actor runs it: rates, fragment sizes, decode cost, weights."""
    from impala_tf.utils.quiet import import_tensorflow

    import_tensorflow()
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import dataclasses

    import numpy as np

    from impala_tf.config import ImpalaConfig
    from impala_tf.data.sample_batch import OBS, OBS_FRAMES, compress, decompress
    from impala_tf.driver.specs import runner_spec
    from impala_tf.learning.learner import ImpalaLearner
    from impala_tf.rollout.env_runner import EnvRunner
    from impala_tf.rollout.fragment import DEFAULT_POLICY_ID

    config, _ = ImpalaConfig.from_yaml(path)
    config.validate()
    runner = EnvRunner(runner_spec(config), worker_index=1)
    learner = ImpalaLearner(config, runner.observation_space, runner.action_space)
    runner.set_weights({DEFAULT_POLICY_ID: (learner.get_policy_weights(), 0)})
    runner.sample()  # Warm-up: traces the policy.
    steps, wall0, cpu0 = 0, time.perf_counter(), time.process_time()
    fragments = []
    while time.perf_counter() - wall0 < seconds:
        fragment = runner.sample()
        steps += fragment.env_steps
        fragments.append(fragment)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    last = fragments[-1]
    tail = [f.batches[DEFAULT_POLICY_ID] for f in fragments[-5:]]

    def timed(fn, items):  # CPU seconds per item: a loaded machine stretches wall time.
        start = time.process_time()
        out = [fn(x) for x in items]
        return out, (time.process_time() - start) / len(items)

    zipped, encode_zlib_s = timed(lambda b: compress(b, (OBS, OBS_FRAMES)), tail)
    _, decode_zlib_s = timed(decompress, zipped)
    sent = [pickled_size(dataclasses.replace(last, batches={DEFAULT_POLICY_ID: b})) for b in tail]
    batch = tail[-1]
    stacked = int(np.prod(runner.observation_space.shape)) * batch["rewards"].size
    obs_bytes = _nbytes({k: v for k, v in batch.items() if k in (OBS, OBS_FRAMES)})
    weights = runner.get_weights()[DEFAULT_POLICY_ID]
    runner.close()
    return {
        "env_steps_per_fragment": last.env_steps,
        "obs_shape": list(runner.observation_space.shape),
        "frames": OBS_FRAMES in batch,
        "fragments": len(fragments),
        "steps_per_wall_s": steps / wall,
        "steps_per_cpu_s": steps / max(cpu, 1e-9),
        "raw_bytes": _nbytes(batch) - obs_bytes + stacked,
        "sent_bytes": sum(_nbytes(b) for b in tail) / len(tail),
        "zlib_bytes": sum(_nbytes(b) for b in zipped) / len(zipped),
        "pickled_bytes": sum(sent) / len(sent),
        "encode_zlib_s": encode_zlib_s,
        "decode_zlib_s": decode_zlib_s,
        "weights_bytes": sum(int(w.nbytes) for w in weights),
        "weights_count": sum(int(w.size) for w in weights),
    }


def _run(args: list[str], timeout: float = 1800) -> dict:
    """Runs `python *args` from the repository root; returns the JSON of its last line."""
    out = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout
    )
    if out.returncode != 0:
        raise RuntimeError(f"{args[:2]} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


LINK_BYTES_PER_S = 1.25e9  # A 10 Gbit/s link into the head node.
MACHINE_CORES = 16


def estimate(actor: dict, learner_per_s: float, intake: dict[str, float]) -> dict:
    """The paper model from the measured figures (arithmetic, no measurement of its own).

    Args:
      actor: `case_actor`'s result (one actor's env steps per CPU second, bytes per step).
      learner_per_s: The learner's env steps (samples) per second on this CPU.
      intake: {"local": ..., "ray": ...} env steps per second one driver core takes
        (`tools.bench_driver`, Pong fragments, driver aggregation).

    Returns:
      Actors per driver core on each backend, actors the CPU learner feeds, bytes per env step,
      the 16-core machine's split, and the link's limit.
    """
    rate = actor["steps_per_cpu_s"]
    per_step = actor["pickled_bytes"] / actor["env_steps_per_fragment"]
    link = LINK_BYTES_PER_S / per_step
    # One 16-core machine: c cores of actors feed a driver that needs c * rate / intake cores.
    cores = MACHINE_CORES - 1  # One core for the learner's input pipeline and the OS.
    driver_share = rate / intake["local"]
    actor_cores = cores / (1.0 + driver_share)
    return {
        "actor_steps_per_s": rate,
        "bytes_per_env_step": per_step,
        "actors_per_driver_core": {k: v / rate for k, v in intake.items()},
        "actors_at_cpu_learner_limit": learner_per_s / rate,
        "machine_actors": actor_cores,
        "machine_steps_per_s": actor_cores * rate,
        "machine_driver_cores": actor_cores * driver_share,
        "link_steps_per_s": link,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--sample_time", type=float, default=30.0, help="seconds of sampling")
    parser.add_argument("--repeats", type=int, default=10, help="learner calls per round")
    parser.add_argument("--rounds", type=int, default=3, help="learner rounds (median, range)")
    parser.add_argument("--intake_seconds", type=float, default=10.0, help="per driver case")
    parser.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(case_actor(**json.loads(args.case))), flush=True)
        return
    from tools import bench_driver

    path = os.path.abspath(args.config)
    load_before = os.getloadavg()
    case = {"path": path, "seconds": args.sample_time}
    actor = _run(["-m", "tools.bench_scaling", "--case", json.dumps(case)])
    print(json.dumps({"actor": actor}), flush=True)
    case = {"name": "learner", "path": path, "repeats": args.repeats, "rounds": args.rounds}
    learner = _run(["-m", "tools.bench_atari", "--case", json.dumps(case)])
    print(json.dumps({"learner": learner}), flush=True)
    learner["rounds_s"] = learner["learner_s"]  # Seconds per update, one per round.
    learner["learner_s"] = statistics.median(learner["rounds_s"])
    intake = bench_driver.measure_intake("pong42", ("local", "ray"), args.intake_seconds)
    print(json.dumps({"intake": intake}), flush=True)
    load_after = os.getloadavg()
    learner_per_s = learner["batch"] / learner["learner_s"]
    est = estimate(actor, learner_per_s, {k: r["env_steps_per_core_s"] for k, r in intake.items()})
    text = report(args, actor, learner, learner_per_s, intake, est, load_before, load_after)
    print(text)
    if not args.no_write:
        benchlib.write_section("bench_scaling", text)


def _mb(x: float) -> str:
    return f"{x / 1e6:,.1f} MB"


def report(args, actor, learner, learner_per_s, intake, est, load_before, load_after) -> str:
    name = os.path.relpath(os.path.abspath(args.config), ROOT)
    cores = os.cpu_count() or 1
    n = actor["env_steps_per_fragment"]
    rate = est["actor_steps_per_s"]
    per_core = est["actors_per_driver_core"]
    lines = [
        f"## How many actors one driver feeds (Pong, `{name}`)",
        "",
        f"`python -m tools.bench_scaling --sample_time={args.sample_time:g}` "
        f"({benchlib.machine_line()}). Load average (1 min) {load_before[0]:.1f} before, "
        f"{load_after[0]:.1f} after, on {cores} cores.",
        "",
        "### Measured here",
        "",
        f"- One actor (1 TF thread, a fragment = {n} env steps, obs {actor['obs_shape']} uint8, "
        f"frames sent once: {actor['frames']}): {actor['steps_per_wall_s']:,.0f} env steps per "
        f"wall second on this shared machine, **{rate:,.0f} per CPU second** (what one "
        f"dedicated core gives), over {actor['fragments']} fragments.",
        f"- One fragment: stacked observations would be {_mb(actor['raw_bytes'])}; as sent "
        f"(`obs_frames`, each frame once) {_mb(actor['sent_bytes'])}, with zlib "
        f"(`compress_observations`) {_mb(actor['zlib_bytes'])}; pickled as sent "
        f"**{_mb(actor['pickled_bytes'])}**, {est['bytes_per_env_step']:,.0f} bytes per env "
        f"step. zlib costs the actor {actor['encode_zlib_s'] * 1e3:.1f} ms and the receiver "
        f"{actor['decode_zlib_s'] * 1e3:.1f} ms per fragment (CPU).",
        f"- Policy weights: {actor['weights_count']:,} numbers, {_mb(actor['weights_bytes'])}.",
        f"- Learner, {learner['model']}, batch {learner['batch']}, CPU, all {cores} cores: "
        f"{learner['learner_s'] * 1e3:.1f} ms per update (median of {len(learner['rounds_s'])} "
        f"rounds, {min(learner['rounds_s']) * 1e3:.1f}-{max(learner['rounds_s']) * 1e3:.1f}), "
        f"**{learner_per_s:,.0f} env steps/s**. "
        "On a GPU: not measured here (no GPU; `python -m tools.bench_gpu` measures it).",
        "- Driver intake (`tools.bench_driver`, 8 fake actors replaying Pong-42 fragments, a "
        "stub learner, aggregation in the driver): "
        + ", ".join(
            f"{b} **{r['env_steps_per_core_s']:,.0f}** env steps per driver-core second"
            for b, r in intake.items()
        )
        + ".",
        "",
        "### Paper model (arithmetic on the figures above, not measured)",
        "",
        "- One driver core takes the fragments of "
        + ", ".join(f"**{v:,.0f}** actors ({b})" for b, v in per_core.items())
        + f" of {rate:,.0f} env steps/s each.",
        f"- 16 cores + one H100: 15 cores split between actors and the driver (one left to the "
        f"learner's input pipeline): **{est['machine_actors']:,.1f} actors**, "
        f"{est['machine_steps_per_s']:,.0f} env steps/s, using "
        f"{est['machine_driver_cores']:,.2f} cores of driver. The actors' cores limit first: "
        "the H100 trains more samples per second than 15 CPU cores of Pong actors produce, "
        "unless its rate (unmeasured) is below "
        f"{est['machine_steps_per_s']:,.0f} samples/s.",
        "- A Ray cluster: one driver core takes "
        f"{intake['ray']['env_steps_per_core_s']:,.0f} env steps/s, **{per_core['ray']:,.0f} "
        "actors**; beyond that the driver's main thread (one core, one GIL) limits first, "
        f"then the head node's 10 Gbit/s link at {est['link_steps_per_s']:,.0f} env steps/s "
        f"({est['link_steps_per_s'] / rate:,.0f} actors). "
        "`num_aggregation_workers` moves batch cutting out of the driver (bench_driver's rows "
        "with aggregation workers).",
        f"- This CPU's learner trains {learner_per_s:,.0f} env steps/s: "
        f"**{est['actors_at_cpu_learner_limit']:,.1f}** actors' worth. A GPU learner at G "
        f"samples/s needs G / {rate:,.0f} actors.",
        "- Weights: broadcasts are bounded per second (`min_time_s_per_broadcast`, "
        "`tools.bench_driver`'s 128-actor row), so weight traffic does not grow with the "
        "learner's speed.",
    ]
    if benchlib.other_jobs_running(load_before):
        lines += [
            "",
            "**Measured under load (other jobs running): the per-wall-second and learner figures "
            "are low; re-run on an idle machine before quoting them.**",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
