"""Atari (Pong) benchmark: env, learner and inference bounds, impala-train throughput, memory.

    .venv/bin/python -m tools.bench_atari                       # everything, 180 s of training
    .venv/bin/python -m tools.bench_atari --train_time 60 --env_time 5 --no-write
    .venv/bin/python -m tools.bench_atari --bound_rounds 5         # more rounds of (a)-(c)
    .venv/bin/python -m tools.bench_atari --profile             # + cProfile of the driver
    .venv/bin/python -m tools.bench_atari --rllib-python /path/to/rllib-venv/bin/python
    .venv/bin/python -m tools.bench_atari --backend=both --rounds 2 --train_time 60

Run from the repository root (each part's process is started as `python -m tools.bench_atari`
there).

All parts run in one invocation, each in a fresh process (TensorFlow's thread pools are fixed at
start-up), against the public entry points only: the config from the YAML
(`ImpalaConfig.from_yaml`), the env runners' env factories (`make_env`, `make_env_batch`,
`atari.vector_env_kwargs`), `ImpalaLearner` and `ActorPolicy` (which build the model the config
asks for through the models catalog) and the `impala-train` binary. Parts:

* (a) **env** - the raw rate of the preprocessed env with random actions, at the config's
  `model.dim` / `framestack`, over the config's `num_env_runners x num_envs_per_env_runner` envs:
  ale-py's `AtariVectorEnv` in one process with one C++ thread per core, the same split over one
  process per runner with the thread count the runners use, and the gymnasium-wrapper path
  (`DeepMindPreprocessing`) in one process per core. Env steps/s and frames/s (x4 action repeat).
  A layout's processes build and reset their envs, then start stepping together (a barrier on
  their stdin), for `--env_time` seconds.
* (b) **learner** - the model's forward + backward + optimizer samples/s at `train_batch_size`:
  `ImpalaLearner(config, env spaces).train_step` compiled and timed on a synthetic uint8 batch,
  next to a bare Keras forward + backward + Adam of the same model (the catalog's model, a
  cross-entropy and a squared value loss, no V-trace), all cores.
* (c) **inference** - `ActorPolicy.step` (the actors' compiled forward with sampling) at batch
  `num_envs_per_env_runner` on 1 TF thread (what one actor does) and at a large batch on all
  cores (what a central inference server would do).
* (d) **train** - `impala-train --config=<yaml> --stop_time_s=<train_time>`; env steps/s sampled
  and trained from `result.json`, between the first and the last iteration (so start-up and
  the first iteration's compilation are excluded). Over the same window, the CPU seconds of the
  run's whole process tree (from /proc every second) per env step trained: the core time per
  env step (`core_time`), and the cores the driver and the actors used.
* (e) **memory** - peak resident memory of the run's whole process tree (driver, fork server,
  actors, ...), sampled from /proc every second: the peak of the summed RSS (counts shared pages
  once per process) and of the summed PSS (shared pages split between the sharers).
* (f) **rllib** - with `--rllib-python` (a Python with `ray[rllib]`, e.g. the side virtualenv of
  /work/shared/PLATFORM.md; this tool does not create it), RLlib 2.60 IMPALA (torch, new API
  stack) on Pong with the YAML's runners, envs, fragment, batch and losses, for the same time.

The bound parts (a)-(c) run in `--bound_rounds` rounds (3 by default) and each row prints the
median over the rounds and the range, min-max (3 to 5 rounds are too few for quartiles). The
rounds are interleaved: each round of (a) runs every layout once, A, B, C, A, B, C, ... (each
for `--env_time` seconds, so (a) steps for layouts x rounds x env_time seconds in all, 90 s by
default); each round of (b) times the learner's update and then the bare Keras one (the median
of `--repeats` calls each). The two rows of (c) need different TF thread pools, fixed when a
process starts, so each runs its rounds in its own process. The training run (d) is one run.

Ratios printed: the ceiling min(env rate, learner bound), the env rate being the best of the
(a) rows, with its range from the rows' min and max (`bounds`); trained / ceiling with the
range that gives (the issue's target is >= 0.70); the core time per env step trained (issue
18's target is <= 0.51 ms); and, when (f) ran, impala_tf trained vs RLlib sampled in the same
invocation. Without (f) no RLlib ratio is printed: a figure from another run, config or day
would not compare like with like.

`--compare_inference SECONDS` runs only the train case, with `inference: actor` (each actor runs
the model at a batch of its envs) and `inference: central` (the driver's server batches every
actor's step, `impala_tf.acting.inference`) alternately for `--rounds` rounds of SECONDS each, and
prints the medians and the ratio (section "bench_atari_inference" of BENCHMARKS.md). `inference:
auto` keeps inference in the actors because of this comparison on an idle machine (central only when
a pool of TensorFlow actors would not fit in memory).

`--profile` runs the driver under cProfile and prints its top functions by own time and by
cumulative time. cProfile sees the driver's main thread only: the learner thread and the actor
processes are not in it.

Results go to BENCHMARKS.md (section "bench_atari"), with the load average before and after the
run; on a loaded machine (load above half the cores) the section says it was measured under load.

`--backend=ray` or `--backend=both` runs only part (d), `impala-train` with `--set
actor_backend=ray` (a Ray started by the driver on this machine) and/or the local pool, for
`--rounds` rounds, alternating which pool goes first, and prints the median env steps/s of each
and the Ray pool's as a ratio of the local pool's (the issue's target for Pong is >= 0.90). Those
figures go to the section "bench_atari_backends", with the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from impala_tf.workers.memory import read_smaps_rollup
from tools import benchlib, proclib

__all__ = [
    "TreeMemorySampler",
    "bounds",
    "case_env",
    "case_inference",
    "case_learner",
    "compare_inference",
    "core_time",
    "cpu_shares",
    "env_layouts",
    "main",
    "memory_kb",
    "profile_top",
    "ratio_to",
    "run_rllib",
    "run_train",
    "throughput",
    "trained_so_far",
]

# Inherited by every case process and impala-train run; TensorFlow is not imported up to here.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULT_CONFIG = os.path.join(ROOT, "configs", "pong-impala-small.yaml")
FRAME_SKIP = 4
TARGET_RATIO = 0.70
TARGET_CORE_MS = 0.51  # Issue 18's target, core time per env step trained on this Pong config.
TARGET_RAY_RATIO = 0.90
BACKENDS = ("local", "ray")

RLLIB_SCRIPT = r"""
import json, sys, time
start = time.time()
import gymnasium as gym
from ray import tune
from ray.rllib.algorithms.impala import IMPALAConfig
from ray.rllib.env.wrappers.atari_wrappers import wrap_atari_for_new_api_stack
s = json.loads(sys.argv[1])
budget_s = float(sys.argv[2])
import ray
# Logical CPUs beyond the cores: the runners take one each, and RLlib's learner and aggregator
# actors need theirs, or the run waits for resources forever (PLATFORM.md; bench_pendulum.py).
ray.init(include_dashboard=False, num_cpus=s["runners"] + 2)
tune.register_env("pong", lambda cfg: wrap_atari_for_new_api_stack(
    gym.make("ale_py:ALE/Pong-v5", frameskip=1, full_action_space=False,
             repeat_action_probability=0.0), s["dim"], 4, 4))  # dim, frameskip, framestack
config = (
    IMPALAConfig()
    .environment("pong", clip_rewards=True)
    .env_runners(num_env_runners=s["runners"], num_envs_per_env_runner=s["envs"],
                 rollout_fragment_length=s["fragment"])
    .training(train_batch_size_per_learner=s["batch"], lr=s["lr"], grad_clip=s["grad_clip"],
              vf_loss_coeff=s["vf"], entropy_coeff=s["entropy"])
    .rl_module(model_config={"vf_share_layers": True, "conv_activation": "relu",
                             "conv_filters": [[16, 4, 2], [32, 4, 2], [64, 4, 2], [128, 4, 2]],
                             "head_fcnet_hiddens": [256]})
)
algo = config.build_algo()
print(json.dumps({"startup_s": time.time() - start}), flush=True)
while time.time() - start < budget_s:
    r = algo.train()
    steps = r.get("env_runners", {}).get("num_env_steps_sampled_lifetime")
    if steps is None:  # Iterations before the first sample report no env-runner metrics.
        steps = r.get("num_env_steps_sampled_lifetime")
    if steps is not None:
        print(json.dumps({"t": time.time() - start, "steps": steps}), flush=True)
algo.stop()
"""


# --------------------------------------------------------------------------- process-tree memory


def memory_kb(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of one process in KiB; (0, 0) if it exited; PSS is RSS if unreadable."""
    rss = proclib.rss_bytes(pid) // 1024
    if not rss:
        return 0, 0
    try:
        pss = read_smaps_rollup(pid)["Pss"] // 1024
    except OSError:
        pss = rss
    return rss, pss


def cpu_shares(samples: list[tuple[float, dict[int, float]]], root_pid: int, t0: float, t1: float):
    """Cores used by the root process and by its descendants between wall times `t0` and `t1`.

    Args:
      samples: `(wall time, {pid: CPU seconds})` as `TreeMemorySampler` records them.
      root_pid: The driver's pid.
      t0, t1: The window; the first sample at or after `t0` and the last at or before `t1`.

    Returns:
      {"window_s", "driver_cores", "children_cores", "busy_children" (descendants above 5% of
      a core), "total_cores"}, or None without two samples in the window.
    """
    inside = [s for s in samples if t0 <= s[0] <= t1]
    if len(inside) < 2:
        return None
    (a_t, a), (b_t, b) = inside[0], inside[-1]
    dt = b_t - a_t
    used = {pid: (b[pid] - a[pid]) / dt for pid in b if pid in a}
    children = [v for pid, v in used.items() if pid != root_pid]
    return {
        "window_s": dt,
        "driver_cores": used.get(root_pid, 0.0),
        "children_cores": sum(children),
        "busy_children": sum(v > 0.05 for v in children),
        "total_cores": sum(used.values()),
    }


def trained_so_far(result_path: str) -> int | None:
    """`num_env_steps_trained` of the last complete line of a run's result.json; None before
    the first (a line being written, with no newline yet, is not read)."""
    try:
        with open(result_path, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    for line in reversed(text.split("\n")[:-1]):
        if line.strip():
            return int(json.loads(line)["num_env_steps_trained"])
    return None


def core_time(
    samples: list[tuple[float, dict[int, float]]],
    trained: list[tuple[float, int | None]],
    root_pid: int,
) -> dict | None:
    """CPU seconds of the whole process tree per env step trained, between the first and the
    last iteration's result: the window of the trained rate (`throughput`).

    Args:
      samples: `(wall time, {pid: CPU seconds})`, `TreeMemorySampler.cpu_samples`.
      trained: `(wall time, env steps trained so far or None)` taken at the same times,
        `TreeMemorySampler.probe_samples` with `trained_so_far` as the probe.
      root_pid: The driver's pid.

    Returns:
      `cpu_shares` over the window from the first sample that saw a result to the first that
      saw the last one, plus "env_steps_trained" in it and "core_ms_per_step"; None with fewer
      than two results seen. Both counts are read at the same samples, so the window's two
      ends are the same for the CPU seconds and the env steps.
    """
    seen = [(t, n) for t, n in trained if n is not None]
    if not seen:
        return None
    t0, n0 = seen[0]
    t1, n1 = next((t, n) for t, n in seen if n == seen[-1][1])
    if n1 <= n0:
        return None
    shares = cpu_shares(samples, root_pid, t0, t1)
    if shares is None:
        return None
    steps = n1 - n0
    return {
        **shares,
        "env_steps_trained": steps,
        "core_ms_per_step": shares["total_cores"] * shares["window_s"] / steps * 1e3,
    }


class TreeMemorySampler(threading.Thread):
    """Samples the summed RSS and PSS of a process tree every `interval_s`; keeps the peaks.

    Each sample also records every process's CPU seconds (`cpu_samples`, see `cpu_shares`) and,
    with a `probe`, the probe's value at the same time (`probe_samples`, see `core_time`).

    Args:
      root_pid: The tree's root (the driver).
      interval_s: Seconds between samples.
      probe: Called at each sample, e.g. the run's env steps trained so far (`trained_so_far`).
    """

    def __init__(
        self, root_pid: int, interval_s: float = 1.0, probe: Callable[[], object] | None = None
    ):
        super().__init__(daemon=True, name="tree-memory-sampler")
        self.root_pid, self.interval_s, self.probe = root_pid, interval_s, probe
        self.peak_rss_kb = self.peak_pss_kb = self.peak_processes = self.samples = 0
        self.cpu_samples: list[tuple[float, dict[int, float]]] = []
        self.probe_samples: list[tuple[float, object]] = []
        self._done = threading.Event()

    def sample(self) -> tuple[int, int, int]:
        """Takes one sample now; returns (RSS KiB, PSS KiB, processes) and updates the peaks."""
        pids = proclib.process_tree(self.root_pid)
        rss = pss = 0
        cpu: dict[int, float] = {}
        for pid in pids:
            r, p = memory_kb(pid)
            rss, pss = rss + r, pss + p
            seconds = proclib.cpu_seconds(pid)
            if seconds is not None:
                cpu[pid] = seconds
        now = time.perf_counter()
        self.cpu_samples.append((now, cpu))
        if self.probe is not None:
            self.probe_samples.append((now, self.probe()))
        self.peak_rss_kb = max(self.peak_rss_kb, rss)
        self.peak_pss_kb = max(self.peak_pss_kb, pss)
        self.peak_processes = max(self.peak_processes, len(pids))
        self.samples += 1
        return rss, pss, len(pids)

    def run(self) -> None:
        while not self._done.is_set():
            self.sample()
            self._done.wait(self.interval_s)

    def stop(self) -> None:
        self._done.set()
        self.join()


# ------------------------------------------------------------------------ cases (fresh processes)


def _load_config(path: str):
    from impala_tf.config import ImpalaConfig

    config, _ = ImpalaConfig.from_yaml(path)
    config.validate()
    return config


def _spaces(config):
    """The observation and action spaces of the env runners' envs (training, worker 1)."""
    from impala_tf.driver.specs import env_spec
    from impala_tf.envs.make import make_env

    env = make_env(env_spec(config), worker_index=1, vector_index=0)
    spaces = env.observation_space, env.action_space
    env.close()
    return spaces


def _set_tf_threads(threads: int | None) -> None:
    import tensorflow as tf

    if threads:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)


def _step_env_batch(batch, seconds: float) -> tuple[int, float]:
    """Steps `batch` (reset) with uniform random actions for `seconds`; (env steps, seconds)."""
    import numpy as np

    rng = np.random.default_rng(0)
    n = batch.num_envs
    steps, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        batch.step(rng.integers(0, batch.action_space.n, n))
        steps += n
    batch.close()
    return steps, elapsed


def case_env(
    path: str, kind: str, num_envs: int, threads: int, seconds: float, barrier: bool = False
) -> dict:
    """One process stepping `num_envs` envs on the vector-env or the wrapper path.

    With `barrier`, the envs are built and reset, then the process prints "ready" and waits for
    a line on stdin before it starts the clock: the processes of one layout step together, not
    each from the end of its own start-up.
    """
    from impala_tf.driver.specs import env_spec
    from impala_tf.envs import atari
    from impala_tf.envs.atari_vector import AtariVectorEnvBatch
    from impala_tf.envs.batch import GymEnvBatch
    from impala_tf.envs.make import make_env

    spec = env_spec(_load_config(path))
    if kind == "vector":
        kwargs = atari.vector_env_kwargs(spec, training=True, num_envs=num_envs)
        if kwargs is None:
            return {"error": "the config is not covered by AtariVectorEnv"}
        batch = AtariVectorEnvBatch(**{**kwargs, "num_threads": threads})
    else:
        batch = GymEnvBatch([make_env(spec, 1, j) for j in range(num_envs)])
    shape = list(batch.observation_space.shape)
    batch.reset([None] * batch.num_envs)
    if barrier:
        print("ready", flush=True)
        sys.stdin.readline()
    steps, elapsed = _step_env_batch(batch, seconds)
    return {"steps": steps, "seconds": elapsed, "obs_shape": shape}


def _random_time_major(config, obs_space, act_space, rows: int, seed: int = 0) -> dict:
    """Synthetic time-major [T, B, ...] train batch with RLlib's columns; uint8 observations."""
    import numpy as np

    from impala_tf.models import distributions

    rng = np.random.default_rng(seed)
    shape = (int(config.rollout_fragment_length), rows)
    dones = rng.random(shape) < 0.01
    return {
        "obs": rng.integers(0, 256, (*shape, *obs_space.shape), dtype=np.uint8),
        "actions": rng.integers(0, act_space.n, shape).astype(np.int64),
        "rewards": rng.choice(np.array([-1.0, 0.0, 1.0], np.float32), shape),
        "terminateds": dones,
        "truncateds": np.zeros(shape, bool),
        "action_dist_inputs": rng.normal(
            scale=0.5, size=(*shape, distributions.logits_size(act_space))
        ).astype(np.float32),
        "action_logp": np.zeros(shape, np.float32),
        "vf_preds": rng.normal(size=shape).astype(np.float32),
        "values_bootstrapped": np.where(dones, 0.0, rng.normal(size=shape)).astype(np.float32),
    }


def _timed_rounds(steps: dict[str, Callable[[], object]], repeats: int, rounds: int) -> dict:
    """Each step's median seconds over `repeats` calls, in each of `rounds` interleaved rounds."""
    return benchlib.interleaved(
        {
            name: lambda step=step: benchlib.median_seconds(step, repeats=repeats, warmup=2)
            for name, step in steps.items()
        },
        rounds,
    )


def _describe(model) -> str:
    torso = getattr(model, "torso", None)
    name = getattr(torso, "name", type(model).__name__)
    return f"{name} ({model.count_params():,} parameters)"


def case_learner(path: str, repeats: int, rounds: int) -> dict:
    """`ImpalaLearner.train_step` vs a bare Keras update of the same model, all cores.

    Returns their seconds per update in each of `rounds` interleaved rounds (the median of
    `repeats` calls each), as lists "learner_s" and "keras_s".
    """
    import keras
    import numpy as np
    import tensorflow as tf

    from impala_tf.learning.learner import ImpalaLearner
    from impala_tf.models import build_model

    config = _load_config(path)
    obs_space, act_space = _spaces(config)
    horizon = int(config.rollout_fragment_length)
    rows = -(-int(config.train_batch_size) // horizon)
    batch = rows * horizon
    learner = ImpalaLearner(config, obs_space, act_space)
    data = {
        k: tf.constant(v) for k, v in _random_time_major(config, obs_space, act_space, rows).items()
    }

    @tf.function(autograph=False)
    def learner_step(d):
        return learner.train_step(d)["total_loss"]

    model = build_model(obs_space, act_space, config.model, name="bare_keras_model")
    optimizer = keras.optimizers.Adam(learning_rate=float(config.lr), epsilon=1e-8)
    optimizer.build(model.trainable_variables)
    obs = tf.reshape(data["obs"], (batch, *obs_space.shape))
    actions = tf.reshape(data["actions"], (batch,))
    targets = tf.reshape(data["vf_preds"], (batch,))

    keras_step = benchlib.bare_keras_step(
        model, optimizer, obs, actions, targets, float(config.grad_clip or 40.0)
    )

    seconds = _timed_rounds(
        {
            "learner": lambda: np.asarray(learner_step(data)),
            "keras": keras_step,
        },
        repeats,
        rounds,
    )
    return {
        "batch": batch,
        "model": _describe(learner.model),
        "obs_shape": list(obs_space.shape),
        "learner_s": seconds["learner"],
        "keras_s": seconds["keras"],
    }


def case_inference(path: str, batch: int, threads: int | None, repeats: int, rounds: int) -> dict:
    """`ActorPolicy.step` on a [batch, H, W, C] uint8 observation, `threads` TF threads.

    Returns its seconds per call in each of `rounds` rounds (the median of `repeats` calls each)
    as the list "seconds".
    """
    import numpy as np

    _set_tf_threads(threads)
    from impala_tf.acting.tf_policy import ActorPolicy

    config = _load_config(path)
    obs_space, act_space = _spaces(config)
    policy = ActorPolicy(obs_space, act_space, config.model, seed=0)
    obs = np.random.default_rng(0).integers(0, 256, (batch, *obs_space.shape), dtype=np.uint8)
    seconds = _timed_rounds({"step": lambda: policy.step(obs)}, repeats, rounds)["step"]
    return {"batch": batch, "threads": threads, "seconds": seconds}


def _run_case(name: str, payload: dict, timeout: float = 1800) -> dict:
    args = [sys.executable, "-m", "tools.bench_atari", "--case"]
    args.append(json.dumps({"name": name, **payload}))
    out = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"case {name} {payload} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _run_parallel(name: str, payloads: list[dict]) -> list[dict]:
    """Runs cases at the same time, one process each (for the all-cores env rates).

    Each case gets `barrier: True`: it prints "ready" when set up and starts timing when every
    process is ready, so the processes' timed windows coincide.
    """
    procs = []
    for payload in payloads:
        args = [sys.executable, "-m", "tools.bench_atari", "--case"]
        args.append(json.dumps({"name": name, **payload, "barrier": True}))
        procs.append(
            subprocess.Popen(
                args,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=ROOT,
            )
        )
    # Up to "ready" (after which a case prints nothing until it is let go, so `communicate`
    # loses nothing read ahead here); a case that returned early (an error) printed its result.
    early = {i: "" for i in range(len(procs))}
    for i, proc in enumerate(procs):
        for line in iter(proc.stdout.readline, ""):
            if line.strip() == "ready":
                break
            early[i] += line
    for proc in procs:
        try:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        except BrokenPipeError:  # It exited (an error); its output says why.
            pass
    results = []
    for i, proc in enumerate(procs):
        stdout, stderr = proc.communicate(timeout=1800)
        stdout = early[i] + stdout
        if proc.returncode != 0:
            raise RuntimeError(f"case {name} failed:\n{stderr[-3000:]}")
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    return results


# ------------------------------------------------------------------------------------- the parts


def env_layouts(config, cores: int) -> list[tuple[str, str, list[tuple[int, int]]]]:
    """Part (a)'s layouts: (label, "vector" or "wrapper", [(envs, threads)] one per process)."""
    from impala_tf.driver.specs import env_spec
    from impala_tf.envs import atari

    runners = max(1, int(config.num_env_runners))
    per_runner = int(config.num_envs_per_env_runner)
    total = runners * per_runner
    runner_threads = (
        atari.vector_env_kwargs(env_spec(config), training=True, num_envs=per_runner) or {}
    ).get("num_threads", 1)
    return [
        ("AtariVectorEnv, 1 process", "vector", [(total, cores)]),
        (
            f"AtariVectorEnv, {runners} processes (as the env runners)",
            "vector",
            [(per_runner, runner_threads)] * runners,
        ),
        (
            f"wrapper (DeepMindPreprocessing), {cores} processes",
            "wrapper",
            [(n, 1) for n in _split(total, cores)],
        ),
    ]


def bench_env(
    path: str,
    config,
    seconds: float,
    cores: int,
    rounds: int,
    run: Callable[[str, list[dict]], list[dict]] | None = None,
) -> list[dict]:
    """Part (a): each layout for `seconds`, in turn, for `rounds` rounds (`benchlib.interleaved`).

    Args:
      path: The config's YAML, `config` loaded from it.
      seconds: Each layout's stepping time per round.
      cores: The machine's cores (layouts use them all).
      rounds: Rounds; each runs every layout once.
      run: Runs one layout's `case_env` payloads at the same time and returns their results;
        by default one process each, started together.

    Returns:
      One row per layout: "label", and "error", or "envs", "threads", "obs_shape" and
      "steps_per_s" (a list, one rate per round: the sum of its processes' rates).
    """
    run = run or _run_parallel
    from impala_tf.driver.specs import env_spec
    from impala_tf.envs import atari

    covered = atari.vector_env_kwargs(env_spec(config), training=True, num_envs=1) is not None
    rows, measures = [], {}
    for label, kind, split in env_layouts(config, cores):
        if kind == "vector" and not covered:
            rows.append({"label": label, "error": "the config is not covered by AtariVectorEnv"})
            continue
        payloads = [
            {"path": path, "kind": kind, "num_envs": n, "threads": t, "seconds": seconds}
            for n, t in split
        ]
        row = {
            "label": label,
            "envs": sum(n for n, _ in split),
            "threads": sum(t for _, t in split),
        }
        rows.append(row)

        def measure(row=row, payloads=payloads) -> float:
            results = run("env", payloads)
            if any("error" in r for r in results):
                raise RuntimeError(f"env layout {row['label']}: {results[0]['error']}")
            row["obs_shape"] = results[0]["obs_shape"]
            rate = sum(r["steps"] / r["seconds"] for r in results)
            print(json.dumps({"env": row["label"], "steps_per_s": rate}), flush=True)
            return rate

        measures[label] = measure
    rates = benchlib.interleaved(measures, rounds)
    for row in rows:
        if row["label"] in rates:
            row["steps_per_s"] = rates[row["label"]]
    return rows


def _split(total: int, parts: int) -> list[int]:
    parts = max(1, min(parts, total))
    return [total // parts + (i < total % parts) for i in range(parts)]


def run_train(path: str, seconds: float, profile: bool, top: int, backend: str = "local") -> dict:
    """Runs impala-train on `backend` for `seconds` of training, sampling the tree's memory."""
    logdir = tempfile.mkdtemp(prefix=f"bench-atari-{backend}-")
    prof = os.path.join(logdir, "driver.prof")
    cmd = [sys.executable]
    if profile:
        cmd += ["-m", "cProfile", "-o", prof]
    cmd += [
        "-m",
        "impala_tf.bin.train",
        f"--config={path}",
        f"--logdir={logdir}",
        f"--stop_time_s={seconds}",
        "--checkpoint_freq=0",
        f"--set=actor_backend={backend}",
    ]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
    log_path = os.path.join(logdir, "stdout.txt")
    start = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        result_path = os.path.join(logdir, "result.json")
        sampler = TreeMemorySampler(proc.pid, probe=lambda: trained_so_far(result_path))
        sampler.start()
        try:
            proc.wait(timeout=seconds + 900)
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(60)
            sampler.stop()
    wall = time.perf_counter() - start
    # The trained rate's window: start-up (imports, tracing, the first iteration) and shutdown
    # left out, and the CPU seconds divided by the env steps trained in the same window.
    cpu = core_time(sampler.cpu_samples, sampler.probe_samples, proc.pid)
    if proc.returncode != 0:
        with open(log_path, encoding="utf-8") as f:
            raise RuntimeError(f"impala-train exited {proc.returncode}:\n{f.read()[-3000:]}")
    with open(result_path, encoding="utf-8") as f:
        results = [json.loads(line) for line in f if line.strip()]
    out = {
        "logdir": logdir,
        "wall_s": wall,
        "iterations": len(results),
        "peak_rss_mb": sampler.peak_rss_kb / 1024,
        "peak_pss_mb": sampler.peak_pss_kb / 1024,
        "peak_processes": sampler.peak_processes,
        "cpu": cpu,
        **throughput(results),
    }
    if profile:
        out["profile"] = profile_top(prof, top)
    return out


def _with_key(path: str, key: str, value) -> str:
    """A copy of the tuned-example YAML at `path` with `config.<key>` set; returns its path."""
    import yaml

    with open(path, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    (spec,) = doc.values()
    spec.setdefault("config", {})[key] = value
    fd, out = tempfile.mkstemp(prefix="bench-atari-", suffix=".yaml")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        yaml.safe_dump(doc, f)
    return out


def compare_inference(path: str, seconds: float, rounds: int) -> str:
    """impala-train with per-actor and central inference, alternately; markdown of the medians."""
    load_before = os.getloadavg()
    modes = ("actor", "central")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            out = run_train(_with_key(path, "inference", mode), seconds, False, 0)
            print(json.dumps({mode: {k: out[k] for k in ("trained_per_s", "sampled_per_s")}}))
            runs[mode].append(out)
    load_after = os.getloadavg()
    med = {
        m: {
            k: statistics.median(x[k] for x in runs[m])
            for k in ("trained_per_s", "sampled_per_s", "peak_pss_mb")
        }
        for m in modes
    }
    cores = os.cpu_count() or 1
    name = os.path.relpath(path, ROOT)
    lines = [
        f"## Atari: per-actor vs central inference, `{name}`",
        "",
        f"Machine: {benchlib.machine_line()}. Load average (1 min) {load_before[0]:.1f} before, "
        f"{load_after[0]:.1f} after, on {cores} cores. {rounds} alternating rounds of "
        f"{seconds:.0f} s of training per mode; medians.",
        "",
        "| inference | env steps/s trained | env steps/s sampled | peak PSS (MiB) |",
        "|---|---:|---:|---:|",
    ]
    for m in modes:
        lines.append(
            f"| {m} | {med[m]['trained_per_s']:,.0f} | {med[m]['sampled_per_s']:,.0f} | "
            f"{med[m]['peak_pss_mb']:,.0f} |"
        )
    ratio = med["central"]["trained_per_s"] / max(med["actor"]["trained_per_s"], 1e-9)
    lines += ["", f"Central / per-actor, env steps/s trained: **{ratio:.2f}x**."]
    if benchlib.other_jobs_running(load_before):
        lines += ["", "**Measured under load (other jobs running): the ratio is indicative.**"]
    return "\n".join(lines)


def throughput(results: list[dict]) -> dict:
    """Env steps/s sampled and trained between the first and the last result (start-up excluded).

    With a single result the rates since the start of training are used instead.
    """
    if not results:
        raise RuntimeError("impala-train wrote no results")
    first, last = results[0], results[-1]
    if len(results) < 2:
        first = {"time_total_s": 0.0, "timesteps_total": 0, "num_env_steps_trained": 0}
    dt = max(float(last["time_total_s"]) - float(first["time_total_s"]), 1e-9)
    return {
        "measured_s": dt,
        "sampled_per_s": (last["timesteps_total"] - first["timesteps_total"]) / dt,
        "trained_per_s": (last["num_env_steps_trained"] - first["num_env_steps_trained"]) / dt,
        "episode_reward_mean": last.get("episode_reward_mean"),
    }


def profile_top(prof_path: str, top: int) -> str:
    """The top `top` functions of a cProfile dump, by own time and by cumulative time."""
    import io
    import pstats

    stream = io.StringIO()
    stats = pstats.Stats(prof_path, stream=stream).strip_dirs()
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return stream.getvalue()


def run_rllib(python: str, config, seconds: float) -> dict:
    """RLlib IMPALA (torch, new API stack) on Pong with the YAML's settings, for `seconds`."""
    settings = {
        "dim": int(config.model.get("dim", 84)),
        **benchlib.rllib_training_settings(config),
    }
    proc = subprocess.run(
        [python, "-c", RLLIB_SCRIPT, json.dumps(settings), str(seconds)],
        capture_output=True,
        text=True,
        timeout=seconds + 900,
    )
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    iters = [r for r in rows if "steps" in r]
    if len(iters) < 2 or iters[-1]["steps"] <= iters[0]["steps"]:
        # E.g. its env runners die at start (a package missing in the side virtualenv).
        tail = proc.stderr[-3000:]
        raise RuntimeError(f"RLlib run failed, too short or sampled nothing:\n{tail}")
    first, last = iters[0], iters[-1]
    return {
        "settings": settings,
        "iterations": len(iters),
        "sampled_per_s": (last["steps"] - first["steps"]) / max(last["t"] - first["t"], 1e-9),
    }


# ------------------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--train_time", type=float, default=180.0, help="seconds of training")
    parser.add_argument(
        "--env_time", type=float, default=10.0, help="seconds per env layout per bound round"
    )
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per round")
    parser.add_argument(
        "--bound_rounds",
        type=int,
        default=3,
        help="interleaved rounds of the env, learner and inference bounds (median and range)",
    )
    parser.add_argument("--inference_batch", type=int, default=256, help="central server batch")
    parser.add_argument("--profile", action="store_true", help="cProfile the driver")
    parser.add_argument("--profile_top", type=int, default=25)
    parser.add_argument("--rllib-python", default=None)
    parser.add_argument(
        "--backend",
        choices=(*BACKENDS, "both"),
        default="local",
        help="actor pool(s); ray or both run only the training part, side by side",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="training runs per backend (or inference mode)"
    )
    parser.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    parser.add_argument("--compare_inference", type=float, default=None, metavar="SECONDS")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.compare_inference:
        text = compare_inference(os.path.abspath(args.config), args.compare_inference, args.rounds)
        print(text)
        if not args.no_write:
            benchlib.write_section("bench_atari_inference", text)
        return
    if args.case:
        case = json.loads(args.case)
        name = case.pop("name")
        fn = {"env": case_env, "learner": case_learner, "inference": case_inference}[name]
        print(json.dumps(fn(**case)), flush=True)
        return

    path = os.path.abspath(args.config)
    if args.backend != "local":
        backend_comparison(args, path)
        return
    config = _load_config(path)
    cores = os.cpu_count() or 1
    load_before = os.getloadavg()
    t0 = time.perf_counter()

    rounds = args.bound_rounds
    env_rows = bench_env(path, config, args.env_time, cores, rounds)
    learner = _run_case("learner", {"path": path, "repeats": args.repeats, "rounds": rounds})
    print(json.dumps({"learner": learner}), flush=True)
    per_actor = int(config.num_envs_per_env_runner)
    inference = [
        _run_case(
            "inference",
            {"path": path, "batch": per_actor, "threads": 1, "repeats": 30, "rounds": rounds},
        ),
        _run_case(
            "inference",
            {
                "path": path,
                "batch": args.inference_batch,
                "threads": None,
                "repeats": args.repeats,
                "rounds": rounds,
            },
        ),
    ]
    print(json.dumps({"inference": inference}), flush=True)
    train = run_train(path, args.train_time, args.profile, args.profile_top)
    print(json.dumps({"train": {k: v for k, v in train.items() if k != "profile"}}), flush=True)
    rllib = None
    if args.rllib_python:
        rllib = run_rllib(args.rllib_python, config, args.train_time)
        print(json.dumps({"rllib": rllib}), flush=True)
    load_after = os.getloadavg()

    text = report(
        args, config, cores, env_rows, learner, inference, train, rllib, load_before, load_after
    )
    text += f"\n\nWhole benchmark: {time.perf_counter() - t0:.0f} s."
    if train.get("profile"):
        text += (
            "\n\n### Profile of the driver (cProfile, main thread only: not the learner thread "
            "or the actors)\n\n```\n" + train["profile"].strip() + "\n```"
        )
    print(text)
    if not args.no_write:
        benchlib.write_section("bench_atari", text)


def backend_comparison(args: argparse.Namespace, path: str) -> None:
    """Part (d) on the chosen backend(s), alternating, with the Ray/local ratio of env steps/s."""
    backends = BACKENDS if args.backend == "both" else (args.backend,)
    cores = os.cpu_count() or 1
    load_before = os.getloadavg()
    runs = []
    for i in range(args.rounds):
        for backend in backends if i % 2 == 0 else tuple(reversed(backends)):
            train = run_train(path, args.train_time, False, 0, backend)
            train["backend"] = backend
            runs.append(train)
            print(json.dumps({"train": train}), flush=True)
    load_after = os.getloadavg()
    name = os.path.relpath(path, ROOT)
    lines = [
        f"## Atari: Ray pool vs local pool, Pong with `{name}`",
        "",
        f"`python -m tools.bench_atari --backend={args.backend} --rounds={args.rounds} "
        f"--train_time={args.train_time:g}` ({benchlib.machine_line()}). Load average (1 min) "
        f"{load_before[0]:.1f} before, {load_after[0]:.1f} after, on {cores} cores. Rates "
        "between the first and the last iteration (start-up and the first iteration excluded).",
        "",
        "| round | backend | iterations | measured s | env steps/s sampled | trained | "
        "peak PSS MB |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for i, r in enumerate(runs):
        lines.append(
            f"| {i // len(backends)} | {r['backend']} | {r['iterations']} | "
            f"{r['measured_s']:.0f} | {r['sampled_per_s']:,.0f} | {r['trained_per_s']:,.0f} | "
            f"{r['peak_pss_mb']:,.0f} |"
        )
    lines += benchlib.backend_ratio_lines(
        runs, "sampled_per_s", "env steps/s sampled", TARGET_RAY_RATIO
    )
    if benchlib.other_jobs_running(load_before):
        lines += [
            "",
            "**Measured under load (other jobs running): these figures are not clean; re-run on "
            "an idle machine before quoting them.**",
        ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        benchlib.write_section("bench_atari_backends", text)


def _cpu_lines(cpu: dict | None, cores: int) -> list[str]:
    """Where the run's CPU went: cores used by the driver and by its child processes."""
    if not cpu:
        return []
    return [
        f"CPU between the first and the last iteration's result ({cpu['window_s']:.0f} s, "
        f"{cpu['env_steps_trained']:,} env steps trained; from /proc every second): driver "
        f"(learner thread, loader, driver loop) {cpu['driver_cores']:.2f} cores, "
        f"{cpu['busy_children']} busy child processes (actors: env stepping and inference) "
        f"{cpu['children_cores']:.2f} cores, total {cpu['total_cores']:.2f} of {cores}: "
        f"**{cpu['core_ms_per_step']:.3f} ms of core time per env step trained** (the CPU "
        "seconds of the whole process tree / the env steps trained in that window).",
    ]


def bounds(env_rows: list[dict], learner: dict) -> dict[str, benchlib.Spread]:
    """The env rate, the learner bound and the ceiling min(env, learner), each with its range.

    The env rate is the best of the (a) rows: the max of their medians, with the max of their
    lows and the max of their highs as its range. The ceiling is the min of that and the
    learner bound, the same way. Max and min keep the order of their arguments, so the rows'
    lows give the ceiling's low end and their highs its high end.

    Args:
      env_rows: `bench_env`'s rows; "steps_per_s" holds one rate per round (rows with an
        "error" are left out).
      learner: `case_learner`'s result: "batch" and "learner_s" (seconds per update, one per
        round).

    Returns:
      {"env", "learner", "ceiling"}: `benchlib.Spread`s of env steps/s (samples/s for the
      learner; one sample is one env step).
    """
    rows = [benchlib.spread(r["steps_per_s"]) for r in env_rows if "steps_per_s" in r]
    nan = float("nan")
    env = benchlib.Spread(*(max(column) for column in zip(*rows))) if rows else None
    env = env or benchlib.Spread(nan, nan, nan)
    rate = benchlib.spread([learner["batch"] / s for s in learner["learner_s"]])
    ceiling = benchlib.Spread(*(min(e, r) for e, r in zip(env, rate)))
    return {"env": env, "learner": rate, "ceiling": ceiling}


def ratio_to(value: float, ceiling: benchlib.Spread) -> benchlib.Spread:
    """`value / ceiling` with its range: the ceiling's high end gives the low ratio."""
    return benchlib.Spread(value / ceiling.median, value / ceiling.high, value / ceiling.low)


def _verdict(ratio: benchlib.Spread, target: float) -> str:
    """Whether `ratio` meets a `>= target`, judged at the median, and whether its range crosses."""
    met = "met" if ratio.median >= target else "not met"
    if ratio.low < target <= ratio.high:
        met += ", the range crosses it"
    return met


def report(
    args, config, cores, env_rows, learner, inference, train, rllib, load_before, load_after
) -> str:
    name = os.path.relpath(os.path.abspath(args.config), ROOT)
    loaded = benchlib.other_jobs_running(load_before)
    rounds = args.bound_rounds
    env_ok = [r for r in env_rows if "steps_per_s" in r]
    bound = bounds(env_rows, learner)
    trained = train["trained_per_s"]
    lines = [
        f"## Atari: Pong with `{name}`",
        "",
        f"`python -m tools.bench_atari --train_time={args.train_time:g} "
        f"--env_time={args.env_time:g} --bound_rounds={rounds} --repeats={args.repeats}`. "
        f"Machine: {benchlib.machine_line()}. Load average (1 min) {load_before[0]:.1f} before, "
        f"{load_after[0]:.1f} after, on {cores} cores.",
    ]
    if loaded:
        lines += [
            "",
            "**Measured under load (other jobs running): these figures are not clean; re-run on "
            "an idle machine before quoting them.**",
        ]
    lines += [
        "",
        "Bound rows (a-c): the median over the rounds and the range, min-max (too few rounds "
        "for quartiles).",
        "",
        f"### (a) Preprocessed env, random actions ({config.env}, obs "
        f"{env_ok[0]['obs_shape'] if env_ok else '?'} uint8, action repeat {FRAME_SKIP})",
        "",
        f"{rounds} rounds, each running every layout in turn for {args.env_time:g} s (a "
        "layout's processes start stepping together).",
        "",
        "| path | envs | threads | env steps/s | min-max | frames/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in env_rows:
        if "error" in r:
            lines.append(f"| {r['label']} | - | - | {r['error']} | - | - |")
        else:
            rate = benchlib.spread(r["steps_per_s"])
            lines.append(
                f"| {r['label']} | {r['envs']} | {r['threads']} | {rate.median:,.0f} | "
                f"{rate.range_text()} | {rate.median * FRAME_SKIP:,.0f} |"
            )
    batch = learner["batch"]
    keras_rate = benchlib.spread([batch / s for s in learner["keras_s"]])
    vs_keras = benchlib.spread([a / b for a, b in zip(learner["learner_s"], learner["keras_s"])])
    lines += [
        "",
        f"### (b) Learner bound: {learner['model']}, batch {batch}, all cores",
        "",
        f"{rounds} rounds, each timing both updates in turn ({args.repeats} calls each, their "
        "median); vs Keras is the time ratio within a round.",
        "",
        "| update | ms / update | samples/s | min-max | vs Keras |",
        "|---|---:|---:|---:|---:|",
        "| `ImpalaLearner.train_step` (V-trace, optimizer, clip) | "
        f"{statistics.median(learner['learner_s']) * 1e3:.1f} | {bound['learner'].median:,.0f} | "
        f"{bound['learner'].range_text()} | {vs_keras.median:.2f}x "
        f"({vs_keras.range_text('.2f')}) |",
        "| bare Keras, same model: forward + backward + Adam | "
        f"{statistics.median(learner['keras_s']) * 1e3:.1f} | {keras_rate.median:,.0f} | "
        f"{keras_rate.range_text()} | 1.00x |",
        "",
        "### (c) Inference bound: `ActorPolicy.step` (forward + sampling), uint8 observations",
        "",
        f"{rounds} rounds each; each row runs in its own process (its TF thread count is fixed "
        "at start-up), so the two rows are not interleaved.",
        "",
        "| batch | TF threads | ms / call | samples/s | min-max |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in inference:
        rate = benchlib.spread([r["batch"] / s for s in r["seconds"]])
        lines.append(
            f"| {r['batch']} | {r['threads'] or f'all ({cores})'} | "
            f"{statistics.median(r['seconds']) * 1e3:.2f} | {rate.median:,.0f} | "
            f"{rate.range_text()} |"
        )
    cpu = train.get("cpu")
    lines += [
        "",
        f"### (d, e) impala-train, {args.train_time:g} s of training (one run)",
        "",
        f"Env steps/s sampled **{train['sampled_per_s']:,.0f}**, trained "
        f"**{trained:,.0f}** (frames/s trained {trained * FRAME_SKIP:,.0f}), between the first "
        f"and the last of {train['iterations']} iterations ({train['measured_s']:.0f} s; "
        f"start-up and the first iteration excluded); process wall time {train['wall_s']:.0f} s; "
        f"last episode_reward_mean {train['episode_reward_mean']}.",
        f"Peak memory of the run's process tree ({train['peak_processes']} processes at most, "
        f"sampled every second): RSS summed {train['peak_rss_mb']:,.0f} MB, PSS summed "
        f"{train['peak_pss_mb']:,.0f} MB.",
        *_cpu_lines(cpu, cores),
        "",
        "### Ratios",
        "",
    ]
    env, rate, ceiling = bound["env"], bound["learner"], bound["ceiling"]
    ratio = ratio_to(trained, ceiling)
    lines += [
        f"- Ceiling min(best env row {env.text()}, learner {rate.text()}) = "
        f"**{ceiling.median:,.0f}** (range {ceiling.range_text()}, from the rows' min and max).",
        f"- trained / ceiling = **{ratio.median:.2f}**, range {ratio.range_text('.2f')} (one "
        f"training run over the ceiling's range; target >= {TARGET_RATIO:.2f}: "
        f"{_verdict(ratio, TARGET_RATIO)}).",
    ]
    if cpu:
        per_step = cpu["core_ms_per_step"]
        lines.append(
            f"- Core time per env step trained: **{per_step:.3f} ms** (target <= "
            f"{TARGET_CORE_MS:.2f}: {'met' if per_step <= TARGET_CORE_MS else 'not met'})."
        )
    if rllib is not None:
        lines.append(
            f"- (f) RLlib 2.60 IMPALA (torch, new API stack, same runners/envs/fragment/batch/"
            f"losses, its 4-layer CNN, ALE/Pong-v5 frameskip 1) in this run: "
            f"{rllib['sampled_per_s']:,.0f} env steps/s sampled; impala_tf trained / RLlib "
            f"sampled = **{trained / rllib['sampled_per_s']:.1f}x** (target >= 5x)."
        )
    else:
        lines.append(
            "- (f) RLlib did not run (no `--rllib-python`), so no ratio against RLlib: run "
            "`python -m tools.bench_atari --rllib-python PATH` for one from the same invocation."
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
