"""What a `WorkerGroup` and its backends exchange: the spec, the calls' results, the events.

A `WorkerSpec` says what each worker hosts (a factory building an object that is opaque here)
and how a backend places it. `Backend` and `BackendGroup` are the protocol a backend
implements: `ProcessBackend` (local processes, `impala_tf.workers.process`) and `RayBackend`
(Ray actors, `impala_tf.workers.ray_backend`) start, kill and restart workers, send them calls
named by `method_name`, and report what happened as events: `Up` (a worker built its hosted
object), `Answer` (a reply-bearing call returned) and `Death` (a worker raised or died). The
group turns those into what its callers see: `Reply`s and `WorkerFailure`s
(`impala_tf.workers.group.WorkerGroup.poll`).

A reply may leave a part in the backend's store, a `StoredValue` (Ray's object store, or shared
memory on local processes): `resolve` fetches one here, `release` frees it.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

__all__ = [
    "Answer",
    "Backend",
    "BackendGroup",
    "Death",
    "Reply",
    "StoredValue",
    "Up",
    "WorkerFailure",
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
