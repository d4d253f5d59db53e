"""Actor storm: SIGKILL an actor every few seconds while CartPole trains, then count leaks.

    nice -n 10 .venv/bin/python -m tools.storm                  # 5 minutes, a kill every 2 s
    nice -n 10 .venv/bin/python -m tools.storm --duration 30

Run from the repository root.

The run is `configs/cartpole-impala.yaml` (stop criteria ignored; 2 actors) built in this
process. The actors are killed in turn (actor 0, 1, 0, ...), so each has `2 x --kill-every`
seconds to come back and sample before it is killed again (the driver gives up on an actor that
fails 3 times in a row without producing a fragment).

Checks, each printed; the exit code is 1 when one fails:

* the run continued: `train()` kept returning and env steps were trained after the last kill;
* restarts were counted: `num_env_runner_restarts` (and `num_env_runner_failures`) at least the
  number of kills that the driver saw (all but possibly the last);
* nothing leaked: the open file descriptors (`/proc/self/fd`, listed by target), the threads
  and the child processes (all descendants, zombies included) after `algo.stop()` are no more
  than before the run. The baseline is taken after two short warm-up runs (built, trained,
  stopped), so that what TensorFlow and the fork server keep for the life of the process is in
  it. The threads counted are all of the process's threads (`/proc/self/task`), native ones
  included; what one warm-up build/stop cycle adds after the first is printed too (0 since the
  learner thread drops its tf.data iterator on stop: before, each cycle left 4 prefetch threads).

The last line is a JSON object with the figures (for tests/storm_test.py).
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import signal
import sys
import threading
import time

from tools import proclib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(ROOT, "configs", "cartpole-impala.yaml")

__all__ = ["main", "resources", "run_storm"]


def resources() -> dict:
    """This process's open fds (by target), threads and descendant processes."""
    gc.collect()
    pid = os.getpid()
    return {
        "fds": proclib.fd_targets(pid),
        "threads": proclib.thread_count(pid),
        "thread_names": sorted(t.name for t in threading.enumerate()),
        "children": proclib.descendants(pid),
    }


def _leaks(before: dict, after: dict) -> list[str]:
    leaks = []
    extra_fds = collections.Counter(after["fds"]) - collections.Counter(before["fds"])
    if len(after["fds"]) > len(before["fds"]):
        leaks.append(
            f"file descriptors: {len(before['fds'])} before, {len(after['fds'])} after "
            f"(new: {sorted(extra_fds.elements())[:10]})"
        )
    extra = collections.Counter(after["thread_names"]) - collections.Counter(before["thread_names"])
    if extra or after["threads"] > before["threads"]:
        leaks.append(
            f"threads: {before['threads']} before, {after['threads']} after "
            f"(new Python threads: {sorted(extra.elements())})"
        )
    if len(after["children"]) > len(before["children"]):
        leaks.append(
            f"child processes: {len(before['children'])} before, {len(after['children'])} "
            f"after (pids {sorted(set(after['children']) - set(before['children']))})"
        )
    return leaks


def _settle(before: dict, timeout_s: float = 10.0) -> dict:
    """Resources after stop, re-read for a while: exiting processes and threads take a moment."""
    deadline = time.monotonic() + timeout_s
    while True:
        after = resources()
        if not _leaks(before, after) or time.monotonic() > deadline:
            return after
        time.sleep(0.5)


def _kill(pid: int) -> bool:
    """SIGKILLs `pid`; False when it had exited already."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def run_storm(
    duration_s: float, kill_every_s: float = 2.0, config_path: str = DEFAULT_CONFIG
) -> dict:
    """Trains for `duration_s`, killing an actor every `kill_every_s`; returns the report."""
    from impala_tf.config import ImpalaConfig

    config, _stop = ImpalaConfig.from_yaml(config_path)
    # Warm-up: TensorFlow's thread pools and the fork server live as long as this process.
    baselines = []
    for _ in range(2):
        warm = config.build()
        try:
            warm.train()
        finally:
            warm.stop()
        del warm
        baselines.append(resources())
    before = baselines[-1]
    per_build_threads = max(0, baselines[1]["threads"] - baselines[0]["threads"])

    algo = config.build()
    kills = 0
    error = None
    result: dict = {}
    trained_at_last_kill = 0
    try:
        start = time.monotonic()
        next_kill = start + kill_every_s
        victim = 0
        while time.monotonic() - start < duration_s:
            result = algo.train()
            now = time.monotonic()
            if now >= next_kill and now - start < duration_s - kill_every_s:
                # Healthy actors only: one that died and is not restarted yet is spared.
                pid = algo.actors.pids().get(victim % algo.actors.workers.num_workers)
                if pid is not None and _kill(pid):
                    kills += 1
                    trained_at_last_kill = result["num_env_steps_trained"]
                victim += 1
                next_kill = now + kill_every_s
        # Let the last kill be seen and trained past.
        for _ in range(5):
            result = algo.train()
    except Exception as e:  # noqa: BLE001 - reported as the storm's verdict.
        error = f"{type(e).__name__}: {e}"
    finally:
        algo.stop()
    del algo
    after = _settle(before)

    failures = []
    if error is not None:
        failures.append(f"the run stopped: {error}")
    restarts = int(result.get("num_env_runner_restarts", 0))
    if kills and restarts < kills - 1:
        failures.append(f"{kills} kills but only {restarts} restarts counted")
    if result.get("num_env_steps_trained", 0) <= trained_at_last_kill:
        failures.append("no env steps were trained after the last kill")
    leaks = _leaks(before, after)
    failures.extend(f"leak: {leak}" for leak in leaks)
    return {
        "duration_s": duration_s,
        "kills": kills,
        "restarts": restarts,
        "failures_counted": int(result.get("num_env_runner_failures", 0)),
        "steps_trained": int(result.get("num_env_steps_trained", 0)),
        "fds": [len(before["fds"]), len(after["fds"])],
        "threads": [before["threads"], after["threads"]],
        "native_threads_per_build": per_build_threads,
        "children": [len(before["children"]), len(after["children"])],
        "failures": failures,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--duration", type=float, default=300.0, help="seconds (default 5 min)")
    parser.add_argument("--kill-every", type=float, default=2.0, help="seconds between kills")
    args = parser.parse_args(argv)
    if args.duration <= 0 or args.kill_every <= 0:
        parser.error("--duration and --kill-every must be > 0")
    report = run_storm(args.duration, args.kill_every, args.config)
    print(
        f"{report['kills']} actors killed in {args.duration:g} s; "
        f"{report['restarts']} restarts and {report['failures_counted']} failures counted; "
        f"{report['steps_trained']} env steps trained"
    )
    for name in ("fds", "threads", "children"):
        print(f"{name}: {report[name][0]} before the run, {report[name][1]} after stop()")
    print(f"(a plain build/stop cycle adds {report['native_threads_per_build']} native threads)")
    for failure in report["failures"]:
        print(f"FAIL: {failure}")
    print("PASS" if not report["failures"] else "FAIL")
    print(json.dumps(report))
    return 0 if not report["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
