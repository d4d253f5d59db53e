"""What a first-time user sees: N fresh, unseeded runs of the README's CartPole train command.

    .venv/bin/python -m tools.bench_robustness                  # 50 runs of the README command
    .venv/bin/python -m tools.bench_robustness --runs 10 --set lr=0.0005 --no-write
    .venv/bin/python -m tools.bench_robustness --fresh-clone    # the first run from a fresh clone

Run from the repository root.

Each run is the README's command, `impala-train --config=configs/cartpole-impala.yaml`, started
as a person starts it: a new process, no seed, no other flag, from the repository root, writing
to `runs/<name>-<time>/` (read afterwards, then deleted unless `--keep`). `--set KEY=VALUE`
(repeatable) adds `--set` overrides, for probes; the block in BENCHMARKS.md names them. With
`--fresh-clone` every run is in a fresh clone of this checkout's HEAD with the README's install
(a new virtualenv and `pip install -e .`, no extras; the install time is reported apart from
the runs'), the first right after the install: what the README's first command does. Without
it the runs use this interpreter's virtualenv, whose extras (the test extra's Ray Tune and
matplotlib: Keras imports pandas and matplotlib when they are installed) add about a second
to every start; the block says which.

Per run, from the binary's output and its `result.json`:

- reached: the run stopped at the config's `stop.episode_reward_mean` (450) within its
  `stop.timesteps_total` (2M env steps);
- a lasting collapse: the iteration's mean entropy (over all of its updates,
  `update_stats.entropy_mean`) under `--collapse-entropy` (0.01) for 3 iterations in a row, or
  a mean return under `--collapse-return` (20) for 5 iterations in a row;
- dips: iterations whose mean return fell under 50 after the run had reached 150 (short
  collapses it came back from);
- times from process start: the first iteration line, the target (the stop line), the exit.
  A run that never reached counts its whole time, process start to exit, as its time to the
  target in every statistic (median, 90th percentile, worst): failures are included, not
  dropped. The shut-down time is the exit less the stop line.

Runs go one at a time; the machine should be otherwise idle. Results go to BENCHMARKS.md
(section "bench_robustness"; with `--set`, "bench_robustness_probe").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from tools import benchlib, proclib

__all__ = ["collapses", "main", "run_once", "summarise"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_CONFIG = "configs/cartpole-impala.yaml"

_LOGDIR_LINE = re.compile(r"logdir (\S+), stop")
_STOP_LINE = re.compile(r"stopped at episode_reward_mean=([-\d.]+)")


def _entropy(result: dict) -> float | None:
    """The iteration's mean entropy over its updates (the last update's where none)."""
    learner = result.get("info", {}).get("learner", {})
    values = []
    for stats in learner.values():
        if not isinstance(stats, dict):
            continue
        updates = stats.get("update_stats", {})
        if "entropy_mean" in updates:
            values.append(float(updates["entropy_mean"]))
        elif "entropy" in stats.get("learner_stats", {}):
            values.append(float(stats["learner_stats"]["entropy"]))
    return min(values) if values else None


def collapses(results: list[dict], entropy_floor: float = 0.01, return_floor: float = 20.0) -> dict:
    """Counts lasting collapses and dips in one run's results (see the module docstring).

    A lasting collapse is a stretch of iterations each inside a spell of 3 (or more)
    iterations in a row with entropy under `entropy_floor`, or of 5 (or more) with a mean
    return under `return_floor`; overlapping spells of both kinds count once.

    Returns:
      {"lasting": the number of such stretches, "dips": iterations with a mean return under
       50 after the run had reached 150, "min_entropy": the least iteration entropy or None}
    """
    n = len(results)
    inside = [False] * n
    for is_low, length in (
        (lambda r: _low_entropy(r, entropy_floor), 3),
        (lambda r: _low_return(r, return_floor), 5),
    ):
        streak = 0
        for i, r in enumerate(results):
            streak = streak + 1 if is_low(r) else 0
            if streak >= length:
                inside[i - streak + 1 : i + 1] = [True] * streak
    lasting = sum(1 for i in range(n) if inside[i] and (i == 0 or not inside[i - 1]))
    dips, peak = 0, float("-inf")
    for r in results:
        ret = r.get("episode_reward_mean")
        if ret is None or ret != ret:
            continue
        if peak >= 150 and ret < 50:
            dips += 1
        peak = max(peak, float(ret))
    entropies = [h for h in map(_entropy, results) if h is not None]
    return {"lasting": lasting, "dips": dips, "min_entropy": min(entropies, default=None)}


def policy_lag(results: list[dict]) -> float | None:
    """The median over iterations of the mean policy lag of their updates, in updates
    (`diff_num_grad_updates_vs_sampler_policy`: how many updates older the weights that
    sampled a batch were than the weights it trained)."""
    lags = []
    for r in results:
        for stats in r.get("info", {}).get("learner", {}).values():
            updates = stats.get("update_stats", {}) if isinstance(stats, dict) else {}
            if "diff_num_grad_updates_vs_sampler_policy_mean" in updates:
                lags.append(float(updates["diff_num_grad_updates_vs_sampler_policy_mean"]))
    return statistics.median(lags) if lags else None


def _low_entropy(result: dict, floor: float) -> bool:
    h = _entropy(result)
    return h is not None and h < floor


def _low_return(result: dict, floor: float) -> bool:
    ret = result.get("episode_reward_mean")
    return ret is not None and ret == ret and float(ret) < floor


def run_once(
    command: list[str], cwd: str, timeout: float, keep: bool = False, env: dict | None = None
) -> dict:
    """Runs one train command line to its end; returns its times, outcome and results."""
    env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=cwd,
        env=env,
        start_new_session=True,  # As a shell's job: its whole tree is one session.
    )
    first_iter_s = stop_s = None
    stop_value = None
    logdir = None
    tail: list[str] = []
    timed_out = False
    try:
        for line in proc.stdout:
            now = time.perf_counter() - start
            tail = (tail + [line.rstrip()])[-20:]
            if logdir is None and (m := _LOGDIR_LINE.search(line)):
                logdir = m.group(1)
            if first_iter_s is None and line.startswith("iter "):
                first_iter_s = now
            if stop_s is None and (m := _STOP_LINE.search(line)):
                stop_s, stop_value = now, float(m.group(1))
            if now > timeout:
                timed_out = True
                break
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
    exit_s = time.perf_counter() - start
    # What still runs once the prompt would be back (workers, the fork server, trackers).
    left_at_exit = len(proclib.session_pids(proc.pid))
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    results = []
    if logdir is not None:
        path = os.path.join(cwd, logdir, "result.json")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                results = [json.loads(line) for line in f if line.strip()]
        if not keep:
            shutil.rmtree(os.path.join(cwd, logdir), ignore_errors=True)
    return {
        "returncode": proc.returncode,
        "timed_out": timed_out,
        "first_iter_s": first_iter_s,
        "stop_s": stop_s,
        "stop_value": stop_value,
        "exit_s": exit_s,
        "left_at_exit": left_at_exit,
        "results": results,
        "tail": tail,
    }


def outcome(run: dict, target: float, max_steps: int) -> dict:
    """The figures of one run (`run_once`'s dict): reached, env steps, collapses, times."""
    results = run["results"]
    last = results[-1] if results else {}
    steps = int(last.get("timesteps_total", 0))
    reached = (
        run["stop_value"] is not None
        and run["stop_value"] >= target
        and steps <= max_steps + 10_000
        and run["returncode"] == 0
    )
    return {
        "reached": reached,
        "steps": steps,
        "iterations": len(results),
        **collapses(results),
        "policy_lag": policy_lag(results),
        "first_iter_s": run["first_iter_s"],
        # Failure-inclusive: a run that never reached counts its whole time.
        "to_target_s": run["stop_s"] if reached else run["exit_s"],
        "exit_s": run["exit_s"],
        "shutdown_s": None if run["stop_s"] is None else run["exit_s"] - run["stop_s"],
        "left_at_exit": run["left_at_exit"],
        "returncode": run["returncode"],
    }


def summarise(rows: list[dict]) -> dict:
    """Failure-inclusive statistics of `outcome` rows."""
    lags = [r["policy_lag"] for r in rows if r.get("policy_lag") is not None]

    def stats(key: str) -> dict:
        values = [r[key] for r in rows if r[key] is not None]
        if not values:
            return {"median": None, "p90": None, "worst": None}
        s = benchlib.run_stats(values)  # `to_target_s` already counts a miss at its whole time.
        return {"median": s.median, "p90": s.p90, "worst": s.high}

    return {
        "runs": len(rows),
        "reached": sum(r["reached"] for r in rows),
        "with_lasting_collapse": sum(r["lasting"] > 0 for r in rows),
        "clean": sum(r["reached"] and r["lasting"] == 0 for r in rows),
        "dips_median": statistics.median(r["dips"] for r in rows) if rows else None,
        "runs_with_dips": sum(r["dips"] > 0 for r in rows),
        "to_target_s": stats("to_target_s"),
        "exit_s": stats("exit_s"),
        "first_iter_s": stats("first_iter_s"),
        "shutdown_s": stats("shutdown_s"),
        "steps_median": statistics.median(r["steps"] for r in rows) if rows else None,
        "runs_leaving_processes": sum(r.get("left_at_exit", 0) > 0 for r in rows),
        "policy_lag_median": statistics.median(lags) if lags else None,
    }


def fresh_clone() -> tuple[str, dict, float]:
    """A fresh clone of HEAD with the README's install (a new virtualenv, `pip install -e .`);
    returns (its directory, the environment to run it in, the install's seconds)."""
    work = tempfile.mkdtemp(prefix="bench-robustness-clone-")
    clone = os.path.join(work, "impala_tf")
    subprocess.run(["git", "clone", "-q", ROOT, clone], check=True)
    start = time.perf_counter()
    subprocess.run(["python3", "-m", "venv", ".venv"], cwd=clone, check=True, timeout=600)
    subprocess.run(
        [".venv/bin/pip", "install", "-q", "-e", "."], cwd=clone, check=True, timeout=1800
    )
    install_s = time.perf_counter() - start
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    return clone, env, install_s


def _fmt(value: float | None, unit: str = " s") -> str:
    return "-" if value is None else f"{value:.1f}{unit}"


def tensorflow_import_s(python: str, env: dict | None = None, tries: int = 3) -> float:
    """The median time of `import tensorflow` alone in a fresh process of `python`: the floor
    under every run's start-up, and the machine's speed that day."""
    times = []
    for _ in range(tries):
        start = time.perf_counter()
        subprocess.run(
            [python, "-c", "import tensorflow"],
            check=True,
            capture_output=True,
            env=dict(os.environ if env is None else env, TF_CPP_MIN_LOG_LEVEL="3"),
        )
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def report(
    args, rows: list[dict], install_s: float | None, load: tuple, import_s: float | None = None
) -> str:
    summary = summarise(rows)
    command = (
        "python -m tools.bench_robustness"
        + "".join(f" --set {item}" for item in args.set)
        + (f" --runs {args.runs}" if args.runs != 50 else "")
        + (" --fresh-clone" if args.fresh_clone else "")
    )
    variant = ", with " + ", ".join(f"`{s}`" for s in args.set) if args.set else ""
    t, e = summary["to_target_s"], summary["exit_s"]
    lines = [
        "## The README's CartPole command, as a first-time user runs it",
        "",
        f"`{command}` ({benchlib.machine_line()}, commit {benchlib.git_commit(ROOT)}; load "
        f"average before {load[0]:.2f}). {summary['runs']} fresh, unseeded processes of "
        f"`impala-train --config={README_CONFIG}`{variant}, one at a time"
        + (
            f", all in a fresh clone with the README's install (`pip install -e .`, no extras; "
            f"it took {install_s:.0f} s, not counted below), the first right after the install"
            if install_s is not None
            else ", in this checkout's virtualenv (with its extras installed)"
        )
        + ".",
        "",
        f"- reached 450 within 2M env steps: **{summary['reached']} of {summary['runs']}**; "
        f"with a lasting collapse (entropy < 0.01 for 3 iterations in a row, or return < 20 "
        f"for 5): **{summary['with_lasting_collapse']}**; reached with none: "
        f"**{summary['clean']} of {summary['runs']}**",
        f"- runs with dips (return < 50 after reaching 150): {summary['runs_with_dips']} of "
        f"{summary['runs']}; median env steps at the stop: {summary['steps_median']:,.0f}; "
        f"median policy lag: {_fmt(summary['policy_lag_median'], ' updates')}",
        f"- process start to 450 (a run that never reached counts its whole time): median "
        f"**{_fmt(t['median'])}**, 90th percentile **{_fmt(t['p90'])}**, worst "
        f"**{_fmt(t['worst'])}**",
        f"- process start to exit: median {_fmt(e['median'])}, 90th percentile "
        f"{_fmt(e['p90'])}, worst {_fmt(e['worst'])}; stop line to exit: median "
        f"{_fmt(summary['shutdown_s']['median'])}, worst {_fmt(summary['shutdown_s']['worst'])}; "
        f"process start to the first iteration line: median "
        f"{_fmt(summary['first_iter_s']['median'])}; runs whose processes outlived the "
        f"binary's exit: {summary['runs_leaving_processes']}"
        + (
            f"; `import tensorflow` alone took {import_s:.1f} s that day (median of 3 fresh "
            "processes of the runs' virtualenv, after the runs)"
            if import_s is not None
            else ""
        ),
        "",
        "| run | reached | env steps | lasting collapses | dips | min entropy | to 450 | exit |",
        "|---:|:---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, r in enumerate(rows, 1):
        h = "-" if r["min_entropy"] is None else f"{r['min_entropy']:.4f}"
        lines.append(
            f"| {i} | {'yes' if r['reached'] else '**no**'} | {r['steps']:,} | {r['lasting']} "
            f"| {r['dips']} | {h} | {_fmt(r['to_target_s'])} | {_fmt(r['exit_s'])} |"
        )
    if benchlib.other_jobs_running(load):
        lines += ["", "Other jobs loaded the machine when this ran."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE override")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run at most")
    parser.add_argument("--fresh-clone", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the runs' logdirs")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    args = parser.parse_args()

    from impala_tf.config import ImpalaConfig

    _, stop = ImpalaConfig.from_yaml(os.path.join(ROOT, README_CONFIG))
    target = float(stop.get("episode_reward_mean", 450))
    max_steps = int(stop.get("timesteps_total", 2_000_000))
    load = os.getloadavg()
    cwd, env, install_s, bin_dir = ROOT, None, None, os.path.dirname(sys.executable)
    if args.fresh_clone:
        cwd, env, install_s = fresh_clone()
        bin_dir = os.path.join(cwd, ".venv", "bin")
    command = [
        os.path.join(bin_dir, "impala-train"),
        f"--config={README_CONFIG}",
        *(f"--set={s}" for s in args.set),
    ]
    rows = []
    for i in range(args.runs):
        run = run_once(command, cwd, args.timeout, args.keep, env)
        row = outcome(run, target, max_steps)
        rows.append(row)
        print(json.dumps({"run": i + 1, **row}), flush=True)
        if run["returncode"] != 0 and not run["timed_out"]:
            print("\n".join(run["tail"]), file=sys.stderr)
    import_s = tensorflow_import_s(os.path.join(bin_dir, "python"), env)
    if args.fresh_clone and not args.keep:
        shutil.rmtree(os.path.dirname(cwd), ignore_errors=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "rows": rows, "summary": summarise(rows)}, f, indent=1)
    text = report(args, rows, install_s, load, import_s)
    print(text)
    if not args.no_write:
        benchlib.write_section("bench_robustness_probe" if args.set else "bench_robustness", text)


if __name__ == "__main__":
    main()
