"""tools.storm, 10 s: actors SIGKILLed every 2 s; the run goes on, restarts are counted,
and no fd, thread or process is left behind after `algo.stop()`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_actor_storm_continues_counts_restarts_and_leaks_nothing():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run(
        [sys.executable, "-m", "tools.storm", "--duration", "10"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=540,
    )
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-3000:]
    report = json.loads(lines[-1])
    assert proc.returncode == 0, (report["failures"], proc.stderr[-3000:])
    assert report["failures"] == []
    assert report["kills"] >= 3  # One every 2 s, the last 2 s spared.
    assert report["restarts"] >= report["kills"] - 1
    assert report["failures_counted"] == report["restarts"]
    assert report["fds"][1] <= report["fds"][0]
    assert report["children"][1] <= report["children"][0]
