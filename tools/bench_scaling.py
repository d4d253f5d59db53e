"""Where the Ray design stops scaling: measured per-actor and learner figures, and the estimate.

    .venv/bin/python -m tools.bench_scaling                     # Pong, pong-impala-small.yaml
    .venv/bin/python -m tools.bench_scaling --sample_time 30 --no-write

Run from the repository root (the parts run there as `python -m tools.bench_scaling` and
`python -m tools.bench_atari`).

Measured here, each part in a fresh process:

* **actor** - one `EnvRunner` as a Ray actor runs it (TensorFlow on 1 intra-op and 1 inter-op
  thread, the config's envs, fragments and vector-env threads): env steps per second of wall
  time and per second of the process's CPU time (the second is what one dedicated core would
  give; on a shared machine the first is lower), and the size of one fragment as the actor sends
  it: the raw columns, frame-stack coded (what goes into the object store by default), coded and
  zlib-compressed (`compress_observations`), and the pickle (protocol 5) of the coded fragment,
  which is what Ray serialises. Also the CPU time to encode a fragment (actor) and to decode it
  (`sample_batch.decompress`, driver), and the bytes of the policy weights.
* **learner** - `ImpalaLearner.train_step` samples/s at `train_batch_size` on this machine's
  CPU, all cores (`tools.bench_atari`'s learner case). No GPU here: the GPU figure is not
  measured.

From these the tool prints, as an estimate (arithmetic, not a measurement), the number of actors
at which the learner's ingest is the limit, the object-store traffic per second at N actors, and
the fragments per second the driver's one main thread can decode. Results go to BENCHMARKS.md
(section "bench_scaling"), with the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
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
ACTOR_COUNTS = (8, 32, 128, 512)


def pickled_size(obj: object) -> int:
    """Bytes of `obj` pickled with protocol 5, out-of-band buffers included (Ray's serializer)."""
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return len(head) + sum(memoryview(b).nbytes for b in buffers)


def _nbytes(batch) -> int:
    return sum(int(getattr(v, "nbytes", 0)) for v in batch.values())


def case_actor(path: str, seconds: float) -> dict:
    """One env runner, as a Ray actor runs it: rates, fragment sizes, decode cost, weights."""
    from impala_tf.quiet import import_tensorflow

    import_tensorflow()
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from impala_tf.config import ImpalaConfig
    from impala_tf.frames import encode_observations
    from impala_tf.rollout.env_runner import EnvRunner
    from impala_tf.sample_batch import decompress

    config, _ = ImpalaConfig.from_yaml(path)
    config.validate()
    runner = EnvRunner(config, worker_index=1)
    runner.sample()  # Warm-up: traces the policy.
    steps, wall0, cpu0 = 0, time.perf_counter(), time.process_time()
    fragments = []
    while time.perf_counter() - wall0 < seconds:
        fragment = runner.sample()
        steps += fragment.env_steps
        fragments.append(fragment)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    last = fragments[-1]
    tail = [f.batch for f in fragments[-5:]]

    def timed(fn, items):  # CPU seconds per item: a loaded machine stretches wall time.
        start = time.process_time()
        out = [fn(x) for x in items]
        return out, (time.process_time() - start) / len(items)

    coded, encode_s = timed(lambda b: encode_observations(b, compress_observations=False), tail)
    zipped, encode_zlib_s = timed(
        lambda b: encode_observations(b, compress_observations=True), tail
    )
    sent = [pickled_size(last.__class__(**{**vars(last), "batch": b})) for b in coded]
    _, decode_s = timed(decompress, coded)
    _, decode_zlib_s = timed(decompress, zipped)
    weights = runner.get_weights()
    runner.close()
    return {
        "env_steps_per_fragment": last.env_steps,
        "obs_shape": list(last.batch["obs"].shape),
        "fragments": len(fragments),
        "steps_per_wall_s": steps / wall,
        "steps_per_cpu_s": steps / max(cpu, 1e-9),
        "raw_bytes": _nbytes(last.batch),
        "coded_bytes": sum(_nbytes(b) for b in coded) / len(coded),
        "zlib_bytes": sum(_nbytes(b) for b in zipped) / len(zipped),
        "pickled_bytes": sum(sent) / len(sent),
        "encode_s": encode_s,
        "encode_zlib_s": encode_zlib_s,
        "decode_s": decode_s,
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


def estimate(actor: dict, learner_per_s: float, counts: tuple[int, ...] = ACTOR_COUNTS) -> dict:
    """The paper estimate from the measured figures (no measurement of its own).

    Args:
      actor: `case_actor`'s result.
      learner_per_s: Learner env steps (samples) per second.
      counts: Numbers of actors to give the object-store traffic for.

    Returns:
      Per-actor rate used, actors at the learner limit, bytes per env step sent, traffic per
      second at each count, and the fragments per second one driver thread decodes.
    """
    rate = actor["steps_per_cpu_s"]
    per_step = actor["pickled_bytes"] / actor["env_steps_per_fragment"]
    fragments_per_actor = rate / actor["env_steps_per_fragment"]
    return {
        "actor_steps_per_s": rate,
        "actors_at_learner_limit": learner_per_s / rate,
        "bytes_per_env_step": per_step,
        "fragments_per_s_per_actor": fragments_per_actor,
        "traffic": {n: n * rate * per_step for n in counts},
        "traffic_at_limit": learner_per_s * per_step,
        "driver_decode_fragments_per_s": 1.0 / max(actor["decode_s"], 1e-12),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--sample_time", type=float, default=30.0, help="seconds of sampling")
    parser.add_argument("--repeats", type=int, default=10, help="learner calls per round")
    parser.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(case_actor(**json.loads(args.case))), flush=True)
        return
    path = os.path.abspath(args.config)
    load_before = os.getloadavg()
    case = {"path": path, "seconds": args.sample_time}
    actor = _run(["-m", "tools.bench_scaling", "--case", json.dumps(case)])
    print(json.dumps({"actor": actor}), flush=True)
    case = {"name": "learner", "path": path, "repeats": args.repeats}
    learner = _run(["-m", "tools.bench_atari", "--case", json.dumps(case)])
    print(json.dumps({"learner": learner}), flush=True)
    load_after = os.getloadavg()
    learner_per_s = learner["batch"] / learner["learner_s"]
    est = estimate(actor, learner_per_s)
    text = report(args, actor, learner, learner_per_s, est, load_before, load_after)
    print(text)
    if not args.no_write:
        benchlib.write_section("bench_scaling", text)


def _mb(x: float) -> str:
    return f"{x / 1e6:,.1f} MB"


def report(args, actor, learner, learner_per_s, est, load_before, load_after) -> str:
    name = os.path.relpath(os.path.abspath(args.config), ROOT)
    cores = os.cpu_count() or 1
    n = actor["env_steps_per_fragment"]
    wall = min(est["driver_decode_fragments_per_s"] * n, 1.25e9 / est["bytes_per_env_step"])
    through = (2 * actor["coded_bytes"] + actor["raw_bytes"]) / actor["coded_bytes"]
    lines = [
        f"## Where the Ray design stops scaling (Pong, `{name}`)",
        "",
        f"`python -m tools.bench_scaling --sample_time={args.sample_time:g}` "
        f"({benchlib.machine_line()}). Load average (1 min) {load_before[0]:.1f} before, "
        f"{load_after[0]:.1f} after, on {cores} cores.",
        "",
        "### Measured here",
        "",
        f"- One actor (1 TF thread, a fragment = {n} env steps, obs {actor['obs_shape']} uint8): "
        f"{actor['steps_per_wall_s']:,.0f} env steps per wall second on this shared machine, "
        f"**{actor['steps_per_cpu_s']:,.0f} per CPU second** (what one dedicated core gives), "
        f"over {actor['fragments']} fragments.",
        f"- One fragment: raw {_mb(actor['raw_bytes'])}, frame-stack coded "
        f"{_mb(actor['coded_bytes'])}, coded + zlib {_mb(actor['zlib_bytes'])}; pickled as Ray "
        f"sends it (coded, the default) **{_mb(actor['pickled_bytes'])}**, i.e. "
        f"{est['bytes_per_env_step']:,.0f} bytes per env step.",
        f"- Per fragment, CPU time: actor encode {actor['encode_s'] * 1e3:.1f} ms coded, "
        f"{actor['encode_zlib_s'] * 1e3:.1f} ms coded + zlib; driver decode "
        f"(`sample_batch.decompress`) {actor['decode_s'] * 1e3:.1f} ms coded, "
        f"{actor['decode_zlib_s'] * 1e3:.1f} ms coded + zlib.",
        f"- Policy weights: {actor['weights_count']:,} numbers, {_mb(actor['weights_bytes'])} "
        "(one `ray.put` per broadcast, one transfer per node that holds actors).",
        f"- Learner, {learner['model']}, batch {learner['batch']}, CPU, all {cores} cores: "
        f"{learner['learner_s'] * 1e3:.1f} ms per update, **{learner_per_s:,.0f} env steps/s** "
        f"({learner_per_s * FRAME_SKIP:,.0f} frames/s). **On a GPU: not measured** (no GPU "
        "here; `python -m tools.bench_learner --parts gpu` measures it where there is one).",
        "",
        "### Estimate (arithmetic on the figures above, not measured)",
        "",
        f"- Actors the CPU learner can feed: {learner_per_s:,.0f} / "
        f"{est['actor_steps_per_s']:,.0f} = **{est['actors_at_learner_limit']:,.1f}** actors of "
        "one core each. Beyond that, more actors only add samples the learner cannot train "
        "(the learner queue drops them, `num_times_learner_queue_full`). A GPU learner raises "
        "the limit in proportion to its samples/s: N = (GPU samples/s) / "
        f"{est['actor_steps_per_s']:,.0f}.",
        f"- Object-store traffic into the driver: {est['bytes_per_env_step']:,.0f} bytes/step "
        "x steps/s: "
        + ", ".join(f"{k} actors {_mb(v)}/s" for k, v in est["traffic"].items())
        + f"; at the CPU learner's limit {_mb(est['traffic_at_limit'])}/s. Every fragment is "
        "pulled to the head node: a 10 Gbit/s link (about 1,250 MB/s) carries "
        f"{1.25e9 / est['bytes_per_env_step']:,.0f} env steps/s, "
        f"{1.25e9 / est['bytes_per_env_step'] / est['actor_steps_per_s']:,.0f} actors' worth.",
        f"- The driver's main thread, given a core, decodes "
        f"{est['driver_decode_fragments_per_s']:,.0f} fragments/s "
        f"({est['driver_decode_fragments_per_s'] * n:,.0f} env steps/s) if it does nothing "
        "else; it also copies fragments out of the object store, batches them and "
        "broadcasts weights, so the real ceiling is lower. With `compress_observations` the "
        f"traffic shrinks {actor['coded_bytes'] / max(actor['zlib_bytes'], 1):.0f}x but the "
        f"driver decodes {1.0 / max(actor['decode_zlib_s'], 1e-12):,.0f} fragments/s.",
        "- Which wall comes first: the learner's ingest ("
        f"{learner_per_s:,.0f} env steps/s on this CPU), the driver's decode "
        f"({est['driver_decode_fragments_per_s'] * n:,.0f} env steps/s per core) or the head's "
        f"10 Gbit/s link ({1.25e9 / est['bytes_per_env_step']:,.0f} env steps/s). A GPU learner "
        "moves the first wall up to its own rate; the design stops scaling at whichever of the "
        f"three is lowest, so past about {wall:,.0f} env steps/s ({wall * FRAME_SKIP:,.0f} "
        "frames/s) a faster learner does not help. `num_aggregation_workers` takes the decode "
        "off the driver's thread, but fragments still pass through the driver (in coded, out to "
        "an aggregator, back decoded at the raw size), which multiplies its traffic per env "
        f"step by about {through:.0f}.",
        "- Weights traffic: at most one broadcast per learner update "
        f"({learner_per_s / learner['batch']:,.1f} updates/s on this CPU), "
        f"{_mb(actor['weights_bytes'])} x nodes holding actors per broadcast, out of the head "
        "node (Ray may serve later nodes from earlier copies); it grows with the learner's "
        "update rate, so a fast GPU learner with many nodes should raise `broadcast_interval`.",
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
