"""`WorkerGroup`: N workers of one kind, called asynchronously, watched, restarted.

The driver runs its env runners ("actor") and its aggregation workers ("aggregation worker") on
the same mechanism. A `WorkerSpec` says what each worker hosts (a factory building an object
that is opaque here) and how to place it; a backend starts the workers: `ProcessBackend` (local
processes, `impala_tf.workers.process`) or `RayBackend` (Ray actors,
`impala_tf.workers.ray_backend`). Each worker runs the calls it gets through a
`impala_tf.workers.host.WorkerHost`, in order, with coalescing.

Everything the backends share lives in `WorkerGroup`: call ids, which reply-bearing calls each
worker still owes, the per-call timeout (`WorkerSpec.timeout_s`: a worker that leaves a call
unanswered that long is killed and reported), replies and failures held for the next `poll`,
and which workers are healthy. The per-call clock runs only once a worker is up (its hosted
object built): a start or restart has its own limit (`WorkerSpec.start_timeout_s`), so a worker
that is slow to start on a busy machine is not killed for the calls queued meanwhile. A backend
only starts, kills and restarts workers, sends calls, and reports `Up`s, `Answer`s and
`Death`s. `RestartPolicy` holds the driver's rules for a failure
(raise, or restart the worker).
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

__all__ = [
    "Answer",
    "Backend",
    "BackendGroup",
    "Death",
    "Reply",
    "RestartPolicy",
    "StoredValue",
    "Up",
    "WorkerFailure",
    "WorkerGroup",
    "WorkerSpec",
    "method_name",
    "release",
    "resolve",
]

_START_METHODS = ("forkserver", "spawn")


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What each worker of a group hosts, and how a backend starts it.

    Attributes:
      role: "actor" or "aggregation worker": names the workers in messages and process names.
      factory: Module-level (picklable) callable; in the worker, `factory(worker_id, *args,
        **kwargs)` builds the hosted object.
      make_args: Driver side, never pickled: the factory's positional args for worker i,
        called at every start and restart. On the process backend a
        `multiprocessing.connection.Connection` among them is handed over: the driver closes
        its copy once the worker started, so the peer end sees EOF when the worker dies.
      preload: Process backend, forkserver start: modules the fork server imports once.
      start_method: Process backend: "forkserver" (the default where available) or "spawn".
        Never "fork": TensorFlow is not fork-safe once it has run.
      needs_tensorflow: Ray: import TensorFlow quietly and set one intra-op and one inter-op
        thread before calling `factory` (afterwards TensorFlow refuses to change its pools).
      shared_progress: Process backend: pass `progress=<multiprocessing.RawArray("q", 3)>` to
        `factory`, which the hosted object updates as it works (None on Ray).
      describe_hang: Driver side: given that array (None on Ray), the text saying where a
        worker that timed out hangs.
      num_cpus: Ray: CPUs of each actor.
      resources: Ray: custom resources of each actor.
      resources_key: The config key named when a resource is missing from the cluster.
      max_restarts: Ray: Ray's own restarts of each actor (`max_restarts`).
      timeout_s: A reply-bearing call unanswered this long, counted from when the worker is up
        (or from the call, if later): the worker is killed and reported.
      timeout_key: The config key named in the timeout message.
      start_timeout_s: A worker not up this long after its start or restart (its factory has
        not returned: an env creator that hangs, a node that never comes back) is killed and
        reported. TensorFlow's import alone takes seconds on a busy machine, so this is
        generous.
    """

    role: str
    factory: Callable[..., Any]
    make_args: Callable[[int], tuple]
    preload: tuple[str, ...] = ()
    start_method: str | None = None
    needs_tensorflow: bool = False
    shared_progress: bool = False
    describe_hang: Callable[[Any], str] | None = None
    num_cpus: float = 1.0
    resources: Mapping[str, float] = dataclasses.field(default_factory=dict)
    resources_key: str = "custom_resources_per_env_runner"
    max_restarts: int = 0
    timeout_s: float | None = None
    timeout_key: str = "sample_timeout_s"
    start_timeout_s: float = 180.0

    def __post_init__(self):
        if not self.role:
            raise ValueError("WorkerSpec.role must name the workers (e.g. 'actor')")
        if self.start_method is not None and self.start_method not in _START_METHODS:
            raise ValueError(
                f"WorkerSpec.start_method={self.start_method!r}: use one of {_START_METHODS} "
                "(never 'fork': TensorFlow is not fork-safe once it has run)"
            )
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(
                f"{self.timeout_key}={self.timeout_s!r}: must be positive (or None for no limit)"
            )
        if not self.start_timeout_s > 0:
            raise ValueError(
                f"WorkerSpec.start_timeout_s={self.start_timeout_s!r}: must be positive"
            )


class StoredValue(abc.ABC):
    """A part of a reply kept in the backend's store (`WorkerGroup.call(..., parts=True)`).

    Passed as an argument of another worker's call, the backend hands it over without it passing
    through this process: Ray resolves it from its object store, a local worker process reads it
    from shared memory (`impala_tf.workers.shared_values`). `get()` fetches a private copy here.
    The driver `release`s it once no call it was passed to can still read it (that call was
    answered, or its worker failed) and it is not wanted here any more.
    """

    @abc.abstractmethod
    def get(self) -> Any:
        """A private copy of the value, fetched into this process."""

    def release(self) -> None:  # noqa: B027 - a no-op for stores with nothing to free per value.
        """Frees the stored value (its shared memory; on Ray its reference goes with the
        handle). Safe twice; a no-op in a worker it was passed to."""


def resolve(value: Any) -> Any:
    """`value`, fetched here if it is a `StoredValue`."""
    return value.get() if isinstance(value, StoredValue) else value


def release(value: Any) -> None:
    """`value.release()` if it is a `StoredValue`."""
    if isinstance(value, StoredValue):
        value.release()


def method_name(method: Callable[..., Any]) -> str:
    """The name a worker dispatches a call on: `method` is a function of the hosted class
    (`RunnerHost.sample`), so that a reader (or a tool) can go from a call to its callee.

    Raises:
      TypeError: `method` is not a named, public function (a string, a lambda, `_private`).
    """
    name = getattr(method, "__name__", "")
    if not callable(method) or isinstance(method, str) or not name.isidentifier():
        raise TypeError(
            f"WorkerGroup.call takes the hosted class's method (e.g. RunnerHost.sample), not "
            f"{method!r}."
        )
    if name.startswith("_"):
        raise TypeError(f"WorkerGroup.call: {name!r} is private; call a public method.")
    return name


@dataclasses.dataclass(frozen=True)
class Reply:
    """The return value of one reply-bearing call.

    Attributes:
      worker_id: Which worker (0-based) answered.
      call_id: The id `WorkerGroup.call` returned.
      method: The method called (the hosted class's function passed to `WorkerGroup.call`).
      value: What it returned (a private copy: nothing points into Ray's object store).
      stale: The call was sent before the group's last `fence()`: the caller drops the reply
        (releasing what it holds).
    """

    worker_id: int
    call_id: int
    method: Callable[..., Any]
    value: Any
    stale: bool = False


@dataclasses.dataclass(frozen=True)
class WorkerFailure:
    """A worker that died, raised or timed out; it stays unhealthy until restarted.

    Attributes:
      worker_id: Which worker (0-based).
      error: What happened, with the remote traceback when there is one.
      fatal: The hosted object raised an exception whose `fatal` attribute is true (e.g. an
        env that returns observations of the wrong shape): a restart cannot help.
      lost_calls: Ids of the worker's reply-bearing calls that will never be answered.
    """

    worker_id: int
    error: str
    fatal: bool = False
    lost_calls: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Up:
    """Backend event: worker `worker_id` built its hosted object (after a start or restart)."""

    worker_id: int


@dataclasses.dataclass(frozen=True)
class Answer:
    """Backend event: worker `worker_id` returned `value` for reply-bearing call `call_id`."""

    worker_id: int
    call_id: int
    value: Any


@dataclasses.dataclass(frozen=True)
class Death:
    """Backend event: a worker raised (`fatal` from the exception) or died; already ended."""

    worker_id: int
    error: str
    fatal: bool = False


class BackendGroup(Protocol):
    """A backend's side of one `WorkerGroup`: starts workers, moves calls and events.

    `start(i, args)` starts worker i with `factory(i, *args)`; `send` sends one call (see
    `WorkerHost.submit`) without waiting (calls sent before the worker is up run once it is);
    `collect(timeout_s)` waits up to `timeout_s` for a first event and returns every event
    ready, one `Up` per start or restart among them; `kill(i)` ends a worker that hangs;
    `restart(i, args)` replaces a dead or killed worker; `progress(i)` is its shared progress
    array or None; `pids`/`node_ids` answer for the given workers; `stop` ends every worker
    (safe twice). After a `Death` of a worker, or `kill` of it, no event comes from it until
    `restart`.
    """

    def start(self, worker_id: int, args: tuple) -> None: ...
    def send(
        self,
        worker_id: int,
        call_id: int,
        method: str,
        args: tuple,
        coalesce: bool,
        reply: bool,
        parts: bool = False,
    ) -> None: ...
    def collect(self, timeout_s: float) -> list[Up | Answer | Death]: ...
    def kill(self, worker_id: int) -> None: ...
    def restart(self, worker_id: int, args: tuple) -> None: ...
    def progress(self, worker_id: int) -> Any: ...
    def pids(self, worker_ids: list[int]) -> dict[int, int]: ...
    def node_ids(self, worker_ids: list[int]) -> dict[int, str]: ...
    def stop(self) -> None: ...


class Backend(Protocol):
    """Where workers run: `ProcessBackend` or `RayBackend`; one may serve several groups."""

    def open(self, spec: WorkerSpec) -> BackendGroup:
        """The backend's side of a new group of `spec` workers (none started yet)."""


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

    def restart_failed(self, failure: WorkerFailure) -> None:
        """Restarts a failed worker, or raises RuntimeError saying why not (`restarts`)."""
        if self.restarts is not None:
            self.restarts.on_failure(failure)
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


class RestartPolicy:
    """What to do when a worker fails, written once for actors and aggregation workers.

    A failure raises RuntimeError when a restart cannot help or is not allowed; otherwise it
    counts one restart and the worker is restarted (`WorkerGroup.restart_failed`).

    Args:
      role: "actor" or "aggregation worker" (capitalised in messages).
      enabled: Restarts are allowed at all (the config key `enabled_key`).
      max_restarts: Most restarts over the run (the config key `max_key`); None for no limit.
      max_in_a_row: Failures of one worker with no reply in between before giving up.
      enabled_key: Config key of `enabled`, named in messages.
      max_key: Config key of `max_restarts`, named in messages.
    """

    def __init__(
        self,
        role: str,
        *,
        enabled: bool,
        max_restarts: int | None,
        max_in_a_row: int = 3,
        enabled_key: str = "restart_failed_env_runners",
        max_key: str = "max_num_env_runner_restarts",
    ):
        self.role = role
        self.enabled = bool(enabled)
        self.max_restarts = max_restarts
        self.max_in_a_row = int(max_in_a_row)
        self.enabled_key = enabled_key
        self.max_key = max_key
        self.restarts = 0
        self._in_a_row: collections.Counter[int] = collections.Counter()

    def restore(self, restarts: int) -> None:
        """Sets the restarts counted so far (a resumed run's, against `max_restarts`)."""
        self.restarts = int(restarts)

    def on_failure(self, failure: WorkerFailure) -> None:
        """Counts one restart of `failure.worker_id`, or raises RuntimeError saying why not."""
        name = f"{self.role[:1].upper()}{self.role[1:]} {failure.worker_id}"
        if failure.fatal:  # E.g. wrong observation shape, NaN data: a restart cannot help.
            raise RuntimeError(f"{name} failed: {failure.error}")
        if not self.enabled:
            raise RuntimeError(f"{name} failed and {self.enabled_key}=False: {failure.error}")
        self._in_a_row[failure.worker_id] += 1
        if self._in_a_row[failure.worker_id] >= self.max_in_a_row:
            raise RuntimeError(
                f"{name} failed {self.max_in_a_row} times in a row without a reply in between; "
                f"giving up. Last error: {failure.error}"
            )
        if self.max_restarts is not None and self.restarts >= self.max_restarts:
            raise RuntimeError(
                f"{name} failed after {self.restarts} restarts "
                f"({self.max_key}={self.max_restarts}): {failure.error}"
            )
        self.restarts += 1

    def succeeded(self, worker_id: int) -> None:
        """A reply of `worker_id` arrived: its failures in a row start again from zero."""
        self._in_a_row.pop(worker_id, None)
