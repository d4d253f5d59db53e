"""Tests of impala-train's signal handling: SIGINT, SIGTERM, SIGHUP and a second signal.

Each run starts as a job manager starts it (`start_new_session=True`, default signal handlers;
one run with SIGINT ignored, as a background job of a non-interactive shell has it). After the
signal: the exit status is 128 + the signal's number, the newest checkpoint loads, and no
process of the run's session (actors, the fork server) is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import tensorflow as tf

from impala_tf import checkpoints
from impala_tf.shutdown import GracefulShutdown, Interrupted

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = [
    "--stop_iters=100000",
    "--checkpoint_freq=1",
    "--set=num_env_runners=2",
    "--set=rollout_fragment_length=10",
    "--set=train_batch_size=20",
    "--set=min_time_s_per_iteration=0.2",
    "--set=model.fcnet_hiddens=[8]",
    "--set=num_gpus=0",
]
_START_TIMEOUT_S = 240


def _session_pids(sid: int) -> list[int]:
    """Live processes whose session id is `sid` (from /proc; zombies count as gone)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[3]) == sid:
            pids.append(int(entry))
    return pids


def _start(tmp_path, ignore_sigint: bool = False) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": REPO, "TF_CPP_MIN_LOG_LEVEL": "2"}

    def preexec():
        if ignore_sigint:
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    return subprocess.Popen(
        [sys.executable, "-m", "impala_tf.bin.train", f"--logdir={tmp_path}", *ARGS],
        cwd=tmp_path,
        env=env,
        stdout=open(tmp_path / "stdout.txt", "w"),  # noqa: SIM115 - the child owns it.
        stderr=open(tmp_path / "stderr.txt", "w"),  # noqa: SIM115
        start_new_session=True,
        preexec_fn=preexec,
    )


def _wait_for_iterations(process, tmp_path, count: int) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    results = tmp_path / "result.json"
    while time.monotonic() < deadline:
        assert process.poll() is None, (tmp_path / "stderr.txt").read_text()
        if results.exists() and len(results.read_text().splitlines()) >= count:
            return
        time.sleep(0.2)
    raise AssertionError("the run did not train: " + (tmp_path / "stderr.txt").read_text())


def _assert_clean_end(process, tmp_path, signum: int) -> str:
    try:
        code = process.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    stderr = (tmp_path / "stderr.txt").read_text()
    assert code == 128 + signum, stderr
    deadline = time.monotonic() + 30
    while _session_pids(process.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _session_pids(process.pid)
    if left:
        os.killpg(process.pid, signal.SIGKILL)
    assert not left, f"processes left behind: {left}"
    # The newest checkpoint loads: every learner variable is readable.
    newest = checkpoints.resolve_checkpoint_dir(checkpoints.latest_checkpoint(str(tmp_path)))
    state = checkpoints.read_driver_state(newest)
    assert state["iteration"] >= 1
    reader = tf.train.load_checkpoint(os.path.join(newest, checkpoints.LEARNER_PREFIX))
    assert reader.get_variable_to_shape_map()
    return stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "ignore_sigint"),
    [("SIGINT", False), ("SIGTERM", False), ("SIGHUP", False), ("SIGINT", True)],
)
def test_a_signal_saves_a_checkpoint_ends_every_child_and_exits_128_plus_signum(
    name, ignore_sigint, tmp_path
):
    signum = getattr(signal, name)
    process = _start(tmp_path, ignore_sigint=ignore_sigint)
    _wait_for_iterations(process, tmp_path, 2)
    process.send_signal(signum)
    stderr = _assert_clean_end(process, tmp_path, signum)
    assert f"interrupted (received {name}); saving a checkpoint" in stderr
    assert "impala-train: saved" in stderr


@pytest.mark.slow
def test_a_second_signal_during_shutdown_exits_at_once_keeping_a_checkpoint(tmp_path):
    process = _start(tmp_path)
    _wait_for_iterations(process, tmp_path, 2)
    process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 60
    while "saving a checkpoint" not in (tmp_path / "stderr.txt").read_text():
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    stderr = _assert_clean_end(process, tmp_path, signal.SIGTERM)
    assert "SIGTERM during shutdown; exiting now" in stderr or "impala-train: saved" in stderr


def test_the_first_signal_raises_interrupted_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    shutdown = GracefulShutdown().install()
    try:
        with pytest.raises(Interrupted) as info:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        assert info.value.exit_code == 128 + signal.SIGTERM
        assert isinstance(info.value, KeyboardInterrupt)
        assert shutdown.received == signal.SIGTERM
    finally:
        shutdown.uninstall()
    assert signal.getsignal(signal.SIGTERM) == before
