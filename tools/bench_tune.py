"""Searches on one small machine: a 4-trial Tune grid against the same runs one after another,
and population-based training recovering a trial from a bad learning rate.

    .venv/bin/python -m tools.bench_tune                 # both parts; writes BENCHMARKS.md
    .venv/bin/python -m tools.bench_tune --part grid --no-write

Run from the repository root, on an otherwise idle machine (it uses every core).

Part "grid": `configs/cartpole-impala.yaml` with `lr` in {0.001, 0.002} and `seed` in {0, 1}.
First the four runs one after another, each `impala-train --config=... --set lr=X --seed=S`
(a new process each, process start to exit timed); then the same four points as one search,
`impala-train --set 'lr={grid_search: [...]}' --set 'seed={grid_search: [...]}'` on a local
Ray with the machine's cores, all four trials at once: each reserves 0.5 CPU (the driver 0.25,
its two actor processes 0.125 each), so the 4 x (1 learner + 2 actors) processes share the
cores. Reported per round (`--rounds`, default 3, one after the other): each run's and trial's
final `episode_reward_mean` (every one must reach 450), the two wall times and their ratio; then
the median ratio (the target: the search within 1.3x of the one-after-another runs).

Part "pbt": `impala-train --config=configs/cartpole-impala-pbt.yaml` (4 trials, one starting at
lr 0.05). Reported from the result files: each trial's starting and final `lr`, its best
`episode_reward_mean`, the exploits Tune logged, and whether any process of the search's
session outlived `impala-train`.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from tools import benchlib, proclib

__all__ = ["main"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/cartpole-impala.yaml"
PBT_CONFIG = "configs/cartpole-impala-pbt.yaml"
LRS = (0.001, 0.002)
SEEDS = (0, 1)
#: A trial's reservation in the grid: four trials share a 2-core machine.
SHARE = ("--set=num_cpus_for_main_process=0.25", "--set=num_cpus_per_env_runner=0.125")


def _train(args: list[str], log_path: str, timeout_s: float) -> tuple[int, float, list[int]]:
    """Runs impala-train in its own session; (exit code, seconds, pids left in the session)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "impala_tf.bin.train", *args],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            code = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGTERM)
            code = process.wait()
    seconds = time.perf_counter() - start
    time.sleep(5.0)  # Ray's and the trials' processes end after the driver's exit.
    left = proclib.session_pids(process.pid)
    if left:
        proclib.kill_session(process.pid)
    return code, seconds, left


def _results(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _lr(result: dict) -> float:
    return float(result["info"]["learner"]["default_policy"]["learner_stats"]["cur_lr"])


def grid(tmp: str, rounds: int = 1) -> tuple[list[str], dict]:
    """`rounds` rounds, each the four runs one after another and then the search."""
    lines, ratios, reached, leftovers = [], [], [0, 0], 0
    for k in range(rounds):
        round_lines, figures = _grid_round(os.path.join(tmp, f"round-{k}"))
        lines += ["", f"Round {k + 1} of {rounds}:", *round_lines]
        ratios.append(figures["ratio"])
        reached = [a + b for a, b in zip(reached, figures["reached"])]
        leftovers += figures["left"]
    median = statistics.median(ratios)
    lines += [
        "",
        f"Search / one after another, median of {rounds} rounds: **{median:.2f}** "
        f"({', '.join(f'{r:.2f}' for r in ratios)}; target <= 1.30: "
        f"{'met' if median <= 1.3 else 'not met'}). Reached 450: {reached[0]} of {4 * rounds} "
        f"runs one after another, {reached[1]} of {4 * rounds} trials. Processes of the "
        f"searches left after their exit: {leftovers}.",
    ]
    return lines, {"ratios": ratios, "reached": reached}


def _grid_round(tmp: str) -> tuple[list[str], dict]:
    os.makedirs(tmp, exist_ok=True)
    lines = ["", "One after another (a new `impala-train` process each):", ""]
    lines += ["| lr | seed | final return | start to exit s |", "|---|---|---|---|"]
    sequential_s, finals = 0.0, []
    for lr in LRS:
        for seed in SEEDS:
            logdir = os.path.join(tmp, f"seq-{lr}-{seed}")
            code, seconds, _ = _train(
                [f"--config={CONFIG}", f"--set=lr={lr}", f"--seed={seed}", f"--logdir={logdir}"],
                logdir + ".log",
                timeout_s=900,
            )
            results = _results(os.path.join(logdir, "result.json"))
            final = results[-1]["episode_reward_mean"] if results else float("nan")
            finals.append(final)
            sequential_s += seconds
            lines.append(f"| {lr} | {seed} | {final:.1f} | {seconds:.1f} |")
            print(f"sequential lr={lr} seed={seed}: {final:.1f} in {seconds:.1f} s (exit {code})")
    logdir = os.path.join(tmp, "grid")
    code, search_s, left = _train(
        [
            f"--config={CONFIG}",
            f"--set=lr={{grid_search: {list(LRS)}}}",
            f"--set=seed={{grid_search: {list(SEEDS)}}}",
            *SHARE,
            f"--ray_num_cpus={os.cpu_count()}",
            f"--logdir={logdir}",
        ],
        logdir + ".log",
        timeout_s=1800,
    )
    trials = []
    for path in sorted(glob.glob(os.path.join(logdir, "*", "impala_tf", "result.json"))):
        results = _results(path)
        trials.append((path, results[-1]["episode_reward_mean"] if results else float("nan")))
    ratio = search_s / sequential_s
    reached = sum(f >= 450 for f in finals), sum(f >= 450 for _, f in trials)
    lines += [
        "",
        f"As one search (4 trials at once, exit {code}): final returns "
        + ", ".join(f"{f:.1f}" for _, f in trials)
        + f"; start to exit **{search_s:.1f} s**.",
        "",
        f"One after another: **{sequential_s:.1f} s** in all. Search / one after another = "
        f"**{ratio:.2f}** (target <= 1.30: {'met' if ratio <= 1.3 else 'not met'}). Reached 450: "
        f"{reached[0]} of {len(finals)} one after another, {reached[1]} of {len(trials)} as "
        f"trials. Processes of the search left after its exit: {len(left)}.",
    ]
    print("\n".join(lines))
    return lines, {"ratio": ratio, "reached": reached, "left": len(left)}


def pbt(tmp: str) -> list[str]:
    logdir = os.path.join(tmp, "pbt")
    code, seconds, left = _train(
        [f"--config={PBT_CONFIG}", f"--ray_num_cpus={os.cpu_count()}", f"--logdir={logdir}"],
        logdir + ".log",
        timeout_s=2400,
    )
    lines = ["", f"`{PBT_CONFIG}` (exit {code}, {seconds:.1f} s start to exit):", ""]
    lines += [
        "| trial | start lr | last return at it | final lr | final return | env steps |",
        "|---|---|---|---|---|---|",
    ]
    for path in sorted(glob.glob(os.path.join(logdir, "*", "impala_tf", "result.json"))):
        results = _results(path)
        if not results:
            continue
        trial = os.path.basename(os.path.dirname(os.path.dirname(path))).split("_2026")[0]
        start = [r for r in results if round(_lr(r), 6) == round(_lr(results[0]), 6)]
        lines.append(
            f"| {trial} | {_lr(results[0]):.6g} | {start[-1]['episode_reward_mean']:.1f} "
            f"(iteration {start[-1]['training_iteration']}) | {_lr(results[-1]):.6g} | "
            f"{results[-1]['episode_reward_mean']:.1f} | {results[-1]['timesteps_total']:,d} |"
        )
    exploits = []
    for path in glob.glob(os.path.join(logdir, "pbt_global.txt")):
        with open(path, encoding="utf-8") as f:
            exploits = [line for line in f if line.strip()]
    lines += [
        "",
        f"Exploits logged by Tune (`pbt_global.txt`): {len(exploits)}. Processes of the "
        f"search's session left after its exit: {len(left)}.",
    ]
    print("\n".join(lines))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("grid", "pbt", "both"), default="both")
    parser.add_argument("--rounds", type=int, default=3, help="grid rounds (median ratio)")
    parser.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    parser.add_argument("--keep", action="store_true", help="keep the runs' directories")
    args = parser.parse_args(argv)
    load = os.getloadavg()
    tmp = tempfile.mkdtemp(prefix="bench-tune-")
    lines = [
        "## Searches: a Tune grid and population-based training",
        "",
        f"`python -m tools.bench_tune` at {benchlib.git_commit(ROOT)}; {benchlib.machine_line()}.",
    ]
    if benchlib.other_jobs_running(load):
        lines.append(f"Other jobs were running (load {load[0]:.2f}): figures are disturbed.")
    try:
        if args.part in ("grid", "both"):
            lines += ["", "### Grid: 2 learning rates x 2 seeds of cartpole-impala.yaml"]
            lines += grid(tmp, args.rounds)[0]
        if args.part in ("pbt", "both"):
            lines += ["", "### Population-based training"]
            lines += pbt(tmp)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"runs kept in {tmp}")
    if not args.no_write:
        benchlib.write_section("bench_tune", "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
