"""GPU measurements, one command for whoever has a GPU: learner vs bare Keras, loader, Pong.

    .venv/bin/python -m tools.bench_gpu               # every part, into BENCHMARKS.md
    .venv/bin/python -m tools.bench_gpu --dry         # the plan, without a GPU
    .venv/bin/python -m tools.bench_gpu --parts learner thread --repeats 30

Refuses to run (exit status 2, a message saying so) where TensorFlow sees no GPU: the figures
are meant for a GPU, and on a CPU `tools.bench_learner` measures the same updates. Run it from
the repository root. Parts (together one BENCHMARKS.md section, `bench_gpu`):

* `learner` - one `ImpalaLearner` update of the Nature CNN (84x84x4 uint8 frames) at batch 500
  and 2,000, with `jit_compile_update` False and True, and with `precision: mixed_bfloat16`
  (XLA off), next to a bare Keras model of the same CNN torso and heads doing forward, backward
  and Adam on a plain loss; interleaved rounds, batches already on the GPU, results fetched.
  Answers "how far is the learner from Keras on the GPU", "should `jit_compile_update: auto`
  turn XLA on for GPUs" and "what does a bfloat16 learner gain there" (actors on CPUs would keep
  `inference_precision: float32`, BENCHMARKS.md `bench_learner_bf16`).
* `thread` - updates/s through the whole learner thread (host batches on the inqueue, the
  loader cutting and copying them onto the GPU in its two slots, one host read per update) at
  batch 500, and the GPU's utilisation meanwhile: what the update alone reaches vs what the
  loader lets it reach; once with the next update queued before the last one's stats are read
  (the thread's way on an accelerator) and once with the stats read at once, which answers
  whether queueing gains anything with the update's `tf.cond` (`impala_tf.learning.thread`).
* `pong` - `impala-train --config=configs/pong-impala-small.yaml --set num_gpus=1` with
  `num_env_runners` = the machine's cores - 2, for `--pong_seconds` each with XLA off and on:
  env steps/s sampled and trained, and the GPU's utilisation (nvidia-smi, every 0.5 s).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from tools import benchlib

__all__ = ["GpuSampler", "bench_learner", "bench_pong", "bench_thread", "main", "plan"]

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ("learner", "thread", "pong")
PONG_CONFIG = "configs/pong-impala-small.yaml"


class NoGpuError(RuntimeError):
    """TensorFlow sees no GPU on this machine."""


def plan(parts: list[str], repeats: int, pong_seconds: float) -> str:
    """What a run does, one line per measurement (`--dry` prints it)."""
    lines = []
    if "learner" in parts:
        lines += [
            f"learner: Nature CNN update at batch {b:,}, XLA off / on, mixed_bfloat16 (XLA "
            f"off), vs bare Keras; "
            f"5 interleaved rounds of {repeats} updates"
            for b in (500, 2000)
        ]
    if "thread" in parts:
        lines += [
            f"thread: 60 train batches of 500 through the learner thread, {how}, GPU utilisation"
            for how in ("next update queued before the stats are read", "stats read at once")
        ]
    if "pong" in parts:
        runners = max(1, (os.cpu_count() or 2) - 2)
        for jit in (False, True):
            lines.append(
                f"pong: impala-train --config={PONG_CONFIG} --stop_time_s={pong_seconds:g} "
                f"--set=num_gpus=1 --set=num_env_runners={runners} "
                f"--set=jit_compile_update={jit}"
            )
    return "\n".join(lines)


def require_gpu() -> str:
    """The first GPU's name; raises `NoGpuError` when TensorFlow sees none."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        raise NoGpuError(
            "tools.bench_gpu measures a GPU and TensorFlow sees none on this machine (check "
            "`nvidia-smi` and CUDA_VISIBLE_DEVICES). On a CPU, `python -m tools.bench_learner` "
            "measures the same updates; `--dry` prints this tool's plan."
        )
    tf.config.experimental.set_memory_growth(gpus[0], True)
    return gpus[0].name


class GpuSampler:
    """Samples the GPU's utilisation (%) with `nvidia-smi` every `interval_s` in a thread."""

    def __init__(self, interval_s: float = 0.5):
        self.interval_s = interval_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.available = shutil.which("nvidia-smi") is not None

    def _run(self) -> None:
        query = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"]
        while not self._stop.wait(self.interval_s):
            out = subprocess.run(query, capture_output=True, text=True, check=False)
            if out.returncode == 0 and out.stdout.strip():
                self.samples.append(float(out.stdout.split()[0]))

    def __enter__(self) -> GpuSampler:
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.available:
            self._thread.join(5)

    def summary(self) -> str:
        if not self.samples:
            return "n/a (no nvidia-smi)" if not self.available else "n/a (no samples)"
        mean, median = statistics.mean(self.samples), statistics.median(self.samples)
        return f"{mean:.0f}% mean, {median:.0f}% median"


def _keras_cnn_step(batch: int) -> Callable[[], None]:
    """Forward + backward + Adam on a bare Keras Nature CNN with policy and value heads."""
    import keras
    import numpy as np
    import tensorflow as tf

    inputs = keras.Input((84, 84, 4), dtype="uint8")
    x = keras.layers.Rescaling(1 / 255)(inputs)
    for filters, kernel, stride in ((32, 8, 4), (64, 4, 2), (64, 3, 1)):
        x = keras.layers.Conv2D(filters, kernel, stride, activation="relu")(x)
    x = keras.layers.Dense(512, activation="relu")(keras.layers.Flatten()(x))
    model = keras.Model(inputs, [keras.layers.Dense(6)(x), keras.layers.Dense(1)(x)])
    optimizer = keras.optimizers.Adam(learning_rate=5e-4)
    optimizer.build(model.trainable_variables)
    rng = np.random.default_rng(0)
    obs = tf.constant(rng.integers(0, 256, (batch, 84, 84, 4), dtype=np.uint8))
    actions = tf.constant(rng.integers(0, 6, batch))
    targets = tf.constant(rng.normal(size=batch).astype(np.float32))

    return benchlib.bare_keras_step(model, optimizer, obs, actions, targets)


def bench_learner(repeats: int) -> list[str]:
    import tensorflow as tf

    from tools import bench_learner as bl

    lines = [
        "| batch | update | ms / update | samples/s | vs bare Keras |",
        "|---:|---|---:|---:|---:|",
    ]
    for batch in (500, 2000):
        steps = {
            "learner, XLA off": bl._learner_step(
                "cnn", batch, tf.distribute.get_strategy(), jit_compile_update=False
            ),
            "learner, XLA on": bl._learner_step(
                "cnn", batch, tf.distribute.get_strategy(), jit_compile_update=True
            ),
            "learner, mixed_bfloat16, XLA off": bl._learner_step(
                "cnn",
                batch,
                tf.distribute.get_strategy(),
                jit_compile_update=False,
                precision="mixed_bfloat16",
            ),
            "bare Keras CNN": _keras_cnn_step(batch),
        }
        times = bl._interleaved_times(steps, repeats)
        keras_s = statistics.median(times["bare Keras CNN"])
        for name, values in times.items():
            s = statistics.median(values)
            lines.append(
                f"| {batch:,} | {name} (rounds {min(values) * 1e3:.2f}-{max(values) * 1e3:.2f}) "
                f"| {s * 1e3:.2f} | {batch / s:,.0f} | {s / keras_s:.2f}x |"
            )
    return lines


def bench_thread(batches: int = 60) -> list[str]:
    """Updates/s through the learner thread, with the next update queued before the last one's
    stats are read (the thread's way on an accelerator) and with the stats read at once."""
    return [_bench_thread(queued, batches) for queued in (True, False)]


def _bench_thread(queued: bool, batches: int) -> str:
    import numpy as np
    import tensorflow as tf

    from impala_tf.data.sample_batch import SampleBatch
    from impala_tf.learning import pipeline
    from impala_tf.learning.learner import ImpalaLearner
    from impala_tf.learning.thread import LearnerThread, TrainBatch
    from tools import bench_learner as bl

    batch = 500
    config = bl._config("cnn", batch)
    obs_space, act_space = bl._spaces("cnn")
    strategy = tf.distribute.get_strategy()
    with strategy.scope():
        learner = ImpalaLearner(config, obs_space, act_space)
    signature = pipeline.batch_signature(config, obs_space, act_space, 1)
    thread = LearnerThread(learner, strategy, signature)
    thread.queues_updates = queued
    host = [SampleBatch(bl._random_batch("cnn", batch // bl.T, seed=i)) for i in range(4)]
    thread.start()
    try:
        thread.inqueue.put(TrainBatch(host[0]))  # Traced and warm before timing.
        thread.outqueue.get(timeout=600)
        with GpuSampler() as gpu:
            start = time.perf_counter()
            for i in range(batches):
                thread.inqueue.put(TrainBatch(host[i % len(host)]))
            for _ in range(batches):
                _, _, stats = thread.outqueue.get(timeout=600)
            seconds = time.perf_counter() - start
    finally:
        thread.stop()
    if thread.error is not None:
        raise thread.error
    assert np.isfinite(stats["total_loss"])
    timing = thread.add_learner_metrics({})["info"]["timing_breakdown"]
    how = "next update queued first" if queued else "stats read at once"
    return (
        f"Learner thread, Nature CNN, batch {batch}, {thread.num_slots} loader slots, {how}: "
        f"{batches / seconds:.1f} updates/s ({batch * batches / seconds:,.0f} samples/s); "
        f"GPU utilisation {gpu.summary()}; per update: grad {timing['learner_grad_time_ms']} ms, "
        f"load {timing['learner_load_time_ms']} ms, waiting for a unit "
        f"{timing['learner_load_wait_time_ms']} ms."
    )


def bench_pong(seconds: float) -> list[str]:
    from tools import bench_atari

    runners = max(1, (os.cpu_count() or 2) - 2)
    lines = [
        f"| `jit_compile_update` | env steps/s sampled | trained | GPU utilisation | "
        f"mean return at the end ({seconds:g} s) |",
        "|---|---:|---:|---|---:|",
    ]
    for jit in (False, True):
        logdir = tempfile.mkdtemp(prefix="bench-gpu-pong-")
        cmd = [sys.executable, "-m", "impala_tf.bin.train", f"--config={PONG_CONFIG}"]
        cmd += [f"--logdir={logdir}", f"--stop_time_s={seconds}", "--checkpoint_freq=0"]
        cmd += ["--set=num_gpus=1", f"--set=num_env_runners={runners}"]
        cmd += [f"--set=jit_compile_update={jit}"]
        with GpuSampler() as gpu:
            _, results, tail, _ = benchlib.watch_training(cmd, ROOT, logdir, None, seconds + 300)
        if not results:
            raise RuntimeError("impala-train wrote no results:\n" + "".join(tail))
        rate = bench_atari.throughput(results)
        lines.append(
            f"| {jit} | {rate['sampled_per_s']:,.0f} | {rate['trained_per_s']:,.0f} | "
            f"{gpu.summary()} | {rate['episode_reward_mean']} |"
        )
        print(lines[-1], flush=True)
    lines += ["", f"`{' '.join(cmd[1:])}` ({runners} env runners: the cores less 2)."]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--pong_seconds", type=float, default=180)
    parser.add_argument("--dry", action="store_true", help="print the plan; needs no GPU")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    print(plan(args.parts, args.repeats, args.pong_seconds), flush=True)
    if args.dry:
        return
    try:
        gpu = require_gpu()
    except NoGpuError as e:
        print(f"bench_gpu: {e}", file=sys.stderr)
        sys.exit(2)
    lines = ["## GPU: learner, loader and Pong (`tools.bench_gpu`)", ""]
    lines += [f"Machine: {benchlib.machine_line()}, {gpu}", ""]
    for part in args.parts:
        start = time.perf_counter()
        if part == "learner":
            lines += bench_learner(args.repeats)
        elif part == "thread":
            lines += bench_thread()
        else:
            lines += bench_pong(args.pong_seconds)
        lines.append("")
        print("\n".join(lines), f"\n({part}: {time.perf_counter() - start:.0f} s)\n", flush=True)
    if not args.no_write:
        benchlib.write_section("bench_gpu", "\n".join(lines).rstrip())


if __name__ == "__main__":
    main()
