"""Plots learning curves from impala-train logdirs: return vs env steps and vs wall time.

Run from the repository root:

    .venv/bin/python -m tools.plot_results runs/a runs/b --out=curves.png --labels=adam,rmsprop

    .venv/bin/python -m tools.plot_results runs/pong0 runs/pong1 --out=docs/pong.png \
        --thresholds 0 18 --section=pong_learning

Each LOGDIR holds the `result.json` that impala-train writes (one RLlib result dict per line); a
path to a `result.json` itself also works. `--thresholds` prints, per run, the first result whose
`episode_reward_mean` reaches each value (env steps and wall time); `--section NAME` also writes
that table and the figure's path to BENCHMARKS.md. The x axes are `timesteps_total` (env steps
sampled) and `time_since_start_s` (wall time since the binary started), or `time_total_s` (time
inside `train()`) for results without it; the y axis is `episode_reward_mean`. Results before the
first finished episode (a NaN return) leave a gap.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence

import numpy as np

from tools import benchlib

__all__ = ["Run", "first_reaching", "load_run", "main", "plot_runs", "thresholds_table"]

RESULT_FILE = "result.json"


@dataclasses.dataclass
class Run:
    """One training run's curve.

    Attributes:
      label: The legend entry.
      steps: float64 [N], `timesteps_total` of each result.
      seconds: float64 [N], wall time of each result (see the module docstring).
      returns: float64 [N], `episode_reward_mean` (NaN before the first episode).
      time_key: The result key `seconds` came from.
    """

    label: str
    steps: np.ndarray
    seconds: np.ndarray
    returns: np.ndarray
    time_key: str


def _as_float(value) -> float:
    return float("nan") if value is None else float(value)


def load_run(path: str, label: str | None = None) -> Run:
    """Reads a logdir's `result.json` (or the file itself) into a `Run`.

    Args:
      path: A logdir or a `result.json` path.
      label: Legend entry; default: the logdir's name.

    Raises:
      FileNotFoundError: if there is no `result.json`.
      ValueError: naming the file and line for a line that is not a JSON dict with
        `timesteps_total`, or for a file with no results.
    """
    file = path if os.path.isfile(path) else os.path.join(path, RESULT_FILE)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"No {RESULT_FILE} in {path!r} (is it an impala-train logdir?)")
    results = []
    with open(file, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                result = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{file}:{number}: not a JSON line ({e})") from e
            if not isinstance(result, dict) or "timesteps_total" not in result:
                raise ValueError(f"{file}:{number}: a result dict needs `timesteps_total`")
            results.append(result)
    if not results:
        raise ValueError(f"{file} holds no results yet.")
    # One key for the whole run, so that its time axis is of one kind.
    time_key = (
        "time_since_start_s" if all("time_since_start_s" in r for r in results) else "time_total_s"
    )
    if label is None:
        label = os.path.basename(os.path.normpath(os.path.dirname(file)))
    return Run(
        label=label,
        steps=np.array([_as_float(r["timesteps_total"]) for r in results]),
        seconds=np.array([_as_float(r.get(time_key)) for r in results]),
        returns=np.array([_as_float(r.get("episode_reward_mean")) for r in results]),
        time_key=time_key,
    )


def first_reaching(run: Run, threshold: float) -> tuple[float, float] | None:
    """(env steps, seconds) of the first result whose return is >= `threshold`, or None."""
    reached = np.flatnonzero(np.nan_to_num(run.returns, nan=-np.inf) >= threshold)
    if not reached.size:
        return None
    i = int(reached[0])
    return float(run.steps[i]), float(run.seconds[i])


def thresholds_table(runs: Sequence[Run], thresholds: Sequence[float]) -> str:
    """A markdown table: per run, when each threshold was first reached, and the best return."""
    header = "| run | " + " | ".join(f"first >= {t:g}" for t in thresholds) + " | best | last |"
    lines = [header, "|---|" + "---:|" * (len(thresholds) + 2)]
    for run in runs:
        cells = []
        for threshold in thresholds:
            hit = first_reaching(run, threshold)
            cells.append(
                "not reached"
                if hit is None
                else f"{hit[1] / 60:.1f} min, {hit[0] / 1e6:.2f}M steps"
            )
        finite = run.returns[~np.isnan(run.returns)]
        best = f"{finite.max():.1f}" if finite.size else "n/a"
        last = (
            f"{run.returns[-1]:.1f} at {run.seconds[-1] / 60:.1f} min, "
            f"{run.steps[-1] / 1e6:.2f}M steps"
        )
        lines.append(f"| {run.label} | " + " | ".join(cells) + f" | {best} | {last} |")
    return "\n".join(lines)


def plot_runs(runs: Sequence[Run], title: str | None = None):
    """Draws return vs env steps (left) and vs wall time (right), one line per run.

    Returns:
      The matplotlib `Figure`.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_steps, by_time) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for run in runs:
        by_steps.plot(run.steps, run.returns, label=run.label)
        by_time.plot(run.seconds, run.returns, label=run.label)
    by_steps.set_xlabel("env steps sampled (timesteps_total)")
    by_steps.set_ylabel("episode_reward_mean")
    time_keys = sorted({run.time_key for run in runs})
    by_time.set_xlabel(f"wall time, s ({', '.join(time_keys)})")
    for ax in (by_steps, by_time):
        ax.grid(True, alpha=0.3)
    by_steps.legend(loc="best")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logdirs", nargs="+", metavar="LOGDIR", help="impala-train logdirs")
    parser.add_argument("--out", default="curves.png", help="image file to write (PNG, SVG, PDF)")
    parser.add_argument("--labels", default=None, help="comma-separated legend entries")
    parser.add_argument("--title", default=None, help="figure title")
    parser.add_argument(
        "--thresholds", type=float, nargs="*", default=[], help="returns to report reaching"
    )
    parser.add_argument(
        "--section",
        default=None,
        help="also write the thresholds table to this BENCHMARKS.md section",
    )
    args = parser.parse_args(argv)
    labels: list[str | None] = [None] * len(args.logdirs)
    if args.labels is not None:
        labels = [label.strip() for label in args.labels.split(",")]
        if len(labels) != len(args.logdirs):
            parser.error(f"--labels has {len(labels)} entries for {len(args.logdirs)} logdirs")
    try:
        runs = [load_run(path, label) for path, label in zip(args.logdirs, labels)]
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    fig = plot_runs(runs, args.title)
    fig.savefig(args.out, dpi=120)
    best = ", ".join(
        f"{run.label}: best {np.nanmax(run.returns):.1f}"
        if not np.isnan(run.returns).all()
        else f"{run.label}: no episodes"
        for run in runs
    )
    print(f"plot_results: wrote {args.out} ({best})")
    if args.thresholds:
        table = thresholds_table(runs, args.thresholds)
        print(table)
        if args.section:
            time_keys = ", ".join(sorted({run.time_key for run in runs}))
            benchlib.write_section(
                args.section,
                f"## Learning curves: {args.title or ', '.join(r.label for r in runs)}\n\n"
                f"`python -m tools.plot_results {' '.join(args.logdirs)} --thresholds "
                f"{' '.join(f'{t:g}' for t in args.thresholds)}` ({benchlib.machine_line()}). "
                f"Wall time is `{time_keys}`; figure: `{args.out}`.\n\n{table}\n",
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
