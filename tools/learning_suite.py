"""The learning suite: the shipped tuned examples, several seeds each, against their pass criteria.

    .venv/bin/python -m tools.learning_suite                    # every config, seeds 100 101 102
    .venv/bin/python -m tools.learning_suite --quick            # the vector-env configs only
    .venv/bin/python -m tools.learning_suite --configs cartpole-impala --seeds 100 101 102
    .venv/bin/python -m tools.learning_suite --report           # tables and figure, no runs

Run from the repository root.

Which configs: every YAML in `configs/` with a `pass_criteria` block (the block of RLlib's
release tests; `impala_tf.config.keys.normalize_pass_criteria` says what it means). Those are
the tuned examples we ship: the CartPole family (plain, replay, separate losses, fake GPUs,
multi-agent, stateless with an LSTM), APPO on CartPole and Pong (`cartpole-appo.yaml`,
`pong-appo-small.yaml`), Pendulum, Pong (`pong-impala-small.yaml`) and Breakout
(`atari-impala.yaml`, scaled to 2 cores by `SUITE_SETS`, which also has RLlib's multi-agent
CartPole report every second instead of every 10). `pong-impala.yaml` and
`pong-impala-fast.yaml` (and `pong-appo.yaml`) are RLlib's files for 32 to 128 workers and a
GPU, copied for RLlib users; they carry no criterion and the suite does not run them. `--quick`
leaves out the Atari configs (30-40 minutes a run on 2 cores).

Seeds: 100, 101 and 102 by default. The configs were tuned on seeds 0, 1 and 2, so those would
flatter them.

Each run is a real `impala-train` (`python -m impala_tf.bin.train --config=... --seed=N`),
started as a job manager starts one: in its own session, output to a log file. One run at a
time. The suite reads `<logdir>/result.json` as it grows (one flushed line per iteration) and
ends the run (SIGINT: the binary saves a checkpoint and stops its actors) once every criterion
is decided: met, or past one of its limits. The binary also gets `--stop_reward` (the highest
threshold) and each limit that every criterion sets, so it usually stops by itself. A run with
no new result for `--stall-s` seconds is ended and recorded as stalled. Peak memory is the
summed RSS (and PSS) of the run's process tree, sampled every second; RSS counts shared pages
once per process, PSS splits them.

Results: `<results-dir>/<config>/seed-<N>/` holds the run's logdir, its log (`train.log`) and
`run.json`, written when the run ends: the criteria and their outcomes, the best return, peak
memory, the machine (CPU model, cores, memory, GPU, TensorFlow version, commit), the cores
other processes kept busy meanwhile (the machine may be shared), and the curve (per iteration:
env steps, training time, wall time since the process started, mean return, and per policy the
entropy, explained variance, losses, unclipped gradient norm and learning rate). A rerun of the
same command skips every run with a `run.json` and restarts from scratch any run without one
(an interrupted run: its times would not be comparable if it were resumed from a checkpoint);
`--rerun` runs the chosen ones again.

The report covers every finished run in the results dir: a summary per config, a table per
config, seed and criterion (met or not, env steps, training time and wall time to the threshold,
best return, peak memory, other processes' cores, commit), and the machines. It is printed and
written to `<results-dir>/learning-suite.md`, and, unless `--no-write`, to the section
"learning_suite" of BENCHMARKS.md and of docs/learning-results.md. The curves go to one figure,
`<results-dir>/learning-suite.png`, one panel per config (matplotlib, the `tools` extra; without
it the tool says so and writes the tables only); `--figure docs/learning-suite.png` puts it where
docs/learning-results.md shows it. Exit status: 0 when every finished run met its criteria, 1
when one did not, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from tools import benchlib, proclib

__all__ = [
    "DEFAULT_SEEDS",
    "SUITE_SETS",
    "SuiteConfig",
    "curve_point",
    "describe_criterion",
    "evaluate",
    "load_records",
    "machine_info",
    "main",
    "plan_runs",
    "plot_suite",
    "read_new_results",
    "report_markdown",
    "run_one",
    "stop_flags",
    "suite_configs",
]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS_DIR = os.path.join(ROOT, "configs")
RESULTS_DIR = os.path.join(ROOT, "runs", "learning-suite")
LEARNING_RESULTS_MD = os.path.join(ROOT, "docs", "learning-results.md")
SECTION = "learning_suite"

#: Seeds the configs were not tuned on (they were tuned on 0, 1 and 2).
DEFAULT_SEEDS = (100, 101, 102)

#: `--set` overrides the suite adds to a config, and why.
SUITE_SETS: dict[str, tuple[str, ...]] = {
    # Fit onto the 2-core machine: RLlib's `atari-impala.yaml` asks for 32 workers x 5 envs;
    # BENCHMARKS.md's Breakout run used these.
    "atari-impala": (
        "num_env_runners=2",
        "num_envs_per_env_runner=16",
        "min_time_s_per_iteration=10",
    ),
    # Report often enough to judge the criterion: RLlib's 10 s iterations are ~110k env steps
    # each on 2 cores against a limit of 200k, so a run's outcome depended on where they ended
    # (seed 100 on 2026-11-28: 477 at 98,000 env steps, then 881 at 232,500: missed). Iterations
    # of 1 s (~11k env steps) change how often results are judged, not what is trained.
    "multi-agent-cartpole-impala": ("min_time_s_per_iteration=1",),
}

RUN_FILE = "run.json"
STARTED_FILE = "started.json"
LOG_FILE = "train.log"
LOGDIR = "logdir"

#: Seconds the binary gets to save its checkpoint and stop its actors after SIGINT.
_STOP_GRACE_S = 120.0
#: Seconds between progress lines of a run.
_PROGRESS_S = 30.0
#: The learner statistics kept per iteration and policy in `run.json`.
_LEARNER_STATS = (
    "entropy",
    "vf_explained_var",
    "policy_loss",
    "vf_loss",
    "grad_gnorm_unclipped",
    "cur_lr",
)
_LIMIT_WORDS = {
    "timesteps_total": "env steps",
    "time_total_s": "of training",
    "training_iteration": "iterations",
}


# ------------------------------------------------------------------------------ the suite


@dataclasses.dataclass(frozen=True)
class SuiteConfig:
    """One config of the suite.

    Attributes:
      name: The file's name without `.yaml` (`cartpole-impala`).
      path: The YAML file.
      criteria: Its `pass_criteria`, canonical keys (`normalize_pass_criteria`).
      atari: Whether its env is an Atari game (left out by `--quick`).
      sets: `--set KEY=VALUE` overrides the suite adds (`SUITE_SETS`).
    """

    name: str
    path: str
    criteria: tuple[dict[str, float], ...]
    atari: bool
    sets: tuple[str, ...] = ()


def suite_configs(configs_dir: str = CONFIGS_DIR) -> list[SuiteConfig]:
    """Every YAML in `configs_dir` with a `pass_criteria` block, the vector-env ones first.

    Raises:
      ValueError: for a YAML that does not read (the message names the file).
    """
    import warnings

    from impala_tf.config.base import AlgorithmConfig
    from impala_tf.config.experiments import read_search_file, search_space_paths
    from impala_tf.envs.atari import is_atari

    found = []
    for file in sorted(os.listdir(configs_dir)):
        if not file.endswith((".yaml", ".yml")):
            continue
        path = os.path.join(configs_dir, file)
        search = read_search_file(path)
        if search.scheduler is not None or search_space_paths(search.settings):
            continue  # A Tune search (many trials), not one config the suite can run.
        with warnings.catch_warnings():  # RLlib's old key names warn; the runs will say so.
            warnings.simplefilter("ignore")
            experiment = AlgorithmConfig.read_experiment(path)
        if not experiment.pass_criteria:
            continue
        name = os.path.splitext(file)[0]
        config = experiment.config
        env = config.env if isinstance(config.env, str) else ""
        found.append(
            SuiteConfig(
                name=name,
                path=path,
                criteria=tuple(experiment.pass_criteria),
                atari=bool(env) and is_atari(env, config.env_config),
                sets=SUITE_SETS.get(name, ()),
            )
        )
    return sorted(found, key=lambda c: (c.atari, c.name))


def describe_criterion(criterion: Mapping[str, float]) -> str:
    """`450 within 2M env steps`, `0 within 20 min of training`, ... for one criterion."""
    limits = []
    for key, word in _LIMIT_WORDS.items():
        if key not in criterion:
            continue
        value = criterion[key]
        if key == "time_total_s":
            limits.append(f"{_duration(value)} {word}")
        else:
            limits.append(f"{_count(value)} {word}")
    return f"{criterion['episode_reward_mean']:g} within {' and '.join(limits)}"


def stop_flags(criteria: Sequence[Mapping[str, float]]) -> list[str]:
    """impala-train's `--stop_*` flags for a run judged by `criteria`.

    The highest threshold (every lower one was reached on the way); a limit only when every
    criterion sets it (the largest of them), so that the binary never stops before a criterion
    is decided. The suite ends the run itself once all are decided.
    """
    flags = [f"--stop_reward={max(c['episode_reward_mean'] for c in criteria):g}"]
    for key, flag, kind in (
        ("timesteps_total", "--stop_timesteps", int),
        ("time_total_s", "--stop_time_s", float),
        ("training_iteration", "--stop_iters", int),
    ):
        if criteria and all(key in c for c in criteria):
            flags.append(f"{flag}={kind(max(c[key] for c in criteria))}")
    return flags


def train_command(
    config: SuiteConfig, seed: int, logdir: str, python: str = sys.executable
) -> list[str]:
    """The impala-train command line of one run."""
    return [
        python,
        "-m",
        "impala_tf.bin.train",
        f"--config={config.path}",
        f"--seed={seed}",
        f"--logdir={logdir}",
        "--checkpoint_freq=0",
        *stop_flags(config.criteria),
        *(f"--set={s}" for s in config.sets),
    ]


def run_dir(results_dir: str, config_name: str, seed: int) -> str:
    """`<results_dir>/<config>/seed-<N>`: one run's directory."""
    return os.path.join(results_dir, config_name, f"seed-{seed}")


def plan_runs(
    configs: Sequence[SuiteConfig], seeds: Sequence[int], results_dir: str, rerun: bool = False
) -> list[tuple[SuiteConfig, int, str]]:
    """The runs still to do, in suite order: (config, seed, "new" | "restart" | "rerun").

    A run with a `run.json` is finished and left out (unless `rerun`); one with a
    `started.json` and no `run.json` was interrupted and is restarted from scratch.
    """
    todo = []
    for config in configs:
        for seed in seeds:
            directory = run_dir(results_dir, config.name, seed)
            if os.path.isfile(os.path.join(directory, RUN_FILE)):
                if rerun:
                    todo.append((config, seed, "rerun"))
            elif os.path.exists(directory):
                todo.append((config, seed, "restart"))
            else:
                todo.append((config, seed, "new"))
    return todo


# ------------------------------------------------------------------------------ results


def _finite(value: Any) -> float | None:
    if value is None:
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def curve_point(result: Mapping[str, Any]) -> dict[str, Any]:
    """The part of one result dict the suite keeps: one point of a curve.

    Returns:
      {"iter", "steps" (timesteps_total), "time_s" (time_total_s, seconds of training),
      "wall_s" (time_since_start_s, seconds since the process started; None without it),
      "return" (episode_reward_mean; None before the first episode), "learner": {policy id:
      {stat: value}} for the statistics in `_LEARNER_STATS`}.
    """
    learner = {}
    for policy_id, info in ((result.get("info") or {}).get("learner") or {}).items():
        stats = (info or {}).get("learner_stats") or {}
        kept = {k: _finite(stats.get(k)) for k in _LEARNER_STATS if k in stats}
        if kept:
            learner[policy_id] = {
                k: None if v is None else float(f"{v:.6g}") for k, v in kept.items()
            }
    wall = _finite(result.get("time_since_start_s"))
    return {
        "iter": int(result.get("training_iteration", 0)),
        "steps": int(result.get("timesteps_total", 0)),
        "time_s": round(float(result.get("time_total_s", 0.0)), 3),
        "wall_s": None if wall is None else round(wall, 3),
        "return": _finite(result.get("episode_reward_mean")),
        "learner": learner,
    }


def read_new_results(path: str, offset: int) -> tuple[list[dict[str, Any]], int]:
    """The curve points of the complete lines of a growing result.json after byte `offset`.

    Returns:
      (points, the offset after the last complete line); a line still being written is left
      for the next call. A file that does not exist yet gives no points.
    """
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    points = []
    for line in data[:end].splitlines():
        if not line.strip():
            continue
        try:
            result = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(result, dict) and "timesteps_total" in result:
            points.append(curve_point(result))
    return points, offset + end


def evaluate(curve: Sequence[Mapping[str, Any]], criterion: Mapping[str, float]) -> dict:
    """Whether a curve met one criterion, and where.

    The criterion is met at the first point whose return reaches the threshold while every
    limit holds (`timesteps_total` <- steps, `time_total_s` <- time_s, `training_iteration` <-
    iter, each <= its limit); it is missed at the first point past a limit before that. The
    counters only grow, so the first such point decides.

    Returns:
      {"met": True | False | None (not decided yet), "at": the deciding point or None}.
    """
    fields = {"timesteps_total": "steps", "time_total_s": "time_s", "training_iteration": "iter"}
    for point in curve:
        within = all(
            point[field] <= criterion[key] for key, field in fields.items() if key in criterion
        )
        if not within:
            return {"met": False, "at": point}
        value = point["return"]
        if value is not None and value >= criterion["episode_reward_mean"]:
            return {"met": True, "at": point}
    return {"met": None, "at": None}


def best_point(curve: Sequence[Mapping[str, Any]]) -> dict | None:
    """The point with the highest return (the first of equals); None before any episode."""
    scored = [p for p in curve if p["return"] is not None]
    return max(scored, key=lambda p: p["return"]) if scored else None


# ------------------------------------------------------------------------------ the machine


def machine_info() -> dict[str, Any]:
    """What a run ran on: CPU model, cores, memory, GPUs, Python, TensorFlow, commit."""
    info = benchlib.read_cpuinfo()
    cpu = (info[0] if info else "") or platform.processor() or platform.machine()
    memory = 0
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    memory = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    gpus = "none"
    if shutil.which("nvidia-smi"):
        try:
            listed = subprocess.run(
                ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            listed = ""
        gpus = "; ".join(line.split(" (UUID")[0] for line in listed.splitlines()) or "none"
    try:
        tensorflow = importlib.metadata.version("tensorflow")
    except importlib.metadata.PackageNotFoundError:
        tensorflow = "not installed"
    commit = benchlib.git_commit(ROOT)
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_bytes": memory,
        "gpu": gpus,
        "python": platform.python_version(),
        "tensorflow": tensorflow,
        "commit": commit,
    }


def machine_line(info: Mapping[str, Any]) -> str:
    """`AMD EPYC ..., 2 cores, 23.5 GiB, GPU none, Python 3.11.7, TensorFlow 2.21.0`."""
    return (
        f"{info['cpu']}, {info['cores']} cores, {info['memory_bytes'] / 2**30:.1f} GiB, "
        f"GPU {info['gpu']}, Python {info['python']}, TensorFlow {info['tensorflow']}"
    )


# ------------------------------------------------------------------------------ one run


def _stop_session(process: subprocess.Popen, grace_s: float, own_exit_s: float = 0.0) -> None:
    """Ends a run: `own_exit_s` seconds for it to exit by itself (it usually stops at the same
    result that decided its criteria), then SIGINT (it checkpoints and stops its actors), then
    SIGKILL to what is left of its session (the run's pid is its session id).

    The suite's own interrupt (`KeyboardInterrupt`) may arrive during either wait. During the
    first it ends that wait and the run still gets its SIGINT; during the second the session is
    killed at once. Either way the run is ended before the interrupt is raised again.
    """
    interrupt: KeyboardInterrupt | None = None
    try:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(own_exit_s)
    except KeyboardInterrupt as e:
        interrupt = e
    try:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(grace_s)
    finally:
        proclib.kill_session(process.pid, process=process)
        process.wait()
    if interrupt is not None:
        raise interrupt


def _shown(path: str) -> str:
    """`path` relative to the repository when it is inside it, else absolute."""
    path = os.path.abspath(path)
    inside = os.path.commonpath([path, ROOT]) == ROOT
    return os.path.relpath(path, ROOT) if inside else path


def _write_json(path: str, value: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def machine_busy_seconds() -> float:
    """CPU seconds every core of the machine has spent busy since boot (/proc/stat; 0 if not
    readable): user, nice, system, irq, softirq and steal time, not idle or iowait."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def run_one(
    command: Sequence[str],
    logdir: str,
    log_path: str,
    criteria: Sequence[Mapping[str, float]],
    *,
    label: str = "run",
    stall_s: float = 900.0,
    poll_s: float = 1.0,
    grace_s: float = _STOP_GRACE_S,
    own_exit_s: float = 15.0,
    cwd: str = ROOT,
    env: Mapping[str, str] | None = None,
    started_path: str | None = None,
) -> dict[str, Any]:
    """Runs one training command until every criterion is decided, it exits, or it stalls.

    Args:
      command: The command line; it writes `<logdir>/result.json`.
      logdir: Its logdir.
      log_path: The file that gets its stdout and stderr.
      criteria: The pass criteria it is judged by.
      label: How progress lines name the run.
      stall_s: End the run when no new result came for this many seconds (start-up included).
      poll_s: Seconds between reads of result.json.
      grace_s: Seconds the process gets to exit after SIGINT before its session is killed.
      own_exit_s: Seconds the process gets to exit by itself once its criteria are decided.
      cwd: Its working directory.
      env: Its environment (default: this one's, with TF_CPP_MIN_LOG_LEVEL=2).
      started_path: Where to record the process id while it runs (`started.json`), so that a
        resumed suite can end a run it lost track of.

    Returns:
      The run's record without the machine: "curve", "outcomes" (per criterion: "criterion",
      "label", "met" (bool), "decided" (False when the run ended first), "at"), "passed",
      "best", "last", "stopped_by", "exit_code", "wall_s", "other_cores" (the cores other
      processes kept busy, on average over the run: the machine's busy CPU time less the run's
      own), peak memory ("peak_rss_bytes", "peak_pss_bytes", "peak_processes").

    Raises:
      KeyboardInterrupt: when this process is interrupted; the run is ended first.
    """
    from tools.bench_atari import TreeMemorySampler

    env = dict(os.environ if env is None else env)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("PYTHONUNBUFFERED", "1")
    os.makedirs(logdir, exist_ok=True)
    result_path = os.path.join(logdir, "result.json")
    start, busy_before = time.monotonic(), machine_busy_seconds()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            list(command),
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Its own session: its whole tree is listed and ended.
        )
    if started_path:
        _write_json(started_path, {"pid": process.pid, "logdir": logdir, "command": list(command)})
    sampler = TreeMemorySampler(process.pid)
    sampler.start()
    curve: list[dict] = []
    offset, last_new, last_print = 0, start, start
    decided_before: set[int] = set()
    stopped_by = None
    try:
        while stopped_by is None:
            code = process.poll()
            points, offset = read_new_results(result_path, offset)
            now = time.monotonic()
            if points:
                curve.extend(points)
                last_new = now
            outcomes = [evaluate(curve, c) for c in criteria]
            for i, outcome in enumerate(outcomes):
                if outcome["met"] is not None and i not in decided_before:
                    decided_before.add(i)
                    print(f"  {label}: {_outcome_text(criteria[i], outcome)}", flush=True)
            if all(o["met"] is not None for o in outcomes):
                stopped_by = "criteria decided"
            elif code is not None:
                stopped_by = (
                    "impala-train stopped" if code == 0 else f"impala-train failed (exit {code})"
                )
            elif now - last_new > stall_s:
                stopped_by = f"stalled (no result for {stall_s:g} s)"
            elif curve and now - last_print >= _PROGRESS_S:
                last_print = now
                p = curve[-1]
                ret = "-" if p["return"] is None else f"{p['return']:.1f}"
                print(
                    f"  {label}: {p['steps']:,} env steps, {p['time_s']:.0f} s, return {ret}",
                    flush=True,
                )
            else:
                time.sleep(poll_s)
    finally:  # Also on KeyboardInterrupt: no run outlives the suite.
        decided = stopped_by == "criteria decided"
        _stop_session(process, grace_s, own_exit_s=own_exit_s if decided else 0.0)
        sampler.stop()
    wall_s = time.monotonic() - start
    # Each process's CPU time only grows: its largest sample is its share of the run.
    own: dict[int, float] = {}
    for _, sample in sampler.cpu_samples:
        for pid, seconds in sample.items():
            own[pid] = max(own.get(pid, 0.0), seconds)
    other_cores = max(0.0, machine_busy_seconds() - busy_before - sum(own.values())) / wall_s
    points, offset = read_new_results(result_path, offset)
    curve.extend(points)
    outcomes = []
    for criterion in criteria:
        outcome = evaluate(curve, criterion)
        outcomes.append(
            {
                "criterion": dict(criterion),
                "label": describe_criterion(criterion),
                "met": bool(outcome["met"]),
                "decided": outcome["met"] is not None,
                "at": outcome["at"],
            }
        )
    return {
        "outcomes": outcomes,
        "passed": all(o["met"] for o in outcomes),
        "best": best_point(curve),
        "last": curve[-1] if curve else None,
        "stopped_by": stopped_by,
        "exit_code": process.returncode,
        "wall_s": round(wall_s, 1),
        "other_cores": round(other_cores, 2),
        "peak_rss_bytes": sampler.peak_rss_kb * 1024,
        "peak_pss_bytes": sampler.peak_pss_kb * 1024,
        "peak_processes": sampler.peak_processes,
        "curve": curve,
    }


def _outcome_text(criterion: Mapping[str, float], outcome: Mapping[str, Any]) -> str:
    text = describe_criterion(criterion)
    at = outcome["at"]
    if outcome["met"]:
        return f"{text}: met at {at['steps']:,} env steps, {at['time_s']:.1f} s of training"
    if at is None:
        return f"{text}: not decided when the run ended"
    return f"{text}: missed (passed a limit at {at['steps']:,} env steps, {at['time_s']:.1f} s)"


def end_stale_run(directory: str) -> bool:
    """Ends the process of an interrupted run if it still runs (the suite was killed).

    Only a process whose command line names the run's logdir is ended (a pid may be reused).

    Returns:
      Whether a process was ended.
    """
    path = os.path.join(directory, STARTED_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            started = json.load(f)
    except (OSError, ValueError):
        return False
    pid = int(started.get("pid", 0))
    if pid <= 0 or proclib.state(pid) in (None, "Z", "X"):
        return False
    if not any(started.get("logdir", "\0") in arg for arg in proclib.cmdline(pid)):
        return False
    proclib.kill_session(pid)
    return True


def run_config_seed(
    config: SuiteConfig,
    seed: int,
    results_dir: str,
    *,
    stall_s: float,
    python: str,
    prefix: str = "",
) -> dict[str, Any]:
    """Runs one config and seed from scratch and writes its `run.json`; returns the record.

    `prefix` starts its first line of output (`[2/9] `)."""
    directory = run_dir(results_dir, config.name, seed)
    print(f"{prefix}{config.name} seed {seed}", flush=True)
    if end_stale_run(directory):
        print(f"  ended the process left running by an interrupted suite in {directory}")
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    logdir = os.path.join(directory, LOGDIR)
    command = train_command(config, seed, logdir, python)
    record: dict[str, Any] = {
        "config": config.name,
        "path": _shown(config.path),
        "seed": seed,
        "sets": list(config.sets),
        "command": command,
        "criteria": [dict(c) for c in config.criteria],
        "machine": machine_info(),
        "load_before": [round(x, 2) for x in os.getloadavg()],
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    print(f"  {' '.join(command[1:])}", flush=True)
    record.update(
        run_one(
            command,
            logdir,
            os.path.join(directory, LOG_FILE),
            config.criteria,
            label=f"{config.name} seed {seed}",
            stall_s=stall_s,
            started_path=os.path.join(directory, STARTED_FILE),
        )
    )
    record["ended"] = time.strftime("%Y-%m-%d %H:%M:%S")
    _write_json(os.path.join(directory, RUN_FILE), record)
    print(f"{config.name} seed {seed}: {_verdict(record)}", flush=True)
    return record


def _verdict(record: Mapping[str, Any]) -> str:
    best = record.get("best")
    best_text = "no episode" if best is None else f"best {best['return']:.1f}"
    state = "passed" if record["passed"] else "FAILED"
    return (
        f"{state} ({record['stopped_by']}); {best_text}; peak RSS "
        f"{record['peak_rss_bytes'] / 2**20:,.0f} MiB; {record['wall_s']:.0f} s"
    )


def load_records(results_dir: str) -> list[dict[str, Any]]:
    """Every finished run's record in `results_dir` (config name, then seed order)."""
    records = []
    if not os.path.isdir(results_dir):
        return records
    for name in sorted(os.listdir(results_dir)):
        config_dir = os.path.join(results_dir, name)
        if not os.path.isdir(config_dir):
            continue
        for seed_dir in os.listdir(config_dir):
            path = os.path.join(config_dir, seed_dir, RUN_FILE)
            if os.path.isfile(path):
                with open(path, encoding="utf-8") as f:
                    records.append(json.load(f))
    return sorted(records, key=lambda r: (r["config"], r["seed"]))


# ------------------------------------------------------------------------------ the report


def _count(value: float) -> str:
    """2000000 -> 2M, 200000 -> 200k, 400 -> 400."""
    for size, suffix in ((1_000_000, "M"), (1_000, "k")):
        if value >= size and value % (size // 10) == 0:
            return f"{value / size:g}{suffix}"
    return f"{value:,.0f}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min"


def _order(records: Sequence[Mapping[str, Any]], configs: Sequence[SuiteConfig]) -> list:
    rank = {c.name: i for i, c in enumerate(configs)}
    return sorted(records, key=lambda r: (rank.get(r["config"], len(rank)), r["config"], r["seed"]))


def summary_table(records: Sequence[Mapping[str, Any]], configs: Sequence[SuiteConfig]) -> str:
    """Markdown: per config and criterion, seeds that met it, median env steps and times.

    The medians count every seed: one that missed counts at the point that decided the miss
    (its limit) or, when the run ended first, at its last result, never dropped.
    """
    lines = [
        "| config | criterion | met | median env steps (all seeds) "
        "| median training time (all seeds) | seeds |",
        "|---|---|:---:|---:|---:|---|",
    ]
    by_config: dict[str, list] = {}
    for record in _order(records, configs):
        by_config.setdefault(record["config"], []).append(record)
    for name, group in by_config.items():
        labels = list(dict.fromkeys(o["label"] for r in group for o in r["outcomes"]))
        for label in labels:
            outcomes = [(r, o) for r in group for o in r["outcomes"] if o["label"] == label]
            met = [o["at"] for _, o in outcomes if o["met"]]
            points = [o["at"] or r.get("last") for r, o in outcomes]
            points = [p for p in points if p]
            steps = f"{statistics.median(p['steps'] for p in points):,.0f}" if points else "-"
            times = _duration(statistics.median(p["time_s"] for p in points)) if points else "-"
            seeds = ", ".join(str(r["seed"]) for r, _ in outcomes)
            lines.append(
                f"| {name} | {label} | {len(met)}/{len(outcomes)} | {steps} | {times} | {seeds} |"
            )
    return "\n".join(lines)


def runs_table(records: Sequence[Mapping[str, Any]], configs: Sequence[SuiteConfig]) -> str:
    """Markdown: one row per config, seed and criterion."""
    lines = [
        "| config | seed | criterion | met | env steps | training time | wall time "
        "| best return | peak RSS | other cores | commit |",
        "|---|---:|---|:---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for record in _order(records, configs):
        best = record.get("best")
        best_text = "-" if best is None else f"{best['return']:.1f} at {best['steps']:,}"
        memory = f"{record['peak_rss_bytes'] / 2**20:,.0f} MiB"
        for outcome in record["outcomes"]:
            at = outcome["at"] if outcome["met"] else None
            if outcome["met"]:
                met = "yes"
            elif outcome["decided"]:
                met = "no"
            else:
                met = f"no ({record['stopped_by']})"
            lines.append(
                f"| {record['config']} | {record['seed']} | {outcome['label']} | {met} | "
                f"{'-' if at is None else format(at['steps'], ',')} | "
                f"{_duration(None if at is None else at['time_s'])} | "
                f"{_duration(None if at is None else at['wall_s'])} | {best_text} | {memory} | "
                f"{record['other_cores']:.2f} | {record['machine']['commit']} |"
            )
    return "\n".join(lines)


def report_markdown(
    records: Sequence[Mapping[str, Any]],
    configs: Sequence[SuiteConfig],
    missing: Sequence[str] = (),
    figure: str | None = None,
) -> str:
    """The suite's report: what ran where, a summary per config, a row per run and criterion."""
    if not records:
        return "No finished run in the results dir yet."
    machines = sorted({machine_line(r["machine"]) for r in records})
    commits = sorted({r["machine"]["commit"] for r in records})
    others = [r["other_cores"] for r in records]
    dates = sorted({r["started"][:10] for r in records})
    seeds = sorted({r["seed"] for r in records})
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    lines = [
        f"`python -m tools.learning_suite`: {len(records)} runs on {when} (seeds "
        f"{', '.join(map(str, seeds))}), one at a time, each a fresh `impala-train`.",
        "",
        f"- Machine: {'; '.join(machines)}. Commit {', '.join(commits)}.",
        f"- Other processes kept {min(others):.2f} to {max(others):.2f} of the "
        f"{records[0]['machine']['cores']} cores busy during a run (the machine's busy CPU time "
        "less the run's own, averaged over the run).",
        '- A criterion "R within N" is met when the mean return of the last 100 episodes first '
        "reaches R while the env steps sampled (`timesteps_total`), the training time "
        "(`time_total_s`) or the iterations are within N. Training time excludes the start-up; "
        "wall time counts from the process start. Peak RSS: the run's processes summed, sampled "
        "every second.",
        "- The medians count every seed: a seed that missed counts at the point that decided "
        "the miss (its limit), or at its last result if the run ended first.",
    ]
    if missing:
        lines.append(f"- Not run yet: {', '.join(missing)}.")
    if figure:
        lines.append(f"- Curves: `{figure}`.")
    lines += ["", summary_table(records, configs), "", runs_table(records, configs)]
    return "\n".join(lines)


def plot_suite(records: Sequence[Mapping[str, Any]], configs: Sequence[SuiteConfig], path: str):
    """Draws every run's mean return over env steps, one panel per config, into `path`.

    Each panel shows its criteria: a dashed line at each threshold, a dotted one at each
    env-step limit.

    Raises:
      ImportError: without matplotlib (the `tools` extra).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_config: dict[str, list] = {}
    for record in _order(records, configs):
        by_config.setdefault(record["config"], []).append(record)
    columns = min(3, max(1, len(by_config)))
    rows = math.ceil(len(by_config) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.6 * rows), squeeze=False)
    for ax in axes.flat[len(by_config) :]:
        ax.set_visible(False)
    for ax, (name, group) in zip(axes.flat, by_config.items()):
        for record in group:
            curve = record["curve"]
            steps = [p["steps"] for p in curve]
            returns = [math.nan if p["return"] is None else p["return"] for p in curve]
            state = "met" if record["passed"] else "missed"
            ax.plot(steps, returns, label=f"seed {record['seed']} ({state})")
        for criterion in group[0]["criteria"]:
            ax.axhline(criterion["episode_reward_mean"], color="gray", linestyle="--", lw=1)
            if "timesteps_total" in criterion:
                ax.axvline(criterion["timesteps_total"], color="gray", linestyle=":", lw=1)
        passed = sum(r["passed"] for r in group)
        ax.set_title(f"{name}: {passed}/{len(group)} passed", fontsize=10)
        ax.set_xlabel("env steps sampled")
        ax.set_ylabel("mean return")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------ the command


def _interrupt(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def install_signal_handlers() -> None:
    """Makes SIGINT, SIGTERM and SIGHUP end the suite (the run in progress is ended first).

    SIGINT is set too, not left to Python's default: a suite started as a background job from a
    non-interactive shell (`nohup ... &`) starts with SIGINT ignored, and Python then installs no
    KeyboardInterrupt handler: a SIGINT to the suite did nothing, and one sent to the run as well
    (`pkill -INT`) ended only the run, which the suite recorded as failed before starting the
    next.
    """
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _interrupt)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=None, help="config names (default: all)")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(DEFAULT_SEEDS))
    parser.add_argument("--quick", action="store_true", help="leave out the Atari configs")
    parser.add_argument("--results-dir", default=RESULTS_DIR)
    parser.add_argument("--configs-dir", default=CONFIGS_DIR)
    parser.add_argument("--rerun", action="store_true", help="run finished runs again")
    parser.add_argument("--report", action="store_true", help="only write the report")
    parser.add_argument("--dry", action="store_true", help="print the runs to do, run none")
    parser.add_argument(
        "--stall-s", type=float, default=900.0, help="end a run with no new result for this long"
    )
    parser.add_argument(
        "--figure",
        default=None,
        help="where to draw the curves (default: <results-dir>/learning-suite.png; under docs/, "
        "docs/learning-results.md shows it)",
    )
    parser.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md and docs/")
    args = parser.parse_args(argv)

    configs = suite_configs(args.configs_dir)
    if args.configs:
        known = {c.name: c for c in configs}
        unknown = [n for n in args.configs if n.removesuffix(".yaml") not in known]
        if unknown:
            parser.error(f"no config with pass_criteria named {unknown}; known: {sorted(known)}")
        selected = [known[n.removesuffix(".yaml")] for n in args.configs]
    else:
        selected = configs
    if args.quick:
        selected = [c for c in selected if not c.atari]
    results_dir = os.path.abspath(args.results_dir)
    todo = [] if args.report else plan_runs(selected, args.seeds, results_dir, args.rerun)
    for config, seed, why in todo:
        print(f"to run: {config.name} seed {seed} ({why})")
    if args.dry:
        for config, seed, _ in todo:
            command = train_command(
                config, seed, os.path.join(run_dir(results_dir, config.name, seed), LOGDIR)
            )
            print(" ".join(command))
        return 0

    install_signal_handlers()
    os.makedirs(results_dir, exist_ok=True)
    current = {c.name: [dict(x) for x in c.criteria] for c in configs}
    try:
        for i, (config, seed, _) in enumerate(todo, 1):
            run_config_seed(
                config,
                seed,
                results_dir,
                stall_s=args.stall_s,
                python=sys.executable,
                prefix=f"[{i}/{len(todo)}] ",
            )
    except KeyboardInterrupt as e:
        print(
            f"learning_suite: interrupted ({e or 'SIGINT'}); the run in progress was ended and "
            "will restart from scratch when the same command runs again",
            file=sys.stderr,
        )
        return 130

    records = load_records(results_dir)
    for record in records:
        if record["config"] in current and record["criteria"] != current[record["config"]]:
            print(
                f"learning_suite: warning: {record['config']} seed {record['seed']} ran under "
                f"other criteria ({record['criteria']}); --rerun runs it again",
                file=sys.stderr,
            )
    finished = {(r["config"], r["seed"]) for r in records}
    missing = []
    for c in selected:
        seeds = [str(s) for s in args.seeds if (c.name, s) not in finished]
        if seeds:
            missing.append(f"{c.name} (seed{'s' if len(seeds) > 1 else ''} {', '.join(seeds)})")
    figure = os.path.abspath(args.figure or os.path.join(results_dir, "learning-suite.png"))
    try:
        if records:
            plot_suite(records, configs, figure)
    except ImportError:
        print(
            "learning_suite: matplotlib is not installed, so no figure was drawn; install the "
            "tools extra (pip install -e '.[tools]') and run again with --report",
            file=sys.stderr,
        )
        figure = None
    text = report_markdown(records, configs, missing, None if figure is None else _shown(figure))
    print(text)
    with open(os.path.join(results_dir, "learning-suite.md"), "w", encoding="utf-8") as f:
        f.write(text + "\n")
    if records and not args.no_write:
        benchlib.write_section(SECTION, "## Learning suite\n\n" + text)
        docs_dir = os.path.dirname(LEARNING_RESULTS_MD)
        if figure and os.path.commonpath([figure, docs_dir]) == docs_dir:
            text += f"\n\n![The learning suite's curves]({os.path.relpath(figure, docs_dir)})"
        benchlib.write_section(SECTION, text, path=LEARNING_RESULTS_MD)
    return 0 if all(r["passed"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
