"""CartPole wall-clock benchmark: time to return 450 and env steps/s, over several seeds.

    .venv/bin/python -m tools.bench_cartpole                    # 5 seeds of the tuned config
    .venv/bin/python -m tools.bench_cartpole --seeds 0 1 --timeout 120
    .venv/bin/python -m tools.bench_cartpole --rllib-python /path/to/rllib-venv/bin/python
    .venv/bin/python -m tools.bench_cartpole --make-rllib-venv /tmp/rllib-venv
    .venv/bin/python -m tools.bench_cartpole --backend=both --seeds 0 1 2 --duration 60
    .venv/bin/python -m tools.bench_cartpole --floors 0 auto 0.1 --seeds 0 1 2 3
    .venv/bin/python -m tools.bench_cartpole --env-batches 32 256

Run from the repository root.

Each seed runs the real binary (`python -m impala_tf.bin.train --config=...`) in a fresh process;
the wall time is measured from launching the process to the moment it prints the iteration whose
`episode_reward_mean` reaches the target, so it includes Python, TensorFlow and actor start-up.
A seed that never reaches counts its full time (launch to the process's end, when it stopped or
timed out) and its full env steps in every median, never dropped, and its figures are printed as
lower bounds (`>= `); each median says how many of the seeds reached.
Throughput is `timesteps_total / time_total_s` (sampled) and `num_env_steps_trained /
time_total_s` (trained) of that last iteration, i.e. while learning, excluding start-up.

With `--rllib-python` (a Python that has `ray[rllib]` and torch; `--make-rllib-venv DIR` creates
one first and uses it), RLlib 2.60's IMPALA (new API stack, torch) runs after the seeds, in the
same invocation, with the YAML's settings (`rllib_settings`: runners, envs per runner, fragment,
batch, lr, grad_clip, loss coefficients, the MLP and `vf_share_layers`, iteration length) on the
first `--rllib-seeds` seeds (3), one at a time, each for at most `--rllib-budget-s` seconds.
Printed beside the seeds: per RLlib seed its time to the target from process start (a seed that
missed: its last iteration's, a lower bound) and its env steps/s sampled between its first and
last iteration, and the ratios of the medians of the same two figures (impala_tf's `sampled/s
(steady)`; the ratio of times is a bound where a side missed). RLlib's new stack is
not the old stack impala_tf reproduces: its loss, model code and runtime differ, and the ratio
says how fast each runs the same settings, not that they compute the same thing. Results go to
BENCHMARKS.md (section "bench_cartpole").

`--backend` picks the actor pool: `local` (processes, the default), `ray` (`--set
actor_backend=ray`: a Ray started by the driver on this machine) or `both`, which runs every
seed on both pools in the same invocation, alternating which goes first, and prints the Ray
pool's env steps/s sampled as a ratio of the local pool's (the issue's target is >= 0.70). The
rate compared is the steady one, between the first and the last iteration (start-up, Ray's
included, and the first iteration excluded). Those runs train for `--duration` seconds each
(`--stop_time_s`), or until the target return; `--timeout` is added as a safety margin. With
`ray` or `both` the figures go to the section "bench_cartpole_backends" instead, with the load
average before and after.

`--floors A B ...` runs every seed once per `min_time_s_per_broadcast` value (the driver's
broadcast floor, `impala_tf.driver.broadcast`), alternating the order from seed to seed, and
writes env steps and wall time to the target per floor (section "bench_cartpole_broadcast").

`--env-batches N ...` times an actor's env stepping alone, no policy: one `step` of N CartPoles
with random actions, as the vector env the training actors get (`GymVectorEnvBatch` over
gymnasium's `CartPoleVectorEnv`) and as N gymnasium envs stepped in turn (`GymEnvBatch`, the
per-env path), interleaved over `--rounds` rounds; it prints the median env steps/s of each and
their ratio (section "bench_cartpole_env_batches").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from tools import benchlib

__all__ = ["main", "make_rllib_venv", "rllib_settings", "run_impala", "run_rllib", "steady_rate"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RLLIB_SCRIPT = r"""
import json, sys, time
start = time.time()
s = json.loads(sys.argv[1])
import ray
from ray.rllib.algorithms.impala import IMPALAConfig
# Logical CPUs beyond the cores: the runners take one each, and RLlib's learner actor needs its
# own, or the run waits for resources forever (bench_pendulum.py, bench_atari.py).
ray.init(include_dashboard=False, num_cpus=s["runners"] + 2)
config = (
    IMPALAConfig()
    .environment("CartPole-v1")
    .env_runners(num_env_runners=s["runners"], num_envs_per_env_runner=s["envs"],
                 rollout_fragment_length=s["fragment"])
    .training(train_batch_size_per_learner=s["batch"], lr=s["lr"], grad_clip=s["grad_clip"],
              vf_loss_coeff=s["vf"], entropy_coeff=s["entropy"])
    .rl_module(model_config={"fcnet_hiddens": s["hiddens"], "fcnet_activation": s["activation"],
                             "vf_share_layers": s["vf_share_layers"]})
    .reporting(min_time_s_per_iteration=s["min_time_s"])
    .debugging(seed=s["seed"])
)
algo = config.build_algo()
while time.time() - start < s["budget_s"]:
    r = algo.train()
    runners = r.get("env_runners", {})
    steps = runners.get("num_env_steps_sampled_lifetime")
    if steps is None:  # Iterations before the first sample report no env-runner metrics.
        continue
    ret = runners.get("episode_return_mean", float("nan"))
    print(json.dumps({"t": time.time() - start, "return": ret, "steps": steps}), flush=True)
    if ret == ret and ret >= s["target"]:
        break
algo.stop()
"""


TARGET_RAY_RATIO = 0.70
BACKENDS = ("local", "ray")


def steady_rate(results: list[dict]) -> float:
    """Env steps/s sampled between the first and the last result (the first iteration excluded).

    With a single result, the rate over that result's `time_total_s`.
    """
    if not results:
        return 0.0
    first, last = results[0], results[-1]
    if len(results) < 2:
        first = {"time_total_s": 0.0, "timesteps_total": 0}
    dt = max(float(last["time_total_s"]) - float(first["time_total_s"]), 1e-9)
    return (last["timesteps_total"] - first["timesteps_total"]) / dt


def run_impala(
    config: str,
    seed: int,
    target: float,
    timeout: float,
    backend: str = "local",
    stop_time_s: float | None = None,
    sets: tuple[str, ...] = (),
) -> dict:
    """Runs the binary once on `backend`; returns wall time to target, steps and throughputs.

    With `stop_time_s` the run also stops by itself after that many seconds of training; `sets`
    are more `KEY=VALUE` overrides (`--set`).
    """
    logdir = tempfile.mkdtemp(prefix=f"bench-cartpole-{backend}-{seed}-")
    cmd = [
        sys.executable,
        "-m",
        "impala_tf.bin.train",
        f"--config={config}",
        f"--seed={seed}",
        f"--logdir={logdir}",
        f"--stop_reward={target}",
        "--checkpoint_freq=0",
        f"--set=actor_backend={backend}",
        *(f"--set={item}" for item in sets),
    ]
    if stop_time_s is not None:
        cmd.append(f"--stop_time_s={stop_time_s}")
    reached_s, results, _, exit_s = benchlib.watch_training(cmd, ROOT, logdir, target, timeout)
    last = results[-1] if results else {}
    total_s = max(last.get("time_total_s", 0.0), 1e-9)
    return {
        "seed": seed,
        "backend": backend,
        "reached": reached_s is not None,
        "wall_s": reached_s,
        # Failure-inclusive: a run that never reached counts its full time, launch to its end.
        "to_target_s": exit_s if reached_s is None else reached_s,
        "exit_s": exit_s,
        "steps": last.get("timesteps_total", 0),
        "sampled_per_s": last.get("timesteps_total", 0) / total_s,
        "trained_per_s": last.get("num_env_steps_trained", 0) / total_s,
        "steady_sampled_per_s": steady_rate(results),
        "iterations": len(results),
    }


def rllib_settings(config_path: str, target: float, budget_s: float, seed: int) -> dict:
    """The YAML's settings as RLlib's IMPALA takes them (`RLLIB_SCRIPT`), so both sides run the
    same runners, envs, fragments, batch, optimizer, loss coefficients, model and iteration
    length."""
    from impala_tf.config import ImpalaConfig

    config, _ = ImpalaConfig.from_yaml(config_path)
    return {
        **benchlib.rllib_training_settings(config),
        "hiddens": list(config.model["fcnet_hiddens"]),
        "activation": str(config.model["fcnet_activation"]),
        "vf_share_layers": bool(config.model["vf_share_layers"]),
        "min_time_s": float(config.min_time_s_per_iteration or 0),
        "target": float(target),
        "budget_s": float(budget_s),
        "seed": int(seed),
    }


def run_rllib(python: str, settings: dict) -> dict:
    """Runs RLlib's IMPALA (new API stack, torch) on CartPole in a side virtualenv with
    `settings` (`rllib_settings`): the first time (from process start) its mean return reached
    the target (`to_target_s`: that time, or its last iteration's if it never reached), and its
    env steps/s sampled between its first and its last iteration."""
    proc = subprocess.run(
        [python, "-c", RLLIB_SCRIPT, json.dumps(settings)],
        capture_output=True,
        text=True,
        timeout=settings["budget_s"] + 300,
    )
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if not rows:
        raise RuntimeError(f"RLlib run failed:\n{proc.stderr[-3000:]}")
    reached = [r for r in rows if r["return"] == r["return"] and r["return"] >= settings["target"]]
    first, last = rows[0], rows[-1]
    dt = max(last["t"] - first["t"], 1e-9)
    return {
        "reached": bool(reached),
        "wall_s": reached[0]["t"] if reached else None,
        "to_target_s": reached[0]["t"] if reached else last["t"],
        "steps": last["steps"],
        "steady_sampled_per_s": (last["steps"] - first["steps"]) / dt,
        "iterations": len(rows),
    }


def make_rllib_venv(path: str) -> str:
    """Creates a side virtualenv with RLlib (as PLATFORM.md measured it); returns its python."""
    subprocess.run([sys.executable, "-m", "venv", path], check=True)
    python = os.path.join(path, "bin", "python")
    pip = [python, "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    subprocess.run([*pip, "ray[rllib]==2.60.0", "gymnasium"], check=True)
    return python


def floor_comparison(args) -> None:
    """Every seed once per `min_time_s_per_broadcast` of `args.floors`, alternating the order:
    env steps and wall time to the target (section "bench_cartpole_broadcast")."""
    load = os.getloadavg()
    runs = []
    for k, seed in enumerate(args.seeds):
        floors = args.floors if k % 2 == 0 else list(reversed(args.floors))
        for floor in floors:
            run = run_impala(
                args.config, seed, args.target, args.timeout,
                sets=(f"min_time_s_per_broadcast={floor}",),
            )  # fmt: skip
            run["floor"] = floor
            runs.append(run)
            print(json.dumps(run), flush=True)
    lines = [
        "## CartPole and the broadcast floor (`min_time_s_per_broadcast`)",
        "",
        f"`python -m tools.bench_cartpole --floors {' '.join(args.floors)} --seeds "
        f"{' '.join(map(str, args.seeds))}` ({benchlib.machine_line()}; load average before "
        f"{load[0]:.2f}). Env steps and wall time (process start) to a mean return of "
        f"{args.target:g}, `{os.path.relpath(args.config, ROOT)}`; `>= ... (not reached)`: "
        "not reached within the config's 2M env steps or the timeout, its full env steps and "
        "time. The medians count every seed, one that never reached at its full env steps and "
        "time.",
        "",
        "| floor | "
        + " | ".join(f"seed {s}" for s in args.seeds)
        + " | median env steps | median s |",
        "|---|" + "---:|" * (len(args.seeds) + 2),
    ]
    for floor in args.floors:
        mine = [r for r in runs if r["floor"] == floor]
        steps, wall = steps_stats(mine), wall_stats(mine)
        cells = [
            f"{r['steps']:,} ({r['to_target_s']:.0f} s)"
            if r["reached"]
            else f">= {r['steps']:,} (>= {r['to_target_s']:.0f} s, not reached)"
            for r in mine
        ]
        lines.append(
            f"| {floor} | " + " | ".join(cells) + f" | {steps.text()} | {wall.text('.0f')} |"
        )
    if benchlib.other_jobs_running(load):
        lines += ["", "Other jobs loaded the machine when this ran."]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        benchlib.write_section("bench_cartpole_broadcast", text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "cartpole-impala.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--target", type=float, default=450.0)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--rllib-python", default=None)
    parser.add_argument("--make-rllib-venv", default=None)
    parser.add_argument("--rllib-budget-s", type=float, default=600.0)
    parser.add_argument(
        "--rllib-seeds", type=int, default=3, help="RLlib runs on this many of the first seeds"
    )
    parser.add_argument(
        "--backend", choices=(*BACKENDS, "both"), default="local", help="actor pool(s) to run"
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=60.0,
        help="with --backend ray or both: seconds of training per run (--stop_time_s)",
    )
    parser.add_argument(
        "--floors",
        nargs="+",
        default=None,
        help="compare these min_time_s_per_broadcast values, alternating per seed",
    )
    parser.add_argument(
        "--env-batches", type=int, nargs="+", default=None, help="time env stepping at N envs"
    )
    parser.add_argument("--rounds", type=int, default=5, help="rounds of --env-batches")
    parser.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    args = parser.parse_args()
    if args.make_rllib_venv:  # Before any run, so that a failed install costs no runs.
        args.rllib_python = make_rllib_venv(args.make_rllib_venv)
    if args.backend != "local":
        backend_comparison(args)
        return
    if args.floors:
        floor_comparison(args)
        return
    if args.env_batches:
        env_batch_comparison(args)
        return

    runs = []
    for seed in args.seeds:
        run = run_impala(args.config, seed, args.target, args.timeout)
        runs.append(run)
        print(json.dumps(run), flush=True)
    text = "\n".join(seeds_lines(args, runs))
    if args.rllib_python:
        text += "\n" + "\n".join(rllib_lines(args, args.rllib_python, runs))
    print(text)
    if not args.no_write:
        benchlib.write_section("bench_cartpole", "## CartPole wall clock\n\n" + text)


def env_batch_rate(batch, steps: int = 2000) -> float:
    """Env steps/s of `batch.step` with random actions, over `steps` vector steps."""
    actions = np.random.default_rng(0).integers(0, 2, (steps, batch.num_envs))
    batch.reset([1] * batch.num_envs)
    start = time.perf_counter()
    for row in actions:
        batch.step(row)
    return steps * batch.num_envs / (time.perf_counter() - start)


def env_batch_comparison(args: argparse.Namespace) -> None:
    """`--env-batches`: the vector env against the per-env path, per batch size."""
    import gymnasium as gym

    from impala_tf.envs.batch import GymEnvBatch, GymVectorEnvBatch

    lines = [
        "## CartPole env stepping: the vector env against the per-env path",
        "",
        f"`python -m tools.bench_cartpole --env-batches {' '.join(map(str, args.env_batches))} "
        f"--rounds {args.rounds}` ({benchlib.machine_line()}, commit "
        f"{benchlib.git_commit(ROOT)}). One actor's env batch alone (no policy), random "
        "actions, 2,000 vector steps a round, the two interleaved; median (min-max) env "
        "steps/s over the rounds.",
        "",
        "| envs | vector env (`GymVectorEnvBatch`) | per env (`GymEnvBatch`) | ratio |",
        "|---:|---:|---:|---:|",
    ]
    for n in args.env_batches:
        vector = GymVectorEnvBatch(
            gym.make_vec("CartPole-v1", n, vectorization_mode="vector_entry_point")
        )
        single = GymEnvBatch([gym.make("CartPole-v1") for _ in range(n)])
        rates = benchlib.interleaved(
            {
                "vector": lambda b=vector: env_batch_rate(b),
                "single": lambda b=single: env_batch_rate(b),
            },
            args.rounds,
        )
        v, g = benchlib.spread(rates["vector"]), benchlib.spread(rates["single"])
        lines.append(f"| {n} | {v.text()} | {g.text()} | {v.median / g.median:.2f}x |")
        print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        benchlib.write_section("bench_cartpole_env_batches", text)


def wall_stats(runs: list[dict]) -> benchlib.RunStats:
    """Seconds to the target over every run of `runs` (`run_impala`'s or `run_rllib`'s): one
    that never reached counts its full time, `to_target_s`."""
    return benchlib.run_stats([r["to_target_s"] for r in runs], [r["reached"] for r in runs])


def steps_stats(runs: list[dict]) -> benchlib.RunStats:
    """Env steps to the target over every run: one that never reached counts all its env steps
    (those of its last result)."""
    return benchlib.run_stats([r["steps"] for r in runs], [r["reached"] for r in runs])


def _wall_cell(run: dict) -> str:
    """A run's seconds to the target; `>= ` its full time where it never reached."""
    return benchlib.bounded(run["to_target_s"], run["reached"], ".1f")


def seeds_lines(args: argparse.Namespace, runs: list[dict]) -> list[str]:
    """The report's lines for impala_tf's seeds (`run_impala`'s dicts): a row per seed and the
    medians over every seed, a seed that never reached at its full time and env steps."""
    wall, steps = wall_stats(runs), steps_stats(runs)
    median_sampled = statistics.median(r["sampled_per_s"] for r in runs)
    median_trained = statistics.median(r["trained_per_s"] for r in runs)
    lines = [
        f"CartPole-v1 to episode_reward_mean >= {args.target:g} with "
        f"`{os.path.relpath(args.config, ROOT)}` ({benchlib.machine_line()}).",
        "",
        "| seed | reached | wall s (process start to result) | env steps | sampled/s | trained/s |",
        "|---:|:---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        lines.append(
            f"| {r['seed']} | {'yes' if r['reached'] else 'no'} | {_wall_cell(r)} | "
            f"{benchlib.bounded(r['steps'], r['reached'])} | "
            f"{r['sampled_per_s']:,.0f} | {r['trained_per_s']:,.0f} |"
        )
    lines += [
        "",
        f"**{wall.reached} of {wall.runs} seeds reached {args.target:g}; median wall time "
        f"{wall.text('.1f', ' s')}; median {steps.text(unit=' env steps')}; median throughput "
        f"while learning {median_sampled:,.0f} sampled/s, {median_trained:,.0f} trained/s.**",
        "",
        "The medians count every seed: one that never reached counts at its full time (process "
        "start to its end, when it stopped or timed out) and its full env steps, `>= ` above.",
    ]
    return lines


def rllib_lines(args: argparse.Namespace, python: str, runs: list[dict]) -> list[str]:
    """Runs RLlib on the first `--rllib-seeds` seeds, one after another after ours (`runs`);
    returns the report's lines: a row per seed and the ratios of the medians, the times'
    counting every seed (a bound where a side has a seed that missed)."""
    seeds = args.seeds[: max(1, args.rllib_seeds)]
    settings = rllib_settings(args.config, args.target, args.rllib_budget_s, seeds[0])
    rows = []
    for seed in seeds:
        rllib = run_rllib(python, {**settings, "seed": int(seed)})
        rows.append({"seed": seed, **rllib})
        print(json.dumps({"rllib": rows[-1]}), flush=True)
    lines = [
        "",
        f"RLlib 2.60 IMPALA (torch, new API stack) with the same YAML's settings "
        f"({settings['runners']} runners x {settings['envs']} envs, fragments of "
        f"{settings['fragment']}, batches of {settings['batch']}, lr {settings['lr']:g}, "
        f"grad_clip {settings['grad_clip']:g}, vf_loss_coeff {settings['vf']:g}, "
        f"entropy_coeff {settings['entropy']:g}, MLP {settings['hiddens']} "
        f"{settings['activation']}, vf_share_layers {settings['vf_share_layers']}), same "
        f"machine, one seed at a time after the seeds above, at most {args.rllib_budget_s:g} s "
        "each:",
        "",
        "| RLlib seed | reached | wall s (process start to result) | env steps | "
        "sampled/s (first to last iteration) | iterations |",
        "|---:|:---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['seed']} | {'yes' if r['reached'] else 'no'} | {_wall_cell(r)} | "
            f"{benchlib.bounded(r['steps'], r['reached'])} | "
            f"{r['steady_sampled_per_s']:,.0f} | {r['iterations']} |"
        )
    ours = statistics.median(r["steady_sampled_per_s"] for r in runs)
    theirs = statistics.median(r["steady_sampled_per_s"] for r in rows)
    ours_wall, theirs_wall = wall_stats(runs), wall_stats(rows)
    ratio = benchlib.ratio_text(theirs_wall, ours_wall, ".1f")
    lines += [
        "",
        f"Env steps/s sampled between the first and the last iteration, median of impala_tf's "
        f"seeds / median of RLlib's: **{ours / max(theirs, 1e-9):.1f}x**.",
        f"Time to {args.target:g} from process start, RLlib's median "
        f"{theirs_wall.text('.1f', ' s')} / impala_tf's median {ours_wall.text('.1f', ' s')}: "
        + (
            f"**{ratio}x**"
            if ratio != "-"
            else "not given (both sides have seeds that missed: each median is a lower bound)"
        )
        + ". The medians count every seed, one that missed at its full time.",
    ]
    return lines


def backend_comparison(args: argparse.Namespace) -> None:
    """Runs every seed on the chosen backend(s), alternating, and reports the Ray/local ratio."""
    backends = BACKENDS if args.backend == "both" else (args.backend,)
    load_before = os.getloadavg()
    runs = []
    for i, seed in enumerate(args.seeds):
        order = backends if i % 2 == 0 else tuple(reversed(backends))
        for backend in order:
            run = run_impala(
                args.config,
                seed,
                args.target,
                args.duration + args.timeout,
                backend,
                stop_time_s=args.duration,
            )
            runs.append(run)
            print(json.dumps(run), flush=True)
    load_after = os.getloadavg()
    lines = [
        "## CartPole: Ray pool vs local pool",
        "",
        f"`python -m tools.bench_cartpole --backend={args.backend}` with "
        f"`{os.path.relpath(args.config, ROOT)}`, {args.duration:g} s of training per run "
        f"(`--stop_time_s`; stopped earlier at return {args.target:g}) "
        f"({benchlib.machine_line()}). Load average (1 min) "
        f"{load_before[0]:.1f} before, {load_after[0]:.1f} after, on {os.cpu_count()} cores. "
        "`>= `: not reached, the run's full time and env steps.",
        "",
        "| seed | backend | reached | wall s (process start to result) | env steps | "
        "sampled/s (steady) | sampled/s (all iterations) |",
        "|---:|---|:---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        lines.append(
            f"| {r['seed']} | {r['backend']} | {'yes' if r['reached'] else 'no'} | "
            f"{_wall_cell(r)} | {benchlib.bounded(r['steps'], r['reached'])} | "
            f"{r['steady_sampled_per_s']:,.0f} | {r['sampled_per_s']:,.0f} |"
        )
    lines += benchlib.backend_ratio_lines(
        runs, "steady_sampled_per_s", "steady env steps/s sampled", TARGET_RAY_RATIO
    )
    if benchlib.other_jobs_running(load_before):
        lines += [
            "",
            "**Measured under load (other jobs running): these figures are not clean; re-run on "
            "an idle machine before quoting them.**",
        ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        benchlib.write_section("bench_cartpole_backends", text)


if __name__ == "__main__":
    main()
