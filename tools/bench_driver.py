"""Driver intake: how many env steps per second one driver core takes from its actors.

    .venv/bin/python -m tools.bench_driver                  # every case, writes BENCHMARKS.md
    .venv/bin/python -m tools.bench_driver --seconds 5 --cases pong42 --backends local --no-write

Run from the repository root (the cases run as `python -m tools.bench_driver --case ...`).

The driver here is the real one (`impala_tf.driver`: `EnvRunnerGroup` on the process or Ray
backend, `AggregationStage` in the driver or in aggregation workers, `Metrics`, `Broadcaster`,
`AsyncSchedule`), with two parts replaced:

* the actors are `ReplayHost`s: each answers `sample` with fragments recorded once from a real
  env runner of the workload's config (packed as a real actor packs them), as fast as the driver
  asks; they cost the driver what real actors cost it (receiving, unpickling, decoding, counting,
  cutting, broadcasting), with no env or inference;
* the learners are a `StubLearners`: train batches are taken at once (nothing waits on a queue)
  and the policy version advances at `--updates-per-s` whatever arrives, the weights being
  arrays of the real model's shapes. A train batch an aggregation worker left in the store is
  fetched by a thread of the driver process, as the learner's loader fetches it, and its CPU
  time counts in the per-core figure.

Workloads: `cartpole` (configs/cartpole-impala.yaml: 32 envs x 50 steps, MLP), `pong42`
(configs/pong-impala-small.yaml: 16 envs x 50 steps, 42x42x4 frames) and `pong84` (the same with
`model: {dim: 84}`). Each case runs in a fresh process for `--seconds` after a warm-up and
reports env steps per second of wall time and per second of the driver process's CPU time
("per driver core": every thread of the driver process counted, Ray's included), the
fragments' bytes per second (their pickled size) and, per fragment, the driver's main-thread CPU
time in microseconds split by stage (receive: poll, unpickle and filter merges; count; aggregate:
decode, replay and batch cutting, or handing the fragment to an aggregation worker and taking
its train batches back; queue; broadcast; request: sending the next sample calls).

Paced rows (`--paced-rate`, fragments per second per fake actor): Pong-42 on local processes
with the actors paced below what the driver and the aggregation workers take on these cores, so
that nothing is saturated: the main thread's cost per fragment, and the share of fragments the
aggregation workers take, when there are enough of them for the load.

`weights`: 128 actors replaying Pong-42 fragments and a stub learner at 1,000 updates/s with the
Pong CNN's weights (4 MB): the weight broadcasts per second the driver makes
(`num_weight_broadcasts`; on Ray each is one `ray.put`), with the default
`min_time_s_per_broadcast` ("auto"). And Pong-42 on local processes once more with the stub
learner at 1 update/s: the difference is the driver's share of broadcasting (on local processes
one write of the weights into shared memory per broadcast, and a handle per actor; the fake
actors copy the weights out as real ones do).

The last line printed is one line of JSON with the headline figures:
`cartpole_env_steps_per_core_s`, `pong42_env_steps_per_core_s` (local processes, driver
aggregation), `ray_pong42_env_steps_per_core_s` (Ray, driver aggregation) and
`weight_puts_per_s_128_actors`. Results go to BENCHMARKS.md (section "bench_driver").
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import os
import pickle
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from typing import Any

from tools import benchlib

__all__ = ["ReplayHost", "StubLearners", "case_intake", "main", "measure_intake", "record"]

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKLOADS = {
    "cartpole": ("cartpole-impala.yaml", {}),
    "pong42": ("pong-impala-small.yaml", {}),
    "pong84": ("pong-impala-small.yaml", {"model": {"dim": 84}}),
}
#: Fragments recorded per workload (replayed in turn).
RECORDED_FRAGMENTS = 4
STAGES = ("receive", "count", "aggregate", "queue", "broadcast", "request")


def workload_config(workload: str, **overrides: Any):
    """The workload's shipped config with `overrides` (RLlib keys) applied."""
    from impala_tf.config import AlgorithmConfig

    name, extra = WORKLOADS[workload]
    config, _ = AlgorithmConfig.from_yaml(os.path.join(ROOT, "configs", name))
    for key, value in {**extra, **overrides}.items():
        if key == "model":
            config.model = {**config.model, **value}
        else:
            setattr(config, key, value)
    return config


# Recording -------------------------------------------------------------------------------------


def record(workload: str, path: str) -> dict[str, Any]:
    """Records `RECORDED_FRAGMENTS` packed fragments of a real env runner, and its weights."""
    from impala_tf.driver.plan import make_plan
    from impala_tf.learning.learner import ImpalaLearner
    from impala_tf.rollout.fragment import DEFAULT_POLICY_ID
    from impala_tf.rollout.host import make_runner_host

    config = workload_config(workload, seed=0)
    plan = make_plan(config)
    obs_space, action_space = plan.spaces.policies[DEFAULT_POLICY_ID]
    learner = ImpalaLearner(config, obs_space, action_space)
    host = make_runner_host(0, plan.runner)
    host.set_weights({DEFAULT_POLICY_ID: (learner.get_policy_weights(), 0)})
    host.sample()  # The first fragment pays for warm-up; not recorded.
    fragments = [host.sample() for _ in range(RECORDED_FRAGMENTS)]
    weights = host.runner.get_weights()
    sizes = [len(pickle.dumps(f, protocol=5)) for f in fragments]
    with open(path, "wb") as f:
        pickle.dump({"fragments": fragments, "weights": weights, "sizes": sizes}, f, protocol=5)
    return {
        "env_steps": fragments[0].env_steps,
        "fragment_bytes": statistics.median(sizes),
        "weight_bytes": sum(int(w.nbytes) for ws in weights.values() for w in ws),
    }


class ReplayHost:
    """A fake actor: answers `sample` with recorded fragments, in turn, at once (or, with
    `fragments_per_s`, at most that many per second, as an actor stepping envs would).

    `set_weights` gets the weights read as a real actor gets them (copied out of shared memory on
    local processes, by the worker host).

    Built by the worker mechanism like `impala_tf.rollout.host.make_runner_host`, with the
    recording's `path` bound (`functools.partial`).
    """

    def __init__(
        self, actor_id: int, *args: Any, path: str, fragments_per_s: float = 0.0, **kwargs: Any
    ):
        del args, kwargs
        with open(path, "rb") as f:
            self._fragments = pickle.load(f)["fragments"]
        self.actor_id = actor_id
        self._next = 0
        self.weights_applied = 0
        self._period = 1.0 / fragments_per_s if fragments_per_s > 0 else 0.0
        self._due = time.monotonic()

    def sample(self):
        if self._period:
            self._due = max(self._due + self._period, time.monotonic())
            time.sleep(max(0.0, self._due - time.monotonic()))
        fragment = self._fragments[self._next % len(self._fragments)]
        self._next += 1
        return dataclasses.replace(fragment, actor_id=self.actor_id)

    def sample_parts(self):
        """`sample()` as (the fragment without batches, the batches), as `RunnerHost` gives it."""
        fragment = self.sample()
        return dataclasses.replace(fragment, batches={}), fragment.batches

    def set_weights(self, weights: Mapping, filters: Mapping | None = None) -> None:
        del weights, filters
        self.weights_applied += 1

    def get_state(self) -> dict:
        return {}

    def set_state(self, state: dict) -> None:
        del state

    def pid(self) -> int:
        return os.getpid()


class StubLearners:
    """The learner group's interface to the driver, with no learning (see the module docstring).

    Args:
      trained: The trained policy ids.
      weights: {policy_id: weight arrays} (the real model's shapes).
      updates_per_s: How fast the policy version advances.
    """

    def __init__(self, trained: list[str], weights: Mapping[str, list], updates_per_s: float):
        self.trained = list(trained)
        self.policy_ids = list(weights)
        self._weights = dict(weights)
        self._rate = float(updates_per_s)
        self._start = time.monotonic()
        self._outputs: collections.deque = collections.deque()
        self.batches = 0
        # The loader's part: fetching the batches queued as handles.
        self._fetches: queue.Queue = queue.Queue()
        self._fetcher = threading.Thread(target=self._fetch, daemon=True)
        self._fetcher.start()

    def check(self) -> None:
        """Stub learners never die."""

    def put(self, batches: list, counters: Any) -> None:
        from impala_tf.data.train_batch import BatchHandle, TrainBatch

        for pid, batch, _ in batches:
            item = TrainBatch(batch)
            counters.num_samples_added_to_queue += item.env_steps
            self._outputs.append((pid, item.env_steps, {}))
            if isinstance(batch, BatchHandle):  # Still in the store: fetched as a loader would.
                self._fetches.put(item)
            self.batches += 1

    def _fetch(self) -> None:
        while (item := self._fetches.get()) is not None:
            item.batch  # noqa: B018 - fetched here, as the learner's loader does.
            self._fetches.task_done()

    def wait_fetched(self) -> None:
        """Waits until every batch put so far was fetched."""
        self._fetches.join()

    def stop(self) -> None:
        self._fetches.put(None)
        self._fetcher.join(10)

    def drain(self) -> list:
        out = list(self._outputs)
        self._outputs.clear()
        return out

    def _version(self) -> int:
        return int((time.monotonic() - self._start) * self._rate)

    def versions(self) -> dict[str, int]:
        return {pid: self._version() for pid in self.policy_ids}

    def snapshot(self, pid: str, wait: bool = True) -> tuple[list, int]:
        del wait
        return self._weights[pid], self._version()

    def weights(self) -> dict[str, tuple[list, int]]:
        return {pid: self.snapshot(pid) for pid in self.policy_ids}


class _StageTimer:
    """Main-thread CPU seconds spent in each wrapped method, while `on`."""

    def __init__(self):
        self.seconds: collections.Counter = collections.Counter()
        self.on = False

    def wrap(self, obj: Any, method: str, stage: str) -> None:
        original = getattr(obj, method)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                if self.on:
                    self.seconds[stage] += time.thread_time() - start

        setattr(obj, method, timed)


def case_intake(
    workload: str,
    backend: str,
    actors: int,
    aggregation_workers: int,
    seconds: float,
    updates_per_s: float,
    recording: str,
    in_flight: int = 2,
    actor_rate: float = 0.0,
) -> dict[str, Any]:
    """One case: the real driver fed by `actors` `ReplayHost`s for `seconds` (module docstring)."""
    from impala_tf.config.policies import policy_config
    from impala_tf.data.batching import rows_per_batch
    from impala_tf.driver import specs
    from impala_tf.driver.aggregation import AggregationStage
    from impala_tf.driver.broadcast import Broadcaster
    from impala_tf.driver.metrics import Metrics
    from impala_tf.driver.plan import make_plan
    from impala_tf.driver.sampling import EnvRunnerGroup, make_backend
    from impala_tf.driver.schedule import AsyncSchedule
    from impala_tf.driver.specs import aggregator_spec

    with open(recording, "rb") as f:
        recorded = pickle.load(f)
    config = workload_config(
        workload,
        seed=0,
        num_env_runners=actors,
        num_aggregation_workers=aggregation_workers,
        actor_backend="ray" if backend == "ray" else "local",
        max_requests_in_flight_per_env_runner=in_flight,
        inference="actor",
    )
    plan = make_plan(config)
    metrics = Metrics(config.metrics_num_episodes_for_smoothing, plan.trained, False)
    counters = metrics.counters
    host = functools.partial(ReplayHost, path=recording, fragments_per_s=actor_rate)
    # The memory guard sizes real actors (envs, TensorFlow); a `ReplayHost` holds neither, so
    # 128 of them fit where 128 Pong actors would not.
    specs.check_actor_memory = lambda *args, **kwargs: None
    group = EnvRunnerGroup(specs.sampling_spec(config, plan), plan, counters, host_factory=host)
    aggregation = learners = None
    try:
        learners = StubLearners(plan.trained, recorded["weights"], updates_per_s)
        rows = {p: rows_per_batch(policy_config(config, p), 1) for p in plan.trained}
        agg_backend = make_backend(group.spec, plan) if aggregation_workers else None
        aggregation = AggregationStage(aggregator_spec(config, rows), counters, agg_backend)
        broadcaster = Broadcaster(
            learners,
            group,
            config.broadcast_interval,
            counters,
            min_time_s=config.min_time_s_per_broadcast,
        )
        schedule = AsyncSchedule(group, aggregation, learners, broadcaster, metrics)
        timer = _StageTimer()
        for obj, method, stage in (
            (group, "fetch", "receive"),
            (metrics, "record_fragment", "count"),
            (aggregation, "process", "aggregate"),
            (aggregation, "fetch", "aggregate"),
            (learners, "put", "queue"),
            (broadcaster, "step", "broadcast"),
            (group, "top_up", "request"),
        ):
            timer.wrap(obj, method, stage)
        fragments = collections.Counter()
        original_fetch = group.fetch

        def counting_fetch(timeout_s):
            got, failures = original_fetch(timeout_s)
            if timer.on:
                fragments["n"] += len(got)
            return got, failures

        group.fetch = counting_fetch
        broadcaster.send(group.healthy_ids())
        schedule.start()
        # Warm-up: every actor up and answering, then a few seconds of steady state.
        deadline = time.monotonic() + 300
        while counters.num_env_steps_sampled < actors * recorded["fragments"][0].env_steps:
            schedule.step()
            if time.monotonic() > deadline:
                raise RuntimeError("the fake actors did not answer within 300 s")
        warm_until = time.monotonic() + min(3.0, seconds / 2)
        while time.monotonic() < warm_until:
            schedule.step()
        before = counters.copy()
        batches_before = learners.batches
        cpu0, wall0, main0 = time.process_time(), time.perf_counter(), time.thread_time()
        timer.on = True
        while time.perf_counter() - wall0 < seconds:
            schedule.step()
        timer.on = False
        learners.wait_fetched()  # The fetches of the batches taken belong to the window.
        cpu = time.process_time() - cpu0
        wall = time.perf_counter() - wall0
        main = time.thread_time() - main0
    finally:
        if learners is not None:
            learners.stop()
        if aggregation is not None:
            aggregation.stop()
        group.stop()
    steps = counters.num_env_steps_sampled - before.num_env_steps_sampled
    n = max(1, fragments["n"])
    per_fragment = {s: round(timer.seconds[s] / n * 1e6, 1) for s in STAGES}
    per_fragment["other"] = round(max(0.0, main - sum(timer.seconds.values())) / n * 1e6, 1)
    broadcasts = counters.num_weight_broadcasts - before.num_weight_broadcasts
    overflow = (
        counters.num_times_no_aggregation_worker_available
        - before.num_times_no_aggregation_worker_available
    )
    fragment_bytes = statistics.median(recorded["sizes"])
    return {
        "workload": workload,
        "backend": backend,
        "actors": actors,
        "actor_rate": actor_rate,
        "aggregation_workers": aggregation_workers,
        "seconds": round(wall, 2),
        "fragments": fragments["n"],
        "env_steps": steps,
        "env_steps_per_s": round(steps / wall),
        "env_steps_per_core_s": round(steps / max(cpu, 1e-9)),
        "driver_cpu_s": round(cpu, 2),
        "main_thread_cpu_s": round(main, 2),
        "bytes_per_s": round(fragments["n"] * fragment_bytes / wall),
        "fragment_bytes": fragment_bytes,
        "per_fragment_us": per_fragment,
        "train_batches": learners.batches - batches_before,
        "weight_puts_per_s": round(broadcasts / wall, 2),
        "updates_per_s": updates_per_s,
        # With aggregation workers: the share of fragments the driver aggregated itself (every
        # worker at `max_requests_in_flight_per_aggregator_worker`).
        "aggregated_in_driver": (round(overflow / n, 3) if aggregation_workers else None),
    }


# Running the cases -----------------------------------------------------------------------------


def measure_intake(
    workload: str, backends: tuple[str, ...], seconds: float, actors: int = 8
) -> dict[str, dict[str, Any]]:
    """{backend: case result} for `workload` with driver aggregation (`tools.bench_scaling`)."""
    with tempfile.TemporaryDirectory(prefix="bench_driver_") as tmp:
        path = os.path.join(tmp, f"{workload}.pkl")
        _record(workload, path)
        return {
            backend: _run_case(
                dict(
                    workload=workload,
                    backend=backend,
                    actors=actors,
                    aggregation_workers=0,
                    seconds=seconds,
                    updates_per_s=20.0,
                    recording=path,
                )  # fmt: skip
            )
            for backend in backends
        }


def _record(workload: str, path: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "tools.bench_driver", "--record", f"{workload}:{path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"recording {workload} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _run_case(case: dict[str, Any], timeout: float = 900) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "tools.bench_driver", "--case", json.dumps(case)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"case {case} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def _row(r: dict[str, Any]) -> str:
    parts = r["per_fragment_us"]
    breakdown = " / ".join(f"{parts[s]:,.0f}" for s in (*STAGES, "other"))
    return (
        f"| {r['workload']} | {r['backend']} | {r['actors']} | {_pace(r['actor_rate'])} | "
        f"{r['aggregation_workers']} | "
        f"{r['updates_per_s']:g} | "
        f"{r['env_steps_per_core_s']:,} | {r['env_steps_per_s']:,} | "
        f"{r['bytes_per_s'] / 1e6:,.1f} | {breakdown} | {r['weight_puts_per_s']} | "
        f"{_share(r.get('aggregated_in_driver'))} |"
    )


def _pace(rate: float) -> str:
    return f"{rate:g}" if rate else "max"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def report(records: dict[str, Any], intake: list[dict], weights: dict | None, load: tuple) -> str:
    lines = [
        "## Driver intake: the real driver fed by fake actors (`tools.bench_driver`)",
        "",
        f"`python -m tools.bench_driver` ({benchlib.machine_line()}); load average before "
        f"{load[0]:.2f}. Env steps/s per driver core: env steps taken per second of the driver "
        "process's CPU time (all its threads); the stub learner takes every batch at once. "
        "Targets: Pong-42 >= 200,000 and CartPole >= 1,000,000 on local processes, "
        "on Ray at least half of that; <= 10 weight puts/s with 128 actors and a learner at "
        "1,000 updates/s.",
        "",
        "Recorded fragments: "
        + "; ".join(
            f"{w} {r['env_steps']} env steps, {r['fragment_bytes'] / 1e3:,.0f} kB pickled, "
            f"weights {r['weight_bytes'] / 1e6:.2f} MB"
            for w, r in records.items()
        )
        + ".",
        "",
        "Per fragment (us of the driver's main-thread CPU): receive / count / aggregate / queue "
        "/ broadcast / request / other. Aggregated in driver: with aggregation workers, the "
        "share of fragments the driver aggregated itself because every worker was at "
        "`max_requests_in_flight_per_aggregator_worker`. Fragments/s per actor: max = as fast "
        "as the driver asks; a number = fake actors paced to it (below what the driver and the "
        "aggregation workers take on these cores: what each fragment costs the main thread "
        "when nothing is saturated).",
        "",
        "| workload | backend | actors | fragments/s per actor | agg. workers | stub updates/s | "
        "env steps/s per driver core | env steps/s wall | MB/s | per fragment (us) | weight "
        "puts/s | aggregated in driver |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [_row(r) for r in intake]
    if weights is not None:
        lines += [
            "",
            f"Weight broadcasts with {weights['actors']} actors and a stub learner at "
            f"{weights['updates_per_s']:,.0f} updates/s: **{weights['weight_puts_per_s']}** per "
            f"second ({weights['backend']} backend, {weights['workload']} fragments).",
        ]
    if benchlib.other_jobs_running(load):
        lines += ["", "Other jobs loaded the machine when this ran: the figures are low."]
    return "\n".join(lines)


def headline(intake: list[dict], weights: dict | None) -> dict[str, Any]:
    def find(workload, backend):  # The first such row: the stub learner at --updates-per-s.
        for r in intake:
            key = (r["workload"], r["backend"], r["aggregation_workers"], r["actor_rate"])
            if key == (workload, backend, 0, 0.0):  # Not a paced row.
                return r["env_steps_per_core_s"]
        return None

    return {
        "cartpole_env_steps_per_core_s": find("cartpole", "local"),
        "pong42_env_steps_per_core_s": find("pong42", "local"),
        "ray_pong42_env_steps_per_core_s": find("pong42", "ray"),
        "weight_puts_per_s_128_actors": None if weights is None else weights["weight_puts_per_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--backends", nargs="+", default=["local", "ray"])
    parser.add_argument("--aggregation-workers", nargs="+", type=int, default=[0, 2, 4])
    parser.add_argument("--actors", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--updates-per-s", type=float, default=20.0)
    parser.add_argument(
        "--paced-rate",
        type=float,
        default=30.0,
        help="fragments/s per fake actor of the paced Pong-42 rows (0: none)",
    )
    parser.add_argument("--weight-actors", type=int, default=128)
    parser.add_argument("--no-weights", action="store_true", help="skip the 128-actor case")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--record", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(case_intake(**json.loads(args.case))), flush=True)
        return
    if args.record:
        workload, path = args.record.split(":", 1)
        print(json.dumps(record(workload, path)), flush=True)
        return
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench_driver_") as tmp:
        records, paths = {}, {}
        for workload in sorted(set(args.cases) | ({"pong42"} if not args.no_weights else set())):
            paths[workload] = os.path.join(tmp, f"{workload}.pkl")
            records[workload] = _record(workload, paths[workload])
            print(f"recorded {workload}: {records[workload]}", flush=True)
        intake = []
        for workload in args.cases:
            for backend in args.backends:
                for workers in args.aggregation_workers:
                    case = dict(
                        workload=workload, backend=backend, actors=args.actors,
                        aggregation_workers=workers, seconds=args.seconds,
                        updates_per_s=args.updates_per_s, recording=paths[workload],
                    )  # fmt: skip
                    result = _run_case(case)
                    intake.append(result)
                    print(_row(result), flush=True)
        if "pong42" in args.cases and "local" in args.backends:
            # The same case with the stub learner at 1 update/s (about 1 broadcast/s) shows the
            # driver's share of broadcasting.
            case = dict(
                workload="pong42", backend="local", actors=args.actors, aggregation_workers=0,
                seconds=args.seconds, updates_per_s=1.0, recording=paths["pong42"],
            )  # fmt: skip
            intake.append(_run_case(case))
            print(_row(intake[-1]), flush=True)
            # Paced actors: the main thread's cost per fragment with and without aggregation
            # workers when the cores are not saturated.
            for workers in sorted({0, *args.aggregation_workers}) if args.paced_rate else ():
                case = dict(
                    workload="pong42", backend="local", actors=args.actors,
                    aggregation_workers=workers, seconds=args.seconds,
                    updates_per_s=args.updates_per_s, recording=paths["pong42"],
                    actor_rate=args.paced_rate,
                )  # fmt: skip
                intake.append(_run_case(case))
                print(_row(intake[-1]), flush=True)
        weights = None
        if not args.no_weights:
            case = dict(
                workload="pong42", backend="local", actors=args.weight_actors,
                aggregation_workers=0, seconds=args.seconds, updates_per_s=1000.0,
                recording=paths["pong42"], in_flight=1,
            )  # fmt: skip
            weights = _run_case(case)
            print(_row(weights), flush=True)
    from impala_tf.utils.quiet import import_tensorflow

    import_tensorflow()  # Quietly: the machine line names TensorFlow's version.
    text = report(records, intake, weights, load)
    print(text)
    if not args.no_write:
        benchlib.write_section("bench_driver", text)
    print(json.dumps(headline(intake, weights)), flush=True)


if __name__ == "__main__":
    main()
