"""`RayActorPool`: the actors as Ray actors (`actor_backend="ray"`), on one machine or a cluster.

The same `ActorPool` interface as `impala_tf.actors.local.LocalActorPool`, and inside each actor
the same `EnvRunner` with per-actor inference (numpy for MLPs, TensorFlow otherwise):

* each actor is a `@ray.remote` actor asking for `num_cpus_per_env_runner` CPUs and the Ray
  resources in `custom_resources_per_env_runner` (which place it, e.g. on a node that carries
  them). Its environment (runtime_env env_vars) hides the GPUs (`CUDA_VISIBLE_DEVICES=""`: Ray
  2.60 no longer does it for actors with `num_gpus=0`) and holds every numeric library to one
  thread; TensorFlow is imported inside the actor, set to one intra-op and one inter-op thread
  before the policy is built (only for policies that need it: MLPs act in numpy);
* a sample request is one `sample` call; the driver keeps at most
  `max_requests_in_flight_per_env_runner` per actor in flight (a request beyond that is an
  error) and collects them with `ray.wait`;
* each broadcast puts the weights into the object store once (`ray.put`) and passes the
  reference to every actor;
* fragments are copied out of the object store (`ray.get` returns read-only arrays backed by
  shared memory) before their references are dropped;
* a dead actor (its process killed, its node lost, an error raised) is reported as an
  `ActorFailure`; `restart` then lets Ray's own restart (`max_restarts` =
  `max_num_env_runner_restarts`) bring it back (waiting until the new process answers: Ray
  refuses calls to a restarting actor rather than queueing them), or makes a new actor when
  Ray has given up on it or its custom resources left the cluster with their node (the new
  actor then asks for CPUs only, and a warning says so). The driver counts each in
  `num_env_runner_restarts` as it does for local actors. An actor that does not answer within
  `sample_timeout_s` is killed and restarted the same way.

Where Ray runs is `impala_tf.actors.ray_session`'s business (`ray_address`). `stop()` kills
every actor this pool made and, if the pool started Ray, shuts it down.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from typing import Any

import numpy as np

from impala_tf.actors import ray_session
from impala_tf.actors.base import ActorFailure, ActorPool
from impala_tf.actors.env_runner import Fragment
from impala_tf.actors.local import _ACTOR_ENV, _ACTOR_TF_LOG_LEVEL, _tensorflow_free
from impala_tf.config import ImpalaConfig
from impala_tf.envs.faults import env_name
from impala_tf.filters import Filter
from impala_tf.frames import encode_observations

__all__ = ["RayActorPool", "actor_runtime_env", "copy_out"]

logger = logging.getLogger(__name__)

_CALL_TIMEOUT_S = 120.0
#: How long `restart` waits for Ray's own restart of an actor to answer before making a new one.
_RESTART_TIMEOUT_S = 60.0


def actor_runtime_env() -> dict[str, Any]:
    """The runtime_env of every actor and aggregator: no GPU, one thread per numeric library."""
    env = dict(_ACTOR_ENV)
    env["TF_CPP_MIN_LOG_LEVEL"] = os.environ.get("TF_CPP_MIN_LOG_LEVEL", _ACTOR_TF_LOG_LEVEL)
    return {"env_vars": env}


def copy_out(value: Any) -> Any:
    """A deep copy of what `ray.get` returned: no array still points into the object store."""
    return copy.deepcopy(value)


class EnvRunnerActor:
    """What runs inside one Ray actor: an `EnvRunner` and its commands.

    Args:
      config: The algorithm config.
      actor_id: The actor's index (0-based); the runner is `worker_index = actor_id + 1`.
      needs_tensorflow: The policy runs in TensorFlow (not numpy).
      weights: Initial policy weights, or None.
      policy_version: Their `num_grad_updates`.
    """

    def __init__(
        self,
        config: ImpalaConfig,
        actor_id: int,
        needs_tensorflow: bool,
        weights: list[np.ndarray] | None,
        policy_version: int,
    ):
        if needs_tensorflow:
            # Before the policy runs a first op: afterwards TF refuses to change its pools.
            from impala_tf.quiet import import_tensorflow

            import_tensorflow()
            import tensorflow as tf

            tf.config.threading.set_intra_op_parallelism_threads(1)
            tf.config.threading.set_inter_op_parallelism_threads(1)
        from impala_tf.actors.env_runner import EnvRunner

        self._config = config
        self._actor_id = actor_id
        self._runner = EnvRunner(config, worker_index=actor_id + 1)
        if weights is not None:
            self.set_weights(weights, policy_version, None)

    def set_weights(
        self, weights: list[np.ndarray], policy_version: int, obs_filter: Filter | None
    ) -> None:
        # The arrays Ray hands over are read-only views of the shared object.
        self._runner.set_weights([np.array(w) for w in weights], policy_version, obs_filter)

    def sample(self) -> Fragment:
        fragment = self._runner.sample()
        fragment.actor_id = self._actor_id
        fragment.batch = encode_observations(
            fragment.batch, compress_observations=self._config.compress_observations
        )
        return fragment

    def get_state(self) -> dict:
        return self._runner.get_state()

    def set_state(self, state: dict) -> None:
        self._runner.set_state(state)

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


class _Actor:
    """The driver's handle on one Ray actor."""

    def __init__(self, handle: Any, resources: dict[str, float]):
        self.handle = handle
        self.resources = resources  # The custom resources it was made with.
        self.healthy = True
        self.pending: list[Any] = []  # Sample refs in flight, oldest first.
        self.waiting_since: float | None = None


class RayActorPool(ActorPool):
    """`num_env_runners` Ray actors (at least one) running `EnvRunner`s.

    Args:
      config: The algorithm config (`actor_backend="ray"`; `ray_address`,
        `num_cpus_per_env_runner`, `custom_resources_per_env_runner`).
      weights: Initial policy weights for every actor (None keeps their random init).
      policy_version: The learner's `num_grad_updates` that `weights` correspond to.

    Raises:
      ImportError: Ray is not installed.
      ValueError: `custom_resources_per_env_runner` names a resource no node of the cluster has.
    """

    def __init__(
        self,
        config: ImpalaConfig,
        weights: list[np.ndarray] | None = None,
        policy_version: int = 0,
    ):
        light, _, _, _ = _tensorflow_free(config)  # Ray actors always run the policy themselves.
        self.config = config
        self.num_actors = max(1, int(config.num_env_runners))
        self._needs_tensorflow = not light
        self._ray = ray_session.acquire(config)
        self._stopped = False
        self._actors: dict[int, _Actor] = {}
        self._owner: dict[Any, int] = {}  # Sample ref -> actor id.
        self._held_failures: list[ActorFailure] = []
        self._weights_ref = None
        try:
            self._check_resources()
            ray = self._ray
            self._remote_cls = ray.remote(EnvRunnerActor)
            ref = None if weights is None else ray.put(weights)
            for i in range(self.num_actors):
                self._actors[i] = self._create(i, ref, policy_version, self._custom_resources())
        except BaseException:
            self.stop()
            raise

    # Making actors ----------------------------------------------------------------------------

    def _custom_resources(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.config.custom_resources_per_env_runner.items()}

    def _check_resources(self) -> None:
        total = self._ray.cluster_resources()
        missing = [k for k in self._custom_resources() if total.get(k, 0) <= 0]
        if missing:
            raise ValueError(
                f"`custom_resources_per_env_runner` asks for {missing}, which no node of the Ray "
                f"cluster offers (cluster resources: {sorted(total)}); the actors would never "
                "start. Start a node with `ray start ... --resources='{\"NAME\": N}'`."
            )

    def _create(self, actor_id: int, weights_ref: Any, version: int, resources: dict) -> _Actor:
        restarts = (
            int(self.config.max_num_env_runner_restarts)
            if self.config.restart_failed_env_runners
            else 0
        )
        handle = self._remote_cls.options(
            num_cpus=float(self.config.num_cpus_per_env_runner),
            num_gpus=0,
            resources=resources or None,
            max_restarts=restarts,
            max_task_retries=0,
            runtime_env=actor_runtime_env(),
            name=None,
        ).remote(self.config, actor_id, self._needs_tensorflow, weights_ref, version)
        return _Actor(handle, resources)

    # ActorPool --------------------------------------------------------------------------------

    def request_samples(self, actor_ids: list[int], count: int = 1) -> None:
        limit = int(self.config.max_requests_in_flight_per_env_runner)
        for i in actor_ids:
            actor = self._actors[i]
            if not actor.healthy:
                continue
            if len(actor.pending) + count > limit:
                raise RuntimeError(
                    f"actor {i}: {len(actor.pending)} + {count} sample requests would exceed "
                    f"max_requests_in_flight_per_env_runner={limit}"
                )
            if not actor.pending:
                actor.waiting_since = time.monotonic()
            for _ in range(count):
                ref = actor.handle.sample.remote()
                actor.pending.append(ref)
                self._owner[ref] = i

    def fetch_ready(self, timeout_s: float) -> tuple[list[Fragment], list[ActorFailure]]:
        ray = self._ray
        refs = list(self._owner)
        ready: list[Any] = []
        if refs:
            if timeout_s > 0 and not self._held_failures:
                ray.wait(refs, num_returns=1, timeout=timeout_s)
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        fragments: list[Fragment] = []
        for ref in ready:
            actor_id = self._owner.pop(ref, None)
            if actor_id is None:  # Dropped with its actor's failure in this loop.
                continue
            actor = self._actors[actor_id]
            actor.pending.remove(ref)
            try:
                fragment = copy_out(ray.get(ref))
            except ray.exceptions.RayError as e:
                if not isinstance(e, ray.exceptions.RayActorError):
                    # It raised but lives, its envs in an unknown state: Ray restarts it fresh.
                    ray.kill(actor.handle, no_restart=False)
                self._fail(actor_id, _describe(ray, e), fatal=_is_fatal(ray, e))
                continue
            fragments.append(fragment)
            actor.waiting_since = time.monotonic() if actor.pending else None
        self._check_timeouts()
        failures, self._held_failures = self._held_failures, []
        return fragments, failures

    def _check_timeouts(self) -> None:
        timeout = self.config.sample_timeout_s
        if timeout is None:
            return
        now = time.monotonic()
        for actor_id, actor in self._actors.items():
            waiting = actor.waiting_since
            if actor.healthy and waiting is not None and now - waiting > timeout:
                # Ray restarts it (max_restarts); `restart` then sends it the weights.
                self._ray.kill(actor.handle, no_restart=False)
                self._fail(
                    actor_id,
                    f"actor {actor_id} did not answer a sample request within "
                    f"sample_timeout_s={timeout:g} s: env {env_name(self.config.env)} hangs "
                    "(the actor was killed)",
                )

    def _fail(self, actor_id: int, error: str, fatal: bool = False) -> None:
        actor = self._actors[actor_id]
        if not actor.healthy:
            return
        actor.healthy = False
        for ref in actor.pending:  # Their answers, if any come, are from the dead actor.
            self._owner.pop(ref, None)
        actor.pending = []
        actor.waiting_since = None
        self._held_failures.append(ActorFailure(actor_id, error, fatal))

    def broadcast_weights(
        self,
        weights: list[np.ndarray],
        policy_version: int,
        actor_ids: list[int],
        obs_filter: Filter | None = None,
    ) -> None:
        targets = [self._actors[i] for i in actor_ids if self._actors[i].healthy]
        if not targets:
            return
        # One copy in the object store, read by every actor on its node (one transfer per node).
        self._weights_ref = self._ray.put(weights)
        for actor in targets:
            actor.handle.set_weights.remote(self._weights_ref, policy_version, obs_filter)

    def restart(self, actor_id: int, weights: list[np.ndarray], policy_version: int) -> None:
        ray = self._ray
        old = self._actors[actor_id]
        ref = ray.put(weights)
        wanted = self._custom_resources()
        feasible = not any(ray.cluster_resources().get(k, 0) <= 0 for k in wanted)
        if (
            feasible
            and _actor_state(ray, old.handle) not in ("DEAD", None)
            and self._wait_until_up(old.handle)
        ):
            # Ray has restarted the actor itself (`max_restarts`).
            old.handle.set_weights.remote(ref, policy_version, None)
            old.healthy = True
            return
        ray.kill(old.handle, no_restart=True)
        if not feasible:
            logger.warning(
                "Actor %d: custom_resources_per_env_runner %s are gone from the cluster (their "
                "node was lost); restarting it with CPUs only.",
                actor_id,
                wanted,
            )
            wanted = {}
        self._actors[actor_id] = self._create(actor_id, ref, policy_version, wanted)

    def _wait_until_up(self, handle: Any) -> bool:
        """Waits until Ray's restart of `handle` answers a call; False if it died or never did.

        With `max_task_retries=0` Ray refuses a call made while the actor restarts
        (`ActorUnavailableError`) instead of queueing it, so the weights (and the samples after
        them) can only go once the new process answers. The wait blocks the driver for as long
        as the restart takes (a process start and imports: seconds), at most
        `_RESTART_TIMEOUT_S`; after that the caller makes a new actor.
        """
        ray = self._ray
        deadline = time.monotonic() + _RESTART_TIMEOUT_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                ray.get(handle.pid.remote(), timeout=left)
                return True
            except ray.exceptions.ActorUnavailableError:
                time.sleep(0.2)
            except ray.exceptions.RayError:  # Dead for good, or no answer in time.
                return False

    def healthy_actor_ids(self) -> list[int]:
        return [i for i, a in self._actors.items() if a.healthy]

    def get_actor_states(self, actor_ids: list[int], timeout_s: float) -> dict[int, dict]:
        ray = self._ray
        refs = {i: self._actors[i].handle.get_state.remote() for i in self.healthy_ids(actor_ids)}
        states: dict[int, dict] = {}
        deadline = time.monotonic() + timeout_s
        for i, ref in refs.items():
            try:
                states[i] = copy_out(ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
            except ray.exceptions.GetTimeoutError as e:
                raise TimeoutError(f"actor {i} sent no state within {timeout_s:g} s") from e
            except ray.exceptions.RayError as e:
                self._fail(i, _describe(ray, e), fatal=_is_fatal(ray, e))
        return states

    def set_actor_states(self, states: dict[int, dict]) -> None:
        for i, state in states.items():
            if self._actors[i].healthy:
                self._actors[i].handle.set_state.remote(state)

    def healthy_ids(self, actor_ids: list[int]) -> list[int]:
        """The healthy ones among `actor_ids`."""
        return [i for i in actor_ids if self._actors[i].healthy]

    # Introspection (tests, monitoring) -----------------------------------------------------------

    def pids(self) -> list[int]:
        """Process ids of the healthy actors (each on its own node; for tests and monitoring)."""
        handles = [self._actors[i].handle for i in self.healthy_actor_ids()]
        return self._ray.get([h.pid.remote() for h in handles], timeout=_CALL_TIMEOUT_S)

    def node_ids(self) -> dict[int, str]:
        """The Ray node id each healthy actor runs on."""
        ids = self.healthy_actor_ids()
        found = self._ray.get(
            [self._actors[i].handle.node_id.remote() for i in ids], timeout=_CALL_TIMEOUT_S
        )
        return dict(zip(ids, found))

    def actor_ids_in_ray(self) -> list[str]:
        """Ray's ids (hex) of every actor this pool made and still holds."""
        return [a.handle._actor_id.hex() for a in self._actors.values()]

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        ray = getattr(self, "_ray", None)
        if ray is None:
            return
        for actor in self._actors.values():
            try:
                ray.kill(actor.handle, no_restart=True)
            except Exception as e:  # noqa: BLE001 - stop must go on with the others.
                logger.debug("ray.kill failed: %s", e)
        self._owner.clear()
        for actor in self._actors.values():
            actor.pending = []
        self._weights_ref = None
        ray_session.release()


def _actor_state(ray: Any, handle: Any) -> str | None:
    """Ray's state of an actor ("ALIVE", "RESTARTING", "DEAD", ...), from the GCS."""
    try:
        from ray._private import state

        info = state.actors(actor_id=handle._actor_id.hex())
    except Exception:  # noqa: BLE001 - unknown: the caller makes a new actor.
        return None
    return info.get("State") if info else None


def _is_fatal(ray: Any, error: BaseException) -> bool:
    """Whether a restart cannot help (the env's `EnvError.fatal`, raised inside the actor)."""
    cause = getattr(error, "cause", None)
    return isinstance(error, ray.exceptions.RayTaskError) and bool(getattr(cause, "fatal", False))


def _describe(ray: Any, error: BaseException) -> str:
    if isinstance(error, ray.exceptions.RayActorError):
        return f"Ray actor died ({type(error).__name__}): {error}"
    return f"{type(error).__name__}: {error}"
