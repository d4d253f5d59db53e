"""Tests of the quiet start: the binaries hide TensorFlow's C++ start-up log unless asked."""

from __future__ import annotations

import os
import re
import sys

import pytest

from impala_tf.utils.quiet import is_cpp_log_line
from tests.support.processes import kill_session, run_in_background

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_NOISE = ("cuInit", "oneDNN", "Could not find cuda drivers", "absl::InitializeLog")
_CPP = re.compile(r"^[IWEF]\d{4} ", re.M)
ARGS = [
    "--stop_iters=1",
    "--set=num_env_runners=1",
    "--set=rollout_fragment_length=10",
    "--set=train_batch_size=20",
    "--set=min_time_s_per_iteration=0",
    "--set=model.fcnet_hiddens=[8]",
    "--set=num_gpus=0",
]


def _start(tmp_path, *extra: str):
    """Starts impala-train as a user would (no TF_CPP_MIN_LOG_LEVEL), its output in log.txt."""
    tmp_path.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    env["PYTHONPATH"] = REPO
    argv = [sys.executable, "-m", "impala_tf.bin.train", f"--logdir={tmp_path / 'run'}"]
    return run_in_background([*argv, *ARGS, *extra], tmp_path, env, tmp_path / "log.txt")


@pytest.mark.slow
def test_train_hides_tensorflow_cpp_startup_lines_and_verbose_shows_them(tmp_path):
    # Both runs at once: each spends seconds importing TensorFlow.
    runs = {
        "quiet": _start(tmp_path / "quiet"),
        "verbose": _start(tmp_path / "verbose", "--verbose"),
    }
    try:
        codes = {name: process.wait(timeout=240) for name, process in runs.items()}
    finally:
        for process in runs.values():
            kill_session(process)
    quiet, verbose = ((tmp_path / name / "log.txt").read_text() for name in runs)
    assert codes["quiet"] == 0, quiet
    for noise in _NOISE:
        assert noise not in quiet, quiet
    assert not _CPP.search(quiet), quiet
    assert "impala-train: stopped at" in quiet
    assert codes["verbose"] == 0, verbose
    assert _CPP.search(verbose), verbose  # TensorFlow's own lines, on this machine.


def test_cpp_log_lines_are_told_apart_from_ours():
    assert is_cpp_log_line(
        "I0000 00:00:1795449521.722541    5367 cudart_stub.cc:31] Could not find cuda drivers"
    )
    assert is_cpp_log_line(
        "E0000 00:00:1795449540.981297    5638 cuda_platform.cc:52] failed call to cuInit: x"
    )
    assert is_cpp_log_line(
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
    )
    assert not is_cpp_log_line("WARNING impala_tf.driver.algorithm: Restarting actor 0 after: boom")
    assert not is_cpp_log_line("impala-train: error: bad flag")
