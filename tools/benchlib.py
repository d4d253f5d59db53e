"""Helpers shared by the benchmarks in tools/: timing by median, statistics over runs that count
the runs that missed their target, running the train binary, and writing BENCHMARKS.md.

Each benchmark owns one section of BENCHMARKS.md, delimited by HTML comments, and rewrites only
that section, so benchmarks can be re-run one at a time.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple, TypeVar

__all__ = [
    "BENCHMARKS_MD",
    "RunStats",
    "Spread",
    "Watched",
    "backend_ratio_lines",
    "bare_keras_step",
    "bounded",
    "interleaved",
    "machine_line",
    "median_seconds",
    "other_jobs_running",
    "percentile",
    "ratio_text",
    "rllib_training_settings",
    "run_stats",
    "spread",
    "watch_training",
    "write_section",
]

T = TypeVar("T")

BENCHMARKS_MD = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "BENCHMARKS.md"
)


def median_seconds(fn: Callable[[], object], repeats: int = 50, warmup: int = 5) -> float:
    """Returns the median wall time of `fn()` in seconds over `repeats` calls after `warmup`."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved(measures: Mapping[str, Callable[[], T]], rounds: int) -> dict[str, list[T]]:
    """Takes every measure once per round, in turn (A, B, C, A, B, C, ...), `rounds` times.

    Interleaving spreads a shared machine's drift (other jobs starting or ending, clock changes)
    over every measure alike, where timing A's rounds and then B's would charge it to one.

    Returns:
      Each measure's values, one per round, in round order.
    """
    values: dict[str, list[T]] = {name: [] for name in measures}
    for _ in range(rounds):
        for name, measure in measures.items():
            values[name].append(measure())
    return values


class Spread(NamedTuple):
    """The median and the range (min, max) of one quantity measured over several rounds."""

    median: float
    low: float
    high: float

    def text(self, fmt: str = ",.0f") -> str:
        """`median (low-high)`, each number formatted with `fmt`."""
        return f"{self.median:{fmt}} ({self.range_text(fmt)})"

    def range_text(self, fmt: str = ",.0f") -> str:
        """`low-high`, each formatted with `fmt`."""
        return f"{self.low:{fmt}}-{self.high:{fmt}}"


def spread(values: Sequence[float]) -> Spread:
    """The median, min and max of `values` (one per round); the range rather than an
    interquartile range, because a benchmark takes 3 to 5 rounds, too few for quartiles."""
    if not values:
        raise ValueError("spread of no values")
    return Spread(statistics.median(values), min(values), max(values))


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) of `values` by linear interpolation between order statistics."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of no values")
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class RunStats(NamedTuple):
    """One figure over every run of a benchmark, the runs that missed their target included.

    A run that never reached the target counts at its full value (its time or env steps when it
    stopped or timed out), a lower bound of what it would have taken; so while any run missed,
    the median, the 90th percentile and the maximum are lower bounds too (`exact` is False). The
    minimum is one only where a run that missed holds it (`low_exact`).
    """

    median: float
    p90: float
    low: float
    high: float
    reached: int
    runs: int
    low_exact: bool = True

    @property
    def exact(self) -> bool:
        """Whether every run reached, so that no statistic is a bound."""
        return self.reached == self.runs

    def reached_text(self) -> str:
        """`N of M reached`."""
        return f"{self.reached} of {self.runs} reached"

    def text(self, fmt: str = ",.0f", unit: str = "") -> str:
        """The median (`>= ` before it while a run missed) and `(N of M reached)`."""
        return f"{bounded(self.median, self.exact, fmt)}{unit} ({self.reached_text()})"

    def range_text(self, fmt: str = ",.0f") -> str:
        """`[low, high]`, each with `>= ` before it where it is a lower bound."""
        low = bounded(self.low, self.low_exact, fmt)
        return f"[{low}, {bounded(self.high, self.exact, fmt)}]"


def run_stats(values: Sequence[float], reached: Sequence[bool] | None = None) -> RunStats:
    """The failure-inclusive statistics of a figure, one value per run.

    Args:
        values: Every run's value; a run that missed counts at its full value (its time or env
            steps when it ended), never dropped.
        reached: Whether each run reached its target; None: all did (a figure, like a rate,
            that has no target).
    """
    if not values:
        raise ValueError("statistics of no runs")
    reached = [True] * len(values) if reached is None else list(reached)
    if len(reached) != len(values):
        raise ValueError(f"{len(values)} values but {len(reached)} reached flags")
    low = min(values)
    return RunStats(
        median=statistics.median(values),
        p90=percentile(values, 90),
        low=low,
        high=max(values),
        reached=sum(bool(r) for r in reached),
        runs=len(values),
        low_exact=any(r for v, r in zip(values, reached) if v == low),
    )


def bounded(value: float, exact: bool, fmt: str = ",.0f") -> str:
    """`value` formatted with `fmt`, `>= ` before it when it is a lower bound (not `exact`)."""
    return f"{'' if exact else '>= '}{value:{fmt}}"


def ratio_text(num: RunStats, den: RunStats, fmt: str = ".3f") -> str:
    """`num.median / den.median`, or the bound it is when a side's median is one.

    `>= r` when only `num` has runs that missed (its median is a lower bound), `<= r` when only
    `den` has, and `-` when both have (the ratio of two lower bounds bounds nothing) or when
    `den`'s median is 0.
    """
    if not den.median or not (num.exact or den.exact):
        return "-"
    ratio = format(num.median / den.median, fmt)
    if num.exact and den.exact:
        return ratio
    return f">= {ratio}" if den.exact else f"<= {ratio}"


def bare_keras_step(model, optimizer, obs, actions, targets, grad_clip: float = 40.0):
    """A bare Keras update of a `model` returning (logits, values): cross-entropy on `actions`,
    a squared value loss on `targets`, global-norm clipping, the optimizer's step; compiled.
    The baseline the learner's V-trace update is compared with. Returns `() -> loss` (numpy)."""
    import numpy as np
    import tensorflow as tf

    @tf.function(autograph=False)
    def step():
        with tf.GradientTape() as tape:
            logits, values = model(obs, training=True)
            loss = tf.reduce_sum(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=actions, logits=logits)
            ) + 0.5 * tf.reduce_sum(tf.square(tf.reshape(values, (-1,)) - targets))
        grads = tape.gradient(loss, model.trainable_variables)
        grads, _ = tf.clip_by_global_norm(grads, grad_clip)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return lambda: np.asarray(step())


def rllib_training_settings(config) -> dict:
    """The settings a side-by-side RLlib script takes from one of our configs: runners, envs,
    fragment, batch, optimizer and loss coefficients (bench_cartpole and bench_atari add their
    model's)."""
    return {
        "runners": int(config.num_env_runners),
        "envs": int(config.num_envs_per_env_runner),
        "fragment": int(config.rollout_fragment_length),
        "batch": int(config.train_batch_size),
        "lr": float(config.lr),
        "grad_clip": float(config.grad_clip or 40.0),
        "vf": float(config.vf_loss_coeff),
        "entropy": float(config.entropy_coeff),
    }


def git_commit(root: str, digits: int = 12) -> str:
    """The checkout's commit at `root`, `digits` hex digits, "+dirty" when tracked files differ
    from it; "unknown" where git cannot tell."""

    def git(*args: str) -> str:
        try:
            done = subprocess.run(
                ["git", "-C", root, *args], capture_output=True, text=True, timeout=30, check=True
            )
        except (OSError, subprocess.SubprocessError):
            return ""
        return done.stdout.strip()

    commit = git("rev-parse", f"--short={digits}", "HEAD") or "unknown"
    return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def read_cpuinfo(path: str = "/proc/cpuinfo") -> tuple[str, frozenset[str]] | None:
    """The first CPU's model name ("" if none) and flags, from `path`; None where it cannot be
    read (not Linux)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
    return (
        model.group(1).strip() if model else "",
        frozenset(flags.group(1).split()) if flags else frozenset(),
    )


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name and its widest vector extension ("AMD EPYC, AVX2"), or "" where
    `cpuinfo` cannot be read. A virtual machine of the same name can land on different hosts
    from day to day, and the figures move with the host: the Nature CNN's update of 500 steps
    took 31-51 ms on hosts with AVX-512 and ~350 ms on one with AVX2 only."""
    info = read_cpuinfo(cpuinfo)
    if info is None:
        return ""
    model, flags = info
    vector = next((name for flag, name in _VECTOR_FLAGS if flag in flags), "")
    return ", ".join(part for part in (model, vector) if part)


#: (cpuinfo flag, name), widest first.
_VECTOR_FLAGS = (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX"), ("sse4_2", "SSE4.2"))


def machine_line() -> str:
    """A one-line description of the machine the figures were measured on."""
    try:
        import tensorflow as tf

        tf_version = tf.__version__
    except ImportError:  # pragma: no cover
        tf_version = "n/a"
    cpu = cpu_model()
    return (
        f"{platform.machine()}{f' ({cpu})' if cpu else ''}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, TensorFlow {tf_version}, "
        f"{time.strftime('%Y-%m-%d')}"
    )


def write_section(name: str, markdown: str, path: str = BENCHMARKS_MD) -> None:
    """Replaces (or appends) the section `name` of BENCHMARKS.md with `markdown`."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{markdown.rstrip()}\n{end}\n"
    text = ""
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            text = f.read()
    if not text:
        text = (
            "# Benchmarks\n\nFigures written by the scripts in `tools/`; re-run one to refresh "
            "its section.\n\n"
        )
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end) + r"\n?", re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip() + "\n\n" + block
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def backend_ratio_lines(runs: list[dict], key: str, label: str, target: float) -> list[str]:
    """Markdown lines: the median of `runs[i][key]` per backend and, with both, Ray / local.

    Args:
        runs: One dict per run, each with "backend" ("local" or "ray") and `key`.
        key: The rate to compare (env steps/s sampled).
        label: What the rate is called in the text.
        target: The issue's Ray / local target, printed as met or not met.
    """
    backends = list(dict.fromkeys(r["backend"] for r in runs))
    medians = {b: statistics.median(r[key] for r in runs if r["backend"] == b) for b in backends}
    lines = [
        "",
        f"Median {label}: " + ", ".join(f"{b} **{m:,.0f}**" for b, m in medians.items()) + ".",
    ]
    if len(medians) == 2:
        ratio = medians["ray"] / max(medians["local"], 1e-9)
        lines.append(
            f"Ray / local = **{ratio:.2f}** (target >= {target:.2f}: "
            f"{'met' if ratio >= target else 'not met'})."
        )
    return lines


def other_jobs_running(load_before: tuple[float, ...]) -> bool:
    """Whether other jobs loaded the machine when a benchmark started.

    Judged by the 1-min load average taken before the runs, above half the cores. The load after
    the runs is not evidence: on a small machine it is the benchmark's own processes.
    """
    return load_before[0] > (os.cpu_count() or 1) / 2


#: impala-train's line per iteration: its mean return (or "-" before any episode ended).
ITER_LINE = re.compile(r"^iter\s+\d+.*return\s+([-\d.]+|nan)")


class Watched(NamedTuple):
    """What `watch_training` saw of one run."""

    #: Seconds from launch to the first iteration whose mean return reached the target (None:
    #: never, or no target).
    reached_s: float | None
    #: The results of `logdir/result.json` ([] if none).
    results: list[dict]
    #: The output's last 30 lines.
    tail: list[str]
    #: Seconds from launch until the process had ended (by itself, or stopped at the timeout):
    #: a run that missed its target counts this as its time to it.
    exit_s: float


def watch_training(
    cmd: Sequence[str], cwd: str, logdir: str, target: float | None, timeout: float
) -> Watched:
    """Runs an impala-train command line (writing to `logdir`) until it ends or `timeout`
    seconds have passed, watching its iteration lines.

    Returns the time to `target`, the results, the output's last lines and the time to the
    process's end (`Watched`).
    """
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    reached_s = None
    proc = subprocess.Popen(
        list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd, env=env
    )
    tail: list[str] = []
    try:
        for line in proc.stdout:
            tail = (tail + [line])[-30:]
            match = ITER_LINE.match(line)
            value = match.group(1) if match else "-"
            done = target is not None and value != "-" and float(value) >= target
            if reached_s is None and done:
                reached_s = time.perf_counter() - start
            if time.perf_counter() - start > timeout:
                break
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(120)  # A loaded machine can take a while to stop the actors.
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
    exit_s = time.perf_counter() - start
    path = os.path.join(logdir, "result.json")
    results = []
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            results = [json.loads(line) for line in f if line.strip()]
    return Watched(reached_s, results, tail, exit_s)
