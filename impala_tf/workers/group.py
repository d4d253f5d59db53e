"""`WorkerGroup`: N workers of one kind, called asynchronously, watched, restarted.

The driver runs its env runners ("actor") and its aggregation workers ("aggregation worker") on
the same mechanism. A `WorkerSpec` says what each worker hosts (a factory building an object
that is opaque here) and how to place it; a backend starts the workers: `ProcessBackend` (local
processes, `impala_tf.workers.process`) or `RayBackend` (Ray actors,
`impala_tf.workers.ray_backend`). What the group and a backend exchange is
`impala_tf.workers.protocol`'s. Each worker runs the calls it gets through a
`impala_tf.workers.host.WorkerHost`, in order, with coalescing.

Everything the backends share lives in `WorkerGroup`: call ids, which reply-bearing calls each
worker still owes, the per-call timeout (`WorkerSpec.timeout_s`: a worker that leaves a call
unanswered that long is killed and reported), replies and failures held for the next `poll`,
and which workers are healthy. The per-call clock runs only once a worker is up (its hosted
object built): a start or restart has its own limit (`WorkerSpec.start_timeout_s`), so a worker
that is slow to start on a busy machine is not killed for the calls queued meanwhile. A backend
only starts, kills and restarts workers, sends calls, and reports `Up`s, `Answer`s and
`Death`s. `impala_tf.workers.restarts.RestartPolicy` holds the driver's rules for a failure
(raise, or restart the worker); the caller counts the restarts.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from impala_tf.workers.protocol import (
    Backend,
    Death,
    Reply,
    Up,
    WorkerFailure,
    WorkerSpec,
    method_name,
    release,
)
from impala_tf.workers.restarts import RestartPolicy

__all__ = ["WorkerGroup"]


class _Worker:
    """The group's bookkeeping of one worker."""

    def __init__(self):
        self.healthy = True
        # Unanswered reply-bearing call id -> method, oldest first.
        self.calls: dict[int, Callable[..., Any]] = {}
        self.starting()

    def starting(self) -> None:
        """Marks a start or restart: not up, no call waiting yet."""
        self.started_at = time.monotonic()  # Of the last start or restart.
        self.up = False  # Its hosted object is built (an `Up` came since the last start).
        # Since when the oldest unanswered call has waited, the worker being up (None: no call,
        # or not up yet).
        self.waiting_since: float | None = None


class WorkerGroup:
    """N workers of one `WorkerSpec` on one backend.

    Args:
      backend: `ProcessBackend()` or `RayBackend(...)`.
      spec: What the workers host and how they are placed.
      num_workers: How many (ids 0 .. num_workers - 1). All start now; if one fails to start,
        those started are stopped and the error is raised.
      restarts: The rules `restart_failed` applies (None: every restart is allowed); a reply
        of a worker resets its failures in a row.

    Attributes:
      restarts: The `RestartPolicy`, or None.
    """

    def __init__(
        self,
        backend: Backend,
        spec: WorkerSpec,
        num_workers: int,
        restarts: RestartPolicy | None = None,
    ):
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers}: must not be negative")
        self.spec = spec
        self.num_workers = int(num_workers)
        self.restarts = restarts
        self._next_id = 0
        self._fence = 0  # Replies to calls with smaller ids are stale (`fence`).
        self._workers = {i: _Worker() for i in range(self.num_workers)}
        self._held_replies: list[Reply] = []
        self._held_failures: list[WorkerFailure] = []
        self._abandoned: set[int] = set()  # Calls whose replies `call_and_wait` gave up on.
        self._stopped = False
        self._impl = backend.open(spec)
        try:
            for i in range(self.num_workers):
                self._impl.start(i, tuple(spec.make_args(i)))
        except BaseException:
            self.stop()
            raise

    # Calls -----------------------------------------------------------------------------------

    def call(
        self,
        worker_id: int,
        method: Callable[..., Any],
        *args: Any,
        coalesce: bool = False,
        reply: bool = True,
        parts: bool = False,
    ) -> int | None:
        """Calls `method(*args)` on worker `worker_id`'s hosted object, without waiting.

        Args:
          worker_id: Which worker.
          method: The hosted class's method, as a function (`RunnerHost.sample`): the worker
            calls the method of that name on its object (`method_name`).
          *args: Its arguments (pickled; on Ray, object refs among them are resolved).
          coalesce: Replace a stored, not yet applied call of the same method (see
            `WorkerHost`); such a call is never answered, so it needs `reply=False`.
          reply: The return value is wanted (a `Reply` from `poll`); counts in `outstanding`
            and in the timeout.
          parts: The method returns (head, body): the reply's value is (head, body) with the
            body left where the backend keeps it, a `StoredValue`: in Ray's object store, or in
            shared memory on local processes (there by value, a plain body, when shared memory
            has no room). Pass it to another worker's call and that worker reads it from the
            store, without it passing through this process; `resolve` it here otherwise; and
            `release` it once no call can still read it. Needs `reply`.

        Returns:
          The call id (increasing across the group), or None if the worker is not healthy.
        """
        name = method_name(method)
        if coalesce and reply:
            raise ValueError(
                f"call({name!r}, coalesce=True): a coalesced call is never answered (a newer "
                "one may replace it); pass reply=False"
            )
        if parts and not reply:
            raise ValueError(
                f"call({name!r}, parts=True): parts come with the reply; pass reply=True"
            )
        worker = self._workers[worker_id]
        if self._stopped or not worker.healthy:
            return None
        call_id = self._next_id
        self._next_id += 1
        if reply:
            if not worker.calls and worker.up:
                worker.waiting_since = time.monotonic()
            worker.calls[call_id] = method
        self._impl.send(worker_id, call_id, name, args, coalesce, reply, parts)
        return call_id

    def poll(self, timeout_s: float) -> tuple[list[Reply], list[WorkerFailure]]:
        """The replies and failures ready now, waiting up to `timeout_s` for a first one.

        Does not wait when some are held already. A worker whose oldest reply-bearing call has
        waited `spec.timeout_s` is killed and reported as failed.
        """
        self._pump(0.0 if self._held_replies or self._held_failures else timeout_s)
        replies, self._held_replies = self._held_replies, []
        failures, self._held_failures = self._held_failures, []
        if self.restarts is not None:
            for reply in replies:
                self.restarts.succeeded(reply.worker_id)
        replies = [
            dataclasses.replace(r, stale=True) if r.call_id < self._fence else r for r in replies
        ]
        return replies, failures

    def fence(self) -> None:
        """Marks the replies to every call sent so far as stale (`Reply.stale`), whenever they
        arrive: what they answer predates a restore or a reset."""
        self._fence = self._next_id

    def call_and_wait(
        self, worker_ids: list[int], method: Callable[..., Any], *args: Any, timeout_s: float
    ) -> dict[int, Any]:
        """Calls `method(*args)` on each healthy worker of `worker_ids` and waits for them.

        Replies to other calls and failures that arrive meanwhile are held for the next
        `poll`; workers that fail meanwhile are left out of the result.

        Returns:
          Worker id -> return value.

        Raises:
          TimeoutError: Some did not answer within `timeout_s` (their late replies are dropped).
        """
        wanted: dict[int, int] = {}
        for i in worker_ids:
            call_id = self.call(i, method, *args)
            if call_id is not None:
                wanted[call_id] = i
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        wait = 0.0
        while True:
            self._pump(wait)
            results.update(
                (wanted[r.call_id], r.value) for r in self._held_replies if r.call_id in wanted
            )
            self._held_replies = [r for r in self._held_replies if r.call_id not in wanted]
            missing = {c: i for c, i in wanted.items() if c in self._workers[i].calls}
            if not missing:
                return {i: results[i] for i in wanted.values() if i in results}
            wait = deadline - time.monotonic()
            if wait <= 0:
                self._abandoned.update(missing)
                raise TimeoutError(
                    f"{self.spec.role} {sorted(missing.values())} did not answer "
                    f"{method_name(method)!r} "
                    f"within {timeout_s:g} s"
                )

    # Health ----------------------------------------------------------------------------------

    def restart_failed(self, failure: WorkerFailure, restarts_so_far: int) -> None:
        """Restarts a failed worker, or raises RuntimeError saying why not (`restarts`).

        Args:
          failure: The failure `poll` reported.
          restarts_so_far: The restarts of this group's workers the caller counted so far over
            the run (a resumed run's included), held against `RestartPolicy.max_restarts`; the
            caller counts this one once it returns.
        """
        if self.restarts is not None:
            self.restarts.on_failure(failure, restarts_so_far)
        self.restart(failure.worker_id)

    def restart(self, worker_id: int) -> None:
        """Replaces worker `worker_id` by a fresh one (`spec.make_args(worker_id)` again)."""
        worker = self._workers[worker_id]
        if worker.healthy:  # A live worker replaced on purpose: its calls are dropped.
            self._impl.kill(worker_id)
            self._forget_calls(worker)
            worker.healthy = False
        self._impl.restart(worker_id, tuple(self.spec.make_args(worker_id)))
        worker.healthy = True
        worker.starting()

    def healthy_ids(self) -> list[int]:
        """The workers that are alive and not failed."""
        return [i for i, w in self._workers.items() if w.healthy]

    def outstanding(self, worker_id: int) -> int:
        """Reply-bearing calls sent to `worker_id` and not yet answered."""
        return len(self._workers[worker_id].calls)

    def pids(self) -> dict[int, int]:
        """Worker id -> OS process id, of the healthy workers (Ray: asks them)."""
        return self._impl.pids(self.healthy_ids())

    def node_ids(self) -> dict[int, str]:
        """Worker id -> Ray node id, of the healthy workers ("local" on the process backend)."""
        return self._impl.node_ids(self.healthy_ids())

    def stop(self) -> None:
        """Ends every worker. Safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        self._impl.stop()

    # Internals -------------------------------------------------------------------------------

    def _pump(self, timeout_s: float) -> None:
        """Collects events for up to `timeout_s` (less if a call times out sooner)."""
        timeout_s = min(timeout_s, self._next_deadline() - time.monotonic())
        for event in self._impl.collect(max(0.0, timeout_s)):
            worker = self._workers[event.worker_id]
            if not worker.healthy:
                continue
            if isinstance(event, Up):
                worker.up = True
                worker.waiting_since = time.monotonic() if worker.calls else None
                continue
            if isinstance(event, Death):
                self._fail(event.worker_id, event.error, event.fatal)
                continue
            method = worker.calls.pop(event.call_id, None)
            worker.waiting_since = time.monotonic() if worker.calls else None
            if method is not None and event.call_id not in self._abandoned:
                self._held_replies.append(
                    Reply(event.worker_id, event.call_id, method, event.value)
                )
                continue
            self._abandoned.discard(event.call_id)
            if isinstance(event.value, tuple) and len(event.value) == 2:
                release(event.value[1])  # The body of a parts reply nobody will read.
        self._check_timeouts()

    def _deadline(self, worker: _Worker) -> float:
        """When `worker` times out: its start limit, or its oldest call's (inf: never)."""
        if not worker.healthy:
            return float("inf")
        if not worker.up:
            return worker.started_at + self.spec.start_timeout_s
        if worker.waiting_since is None or self.spec.timeout_s is None:
            return float("inf")
        return worker.waiting_since + self.spec.timeout_s

    def _next_deadline(self) -> float:
        return min((self._deadline(w) for w in self._workers.values()), default=float("inf"))

    def _check_timeouts(self) -> None:
        now, role, describe = time.monotonic(), self.spec.role, self.spec.describe_hang
        for i, w in self._workers.items():
            if now < self._deadline(w):
                continue
            if not w.up:
                error = (
                    f"{role} {i} did not start within {self.spec.start_timeout_s:g} s (its "
                    f"factory, e.g. the env creator, had not returned; the {role} was killed)"
                )
            else:
                where = "" if describe is None else f": {describe(self._impl.progress(i))}"
                error = (
                    f"{role} {i} did not answer a {method_name(next(iter(w.calls.values())))} "
                    "request "
                    f"within {self.spec.timeout_key}={self.spec.timeout_s:g} s{where} (the "
                    f"{role} was killed)"
                )
            self._impl.kill(i)
            self._fail(i, error)

    def _fail(self, worker_id: int, error: str, fatal: bool = False) -> None:
        worker = self._workers[worker_id]
        worker.healthy = False
        lost = self._forget_calls(worker)
        self._held_failures.append(WorkerFailure(worker_id, error, fatal, lost))

    def _forget_calls(self, worker: _Worker) -> tuple[int, ...]:
        lost = tuple(worker.calls)
        worker.calls.clear()
        worker.waiting_since = None
        self._abandoned.difference_update(lost)
        return lost
