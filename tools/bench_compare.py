"""A/B of two checkouts on the training runs that matter: CartPole, Pong (small), multi-agent.

    .venv/bin/python -m tools.bench_compare --baseline-root /tmp/old \
        --baseline-python /tmp/old/.venv/bin/python --rounds 3

Run from the repository root. Each round runs every case once with this checkout and once with
the baseline (another checkout of the repository, e.g. `git worktree add /tmp/old <commit>`, with
a Python whose `impala_tf` is that checkout), alternating which goes first, one run at a time, so
the two see the same machine. Every run is the real binary (`python -m impala_tf.bin.train`,
`--checkpoint_freq=0`) on the checkout's own YAML:

* `cartpole`: `configs/cartpole-impala.yaml` with `--seed=<round>` until the return reaches 450:
  the wall time from launching the process (imports and start-up included) and the env steps/s
  sampled between the first and the last iteration;
* `pong`: `configs/pong-impala-small.yaml` for `--pong_time` seconds of training: env steps/s
  trained and sampled between the first and the last iteration (`tools/bench_atari.py`'s
  training row);
* `multi_agent`: `configs/multi-agent-cartpole-impala.yaml` with `--seed=<round>` until its stop
  criteria (summed return 600 or 200k env steps): the wall time to 600 and the env steps/s.

It prints the medians over the rounds, their spread, and the ratios this / baseline, and writes
them to BENCHMARKS.md (section "bench_compare"). The times to a return count every round: a run
that never reached it counts its full time (launch to the process's end, when it stopped or timed
out), so a median with a miss is a lower bound (`>= `), and each says how many rounds reached; a
ratio with a bound on one side is a bound itself (none with bounds on both).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from tools import benchlib

__all__ = ["CASES", "FIGURES", "figure_cells", "figure_stats", "main", "run_case"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: case -> (YAML under configs/, target return (None: none), extra flags of the binary).
CASES = {
    "cartpole": ("cartpole-impala.yaml", 450.0, []),
    "pong": ("pong-impala-small.yaml", None, []),
    "multi_agent": ("multi-agent-cartpole-impala.yaml", 600.0, []),
}

#: case -> its figures in the report: (key of `run_case`'s dict, label).
FIGURES = {
    "cartpole": [("to_target_s", "s to 450 (from launch)"), ("sampled_per_s", "env steps/s")],
    "pong": [("trained_per_s", "env steps/s trained"), ("sampled_per_s", "env steps/s")],
    "multi_agent": [("to_target_s", "s to 600 (from launch)"), ("sampled_per_s", "env steps/s")],
}

#: The figures that have a target: a run that missed it counts at its full value.
_TO_TARGET = {"to_target_s"}


def _rates(results: list[dict]) -> dict[str, float]:
    """Env steps/s sampled and trained between the first and the last result."""
    first, last = results[0], results[-1]
    if len(results) < 2:
        first = {"time_total_s": 0.0, "timesteps_total": 0, "num_env_steps_trained": 0}
    dt = max(float(last["time_total_s"]) - float(first["time_total_s"]), 1e-9)
    return {
        "sampled_per_s": (last["timesteps_total"] - first["timesteps_total"]) / dt,
        "trained_per_s": (last["num_env_steps_trained"] - first["num_env_steps_trained"]) / dt,
    }


def run_case(python: str, root: str, case: str, seed: int, train_s: float, timeout: float) -> dict:
    """One run of `case` with the checkout at `root` (its `python`); returns its figures.

    With a target, `reached` says whether the run reached it and `to_target_s` is the time to it
    from launch, or the run's full time (launch to its end) where it never reached.
    """
    yaml, target, extra = CASES[case]
    logdir = tempfile.mkdtemp(prefix=f"bench-compare-{case}-")
    cmd = [
        python,
        "-m",
        "impala_tf.bin.train",
        f"--config={os.path.join(root, 'configs', yaml)}",
        f"--logdir={logdir}",
        f"--seed={seed}",
        "--checkpoint_freq=0",
        *extra,
    ]
    if target is None:
        cmd.append(f"--stop_time_s={train_s}")
    reached_s, results, tail, exit_s = benchlib.watch_training(cmd, root, logdir, target, timeout)
    if not results:
        raise RuntimeError(f"{case} with {python} wrote no results:\n{''.join(tail)}")
    last = results[-1]
    out = {
        "reached_s": reached_s,
        "exit_s": exit_s,
        "env_steps": int(last["timesteps_total"]),
        "return": last.get("episode_reward_mean"),
        **_rates(results),
    }
    if target is not None:
        out["reached"] = reached_s is not None
        out["to_target_s"] = exit_s if reached_s is None else reached_s
    return out


def figure_stats(runs: list[dict], key: str) -> benchlib.RunStats:
    """`key` over every run of `runs` (`run_case`'s dicts, one side of one case); for a time to
    the target, a run that never reached counts at its full time (`to_target_s`)."""
    reached = [r["reached"] for r in runs] if key in _TO_TARGET else None
    return benchlib.run_stats([r[key] for r in runs], reached)


def figure_cells(this: list[dict], baseline: list[dict], key: str) -> tuple[str, str, str]:
    """The report's cells for one figure: each side's median [min, max] (`>= ` where a run
    missed, and `N of M reached` for a time to the target), and the ratio this / baseline (a
    bound where one side's median is one, `-` where both are)."""
    sides = [figure_stats(runs, key) for runs in (this, baseline)]
    cells = []
    for s in sides:
        cell = f"{benchlib.bounded(s.median, s.exact)} {s.range_text()}"
        cells.append(cell + (f" ({s.reached_text()})" if key in _TO_TARGET else ""))
    return cells[0], cells[1], benchlib.ratio_text(sides[0], sides[1], ".3f")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline-root", required=True, help="the other checkout")
    parser.add_argument("--baseline-python", required=True, help="its Python")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--pong_time", type=float, default=120.0, help="Pong training seconds")
    parser.add_argument("--timeout", type=float, default=600.0, help="per run, seconds")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    load_before = os.getloadavg()
    sides = {"this": (sys.executable, ROOT), "baseline": (args.baseline_python, args.baseline_root)}
    runs: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.rounds):
        order = ["this", "baseline"] if r % 2 == 0 else ["baseline", "this"]
        for case in args.cases:
            for side in order:
                python, root = sides[side]
                out = run_case(python, root, case, r, args.pong_time, args.timeout)
                runs.setdefault((case, side), []).append(out)
                print(f"round {r} {case:11s} {side:8s} {json.dumps(out)}", flush=True)
    flags = f"--rounds {args.rounds}"
    if list(args.cases) != list(CASES):
        flags += " --cases " + " ".join(args.cases)
    if "pong" in args.cases:
        flags += f" --pong_time {args.pong_time:g}"
    lines = [
        f"`python -m tools.bench_compare {flags}` with `--baseline-root {args.baseline_root}` "
        f"(baseline {benchlib.git_commit(args.baseline_root, 7)}, "
        f"this {benchlib.git_commit(ROOT, 7)}; "
        f"{benchlib.machine_line()}); "
        f"load average before {load_before[0]:.2f}"
        + (" (other jobs were running)" if benchlib.other_jobs_running(load_before) else "")
        + ". Medians over the rounds [min, max]; ratio = this / baseline. The medians count "
        "every round, a run that never reached its target at its full time (`>= `).",
        "",
        "| case | figure | this | baseline | ratio |",
        "|---|---|---|---|---|",
    ]
    for case in args.cases:
        for key, label in FIGURES[case]:
            sides = runs[(case, "this")], runs[(case, "baseline")]
            this, baseline, ratio = figure_cells(*sides, key)
            lines.append(f"| {case} | {label} | {this} | {baseline} | {ratio} |")
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        benchlib.write_section("bench_compare", "## A/B against a baseline checkout\n\n" + text)


if __name__ == "__main__":
    main()
