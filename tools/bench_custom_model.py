"""What a custom model costs: CartPole with the built-in MLP against the same MLP as a Keras model.

    .venv/bin/python -m tools.bench_custom_model --rounds 3 --train_s 20

Run from the repository root. Each round runs `configs/cartpole-impala.yaml` (the catalog's MLP,
which the actors run as a hand-written numpy program, `impala_tf.acting.numpy_policy`) and
`configs/cartpole-impala-keras-model.yaml` (the same network written as a functional Keras
model, `examples.custom_models:keras_mlp`, whose traced step the actors run with numpy op by
op, `impala_tf.acting.traced_policy`; every other key the same), one after the other, alternating
which goes first, with the same seed, for `--train_s` seconds of training each (the reward stop
is lifted so both train the whole time). Every run is the real binary
(`python -m impala_tf.bin.train`, `--checkpoint_freq=0`). The figures are env steps/s sampled
and trained between the first and the last iteration (start-up excluded), as
`tools/bench_compare.py` measures them.

It prints the medians over the rounds with their spread, the ratio custom / built-in, and
writes them to BENCHMARKS.md (section "bench_custom_model").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from tools import benchlib

__all__ = ["CASES", "main"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: case -> its YAML under configs/.
CASES = {
    "built-in MLP (hand-written numpy)": "cartpole-impala.yaml",
    "Keras model (traced step in numpy)": "cartpole-impala-keras-model.yaml",
}


def _rates(results: list[dict]) -> dict[str, float]:
    first, last = results[0], results[-1]
    dt = max(float(last["time_total_s"]) - float(first["time_total_s"]), 1e-9)
    return {
        "sampled_per_s": (last["timesteps_total"] - first["timesteps_total"]) / dt,
        "trained_per_s": (last["num_env_steps_trained"] - first["num_env_steps_trained"]) / dt,
    }


def run_case(yaml: str, seed: int, train_s: float, timeout: float) -> dict:
    """One run of `yaml` for `train_s` seconds of training; its rates."""
    logdir = tempfile.mkdtemp(prefix="bench-custom-model-")
    cmd = [
        sys.executable,
        "-m",
        "impala_tf.bin.train",
        f"--config={os.path.join(ROOT, 'configs', yaml)}",
        f"--logdir={logdir}",
        f"--seed={seed}",
        "--checkpoint_freq=0",
        f"--stop_time_s={train_s}",
        "--stop_reward=1e9",
        "--stop_timesteps=1000000000",
    ]
    _, results, tail, _ = benchlib.watch_training(cmd, ROOT, logdir, None, timeout)
    if len(results) < 2:
        raise RuntimeError(f"{yaml} wrote {len(results)} results:\n{''.join(tail)}")
    return {"env_steps": int(results[-1]["timesteps_total"]), **_rates(results)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--train_s", type=float, default=20.0, help="training seconds per run")
    parser.add_argument("--timeout", type=float, default=300.0, help="per run, seconds")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {case: [] for case in CASES}
    names = list(CASES)
    for r in range(args.rounds):
        for case in names if r % 2 == 0 else names[::-1]:
            out = run_case(CASES[case], 100 + r, args.train_s, args.timeout)
            runs[case].append(out)
            print(f"round {r} {case}: {json.dumps(out)}", flush=True)
    lines = [
        f"`python -m tools.bench_custom_model --rounds {args.rounds} --train_s {args.train_s:g}` "
        f"({benchlib.git_commit(ROOT, 7)}; {benchlib.machine_line()}); load average before "
        f"{load_before[0]:.2f}"
        + (" (other jobs were running)" if benchlib.other_jobs_running(load_before) else "")
        + ". CartPole with `configs/cartpole-impala.yaml` against the same network as a "
        "functional Keras model (`configs/cartpole-impala-keras-model.yaml`), alternating, "
        "seeds 100, 101, ...; medians over the rounds [min, max] of the env steps/s between "
        "the first and the last iteration.",
        "",
        "| model | env steps/s sampled | env steps/s trained |",
        "|---|---|---|",
    ]
    medians: dict[str, dict[str, float]] = {}
    for case in names:
        cells = []
        for key in ("sampled_per_s", "trained_per_s"):
            values = [run[key] for run in runs[case]]
            medians.setdefault(case, {})[key] = statistics.median(values)
            median = statistics.median(values)
            cells.append(f"{median:,.0f} [{min(values):,.0f}, {max(values):,.0f}]")
        lines.append(f"| {case} | {cells[0]} | {cells[1]} |")
    built_in, custom = (medians[c] for c in names)
    ratio = custom["trained_per_s"] / built_in["trained_per_s"]
    lines += [
        "",
        f"Custom / built-in, env steps/s trained: **{ratio:.3f}** "
        f"(sampled: {custom['sampled_per_s'] / built_in['sampled_per_s']:.3f}; "
        f"target >= 0.90: {'met' if ratio >= 0.9 else 'not met'}).",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        benchlib.write_section(
            "bench_custom_model", "## What a custom model costs (CartPole)\n\n" + text
        )


if __name__ == "__main__":
    main()
