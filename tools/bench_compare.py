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
them to BENCHMARKS.md (section "bench_compare").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from tools import benchlib

__all__ = ["CASES", "main", "run_case"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: case -> (YAML under configs/, target return (None: none), extra flags of the binary).
CASES = {
    "cartpole": ("cartpole-impala.yaml", 450.0, []),
    "pong": ("pong-impala-small.yaml", None, []),
    "multi_agent": ("multi-agent-cartpole-impala.yaml", 600.0, []),
}


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
    """One run of `case` with the checkout at `root` (its `python`); returns its figures."""
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
    reached_s, results, tail = benchlib.watch_training(cmd, root, logdir, target, timeout)
    if not results:
        raise RuntimeError(f"{case} with {python} wrote no results:\n{''.join(tail)}")
    last = results[-1]
    return {
        "reached_s": reached_s,
        "env_steps": int(last["timesteps_total"]),
        "return": last.get("episode_reward_mean"),
        **_rates(results),
    }


def _median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _fmt(value: float | None, spec: str = ",.0f") -> str:
    return "-" if value is None else format(value, spec)


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
        + ". Medians over the rounds [min, max]; ratio = this / baseline.",
        "",
        "| case | figure | this | baseline | ratio |",
        "|---|---|---|---|---|",
    ]
    figures = {
        "cartpole": [("reached_s", "s to 450 (from launch)"), ("sampled_per_s", "env steps/s")],
        "pong": [("trained_per_s", "env steps/s trained"), ("sampled_per_s", "env steps/s")],
        "multi_agent": [("reached_s", "s to 600 (from launch)"), ("sampled_per_s", "env steps/s")],
    }
    for case in args.cases:
        for key, label in figures[case]:
            cells = []
            medians = {}
            for side in ("this", "baseline"):
                values = [run[key] for run in runs[(case, side)]]
                medians[side] = _median(values)
                known = [v for v in values if v is not None]
                spread = f" [{_fmt(min(known))}, {_fmt(max(known))}]" if known else ""
                missed = sum(v is None for v in values)
                note = f" ({missed} not reached)" if missed else ""
                cells.append(f"{_fmt(medians[side])}{spread}{note}")
            ratio = (
                medians["this"] / medians["baseline"]
                if medians["this"] is not None and medians["baseline"]
                else None
            )
            lines.append(f"| {case} | {label} | {cells[0]} | {cells[1]} | {_fmt(ratio, '.3f')} |")
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        benchlib.write_section("bench_compare", "## A/B against a baseline checkout\n\n" + text)


if __name__ == "__main__":
    main()
