"""Tests of impala-train's signal handling: SIGINT, SIGTERM, SIGHUP and a second signal.

Each run starts as a job manager starts it (`tests.support.processes.run_in_background`: its own
session, default signal handlers; one run with SIGINT ignored, as a background job of a
non-interactive shell has it) and is signalled once its log shows trained iterations. After the
signal: the exit status is 128 + the signal's number, the newest checkpoint loads, and no
process of the run's session (actors, the fork server) is left. The runs send SIGINT and
SIGTERM; SIGHUP goes through the same handler, which is checked in-process for all three.

`LingeringThread` below is loaded by the binary as `tests.signals_test:LingeringThread`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import keras
import pytest
import tensorflow as tf

from impala_tf import checkpoints
from impala_tf.utils.shutdown import GracefulShutdown, Interrupted, uninterrupted
from impala_tf.workers.shared_arrays import SEGMENT_PREFIX
from tests.support.processes import (
    kill_session,
    log_tail,
    run_in_background,
    session_pids,
    wait_for_line,
    wait_until,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = [
    "--stop_iters=100000",
    "--set=num_env_runners=2",
    "--set=rollout_fragment_length=10",
    "--set=train_batch_size=20",
    "--set=min_time_s_per_iteration=0.2",
    "--set=model.fcnet_hiddens=[8]",
    "--set=num_gpus=0",
]
_START_TIMEOUT_S = 240
_EXIT_TIMEOUT_S = 120
#: How long `LingeringThread` keeps an orderly exit of the binary waiting.
_LINGER_S = 600.0


class LingeringThread(keras.callbacks.Callback):
    """A driver callback that starts a non-daemon thread (an upload of results, say) that lives
    `_LINGER_S` seconds: an orderly exit of the binary waits for it, a forced one does not.

    Prints `lingering until <unix time>` once the thread runs.
    """

    def __init__(self):
        super().__init__()
        self.thread: threading.Thread | None = None

    def on_epoch_end(self, epoch, logs=None):
        if self.thread is None:
            self.thread = threading.Thread(target=time.sleep, args=(_LINGER_S,), daemon=False)
            self.thread.start()
            print(f"lingering until {time.time() + _LINGER_S:.3f}", flush=True)


def _segments(pid: int) -> list[str]:
    """The shared memory segments of the run whose driver is `pid` (weights, fragments, train
    batches)."""
    if not os.path.isdir("/dev/shm"):
        return []
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"{SEGMENT_PREFIX}{pid}_")]


def _start(tmp_path, *extra: str, ignore_sigint: bool = False):
    argv = [sys.executable, "-m", "impala_tf.bin.train", f"--logdir={tmp_path / 'run'}"]
    env = {**os.environ, "PYTHONPATH": REPO, "TF_CPP_MIN_LOG_LEVEL": "2"}
    return run_in_background(
        [*argv, *ARGS, *extra], tmp_path, env, tmp_path / "log.txt", ignore_sigint=ignore_sigint
    )


def _wait_for_iterations(process, tmp_path, count: int) -> None:
    """Waits for the progress line of iteration `count`."""
    wait_for_line(tmp_path / "log.txt", rf"^iter\s+{count}\b", _START_TIMEOUT_S, process)


def _assert_clean_end(process, tmp_path, code: int, at_once: bool = False) -> str:
    """Waits for the exit, checks its status, the session and the newest checkpoint; returns
    the log. `at_once`: the binary exited without stopping its children (a second signal)."""
    log = tmp_path / "log.txt"
    try:
        assert process.wait(_EXIT_TIMEOUT_S) == code, log_tail(log)
        # An orderly exit ends every child first: the workers, the fork server and the
        # resource tracker (which would otherwise go only once they noticed the exit). After an
        # exit at once they notice it by themselves; they get a moment to go.
        assert wait_until(lambda: not session_pids(process.pid), timeout_s=30 if at_once else 0), (
            f"processes left behind: {session_pids(process.pid)}"
        )
        assert wait_until(lambda: not _segments(process.pid), timeout_s=30), (
            f"shared memory left behind: {_segments(process.pid)}"
        )
    finally:
        kill_session(process)
    # The newest checkpoint loads: every learner variable is readable.
    newest = checkpoints.resolve_checkpoint_dir(str(tmp_path / "run"))
    assert checkpoints.read_driver_state(newest)["iteration"] >= 2
    reader = tf.train.load_checkpoint(checkpoints.learner_prefix(newest))
    assert any(key.startswith("model/") for key in reader.get_variable_to_shape_map())
    return log.read_text()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "ignore_sigint", "extra"),
    [
        ("SIGINT", False, ()),
        # With an aggregation worker: fragments and train batches in shared memory too.
        ("SIGTERM", False, ("--set=num_aggregation_workers=1",)),
        ("SIGINT", True, ()),
    ],
)
def test_a_signal_saves_a_checkpoint_ends_every_child_and_exits_128_plus_signum(
    name, ignore_sigint, extra, tmp_path
):
    signum = getattr(signal, name)
    # No periodic checkpoint: the one the run leaves is the one the signal made it save.
    process = _start(tmp_path, "--checkpoint_freq=0", *extra, ignore_sigint=ignore_sigint)
    try:
        _wait_for_iterations(process, tmp_path, 2)
    except BaseException:
        kill_session(process)
        raise
    process.send_signal(signum)
    output = _assert_clean_end(process, tmp_path, 128 + signum)
    assert f"interrupted (received {name}); saving a checkpoint" in output
    # The orderly exit removed every segment itself: none was left to the resource tracker
    # (which would report them), and none went by value for want of room.
    assert "leaked shared_memory" not in output and "has no room" not in output
    saved = wait_for_line(tmp_path / "log.txt", r"^impala-train: saved (\S+)$", 0)
    assert checkpoints.read_driver_state(saved.group(1))["iteration"] >= 2
    kept = os.listdir(tmp_path / "run" / checkpoints.CHECKPOINTS_DIR)
    assert kept == [os.path.basename(saved.group(1))], kept


@pytest.mark.slow
def test_a_second_signal_during_shutdown_exits_at_once_keeping_a_checkpoint(tmp_path):
    """The first SIGTERM's orderly exit would wait for a lingering thread; a SIGINT during it
    ends the run at once, with the second signal's status (130, where the first would give 143)
    and message."""
    # Checkpoints every iteration: the second signal may cut the interrupt's save short.
    process = _start(
        tmp_path, "--checkpoint_freq=1", "--callbacks=tests.signals_test:LingeringThread"
    )
    log = tmp_path / "log.txt"
    try:
        linger = wait_for_line(log, r"^lingering until ([\d.]+)$", _START_TIMEOUT_S, process)
        # The second signal may cut the interrupt's save short, and iteration 2's progress line
        # comes before its periodic save: iteration 3's line means checkpoint 2 is on disk.
        _wait_for_iterations(process, tmp_path, 3)
        process.send_signal(signal.SIGTERM)
        wait_for_line(log, r"interrupted \(received SIGTERM\); saving a checkpoint", 60, process)
        process.send_signal(signal.SIGINT)
        sent = time.time()
        try:
            process.wait(_EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the second signal did not end the run:\n{log_tail(log)}")
        exited = time.time()
    except BaseException:
        kill_session(process)
        raise
    output = _assert_clean_end(process, tmp_path, 128 + signal.SIGINT, at_once=True)
    assert exited - sent < 30, "the second signal did not end the run at once"
    orderly = float(linger.group(1))  # The earliest an orderly exit could have come.
    assert exited < orderly - 300, (exited, orderly)
    assert "impala-train: SIGINT during shutdown; exiting now" in output


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_the_first_signal_raises_interrupted_and_handlers_are_restored(name):
    # Each signal takes this one path; the runs above send SIGINT and SIGTERM to impala-train.
    signum = getattr(signal, name)
    before = signal.getsignal(signum)
    shutdown = GracefulShutdown().install()
    try:
        with pytest.raises(Interrupted) as info:
            os.kill(os.getpid(), signum)
            time.sleep(1)  # The handler raises in this thread as soon as the signal arrives.
        assert info.value.exit_code == 128 + signum
        assert isinstance(info.value, KeyboardInterrupt)
        assert shutdown.received == signum
    finally:
        shutdown.uninstall()
    assert signal.getsignal(signum) == before


def test_a_signal_inside_uninterrupted_blocks_is_raised_when_the_outer_block_ends():
    shutdown = GracefulShutdown().install()
    steps = []
    try:
        with pytest.raises(Interrupted) as info:
            with uninterrupted():
                with uninterrupted():
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(0.2)  # The handler has run: nothing was raised yet.
                    steps.append("inner")
                steps.append("outer")
            steps.append("after")
        assert info.value.signum == signal.SIGTERM and steps == ["inner", "outer"]
        assert shutdown.received == signal.SIGTERM
        with uninterrupted():  # Raised once: a later block ends normally.
            steps.append("later")
    finally:
        shutdown.uninstall()
    assert steps == ["inner", "outer", "later"]
