"""`WorkerHost`: the calls to one hosted object, run in order, with coalescing.

Every worker, a local process or a Ray actor, hosts one object (an env runner, an aggregator:
opaque here) and runs the driver's calls on it through a `WorkerHost`, so that both backends
apply them by the same rules:

* a plain call is queued and runs in the order it was submitted;
* a coalesced call (weights, typically) is stored instead, replacing an earlier stored call of
  the same method: only the newest of each method is ever applied, just before the next plain
  call runs. An actor with two sample requests in flight that then receives three weight
  broadcasts applies only the newest before its next sample, and weights sent before a
  `get_state` call are applied before it runs.

A `impala_tf.workers.StoredValue` argument (weights or a fragment's batches in shared memory,
on local processes; Ray resolves its object references itself) is resolved, its value fetched
into this process, just before its call runs: a coalesced call that a newer one replaced is
never fetched.
"""

from __future__ import annotations

import collections
from typing import Any

from impala_tf.workers.protocol import resolve

__all__ = ["WorkerHost"]


class WorkerHost:
    """Runs calls on one hosted object, in order, with coalescing (identical on both backends).

    Args:
      obj: The hosted object; a call of `method` runs `getattr(obj, method)(*args)`.
    """

    def __init__(self, obj: Any):
        self.obj = obj
        # Dicts keep insertion order: popping before storing orders them by last submission.
        self._stored: dict[str, tuple[int, tuple]] = {}
        self._queue: collections.deque[tuple[int, str, tuple, bool]] = collections.deque()

    def submit(self, call_id: int, method: str, args: tuple, coalesce: bool, reply: bool) -> None:
        """Queues a plain call, or stores a coalesced one in place of its method's older one.

        Args:
          call_id: The driver's id of the call.
          method: The hosted object's method to call.
          args: Its positional arguments.
          coalesce: Store (replacing the stored call of the same method) instead of queueing.
          reply: Whether the driver wants the result (returned by `run_next`; coalesced calls
            are never answered).
        """
        if coalesce:
            self._stored.pop(method, None)
            self._stored[method] = (call_id, args)
        else:
            self._queue.append((call_id, method, args, reply))

    def has_pending(self) -> bool:
        """Whether a queued (not coalesced) call waits to run."""
        return bool(self._queue)

    def run_next(self) -> tuple[int, bool, Any]:
        """Applies the stored coalesced calls, then runs the oldest queued call (`StoredValue`
        arguments resolved).

        Returns:
          (call id, whether a reply is wanted, the call's return value). Exceptions raised by
          the hosted object propagate.

        Raises:
          IndexError: No call is queued.
        """
        if not self._queue:
            raise IndexError("WorkerHost.run_next: no call is queued")
        while self._stored:
            method = next(iter(self._stored))
            _, args = self._stored.pop(method)
            getattr(self.obj, method)(*map(resolve, args))
        call_id, method, args, reply = self._queue.popleft()
        return call_id, reply, getattr(self.obj, method)(*map(resolve, args))
