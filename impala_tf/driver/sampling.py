"""`EnvRunnerGroup`: the actors, their sample requests, restarts and observation filters.

The actors are `num_env_runners` workers (`impala_tf.workers.WorkerGroup`: local processes or Ray
actors, as the plan says) each hosting an env runner (`impala_tf.rollout.host`). This module is
RLlib's env-runner group seen from the driver:

* sampling is asynchronous: each actor has at most `max_requests_in_flight_per_env_runner` sample
  requests outstanding (`top_up`), or exactly one in lockstep (`request_idle`); an actor that
  does not answer within `sample_timeout_s` is killed and reported (the worker group's timeout);
* a failed actor is restarted (`restart_failed_env_runners`, `max_num_env_runner_restarts`; the
  `impala_tf.workers.RestartPolicy` rules) with the newest weights and, in a seeded run, env and
  sampler seeds of its own (a new process would otherwise replay the episodes of the one it
  replaces); `num_env_runner_failures` and `num_env_runner_restarts` count them (the latter,
  restored on a resume, is the one count `max_num_env_runner_restarts` limits);
* the master observation filters (`observation_filter`, one per policy) merge each fragment's
  changes and go to the actors with the weights;
* with central inference the driver's `InferenceServer` acts for every actor: broadcasts load
  the server once and the actors get the versions only;
* on local processes a broadcast writes each policy's weights once into shared memory (a ring
  per policy, `impala_tf.workers.shared_arrays`) and each actor's message carries a handle,
  which the actor reads when it applies the weights; on Ray the weights go into the object
  store once (`impala_tf.workers.ray_backend`);
* after a restore, fragments requested before it are dropped (`drop_in_flight`);
* with aggregation workers a fragment's batches stay where the actor put them (`sample_parts`):
  in Ray's object store, or in shared memory on local processes
  (`impala_tf.workers.shared_values`). The driver reads the counts, episodes and filter
  changes, and the batches go to an aggregation worker by reference
  (`impala_tf.driver.aggregation`), which releases them.

The group is built from a `SamplingSpec` (`impala_tf.driver.specs.sampling_spec`), never from the
config; resolving it checks, before any local actor starts, that the pool fits in this machine's
memory (`impala_tf.workers.memory.check_actor_memory`: an `ActorMemoryError` naming
`num_env_runners`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from impala_tf.acting import filters as filter_lib
from impala_tf.driver.counters import Counters
from impala_tf.driver.plan import RuntimePlan
from impala_tf.driver.specs import SamplingSpec
from impala_tf.envs.faults import StepProgress
from impala_tf.rollout.fragment import Fragment
from impala_tf.rollout.host import RunnerHost, make_runner_host
from impala_tf.utils.seeds import Stream, stream_seed
from impala_tf.workers import (
    ProcessBackend,
    RestartPolicy,
    WorkerFailure,
    WorkerGroup,
    WorkerSpec,
    release,
)
from impala_tf.workers.shared_arrays import ArrayRings

__all__ = ["EnvRunnerGroup", "make_backend", "ray_request"]

logger = logging.getLogger(__name__)

#: How long a deterministic save waits for an actor's snapshot.
_STATE_TIMEOUT_S = 120.0


def ray_request(spec: SamplingSpec) -> tuple[str | None, float, dict[str, float]]:
    """What the Ray backend of `spec` asks of Ray (`impala_tf.workers.ray_session.acquire`'s
    arguments): `ray_address`, and the CPUs and custom resources of a Ray started here, sized
    for the actors and the aggregation workers."""
    actors = spec.num_actors
    cpus = actors * spec.num_cpus + spec.num_aggregation_workers
    resources = {k: v * actors for k, v in spec.resources.items()}
    return spec.ray_address, max(float(os.cpu_count() or 1), cpus), resources


def make_backend(spec: SamplingSpec, plan: RuntimePlan) -> Any:
    """The worker backend of the plan: local processes, or Ray (`ray_request`)."""
    if plan.backend == "process":
        return ProcessBackend()
    from impala_tf.workers.ray_backend import RayBackend  # Ray is an optional extra.

    return RayBackend(*ray_request(spec))


def _describe_hang(env: str, progress: Any) -> str:
    where = f" {StepProgress(progress).describe()}" if progress is not None else ""
    return f"env {env} hangs{where}"


class EnvRunnerGroup:
    """The actors (see the module docstring).

    Args:
      spec: The sampling settings (`impala_tf.driver.specs.sampling_spec`, which also checked
        that local actors fit in memory).
      plan: The run's plan (backend, spaces, inference, preload).
      counters: The driver's counters (failures and restarts are counted here).
      host_factory: What each actor worker hosts (`impala_tf.rollout.host.make_runner_host`;
        `tools.bench_driver` replays recorded fragments instead), called with the actor id and
        `(plan.runner, endpoint, initial_states)`: the actors receive the plan's `RunnerSpec`,
        never the config.
    """

    def __init__(
        self,
        spec: SamplingSpec,
        plan: RuntimePlan,
        counters: Counters,
        host_factory: Callable[..., Any] = make_runner_host,
    ):
        self.spec = spec
        self.plan = plan
        self.counters = counters
        self.num_actors = spec.num_actors
        self.filters = {
            pid: filter_lib.get_filter(spec.observation_filter, obs.shape)
            for pid, (obs, _) in plan.spaces.policies.items()
        }
        self.server = None
        self._endpoint = None
        self._node_ip: str | None = None
        if plan.central_inference:
            from impala_tf.acting.inference import InferenceServer  # TensorFlow: the driver's.

            acting = plan.runner.policies
            self.server = InferenceServer(
                {pid: (*a.spaces, a.model) for pid, a in acting.items()},
                precisions={pid: a.precision for pid, a in acting.items()},
                frame_stacks=plan.runner.frame_stacks,
            )
        enabled = spec.restart_failed
        worker_spec = WorkerSpec(
            role="actor",
            factory=host_factory,
            make_args=self._factory_args,
            preload=plan.preload,
            needs_tensorflow=plan.actors_need_tensorflow,
            shared_progress=True,
            describe_hang=functools.partial(_describe_hang, spec.env_name),
            num_cpus=spec.num_cpus,
            resources=dict(spec.resources),
            max_restarts=spec.max_restarts if enabled else 0,
            timeout_s=spec.sample_timeout_s,
        )
        restarts = RestartPolicy("actor", enabled=enabled, max_restarts=spec.max_restarts)
        # With aggregation workers, fragments' batches stay in the backend's store and go to an
        # aggregation worker from there (`impala_tf.driver.aggregation`): the driver fetches
        # only the rest (counts, episodes, filter changes).
        self._parts = spec.num_aggregation_workers > 0
        # Local processes read the weights from shared memory: one write per broadcast, not a
        # pickle per actor.
        self._rings = ArrayRings() if plan.backend == "process" else None
        self.in_flight = {i: 0 for i in range(self.num_actors)}
        try:
            self.workers = WorkerGroup(
                make_backend(spec, plan), worker_spec, self.num_actors, restarts=restarts
            )
        except BaseException:
            if self.server is not None:
                self.server.stop()
            raise

    def _factory_args(self, actor_id: int) -> tuple:
        endpoint, shapes = None, None
        if self.server is not None:
            shapes = self.server.initial_states
            if self.plan.backend == "process":
                endpoint = self.server.attach(actor_id)
            else:
                if self._endpoint is None:
                    self._endpoint = self.server.listen(advertise=self.node_ip)
                endpoint = self._endpoint
        return (self.plan.runner, endpoint, shapes)

    @property
    def node_ip(self) -> str:
        """The driver's node address, as RLlib's result dict reports it (`node_ip`).

        On Ray, Ray's address of this node (`ray.util.get_node_ip_address`, what Ray actors
        reach the driver at); on local processes, this machine's address on its default route
        (`impala_tf.acting.inference_protocol.node_ip_address`, "127.0.0.1" offline).
        """
        if self._node_ip is None:
            if self.plan.backend == "ray":
                import ray

                self._node_ip = str(ray.util.get_node_ip_address())
            else:
                from impala_tf.acting.inference_protocol import node_ip_address

                self._node_ip = node_ip_address()
        return self._node_ip

    # Sampling -----------------------------------------------------------------------------------

    def _sample(self, actor_id: int) -> int | None:
        if self._parts:
            return self.workers.call(actor_id, RunnerHost.sample_parts, parts=True)
        return self.workers.call(actor_id, RunnerHost.sample)

    def top_up(self) -> None:
        """Keeps `max_requests_in_flight_per_env_runner` sample requests out per healthy actor."""
        limit = self.spec.max_requests_in_flight
        for actor_id in self.workers.healthy_ids():
            for _ in range(limit - self.in_flight[actor_id]):
                if self._sample(actor_id) is None:
                    break
                self.in_flight[actor_id] += 1

    def request_idle(self) -> None:
        """One sample request to each healthy actor with none outstanding (lockstep)."""
        for actor_id in self.workers.healthy_ids():
            if self.in_flight[actor_id] == 0 and self._sample(actor_id) is not None:
                self.in_flight[actor_id] = 1

    def fetch(self, timeout_s: float) -> tuple[list[Fragment], list[WorkerFailure]]:
        """The fragments ready now (waiting up to `timeout_s` for one) and the actors that failed.

        Each fragment's filter changes are merged into the master filters here.
        """
        replies, failures = self.workers.poll(timeout_s)
        fragments = []
        for reply in replies:
            if reply.method not in (RunnerHost.sample, RunnerHost.sample_parts):
                continue
            self.in_flight[reply.worker_id] = max(0, self.in_flight[reply.worker_id] - 1)
            fragment = reply.value
            if reply.method is RunnerHost.sample_parts:  # The batches: a `StoredValue`.
                head, batches = fragment
                fragment = dataclasses.replace(head, batches=batches)
            if reply.stale:  # Sampled before a restore.
                release(fragment.batches)
                continue
            for pid, delta in (fragment.filter_deltas or {}).items():
                if delta is not None:
                    self.filters[pid].apply_changes(delta)
            fragments.append(fragment)
        return fragments, failures

    def handle_failures(self, failures: Iterable[WorkerFailure]) -> list[int]:
        """Restarts failed actors or raises (the `RestartPolicy` rules); returns the restarted
        ones, which need weights (`impala_tf.driver.broadcast.Broadcaster.restarted`)."""
        restarted = []
        for failure in failures:
            self.in_flight[failure.worker_id] = 0
            self.counters.num_env_runner_failures += 1
            # Raises when no restart is allowed (`max_num_env_runner_restarts` against the
            # counter, a resumed run's restarts included).
            self.workers.restart_failed(failure, self.counters.num_env_runner_restarts)
            logger.warning("Restarted actor %d after: %s", failure.worker_id, failure.error)
            self.counters.num_env_runner_restarts += 1
            restarted.append(failure.worker_id)
            seed = self.spec.seed
            if seed is not None:  # A new process would replay its predecessor's episodes.
                restarts = int(self.counters.num_env_runner_restarts)
                reseed = stream_seed(seed, Stream.RESTARTED_ACTOR, restarts, failure.worker_id)
                self.workers.call(
                    failure.worker_id, RunnerHost.set_state, {"seed": reseed}, reply=False
                )
        return restarted

    # Weights, filters and states ----------------------------------------------------------------

    def filters_to_send(self) -> dict[str, filter_lib.Filter] | None:
        """The master observation filters as the actors receive them (None without filters)."""
        if self.spec.observation_filter == "NoFilter":
            return None
        return {pid: f.as_serializable() for pid, f in self.filters.items()}

    def broadcast(self, weights: Mapping[str, tuple], actor_ids: Iterable[int]) -> None:
        """Sends {policy_id: (weights, num_grad_updates)} and the filters to `actor_ids`.

        Local processes get the weights as one handle on their copy in shared memory, written
        here once (`ArrayRings.share`); each actor's worker host reads it when it applies it.
        """
        actor_ids = list(actor_ids)
        if self.server is not None:
            self.server.set_weights(weights)
            weights = {pid: (None, version) for pid, (_, version) in weights.items()}
        elif self._rings is not None and actor_ids:
            weights = self._rings.share(weights)
        filters = self.filters_to_send()
        for actor_id in actor_ids:
            self.workers.call(
                actor_id, RunnerHost.set_weights, weights, filters, coalesce=True, reply=False
            )

    def get_states(self) -> dict[int, dict]:
        """Snapshots of the idle actors' runners (`get_state`), for an exact resume."""
        return self.workers.call_and_wait(
            self.workers.healthy_ids(), RunnerHost.get_state, timeout_s=_STATE_TIMEOUT_S
        )

    def get_state(self) -> dict[str, Any]:
        """Plain data: the merged observation filters."""
        return {"observation_filters": {p: f.get_state() for p, f in self.filters.items()}}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Restores `get_state()` (a policy's filter not in `state` stays as it is)."""
        for pid, saved in (state.get("observation_filters") or {}).items():
            if saved is not None and pid in self.filters:
                self.filters[pid] = filter_lib.filter_from_state(saved)

    def set_states(self, states: Mapping[int, dict]) -> None:
        """Applies each actor's runner state (in order with the other calls sent to it)."""
        for actor_id, state in states.items():
            self.workers.call(actor_id, RunnerHost.set_state, state, reply=False)

    def drop_in_flight(self) -> None:
        """Fragments of sample requests sent before now will be dropped (a restore)."""
        self.workers.fence()

    # Introspection and shutdown -----------------------------------------------------------------

    def healthy_ids(self) -> list[int]:
        return self.workers.healthy_ids()

    def num_in_flight(self) -> int:
        return int(sum(self.in_flight.values()))

    def pids(self) -> dict[int, int]:
        """{actor id: OS pid} of the healthy actors."""
        return self.workers.pids()

    def stop(self) -> None:
        """Ends every actor and the inference server. Safe to call twice."""
        if self.server is not None:
            # First: actors waiting for an answer see EOF and exit instead of finishing a fragment.
            self.server.stop()
        workers = getattr(self, "workers", None)
        if workers is not None:
            workers.stop()
        rings = getattr(self, "_rings", None)
        if rings is not None:
            rings.close()
