"""Soak test: train CartPole for a long time and watch memory, step rate and file descriptors.

    nice -n 10 .venv/bin/python -m tools.soak                     # 1 hour, 30 s samples
    nice -n 10 .venv/bin/python -m tools.soak --duration 600 --warmup 120

Run from the repository root.

The run is `configs/cartpole-impala.yaml` (its stop criteria ignored) built in this process, so
its processes are this process (driver and learner thread), the fork server and the actors.
Every `--interval` seconds the tool samples, from /proc, the summed RSS of all of them, their
number, their open file descriptors, and the env steps sampled per second since the previous
sample. At the end it prints the table and the growth after `--warmup` seconds:

* RSS growth: last sample against the first sample after warm-up (threshold `--max-rss-growth`,
  5 %);
* step-rate change: median rate of the second half of the post-warm-up samples against the
  first half (threshold `--max-rate-change`, 10 %; medians, because other work on the machine
  makes single samples noisy). `--rate-basis wall` (the default) judges env steps per wall
  second; `--rate-basis cpu` judges env steps per CPU second used by the run's processes, which
  does not move with the load other programs put on a shared machine (both are printed);
* fd growth: open fds (all processes) of the last sample minus the first after warm-up (must be
  <= 0).

It exits 1 when a threshold fails, 0 otherwise. `--record` also writes the table and the
verdict to BENCHMARKS.md (section "soak"). (RLlib users reported IMPALA running out of
memory after long runs: ray issues #3884, #23769, #24329.)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

from tools import benchlib, proclib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(ROOT, "configs", "cartpole-impala.yaml")

__all__ = ["Sample", "Verdict", "judge", "main", "markdown", "run_soak", "sample_processes"]


@dataclasses.dataclass
class Sample:
    """One row of the soak table.

    Attributes:
      t_s: Seconds since the run was built.
      rss_mb: Summed RSS of the driver and all its descendants, MiB.
      processes: How many processes that is.
      fds: Summed open file descriptors of those processes.
      steps: `timesteps_total` (env steps sampled) so far.
      rate: Env steps per second since the previous sample.
      cpu_rate: Env steps per CPU second (all the run's processes) since the previous sample.
    """

    t_s: float
    rss_mb: float
    processes: int
    fds: int
    steps: int
    rate: float
    cpu_rate: float = 0.0


@dataclasses.dataclass
class Verdict:
    """Growth after warm-up and whether it is within the thresholds."""

    rss_growth_pct: float
    rate_change_pct: float
    fd_growth: int
    failures: list[str]

    @property
    def ok(self) -> bool:
        return not self.failures


def sample_processes(pid: int | None = None) -> tuple[float, int, int, float]:
    """Returns (summed RSS in MiB, process count, summed open fds, summed CPU seconds) of `pid`
    and its descendants."""
    pid = os.getpid() if pid is None else pid
    pids = [pid, *proclib.descendants(pid)]
    rss = sum(proclib.rss_bytes(p) for p in pids) / 2**20
    fds = sum(proclib.fd_count(p) for p in pids)
    # A process that exits between the listing and the read counts as nothing.
    cpu = sum(seconds for p in pids if (seconds := proclib.cpu_seconds(p)) is not None)
    return rss, len(pids), fds, cpu


def judge(
    samples: list[Sample],
    warmup_s: float,
    max_rss_growth: float = 5.0,
    max_rate_change: float = 10.0,
    rate_basis: str = "wall",
) -> Verdict:
    """Compares the samples after `warmup_s` against the thresholds (percent).

    `rate_basis` is "wall" (env steps per second) or "cpu" (env steps per CPU second).

    Raises:
      ValueError: if fewer than 3 samples fall after the warm-up (nothing to compare).
    """
    after = [s for s in samples if s.t_s >= warmup_s]
    if len(after) < 3:
        raise ValueError(
            f"only {len(after)} samples after the {warmup_s:g} s warm-up; run longer or sample "
            "more often (--duration, --interval, --warmup)"
        )
    base, last = after[0], after[-1]
    rss_growth = 100.0 * (last.rss_mb - base.rss_mb) / base.rss_mb
    # The first post-warm-up rate spans the warm-up boundary; the rates after it are clean.
    if rate_basis not in ("wall", "cpu"):
        raise ValueError(f"rate_basis must be 'wall' or 'cpu', got {rate_basis!r}")
    rates = [s.rate if rate_basis == "wall" else s.cpu_rate for s in after[1:]]
    half = len(rates) // 2
    first = statistics.median(rates[: max(1, half)])
    second = statistics.median(rates[half:])
    rate_change = 100.0 * (second - first) / first if first > 0 else float("inf")
    fd_growth = last.fds - base.fds
    failures = []
    if rss_growth >= max_rss_growth:
        failures.append(f"RSS grew {rss_growth:.1f}% (limit {max_rss_growth:g}%)")
    if abs(rate_change) > max_rate_change:
        failures.append(f"step rate changed {rate_change:+.1f}% (limit {max_rate_change:g}%)")
    if fd_growth > 0:
        failures.append(f"open file descriptors grew by {fd_growth}")
    return Verdict(rss_growth, rate_change, fd_growth, failures)


def run_soak(
    duration_s: float,
    interval_s: float,
    config_path: str = DEFAULT_CONFIG,
    printer=print,
) -> list[Sample]:
    """Trains the config for `duration_s` seconds, sampling every `interval_s`; returns rows."""
    from impala_tf.config import ImpalaConfig

    config, _stop = ImpalaConfig.from_yaml(config_path)  # Stop criteria ignored on purpose.
    algo = config.build()
    samples: list[Sample] = []
    try:
        start = time.monotonic()
        last_t, last_steps, last_cpu = 0.0, 0, sample_processes()[3]
        next_sample = interval_s
        printer(
            f"{'t_s':>7} {'rss_mb':>9} {'procs':>5} {'fds':>5} {'steps':>10} {'steps/s':>9} "
            f"{'steps/cpu_s':>11}"
        )
        while True:
            result = algo.train()
            now = time.monotonic() - start
            if now < next_sample:
                continue
            steps = int(result["timesteps_total"])
            rss, procs, fds, cpu = sample_processes()
            rate = (steps - last_steps) / max(now - last_t, 1e-9)
            cpu_rate = (steps - last_steps) / max(cpu - last_cpu, 1e-9)
            row = Sample(now, rss, procs, fds, steps, rate, cpu_rate)
            samples.append(row)
            printer(
                f"{row.t_s:7.0f} {row.rss_mb:9.1f} {row.processes:5d} {row.fds:5d} "
                f"{row.steps:10d} {row.rate:9.0f} {row.cpu_rate:11.0f}"
            )
            last_t, last_steps, last_cpu = now, steps, cpu
            next_sample += interval_s
            if now >= duration_s:
                break
    finally:
        algo.stop()
    return samples


def markdown(samples: list[Sample], verdict: Verdict, args: argparse.Namespace) -> str:
    """The BENCHMARKS.md section: command, machine, table and verdict."""
    lines = [
        f"## Soak ({args.duration / 60:g} min of CartPole)",
        "",
        f"`nice -n 10 .venv/bin/python -m tools.soak --duration {args.duration:g} "
        f"--interval {args.interval:g} --warmup {args.warmup:g}` on {benchlib.machine_line()}. "
        "RSS, processes and fds are summed over the driver, the fork server and the actors.",
        "",
        "| t (s) | RSS (MiB) | processes | fds | env steps | steps/s | steps/CPU s |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in samples:
        lines.append(
            f"| {row.t_s:.0f} | {row.rss_mb:.1f} | {row.processes} | {row.fds} | {row.steps} "
            f"| {row.rate:.0f} | {row.cpu_rate:.0f} |"
        )
    lines += [
        "",
        f"After the {args.warmup:g} s warm-up: RSS growth {verdict.rss_growth_pct:+.2f}% "
        f"(limit {args.max_rss_growth:g}%), step-rate change ({args.rate_basis}) "
        f"{verdict.rate_change_pct:+.2f}% (limit {args.max_rate_change:g}%), fd growth "
        f"{verdict.fd_growth:+d}: **{'PASS' if verdict.ok else 'FAIL'}**.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--duration", type=float, default=3600.0, help="seconds (default 1 h)")
    parser.add_argument("--interval", type=float, default=30.0, help="seconds between samples")
    parser.add_argument("--warmup", type=float, default=300.0, help="seconds before the baseline")
    parser.add_argument("--max-rss-growth", type=float, default=5.0, help="percent")
    parser.add_argument("--max-rate-change", type=float, default=10.0, help="percent")
    parser.add_argument("--rate-basis", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--record", action="store_true", help="write to BENCHMARKS.md")
    args = parser.parse_args(argv)
    if args.interval <= 0 or args.duration <= 0 or args.warmup < 0:
        parser.error("--duration and --interval must be > 0, --warmup >= 0")
    samples = run_soak(args.duration, args.interval, args.config)
    try:
        verdict = judge(
            samples, args.warmup, args.max_rss_growth, args.max_rate_change, args.rate_basis
        )
    except ValueError as e:
        print(f"soak: {e}", file=sys.stderr)
        return 2
    print(
        f"after {args.warmup:g} s warm-up: RSS growth {verdict.rss_growth_pct:+.2f}%, "
        f"step-rate change ({args.rate_basis}) {verdict.rate_change_pct:+.2f}%, "
        f"fd growth {verdict.fd_growth:+d}"
    )
    for failure in verdict.failures:
        print(f"FAIL: {failure}")
    print("PASS" if verdict.ok else "FAIL")
    if args.record:
        benchlib.write_section("soak", markdown(samples, verdict, args))
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
