"""Signals that end a training run: SIGINT, SIGTERM and SIGHUP, handled alike (TF-free).

What a terminal (Ctrl-C: SIGINT; closing it: SIGHUP) and what job managers (Kubernetes, Slurm,
systemd, `docker stop`: SIGTERM) send. `GracefulShutdown.install()` makes the first of them raise
`Interrupted` (a `KeyboardInterrupt`) in the main thread, so that the binary saves a final
checkpoint, stops every child process and exits with `128 + signal number` (130, 143, 129: the
shell convention for "ended by that signal"). A further signal while that shutdown runs kills
the child processes this process started and exits at once with the same convention; checkpoints
are written by an atomic directory swap (`impala_tf.checkpoints.write_checkpoint`), so the last
complete one stays loadable.

SIGINT is handled even when the process started with it ignored (a background job of a
non-interactive shell): a SIGINT sent to the run on purpose then still ends it cleanly.

A few steps must not be cut in two by `Interrupted`, because the orderly shutdown that follows
could not finish them: removing a shared memory segment is an unlink and then a message to
Python's resource tracker, and a segment unlinked but still registered is reported as leaked at
exit. Such a step runs in `uninterrupted()`: a first signal that arrives meanwhile raises its
`Interrupted` when the block ends instead (in the main thread; other threads get no signals).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
from types import FrameType

__all__ = ["SIGNALS", "GracefulShutdown", "Interrupted", "uninterrupted"]

#: The signals handled, where the platform has them.
SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)


#: Per thread: how deep in `uninterrupted` blocks it is, and the signal they held back.
_held = threading.local()


class Interrupted(KeyboardInterrupt):
    """A signal asked the run to end.

    Attributes:
      signum: The signal's number.
      exit_code: `128 + signum`, the exit status to end with.
    """

    def __init__(self, signum: int):
        self.signum = int(signum)
        self.exit_code = 128 + self.signum
        super().__init__(f"received {signal.Signals(self.signum).name}")


class GracefulShutdown:
    """Turns the first SIGINT/SIGTERM/SIGHUP into `Interrupted`, a second into an immediate exit.

    Args:
      name: Prefix of the message printed on a second signal.
    """

    def __init__(self, name: str = "impala-train"):
        self.name = name
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> GracefulShutdown:
        """Installs the handlers (main thread only); returns self."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("signal handlers can only be installed from the main thread")
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def uninstall(self) -> None:
        """Restores the handlers that `install` replaced."""
        for signum, previous in self._previous.items():
            with contextlib.suppress(TypeError, ValueError):
                signal.signal(signum, previous)  # type: ignore[arg-type]
        self._previous.clear()

    def shutting_down(self) -> None:
        """Marks the shutdown as begun: any signal from now on exits at once."""
        if self.received is None:
            self.received = 0

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        if self.received is None:
            self.received = signum
            if getattr(_held, "depth", 0):
                _held.signum = signum  # `uninterrupted` raises it when its block ends.
                return
            raise Interrupted(signum)
        with contextlib.suppress(OSError, ValueError):
            os.write(
                2,
                f"{self.name}: {signal.Signals(signum).name} during shutdown; exiting now "
                "(the last complete checkpoint is kept)\n".encode(),
            )
        _kill_children()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os._exit(128 + signum)


class uninterrupted:  # noqa: N801 (used as a context manager, like contextlib's)
    """A block that a first signal's `Interrupted` does not cut: it is raised when the block ends.

    For steps that the orderly shutdown could not finish if they stopped halfway (the module
    docstring). Nests; cheap (no system call). A second signal still exits at once.
    """

    __slots__ = ()

    def __enter__(self) -> None:
        _held.depth = getattr(_held, "depth", 0) + 1

    def __exit__(self, *exc_info) -> None:
        _held.depth -= 1
        # A signal handled after the decrement raises by itself; one handled before it left
        # its number here.
        signum = getattr(_held, "signum", None)
        if not _held.depth and signum is not None:
            _held.signum = None
            raise Interrupted(signum)  # An error of the block stays its __context__.


def _kill_children() -> None:
    """SIGKILLs the child processes `multiprocessing` started (actors, aggregators)."""
    with contextlib.suppress(Exception):
        for child in multiprocessing.active_children():
            with contextlib.suppress(Exception):
                child.kill()
