"""What tests need about processes: alive or not, waiting, a binary started as a job would be.

Built on `tools.proclib` (the one /proc reader). A binary under test is started the way a person
or a job manager starts it: in its own session (`start_new_session=True`, so its whole tree can
be listed with `session_pids` and ended with `kill_session`), stdin from /dev/null, stdout and
stderr into one log file that the test polls with `wait_for_line`:

    process = run_in_background(
        [sys.executable, "-m", "impala_tf.bin.train", f"--logdir={tmp_path}"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": REPO}, log_path=tmp_path / "log.txt",
    )
    try:
        wait_for_line(tmp_path / "log.txt", r"^iter\\s+2\\b", timeout_s=240, process=process)
    finally:
        kill_session(process)
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence

from tools import proclib

__all__ = [
    "EXIT_WITHOUT_TEARDOWN",
    "alive",
    "descendants",
    "kill_session",
    "log_tail",
    "run_in_background",
    "session_pids",
    "wait_for_line",
    "wait_until",
]

_TAIL_CHARS = 3000

#: Appended to a `python -c` script that loaded TensorFlow: it ends the process as the binaries
#: end theirs (`impala_tf.bin._common`): the atexit handlers run (Ray's shutdown among them),
#: the output is flushed and the interpreter's teardown is skipped (1-2 s with TensorFlow
#: loaded, in every such process). Plain Python, so a script that checks what it imported can
#: use it too.
EXIT_WITHOUT_TEARDOWN = """
import atexit as _atexit, os as _os, sys as _sys
_atexit._run_exitfuncs()
_sys.stdout.flush()
_sys.stderr.flush()
_os._exit(0)
"""


def alive(pid: int) -> bool:
    """Whether `pid` is running; a zombie (exited, not yet reaped) counts as dead."""
    return proclib.state(pid) not in (None, "Z", "X")


def wait_until(
    predicate: Callable[[], object], timeout_s: float = 60.0, interval_s: float = 0.2
) -> bool:
    """Polls `predicate()` every `interval_s` until it is true or `timeout_s` has passed.

    Returns:
      Whether it became true; it is asked once more at the deadline, so a slow last poll counts.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


def descendants(pid: int) -> list[int]:
    """The live descendants of `pid` (children, grandchildren, ...; zombies left out)."""
    return [child for child in proclib.descendants(pid) if alive(child)]


def session_pids(sid: int) -> list[int]:
    """The live processes of session `sid` (zombies left out); a run's whole tree when `sid` is
    the pid of a process started by `run_in_background`, even children re-parented to init."""
    return proclib.session_pids(sid)


def run_in_background(
    argv: Sequence[str | os.PathLike],
    cwd: str | os.PathLike,
    env: Mapping[str, str] | None,
    log_path: str | os.PathLike,
    *,
    ignore_sigint: bool = False,
) -> subprocess.Popen:
    """Starts `argv` as a job manager would: its own session, its output into `log_path`.

    Args:
      argv: The program and its arguments.
      cwd: Its working directory.
      env: Its whole environment; None inherits this process's.
      log_path: The file (created or truncated) that gets its stdout and stderr, interleaved.
      ignore_sigint: Start it with SIGINT ignored, as a non-interactive shell starts a
        background job (`cmd &`); otherwise with SIGINT's default action, even when this
        process ignores SIGINT (a test run started as a background job: the child would
        inherit the ignored SIGINT).

    Returns:
      The process; its pid is also its process group and session id. It outlives the test
      unless the test ends it (`kill_session`).
    """

    def _set_sigint() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN if ignore_sigint else signal.SIG_DFL)

    # The child gets its own copy of the descriptor; ours is closed when Popen returns.
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            [os.fspath(arg) for arg in argv],
            cwd=cwd,
            env=None if env is None else dict(env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_set_sigint,
        )


def _read(log_path: str | os.PathLike) -> str:
    """The whole log ("" while it does not exist)."""
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def log_tail(log_path: str | os.PathLike, chars: int = _TAIL_CHARS) -> str:
    """The last `chars` characters of a log ("" while it does not exist), for failure messages."""
    return _read(log_path)[-chars:]


def wait_for_line(
    log_path: str | os.PathLike,
    pattern: str | re.Pattern[str],
    timeout_s: float,
    process: subprocess.Popen | None = None,
    interval_s: float = 0.1,
) -> re.Match[str]:
    """Polls a log until one of its lines matches `pattern` (`re.search`, per line).

    Args:
      log_path: The log `run_in_background` writes.
      pattern: A regular expression; `^` and `$` anchor at the line's ends.
      timeout_s: Seconds to wait.
      process: The process writing the log; when given, its exit ends the wait early.
      interval_s: Seconds between reads.

    Returns:
      The match of the first matching line.

    Raises:
      TimeoutError: No line matched within `timeout_s`; the message holds the log's tail.
      RuntimeError: `process` exited and no line of its log matched; the message holds its
        exit status and the log's tail.
    """
    regex = re.compile(pattern)
    deadline = time.monotonic() + timeout_s
    while True:
        # Checked before the read, so that a line written just before the exit still counts.
        code = None if process is None else process.poll()
        for line in _read(log_path).splitlines():
            match = regex.search(line)
            if match:
                return match
        if code is not None:
            raise RuntimeError(
                f"the process exited with status {code} before a line matched "
                f"{regex.pattern!r}; {log_path} ends with:\n{log_tail(log_path)}"
            )
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"no line matched {regex.pattern!r} within {timeout_s:g} s; {log_path} ends "
                f"with:\n{log_tail(log_path)}"
            )
        time.sleep(interval_s)


def kill_session(process: subprocess.Popen, timeout_s: float = 30.0) -> list[int]:
    """SIGKILLs every process of `process`'s session and reaps `process`: a test's clean-up
    (`tools.proclib.kill_session`).

    Args:
      process: A process started by `run_in_background` (its pid is its session id).
      timeout_s: Seconds to wait for the session to empty.

    Returns:
      The pids still alive in the session after `timeout_s` (empty when all are gone).
    """
    return proclib.kill_session(process.pid, timeout_s, process)
