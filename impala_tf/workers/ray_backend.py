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
  dead actor (`RayActorError`) likewise. `restart` then waits until Ray's own restart answers
  (Ray refuses calls to a restarting actor rather than queueing them), or makes a new actor
  when Ray gave up on it or its custom resources left the cluster with their node (the new
  actor then asks for CPUs only, and a warning says so).

Where Ray runs is `impala_tf.workers.ray_session`'s business: each group acquires the session
when it opens and releases it when it stops.
"""

from __future__ import annotations

import collections
import copy
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import impala_tf.workers.ray_session as ray_session
from impala_tf.workers.group import Answer, Death, WorkerSpec
from impala_tf.workers.host import WorkerHost
from impala_tf.workers.process import worker_env_vars

__all__ = ["RayBackend", "RayWorker", "actor_runtime_env", "copy_out"]

logger = logging.getLogger(__name__)

#: How long `pids`/`node_ids` wait for the actors' answers.
_CALL_TIMEOUT_S = 120.0
#: How long `restart` waits for Ray's own restart of an actor to answer before making a new one.
_RESTART_TIMEOUT_S = 60.0
#: Call id of the `init` task that builds the hosted object (never answered).
_INIT = -1


def actor_runtime_env() -> dict[str, Any]:
    """The runtime_env of every Ray worker: no GPU, one thread per numeric library."""
    return {"env_vars": worker_env_vars()}


def copy_out(value: Any) -> Any:
    """A deep copy of what `ray.get` returned: no array still points into the object store."""
    return copy.deepcopy(value)


class RayWorker:
    """What runs inside one Ray actor: a `WorkerHost` around the hosted object.

    Args:
      needs_tensorflow: Import TensorFlow and limit its thread pools before anything runs it.
    """

    def __init__(self, needs_tensorflow: bool):
        if needs_tensorflow:
            # Before the hosted object runs a first op: afterwards TF refuses to change its pools.
            from impala_tf.quiet import import_tensorflow

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


class _Actor:
    """The driver's handle on one Ray worker."""

    def __init__(self, handle: Any, resources: dict[str, float]):
        self.handle = handle
        self.resources = resources  # The custom resources it was made with.
        self.live = True
        self.pending: collections.deque[tuple[int, Any, bool]] = collections.deque()
        self.pid: int | None = None  # Of the process that built the hosted object.


class _RayGroup:
    """The Ray actors of one `WorkerGroup` (see `impala_tf.workers.group.BackendGroup`)."""

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
        actor.pending.append((_INIT, ref, False))
        actor.live = True

    def restart(self, worker_id: int, args: tuple) -> None:
        ray = self._ray
        old = self._actors[worker_id]
        old.pending.clear()
        feasible = not any(ray.cluster_resources().get(k, 0) <= 0 for k in old.resources)
        if (
            feasible
            and _actor_state(old.handle) not in ("DEAD", None)
            and self._wait_until_up(old.handle, old.pid)
        ):
            self._init(worker_id, old, args)  # Ray has restarted the actor (`max_restarts`).
            return
        try:
            ray.kill(old.handle, no_restart=True)
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
        self.start(worker_id, args, resources)

    def _wait_until_up(self, handle: Any, old_pid: int | None) -> bool:
        """Waits until Ray's restart of `handle` answers a call; False if it died or never did.

        An answer from `old_pid` is the process being killed, not yet gone: it does not count.

        With `max_task_retries=0` Ray refuses a call made while the actor restarts
        (`ActorUnavailableError`) instead of queueing it, so the new hosted object can only be
        built once the new process answers. This blocks the driver for as long as the restart
        takes (a process start and imports: seconds), at most `_RESTART_TIMEOUT_S`.
        """
        ray = self._ray
        deadline = time.monotonic() + _RESTART_TIMEOUT_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                if ray.get(handle.pid.remote(), timeout=left) != old_pid:
                    return True
                time.sleep(0.2)
            except ray.exceptions.ActorUnavailableError:
                time.sleep(0.2)
            except ray.exceptions.RayError:  # Dead for good, or no answer in time.
                return False

    # Calls -----------------------------------------------------------------------------------

    def send(
        self, worker_id: int, call_id: int, method: str, args: tuple, coalesce: bool, reply: bool
    ) -> None:
        actor = self._actors[worker_id]
        if actor.live:
            # Arguments go top-level, where Ray resolves object refs.
            ref = actor.handle.call.remote(call_id, method, coalesce, reply, *self._shared(args))
            actor.pending.append((call_id, ref, reply))

    def _shared(self, args: tuple) -> tuple:
        """`args`, each object sent again since the last `collect` passed as one shared ref.

        A broadcast (the same weights to every actor) then goes into the object store once,
        read by every actor on its node (one transfer per node), not once per actor. The window
        is short (calls sent before the next `collect`), so an object changed in place and sent
        again later goes anew.
        """
        shared = []
        for arg in args:
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

    def collect(self, timeout_s: float) -> list[Answer | Death]:
        ray = self._ray
        self._recent.clear()
        refs = [ref for a in self._actors.values() if a.live for _, ref, _ in a.pending]
        if not refs:
            if timeout_s > 0:
                time.sleep(timeout_s)
            return []
        if timeout_s > 0:
            ray.wait(refs, num_returns=1, timeout=timeout_s)
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
        events: list[Answer | Death] = []
        for worker_id, actor in self._actors.items():
            # In call order: a later call's result waits for the earlier ones'.
            while actor.live and actor.pending and actor.pending[0][1] in ready:
                call_id, ref, reply = actor.pending.popleft()
                try:
                    value = copy_out(ray.get(ref))
                except ray.exceptions.RayError as e:
                    if not isinstance(e, ray.exceptions.RayActorError):
                        # It raised but lives, its state unknown: Ray restarts it fresh.
                        ray.kill(actor.handle, no_restart=False)
                    self._forget(actor)
                    events.append(Death(worker_id, _describe(ray, e), _is_fatal(ray, e)))
                    break
                if call_id == _INIT:
                    actor.pid = value
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

    # Introspection ---------------------------------------------------------------------------

    def progress(self, worker_id: int) -> Any:
        del worker_id
        return None

    def pids(self, worker_ids: list[int]) -> dict[int, int]:
        handles = [self._actors[i].handle for i in worker_ids]
        found = self._ray.get([h.pid.remote() for h in handles], timeout=_CALL_TIMEOUT_S)
        return dict(zip(worker_ids, found))

    def node_ids(self, worker_ids: list[int]) -> dict[int, str]:
        handles = [self._actors[i].handle for i in worker_ids]
        found = self._ray.get([h.node_id.remote() for h in handles], timeout=_CALL_TIMEOUT_S)
        return dict(zip(worker_ids, found))

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
