"""Pendulum benchmark: time and env steps to a mean return of -700 and -200, beside RLlib's run.

    .venv/bin/python -m tools.bench_pendulum                     # configs/pendulum-impala.yaml
    .venv/bin/python -m tools.bench_pendulum --seeds 1 2 --timeout 900
    .venv/bin/python -m tools.bench_pendulum --rllib-python /work/rllib-venv/bin/python

Run from the repository root.

Each impala_tf seed runs the real binary (`python -m impala_tf.bin.train --config=...`) in a
fresh process, stopped at RLlib's stop criterion (`episode_reward_mean` -200 or 5M env steps) or
at `--timeout` seconds. Every iteration line the binary prints gives one point of the curve:
(wall seconds since the process was launched, env steps sampled, mean return of the last 100
episodes). The wall time therefore includes Python, TensorFlow and actor start-up.

With `--rllib-python` (a Python with `ray[rllib]==2.60.0` and torch; PLATFORM.md, "RLlib on the
same machine"), RLlib's own `rllib/tuned_examples/impala/pendulum_impala.py` settings run
*concurrently* with the first impala_tf seed (both processes start together and share the
machine, so both see the same load), and the table shows both curves. RLlib's curve comes from
`algo.train()` results: `env_runners/episode_return_mean` (also over 100 episodes) and
`env_runners/num_env_steps_sampled_lifetime`. Results go to BENCHMARKS.md (section
"bench_pendulum") unless `--no-write`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence

from tools import benchlib

__all__ = ["Point", "parse_impala_line", "parse_rllib_line", "summarize"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = (-700.0, -200.0)
STOP_STEPS = 5_000_000

#: One point of a learning curve: (wall seconds since launch, env steps sampled, mean return).
Point = tuple[float, int, float]

# `iter   13  t=65.2s  steps   332,000  return -1102.4 [-1556, -288]  ...`
# (impala_tf.training.reporting).
_ITER_LINE = re.compile(r"^iter\s+\d+\s+t=\S+\s+steps\s+([\d,]+)\s+return\s+(\S+)")

# RLlib's tuned example `pendulum_impala.py` (Ray 2.60, new API stack, torch), with the env
# runners and the stop criterion written out; prints one JSON line per `train()`.
RLLIB_SCRIPT = r"""
import json, sys, time
import ray
from ray.rllib.algorithms.impala import IMPALAConfig
from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig
budget_s, seed, stop_reward, stop_steps = (
    float(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
start = time.time()
# 4 logical CPUs: with Ray's default (one per core, 2 here) the 2 env runners take both and the
# learner actor never starts, so the first train() never returns (measured on the 2-core machine).
ray.init(include_dashboard=False, log_to_driver=False, num_cpus=4)
config = (
    IMPALAConfig()
    .env_runners(num_env_runners=2, num_envs_per_env_runner=5)
    .environment("Pendulum-v1")
    .training(
        train_batch_size_per_learner=256,
        grad_clip=40.0,
        grad_clip_by="global_norm",
        lr=0.0003,
        vf_loss_coeff=0.05,
        entropy_coeff=[[0, 0.1], [2000000, 0.0]],
    )
    .rl_module(model_config=DefaultModelConfig(vf_share_layers=True, fcnet_hiddens=[512, 512]))
    .debugging(seed=seed)
)
algo = config.build_algo()
while time.time() - start < budget_s:
    r = algo.train()
    runners = r.get("env_runners", {})
    ret = runners.get("episode_return_mean", float("nan"))
    key = "num_env_steps_sampled_lifetime"
    steps = runners.get(key, r.get(key, 0))
    print(json.dumps({"steps": int(steps), "return": ret}), flush=True)
    if (ret == ret and ret >= stop_reward) or steps >= stop_steps:
        break
algo.stop()
ray.shutdown()
"""


def parse_impala_line(line: str) -> tuple[int, float] | None:
    """Parses one iteration line of `impala-train`.

    Args:
      line: A line of the binary's output.

    Returns:
      (env steps sampled, mean return) for an iteration line; the return is NaN while no episode
      has finished (the binary prints `-`). None for any other line.
    """
    match = _ITER_LINE.match(line.strip())
    if not match:
        return None
    steps = int(match.group(1).replace(",", ""))
    raw = match.group(2)
    try:
        ret = float(raw)
    except ValueError:
        ret = math.nan
    return steps, ret


def parse_rllib_line(line: str) -> tuple[int, float] | None:
    """Parses one JSON line of `RLLIB_SCRIPT` ({"steps": int, "return": float}); else None."""
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    if "steps" not in row or "return" not in row:
        return None
    ret = row["return"]
    return int(row["steps"]), float(ret) if ret is not None else math.nan


def summarize(curve: Sequence[Point], targets: Iterable[float] = TARGETS) -> dict:
    """Finds when a learning curve first reached each target, and its best return.

    Args:
      curve: Points (wall s, env steps, mean return) in the order they were printed; NaN returns
        (no finished episode yet) never reach a target.

    Returns:
      {"reached": {target: (wall s, env steps) or None}, "best": (return, env steps) or None,
      "last": the last point or None}. A target counts as reached at the first point whose
      return is >= the target.
    """
    reached: dict[float, tuple[float, int] | None] = {}
    for target in targets:
        reached[target] = next(
            ((t, steps) for t, steps, ret in curve if not math.isnan(ret) and ret >= target),
            None,
        )
    finite = [(ret, steps) for _, steps, ret in curve if not math.isnan(ret)]
    best = max(finite, key=lambda pair: pair[0]) if finite else None
    return {"reached": reached, "best": best, "last": curve[-1] if curve else None}


class _Run:
    """A child process whose output lines are parsed into a curve on a reader thread."""

    def __init__(self, name: str, cmd: list[str], parse, timeout: float, env: dict[str, str]):
        self.name = name
        self.curve: list[Point] = []
        self.tail: list[str] = []
        self._parse = parse
        self._timeout = timeout
        self._start = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env
        )
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.tail = (self.tail + [line.rstrip()])[-20:]
            parsed = self._parse(line)
            if parsed is not None:
                point = (time.perf_counter() - self._start, *parsed)
                self.curve.append(point)
                print(f"{self.name}: {point[0]:.0f} s, {point[1]:,} steps, return {point[2]:.1f}",
                      file=sys.stderr, flush=True)  # fmt: skip

    def wait(self) -> None:
        """Waits for the child (terminating it at the timeout) and for its output to be read."""
        remaining = self._timeout - (time.perf_counter() - self._start)
        try:
            self.proc.wait(max(remaining, 0.0))
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._thread.join(30)
        if not self.curve:
            # Reported as a row with no points (the other runs' figures still count).
            tail = "\n".join(self.tail)
            print(f"{self.name}: no iteration parsed; last output:\n{tail}", file=sys.stderr)


def _impala_cmd(config: str, seed: int, sets: Sequence[str]) -> list[str]:
    logdir = tempfile.mkdtemp(prefix=f"bench-pendulum-{seed}-")
    cmd = [
        sys.executable,
        "-m",
        "impala_tf.bin.train",
        f"--config={config}",
        f"--seed={seed}",
        f"--logdir={logdir}",
        f"--stop_reward={TARGETS[-1]}",
        f"--stop_timesteps={STOP_STEPS}",
        "--checkpoint_freq=0",
    ]
    return cmd + [f"--set={s}" for s in sets]


def _fmt_reached(value: tuple[float, int] | None) -> str:
    return "-" if value is None else f"{value[1]:,} steps, {value[0]:.0f} s"


def _row(name: str, summary: dict) -> str:
    if summary["last"] is None:
        return f"| {name} | - | - | no iteration finished | - |"
    best = summary["best"]
    last = summary["last"]
    cells = [name] + [_fmt_reached(summary["reached"][t]) for t in TARGETS]
    cells.append("-" if best is None else f"{best[0]:.0f} (at {best[1]:,} steps)")
    cells.append("-" if last is None else f"{last[1]:,} steps, {last[0]:.0f} s")
    return "| " + " | ".join(cells) + " |"


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f}, {five:.2f}, {fifteen:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "pendulum-impala.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE for impala-train")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--rllib-python", default=None)
    parser.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    args = parser.parse_args()

    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
    load_before = _load()
    rows: list[tuple[str, dict]] = []
    for i, seed in enumerate(args.seeds):
        runs = [
            _Run(
                f"impala_tf seed {seed}",
                _impala_cmd(args.config, seed, args.set),
                parse_impala_line,
                args.timeout,
                env,
            )
        ]
        if args.rllib_python and i == 0:
            rllib_cmd = [
                args.rllib_python, "-c", RLLIB_SCRIPT,
                str(args.timeout), str(seed), str(TARGETS[-1]), str(STOP_STEPS),
            ]  # fmt: skip
            runs.append(_Run(f"RLlib 2.60 seed {seed}", rllib_cmd, parse_rllib_line,
                             args.timeout + 120, env))  # fmt: skip
        for run in runs:
            run.wait()
        for run in runs:
            summary = summarize(run.curve)
            rows.append((run.name, summary))
            print(json.dumps({"run": run.name, **{str(k): v for k, v in summary.items()}},
                             default=str), flush=True)  # fmt: skip
    load_after = _load()

    lines = [
        f"Pendulum-v1, `{os.path.relpath(args.config, ROOT)}`"
        + (f" with {', '.join(f'`{s}`' for s in args.set)}" if args.set else "")
        + f", stop at -200 or 5M env steps or {args.timeout:g} s ({benchlib.machine_line()}).",
        f"Load average (1, 5, 15 min) before: {load_before}; after: {load_after}.",
    ]
    if args.rllib_python:
        lines.append(
            "RLlib ran concurrently with the first seed (both processes started together)."
        )
    lines += [
        "",
        "| run | to -700 | to -200 | best return | last point |",
        "|---|---|---|---|---|",
    ]
    lines += [_row(name, summary) for name, summary in rows]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        benchlib.write_section("bench_pendulum", "## Pendulum side by side\n\n" + text)


if __name__ == "__main__":
    main()
