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
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
from types import FrameType

__all__ = ["SIGNALS", "GracefulShutdown", "Interrupted"]

#: The signals handled, where the platform has them.
SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)


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


def _kill_children() -> None:
    """SIGKILLs the child processes `multiprocessing` started (actors, aggregators)."""
    with contextlib.suppress(Exception):
        for child in multiprocessing.active_children():
            with contextlib.suppress(Exception):
                child.kill()
