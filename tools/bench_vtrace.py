"""Benchmarks of impala_tf's learner-side computations, one BENCHMARKS.md section each.

Run from the repository root: `.venv/bin/python -m tools.bench_vtrace [--no-write]`.

Sections:
    bench_vtrace: V-trace (`impala_tf.learning.vtrace.from_importance_weights`) against
        `impala_tf.learning.vtrace.scan_vtrace_baseline` (the same function with its reverse
        recursion written as RLlib's `vtrace_tf.py` writes it: `tf.scan`, `parallel_iterations=1`;
        RLlib's own code is not run) and a numpy loop, at T=50 (time), B=500 (batch), float32.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from impala_tf.learning import vtrace  # noqa: E402
from tools import benchlib  # noqa: E402

__all__ = ["main", "vtrace_section"]

NUM_STEPS = 50  # T, RLlib's rollout_fragment_length.
BATCH = 500  # B, RLlib's train_batch_size / T.
CHAIN = 10  # V-traces per call in the in-graph measurement.
ROUNDS = 15  # Candidates are timed in interleaved rounds, so drift hits them all alike.
REPEATS = 10
#: The baseline row: impala_tf's own V-trace with RLlib's recursion (`tf.scan`), not RLlib's code.
BASELINE = "impala_tf, `tf.scan` recursion (baseline)"


def _vtrace_inputs(seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    shape = (NUM_STEPS, BATCH)
    discounts = np.where(rng.random(shape) < 0.02, 0.0, 0.99)
    return tuple(
        x.astype(np.float32)
        for x in (
            rng.normal(scale=0.5, size=shape),  # log_rhos
            discounts,
            rng.normal(size=shape),  # rewards
            rng.normal(size=shape),  # values
            rng.normal(size=shape[1:]),  # bootstrap_value
        )
    )


def _numpy_vtrace(log_rhos, discounts, rewards, values, bootstrap_value):
    """The reverse recursion as a numpy loop over T, vectorised over B (thresholds 1.0)."""
    rhos = np.exp(log_rhos)
    clipped_rhos = np.minimum(1.0, rhos)
    next_values = np.concatenate([values[1:], bootstrap_value[None]])
    deltas = clipped_rhos * (rewards + discounts * next_values - values)
    decay = discounts * clipped_rhos  # c-bar = rho-bar = 1 here.
    acc = np.zeros_like(bootstrap_value)
    vs_minus_v = np.empty_like(values)
    for t in range(len(values) - 1, -1, -1):
        acc = deltas[t] + decay[t] * acc
        vs_minus_v[t] = acc
    vs = values + vs_minus_v
    next_vs = np.concatenate([vs[1:], bootstrap_value[None]])
    return vs, clipped_rhos * (rewards + discounts * next_vs - values)


def _single(fn: Callable) -> Callable:
    return lambda log_rhos, discounts, rewards, values, bootstrap_value: tuple(
        fn(log_rhos, discounts, rewards, values, bootstrap_value)
    )


def _chained(fn: Callable) -> Callable:
    """CHAIN V-traces in one call; each feeds the next's values, so they run one after another."""

    def run(log_rhos, discounts, rewards, values, bootstrap_value):
        for _ in range(CHAIN):
            vs, pg_advantages = fn(log_rhos, discounts, rewards, values, bootstrap_value)
            values = values + 1e-6 * vs
        return vs, pg_advantages

    return run


def _empty(log_rhos, discounts, rewards, values, bootstrap_value):
    return log_rhos + discounts, rewards + values


def _time_interleaved(calls: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Median seconds per call of each candidate, over ROUNDS interleaved rounds."""
    for call in calls.values():
        benchlib.median_seconds(call, repeats=1, warmup=3)
    samples = {name: [] for name in calls}
    for _ in range(ROUNDS):
        for name, call in calls.items():
            samples[name].append(benchlib.median_seconds(call, repeats=REPEATS, warmup=1))
    return {name: float(np.median(times)) for name, times in samples.items()}


def vtrace_section() -> str:
    """Times V-trace implementations at T=50, B=500 and returns a markdown section."""
    load_before = os.getloadavg()
    arrays = _vtrace_inputs()
    tensors = tuple(tf.constant(x) for x in arrays)
    unknown_shapes = [tf.TensorSpec([None, None])] * 4 + [tf.TensorSpec([None])]
    baseline, ours = vtrace.scan_vtrace_baseline, vtrace.from_importance_weights

    # (label, mode, function of the five tensors or None, in-graph function or None)
    rows = [
        (BASELINE, "tf.function", tf.function(_single(baseline)), tf.function(_chained(baseline))),
        (BASELINE, "XLA", tf.function(_single(baseline), jit_compile=True),
         tf.function(_chained(baseline), jit_compile=True)),
        ("impala_tf", "eager", _single(ours), None),
        ("impala_tf", "tf.function", tf.function(_single(ours)), tf.function(_chained(ours))),
        ("impala_tf", "tf.function, unknown T and B",
         tf.function(_single(ours), input_signature=unknown_shapes),
         tf.function(_chained(ours), input_signature=unknown_shapes)),
        ("impala_tf", "XLA", tf.function(_single(ours), jit_compile=True),
         tf.function(_chained(ours), jit_compile=True)),
        ("numpy loop over T", "numpy", None, None),
        ("empty function, same inputs and outputs", "tf.function", tf.function(_empty), None),
        ("empty function, same inputs and outputs", "XLA", tf.function(_empty, jit_compile=True),
         None),
    ]  # fmt: skip

    expected_vs, expected_pg = _numpy_vtrace(*arrays)
    calls = {}
    for label, mode, single, chained in rows:
        key = f"{label} / {mode}"
        if single is None:
            calls[key] = lambda: _numpy_vtrace(*arrays)
            continue
        if "empty" not in label:
            vs, pg_advantages = single(*tensors)
            np.testing.assert_allclose(vs.numpy(), expected_vs, rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(pg_advantages.numpy(), expected_pg, rtol=1e-4, atol=1e-4)
        calls[key] = lambda f=single: [x.numpy() for x in f(*tensors)]
        if chained is not None:
            calls[key + " / chained"] = lambda f=chained: [x.numpy() for x in f(*tensors)]
    seconds = _time_interleaved(calls)
    load_after = os.getloadavg()

    base_call = seconds[f"{BASELINE} / tf.function"]
    base_graph = seconds[f"{BASELINE} / tf.function / chained"] / CHAIN
    lines = [
        f"### V-trace, T={NUM_STEPS}, B={BATCH}, float32",
        "",
        f"Machine: {benchlib.machine_line()}; load average (1 min) {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after",
        "",
        "| implementation | mode | per call (ms) | speed-up | in graph (ms / V-trace) | speed-up |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for label, mode, _, chained in rows:
        key = f"{label} / {mode}"
        per_call = seconds[key]
        cells = [label, mode, f"{per_call * 1e3:.3f}"]
        cells.append("" if "empty" in label else f"{base_call / per_call:.1f}x")
        if chained is None:
            cells += ["", ""]
        else:
            in_graph = seconds[key + " / chained"] / CHAIN
            cells += [f"{in_graph * 1e3:.3f}", f"{base_graph / in_graph:.1f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Per call: median wall time of one call from Python with the outputs fetched by "
        "`.numpy()`; it includes TensorFlow's function-call overhead, which the empty-function "
        f"rows measure. In graph: one call runs {CHAIN} chained V-traces (each one's `vs` feeds "
        f"the next one's values), time / {CHAIN}: the cost inside a learner's traced train step. "
        "Speed-ups are against the baseline under `tf.function` in the same column. The "
        "baseline is `impala_tf.learning.vtrace.scan_vtrace_baseline`: impala_tf's V-trace with "
        "its "
        "reverse recursion written as RLlib's `vtrace_tf.py` writes it (`tf.scan`, "
        "`parallel_iterations=1`); RLlib's own code is not run. Thresholds "
        "rho-bar = rho-bar_pg = 1.0; 2% of discounts are zero.",
    ]
    if benchlib.other_jobs_running(load_before):
        lines += ["", "Other jobs loaded the machine when this ran: the figures are noisy."]
    return "\n".join(lines)


SECTIONS: dict[str, Callable[[], str]] = {
    "bench_vtrace": vtrace_section,
}


def main() -> None:
    """Runs every section, prints it and writes it to BENCHMARKS.md (unless `--no-write`)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    args = parser.parse_args()
    for name, section in SECTIONS.items():
        markdown = section()
        print(markdown, flush=True)
        if not args.no_write:
            benchlib.write_section(name, markdown)


if __name__ == "__main__":
    main()
