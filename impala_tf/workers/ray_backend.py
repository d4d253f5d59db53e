"""`RayBackend`: each worker a Ray actor, on one machine or a cluster.

Every worker is the same Ray actor class, `RayWorker`, hosting its object in a
`impala_tf.workers.host.WorkerHost`:

* it asks for `WorkerSpec.num_cpus` CPUs and the custom `WorkerSpec.resources` (which place it,
  e.g. on a node that carries them); its runtime_env hides the GPUs (`CUDA_VISIBLE_DEVICES=""`:
  Ray 2.60 no longer does it for actors with `num_gpus=0`) and holds every numeric library to
  one thread (`impala_tf.workers.process.worker_env_vars`); with `needs_tensorflow` it imports
  TensorFlow quietly and sets one intra-op and one inter-op thread before the factory runs;
* the hosted object is built by a first `init` task, not by the actor's constructor, so that a
  restarted actor gets the factory arguments of the restart;
* each call is one `call` task. Ray runs an actor's tasks one at a time in order, so a coalesced
  call is stored on arrival and applied before the next plain call, as in a worker process.
  Object refs passed as call arguments are resolved by Ray, and the arguments copied (Ray hands
  over read-only arrays backed by its object store). The same object sent to several actors
  in a row (a weight broadcast) goes into the object store once;
* results are copied out of the object store (`copy_out`) before their refs are dropped, and
  delivered in each actor's call order;
* a call that raised kills its actor with `no_restart=False` (Ray restarts it, within
  `WorkerSpec.max_restarts`) and is reported, fatal when the exception has a true `fatal`; a
  dead actor (`RayActorError`) likewise. `restart` never blocks the driver: it returns at once,
  the calls sent meanwhile are held, and each `collect` checks, without waiting, whether Ray's
  own restart answers yet (Ray refuses calls to a restarting actor rather than queueing them);
  once it does, the hosted object is built and the held calls go out in order. When Ray gave up
  on the actor, its restart does not answer within `_RESTART_TIMEOUT_S`, or its custom
  resources left the cluster with their node, a new actor replaces it (asking for CPUs only in
  the last case, with a warning). The other workers sample and train meanwhile.

Where Ray runs is `impala_tf.workers.ray_session`'s business: each group acquires the session
when it opens and releases it when it stops.
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
import time
from collections.abc import Mapping
from typing import Any

import impala_tf.workers.ray_session as ray_session
from impala_tf.workers.host import WorkerHost
from impala_tf.workers.process import worker_env_vars
from impala_tf.workers.protocol import Answer, Death, StoredValue, Up, WorkerSpec

__all__ = ["RayBackend", "RayStoredValue", "RayWorker", "actor_runtime_env", "copy_out"]

logger = logging.getLogger(__name__)

#: How long `pids`/`node_ids` wait for the actors' answers.
_CALL_TIMEOUT_S = 120.0
#: How long Ray's own restart of an actor may take to answer before a new actor replaces it.
_RESTART_TIMEOUT_S = 60.0
#: Seconds between two checks of a restarting actor (a `pid` call each).
_PROBE_INTERVAL_S = 0.2
#: Call id of the `init` task that builds the hosted object (never answered).
_INIT = -1


def actor_runtime_env() -> dict[str, Any]:
    """The runtime_env of every Ray worker: no GPU, one thread per numeric library."""
    return {"env_vars": worker_env_vars()}


def copy_out(value: Any) -> Any:
    """A deep copy of what `ray.get` returned: no array still points into the object store.

    A pickle round trip copies in C: half the time of `copy.deepcopy` on a CartPole fragment
    (175 against 350 us, measured). Protocol 4, not 5: under protocol 5 a read-only array (Ray
    hands those out) pickles as immutable bytes and comes back read-only; under 4 every array
    comes back a writable copy of its own.
    """
    return pickle.loads(pickle.dumps(value, protocol=4))


class RayStoredValue(StoredValue):
    """The body of a `parts` reply, left in Ray's object store (`WorkerGroup.call`)."""

    def __init__(self, ref: Any):
        self.ref = ref

    def get(self) -> Any:
        import ray

        return copy_out(ray.get(self.ref))

    def release(self) -> None:
        """Drops this handle's reference (Ray frees the object once no task holds one)."""
        self.ref = None


class RayWorker:
    """What runs inside one Ray actor: a `WorkerHost` around the hosted object.

    Args:
      needs_tensorflow: Import TensorFlow and limit its thread pools before anything runs it.
    """

    def __init__(self, needs_tensorflow: bool):
        if needs_tensorflow:
            # Before the hosted object runs a first op: afterwards TF refuses to change its pools.
            from impala_tf.utils.quiet import import_tensorflow

            import_tensorflow()
            import tensorflow as tf

            tf.config.threading.set_intra_op_parallelism_threads(1)
            tf.config.threading.set_inter_op_parallelism_threads(1)
        self._host: WorkerHost | None = None

    def init(self, factory: Any, worker_id: int, kwargs: dict[str, Any], *args: Any) -> int:
        """Builds the hosted object, `factory(worker_id, *args, **kwargs)`; returns the pid."""
        self._host = WorkerHost(factory(worker_id, *copy_out(args), **kwargs))
        return os.getpid()

    def call(self, call_id: int, method: str, coalesce: bool, reply: bool, *args: Any) -> Any:
        """Submits one call to the host; runs it (and returns its value) unless coalesced."""
        self._host.submit(call_id, method, copy_out(args), coalesce, reply)
        if self._host.has_pending():
            return self._host.run_next()[2]
        return None

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


class RayBackend:
    """Workers as Ray actors; one instance may serve several groups.

    Args:
      address: The Ray cluster ("auto", "HOST:PORT"), or None for a Ray already initialised in
        this process or else a local one started here (see `impala_tf.workers.ray_session`).
      num_cpus: CPUs of a local Ray started here.
      resources: Custom resources of a local Ray started here.
    """

    def __init__(
        self, address: str | None, num_cpus: float, resources: Mapping[str, float] | None = None
    ):
        self.address = address
        self.num_cpus = num_cpus
        self.resources = dict(resources or {})

    def open(self, spec: WorkerSpec) -> _RayGroup:
        """The Ray side of a new group of `spec` workers (connects to Ray).

        Raises:
          ImportError: Ray is not installed.
          ValueError: `spec.resources` names a resource no node of the cluster has.
        """
        ray = ray_session.acquire(self.address, self.num_cpus, self.resources)
        try:
            return _RayGroup(ray, spec)
        except BaseException:
            ray_session.release()
            raise


class _Restart:
    """Ray's own restart of an actor, waited for without blocking (see `_RayGroup.restart`)."""

    def __init__(self, args: tuple, old_pid: int | None):
        self.args = args  # The factory arguments of the restart.
        self.old_pid = old_pid  # An answer from this pid is the old process, not yet gone.
        self.deadline = time.monotonic() + _RESTART_TIMEOUT_S
        self.probe: Any = None  # The ref of the `pid` call in flight.
        self.next_probe = 0.0
        # Calls sent while it restarts: (call_id, method, args, coalesce, reply), in order.
        self.held: list[tuple[int, str, tuple, bool, bool, bool]] = []


class _Actor:
    """The driver's handle on one Ray worker."""

    def __init__(self, handle: Any, resources: dict[str, float]):
        self.handle = handle
        self.resources = resources  # The custom resources it was made with.
        self.live = True
        # (call id, ref of the reply or its head, reply wanted, ref of the body or None).
        self.pending: collections.deque[tuple[int, Any, bool, Any]] = collections.deque()
        self.pid: int | None = None  # Of the process that built the hosted object.
        self.restarting: _Restart | None = None


class _RayGroup:
    """The Ray actors of one `WorkerGroup` (see `impala_tf.workers.protocol.BackendGroup`)."""

    def __init__(self, ray: Any, spec: WorkerSpec):
        self._ray = ray
        self.spec = spec
        self._stopped = False
        self._actors: dict[int, _Actor] = {}
        self._wanted = {k: float(v) for k, v in spec.resources.items()}
        total = ray.cluster_resources()
        missing = [k for k in self._wanted if total.get(k, 0) <= 0]
        if missing:
            raise ValueError(
                f"`{spec.resources_key}` asks for {missing}, which no node of the Ray cluster "
                f"offers (cluster resources: {sorted(total)}); the {spec.role}s would never "
                "start. Start a node with `ray start ... --resources='{\"NAME\": N}'`."
            )
        self._remote_cls = ray.remote(RayWorker)
        # Objects sent since the last `collect`: id -> (object, its ref once put).
        self._recent: dict[int, tuple[Any, Any]] = {}

    # Starting --------------------------------------------------------------------------------

    def start(self, worker_id: int, args: tuple, resources: dict[str, float] | None = None) -> None:
        resources = dict(self._wanted if resources is None else resources)
        handle = self._remote_cls.options(
            num_cpus=float(self.spec.num_cpus),
            num_gpus=0,
            resources=resources or None,
            max_restarts=int(self.spec.max_restarts),
            max_task_retries=0,
            runtime_env=actor_runtime_env(),
            name=None,
        ).remote(self.spec.needs_tensorflow)
        actor = _Actor(handle, resources)
        self._actors[worker_id] = actor
        self._init(worker_id, actor, args)

    def _init(self, worker_id: int, actor: _Actor, args: tuple) -> None:
        kwargs = {"progress": None} if self.spec.shared_progress else {}
        ref = actor.handle.init.remote(self.spec.factory, worker_id, kwargs, *args)
        actor.pending.append((_INIT, ref, False, None))
        actor.live = True

    def restart(self, worker_id: int, args: tuple) -> None:
        """Restarts worker `worker_id` without waiting (see the module docstring)."""
        old = self._actors[worker_id]
        old.pending.clear()
        feasible = not any(self._ray.cluster_resources().get(k, 0) <= 0 for k in old.resources)
        if feasible and _actor_state(old.handle) not in ("DEAD", None):
            # Ray restarts it (`max_restarts`): held calls go out once it answers.
            old.live = True
            old.restarting = _Restart(args, old.pid)
            return
        self._replace(worker_id, args, feasible, held=[])

    def _replace(self, worker_id: int, args: tuple, feasible: bool, held: list) -> None:
        """A new actor for `worker_id` (Ray gave up on the old one); `held` calls go to it."""
        old = self._actors[worker_id]
        try:
            self._ray.kill(old.handle, no_restart=True)
        except Exception as e:  # noqa: BLE001 - gone already: a new actor replaces it.
            logger.debug("ray.kill failed: %s", e)
        resources = old.resources
        if not feasible:
            logger.warning(
                "%s %d: %s %s are gone from the cluster (their node was lost); restarting it "
                "with CPUs only.",
                self.spec.role.capitalize(),
                worker_id,
                self.spec.resources_key,
                old.resources,
            )
            resources = {}
        self.start(worker_id, args, resources)  # Ray queues calls until the actor is created.
        for call in held:
            self.send(worker_id, *call)

    def _check_restarts(self) -> None:
        """Advances every restarting actor by at most one non-blocking look (module docstring).

        An answer from a pid other than the old one means Ray's restart is up: the hosted
        object is built and the held calls are sent. No answer yet (`ActorUnavailableError`, or
        the old process still answering): look again later. Dead for good, or no answer within
        `_RESTART_TIMEOUT_S`: a new actor replaces it.
        """
        ray = self._ray
        now = time.monotonic()
        for worker_id, actor in list(self._actors.items()):
            restart = actor.restarting
            if restart is None or not actor.live:
                continue
            if restart.probe is not None and ray.wait([restart.probe], timeout=0)[0]:
                probe, restart.probe = restart.probe, None
                try:
                    pid = ray.get(probe)
                except ray.exceptions.ActorUnavailableError:
                    pid = restart.old_pid  # Still restarting.
                except ray.exceptions.RayError:  # Dead for good.
                    actor.restarting = None
                    self._replace(worker_id, restart.args, True, restart.held)
                    continue
                if pid != restart.old_pid:
                    actor.restarting = None
                    self._init(worker_id, actor, restart.args)
                    for call in restart.held:
                        self.send(worker_id, *call)
                    continue
                restart.next_probe = now + _PROBE_INTERVAL_S
            if now > restart.deadline:
                actor.restarting = None
                self._replace(worker_id, restart.args, True, restart.held)
            elif restart.probe is None and now >= restart.next_probe:
                restart.probe = actor.handle.pid.remote()

    # Calls -----------------------------------------------------------------------------------

    def send(
        self,
        worker_id: int,
        call_id: int,
        method: str,
        args: tuple,
        coalesce: bool,
        reply: bool,
        parts: bool = False,
    ) -> None:
        actor = self._actors[worker_id]
        if actor.live and actor.restarting is not None:
            actor.restarting.held.append((call_id, method, args, coalesce, reply, parts))
        elif actor.live:
            # Arguments go top-level, where Ray resolves object refs.
            shared = self._shared(args)
            if parts:  # (head, body): the body stays in the object store (`RayStoredValue`).
                head, body = actor.handle.call.options(num_returns=2).remote(
                    call_id, method, coalesce, reply, *shared
                )
                actor.pending.append((call_id, head, reply, body))
            else:
                ref = actor.handle.call.remote(call_id, method, coalesce, reply, *shared)
                actor.pending.append((call_id, ref, reply, None))

    def _shared(self, args: tuple) -> tuple:
        """`args`, each object sent again since the last `collect` passed as one shared ref.

        A broadcast (the same weights to every actor) then goes into the object store once,
        read by every actor on its node (one transfer per node), not once per actor. The window
        is short (calls sent before the next `collect`), so an object changed in place and sent
        again later goes anew.
        """
        shared = []
        for arg in args:
            if isinstance(arg, RayStoredValue):  # Resolved by Ray in the worker it goes to.
                shared.append(arg.ref)
                continue
            if arg is None or isinstance(arg, (bool, int, float, str, self._ray.ObjectRef)):
                shared.append(arg)
                continue
            obj, ref = self._recent.get(id(arg), (None, None))
            if obj is not arg:  # First sight: by value, as Ray would.
                self._recent[id(arg)] = (arg, None)
                shared.append(arg)
                continue
            if ref is None:
                ref = self._ray.put(arg)
                self._recent[id(arg)] = (arg, ref)
            shared.append(ref)
        return tuple(shared)

    def collect(self, timeout_s: float) -> list[Up | Answer | Death]:
        ray = self._ray
        self._recent.clear()
        self._check_restarts()
        refs = [p[1] for a in self._actors.values() if a.live for p in a.pending]
        if not refs:
            if timeout_s > 0:
                time.sleep(timeout_s)
            return []
        if timeout_s > 0:
            ray.wait(refs, num_returns=1, timeout=timeout_s)
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
        events: list[Up | Answer | Death] = []
        for worker_id, actor in self._actors.items():
            # In call order: a later call's result waits for the earlier ones'.
            while actor.live and actor.pending and actor.pending[0][1] in ready:
                call_id, ref, reply, body = actor.pending.popleft()
                try:
                    value = copy_out(ray.get(ref))
                    if body is not None:
                        value = (value, RayStoredValue(body))
                except ray.exceptions.RayError as e:
                    if not isinstance(e, ray.exceptions.RayActorError):
                        # It raised but lives, its state unknown: Ray restarts it fresh.
                        ray.kill(actor.handle, no_restart=False)
                    self._forget(actor)
                    events.append(Death(worker_id, _describe(ray, e), _is_fatal(ray, e)))
                    break
                if call_id == _INIT:
                    actor.pid = value
                    events.append(Up(worker_id))
                elif reply:
                    events.append(Answer(worker_id, call_id, value))
        return events

    def kill(self, worker_id: int) -> None:
        actor = self._actors[worker_id]
        self._forget(actor)
        try:
            self._ray.kill(actor.handle, no_restart=False)  # `restart` waits for Ray's restart.
        except Exception as e:  # noqa: BLE001 - already dead: `restart` makes a new one.
            logger.debug("ray.kill failed: %s", e)

    @staticmethod
    def _forget(actor: _Actor) -> None:
        actor.live = False
        actor.pending.clear()  # Their answers, if any come, are from the dead actor.
        actor.restarting = None

    # Introspection ---------------------------------------------------------------------------

    def progress(self, worker_id: int) -> Any:
        del worker_id
        return None

    def _up(self, worker_ids: list[int]) -> list[int]:
        """Those of `worker_ids` not restarting (a restarting actor refuses calls).

        Restarts advance here too (one non-blocking look), so that a caller polling `pids`
        between `collect`s, as a job manager's health check would, sees the restart finish.
        """
        self._check_restarts()
        return [i for i in worker_ids if self._actors[i].restarting is None]

    def pids(self, worker_ids: list[int]) -> dict[int, int]:
        """Worker id -> OS pid (workers still restarting are left out)."""
        ids = self._up(worker_ids)
        handles = [self._actors[i].handle for i in ids]
        found = self._ray.get([h.pid.remote() for h in handles], timeout=_CALL_TIMEOUT_S)
        return dict(zip(ids, found))

    def node_ids(self, worker_ids: list[int]) -> dict[int, str]:
        """Worker id -> Ray node id (workers still restarting are left out)."""
        ids = self._up(worker_ids)
        handles = [self._actors[i].handle for i in ids]
        found = self._ray.get([h.node_id.remote() for h in handles], timeout=_CALL_TIMEOUT_S)
        return dict(zip(ids, found))

    def actor_ids_in_ray(self) -> list[str]:
        """Ray's ids (hex) of every actor this group made and still holds."""
        return [a.handle._actor_id.hex() for a in self._actors.values()]

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for actor in self._actors.values():
            try:
                self._ray.kill(actor.handle, no_restart=True)
            except Exception as e:  # noqa: BLE001 - stop must go on with the others.
                logger.debug("ray.kill failed: %s", e)
            self._forget(actor)
        self._recent.clear()  # The last broadcast's object-store copy goes with the actors.
        ray_session.release()


def _actor_state(handle: Any) -> str | None:
    """Ray's state of an actor ("ALIVE", "RESTARTING", "DEAD", ...), from the GCS."""
    try:
        from ray._private import state

        info = state.actors(actor_id=handle._actor_id.hex())
    except Exception:  # noqa: BLE001 - unknown: the caller makes a new actor.
        return None
    return info.get("State") if info else None


def _is_fatal(ray: Any, error: BaseException) -> bool:
    """Whether a restart cannot help (the hosted object raised an exception with `fatal`)."""
    cause = getattr(error, "cause", None)
    return isinstance(error, ray.exceptions.RayTaskError) and bool(getattr(cause, "fatal", False))


def _describe(ray: Any, error: BaseException) -> str:
    if isinstance(error, ray.exceptions.RayActorError):
        return f"Ray actor died ({type(error).__name__}): {error}"
    return f"{type(error).__name__}: {error}"
