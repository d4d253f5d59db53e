"""The process and pipe handling shared by actor and aggregation worker processes.

A worker process gets its commands through a `CommandQueue` (a `multiprocessing.Queue` whose
feeder thread never blocks the driver) and sends results through its own one-way pipe. Ending a
worker, `end_worker`, must leave nothing behind, even when the worker was killed (SIGKILL, OOM)
while the driver's feeder thread was blocked writing a large message (weights, a batch) into
the full command pipe: that thread would otherwise wait for ever, holding both ends of the pipe
(a thread and two fds leaked per killed worker, found by tools/storm.py). `end_worker` closes
the read end in the driver, so that the blocked write fails at once (EPIPE, silenced) and the
feeder thread exits, then joins it.
"""

from __future__ import annotations

import contextlib
import multiprocessing.queues
from multiprocessing import connection
from typing import Any

__all__ = ["CommandQueue", "end_worker"]


class CommandQueue(multiprocessing.queues.Queue):
    """A `multiprocessing.Queue` for a worker's commands, which `end_worker` can discard.

    Args:
      ctx: The multiprocessing context the worker is started from.
    """

    def __init__(self, ctx: Any):
        super().__init__(ctx=ctx)

    @staticmethod
    def _on_queue_feeder_error(e: BaseException, obj: Any) -> None:
        # Only reached when the worker has died (its pipe is broken): the command is moot, and
        # the driver learns of the death from the worker's result pipe and process sentinel.
        del e, obj

    def discard(self, timeout_s: float) -> None:
        """Drops unsent commands and frees the pipe and feeder thread (the worker has ended)."""
        self.cancel_join_thread()
        thread = self._thread
        # A feeder blocked writing into the dead worker's full pipe fails now instead. (Closed
        # before the exit sentinel is queued, so the feeder's own close of it is a no-op.)
        self._reader.close()
        self.close()  # Queues the feeder's exit sentinel (when a feeder runs).
        if thread is not None:
            thread.join(timeout_s)
        if thread is None or not thread.is_alive():
            self._writer.close()


def end_worker(
    process: Any, commands: CommandQueue, results: connection.Connection, join_s: float
) -> None:
    """Ends `process` (SIGTERM, then SIGKILL after `join_s`) and frees its queue and pipe.

    Safe to call more than once.
    """
    if process.is_alive():
        process.terminate()
        process.join(join_s)
    if process.is_alive():
        process.kill()
        process.join(join_s)
    with contextlib.suppress(ValueError, OSError):
        commands.discard(join_s)
    results.close()
