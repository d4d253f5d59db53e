"""Aggregation: fragments -> decompressed, replayed, train-batch-sized pieces per policy.

`Aggregator` is what happens to every fragment between the actors and the learners, per trained
policy: decompression of its observations (`impala_tf.data.sample_batch.decompress`: zlib, with
`compress_observations`; frame-stacked observations stay frames, `impala_tf.models.frames`), RLlib's
mix-in replay (`replay_proportion`, `replay_buffer_num_slots`; one buffer per policy, RLlib's
"independent" multi-agent replay) and cutting into train batches of `train_batch_size`
(`impala_tf.data.batching.BatchBuilder`). Policies not in `policies_to_train` are
dropped here.

`AggregationStage` runs it in the driver, or, with `num_aggregation_workers` > 0 (RLlib's tree
aggregation), in aggregation workers on the actors' backend (local processes or Ray actors; the
same `impala_tf.workers` mechanism): each fragment goes to a random healthy worker with fewer
than `max_requests_in_flight_per_aggregator_worker` fragments outstanding, and the train batches
come back. Both ways by reference (`impala_tf.workers.StoredValue`): a fragment's batches stay
where the actor left them, in Ray's object store or in a shared memory segment
(`impala_tf.workers.shared_values`), and the aggregation worker reads them from there; its train
batches come back the same way (`process_parts`). The driver so sees the fragments' counts and
episodes and handles on the train batches only, and releases each fragment's batches once its
aggregation worker answered or failed. The train batches stay in the store too until the
learner's loader fetches them (`BatchRef`, an `impala_tf.data.train_batch.BatchHandle`): their bytes
never pass through the driver's main thread, which so does no per-byte work for the fragments
its workers take. A train batch lost with its node before the loader fetched it is skipped and
its env steps counted in `num_env_steps_lost_in_aggregation`. (On Ray a fragment whose batches
were lost with their actor costs its aggregation worker a restart, counted.) When no worker is
healthy or every healthy one is at that limit even after the replies that came back are taken,
the driver reads the fragment's batches and aggregates them itself, counting
`num_times_no_aggregation_worker_available` (RLlib counts it too, and drops the fragment). A
worker that dies is restarted (`num_aggregation_worker_restarts`); the env steps it held are lost
(`num_env_steps_lost_in_aggregation`). `reset` drops what the workers and the driver hold (a
restore), so nothing sampled before a restore trains after it.

numpy only: aggregation workers never import TensorFlow.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import random
import threading
from collections.abc import Mapping
from typing import Any

from impala_tf.data.batching import BatchBuilder
from impala_tf.data.replay import MixInReplayBuffer
from impala_tf.data.sample_batch import SampleBatch, decompress
from impala_tf.data.train_batch import BatchHandle, BatchLost, release_unread
from impala_tf.driver.counters import Counters
from impala_tf.rollout.fragment import Fragment
from impala_tf.utils.seeds import replay_seed
from impala_tf.workers import (
    RestartPolicy,
    StoredValue,
    WorkerGroup,
    WorkerSpec,
    release,
    resolve,
)

__all__ = [
    "AggregationStage",
    "Aggregator",
    "AggregatorHost",
    "AggregatorSpec",
    "BatchRef",
    "make_aggregator_host",
]

logger = logging.getLogger(__name__)

#: (policy id, train batch, mean `num_grad_updates` of the weights that sampled it); the batch of
#: an aggregation worker is a `BatchRef` (fetched by the learner's loader).
Output = tuple[str, SampleBatch | BatchHandle, float]


@dataclasses.dataclass(frozen=True)
class AggregatorSpec:
    """What an aggregator is built from (`impala_tf.driver.specs.aggregator_spec` of a config).

    Attributes:
      rows: {policy_id: sequences per train batch} of the trained policies.
      replay: {policy_id: (capacity, replay ratio)} of the policies with mix-in replay
        (`replay_buffer_num_slots`, and the ratio of `replay_proportion`).
      seed: The run's seed (`seed`): the replay streams derive theirs from it, and the
        driver's choice of a worker for each fragment.
      num_workers: Aggregation workers (`num_aggregation_workers`; 0 aggregates in the driver).
      max_in_flight: Fragments out per worker at most
        (`max_requests_in_flight_per_aggregator_worker`).
    """

    rows: Mapping[str, int]
    replay: Mapping[str, tuple[int, float]] = dataclasses.field(default_factory=dict)
    seed: int | None = None
    num_workers: int = 0
    max_in_flight: int = 2


class Aggregator:
    """Per trained policy: decompression, mix-in replay and train-batch cutting.

    Args:
      spec: What it is built from.
      index: The aggregation worker's index (0: the driver); varies the replay seeds.
      seed: The seed of the replay streams (default: `spec.seed`).
    """

    def __init__(self, spec: AggregatorSpec, index: int = 0, seed: int | None = None):
        seed = spec.seed if seed is None else seed
        self._replay: dict[str, MixInReplayBuffer | None] = {}
        self._builders: dict[str, BatchBuilder] = {}
        for k, pid in enumerate(sorted(spec.rows)):
            self._builders[pid] = BatchBuilder(spec.rows[pid])
            self._replay[pid] = None
            if pid in spec.replay:
                capacity, ratio = spec.replay[pid]
                self._replay[pid] = MixInReplayBuffer(
                    capacity=capacity,
                    replay_ratio=ratio,
                    seed=replay_seed(seed, index, k),
                )

    def process(
        self, batches: Mapping[str, SampleBatch], versions: Mapping[str, float]
    ) -> list[Output]:
        """Decompresses, mixes in replay and returns the completed train batches."""
        out: list[Output] = []
        for pid, batch in batches.items():
            builder = self._builders.get(pid)
            if builder is None:  # Not in `policies_to_train`.
                continue
            batch = decompress(batch)
            replay = self._replay[pid]
            if replay is not None:
                replay.add(batch)
                batch = replay.replay()
                if batch is None:
                    continue
            for train_batch, version in builder.add(batch, float(versions.get(pid, 0))):
                out.append((pid, train_batch, version))
        return out

    def get_state(self, replay: bool = True) -> dict[str, Any]:
        """Plain data: the rows waiting to fill a train batch and (`replay`) the buffers."""
        return {
            pid: {
                "pending": self._builders[pid].get_state(),
                "replay": (
                    self._replay[pid].get_state()
                    if replay and self._replay[pid] is not None
                    else None
                ),
            }
            for pid in self._builders
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Restores `get_state()`; a policy's buffer not in `state` stays as it is."""
        for pid, part in state.items():
            if pid not in self._builders:
                continue
            self._builders[pid].set_state(part["pending"])
            if part.get("replay") is not None and self._replay[pid] is not None:
                self._replay[pid].set_state(part["replay"])


class AggregatorHost:
    """What one aggregation worker hosts: an `Aggregator` (see `make_aggregator_host`)."""

    def __init__(self, index: int, spec: AggregatorSpec):
        self._spec, self._index = spec, index
        self.aggregator = Aggregator(spec, index + 1)

    def process(
        self, batches: Mapping[str, SampleBatch], versions: Mapping[str, float]
    ) -> list[Output]:
        return self.aggregator.process(batches, versions)

    def process_parts(
        self, batches: Mapping[str, SampleBatch], versions: Mapping[str, float]
    ) -> tuple[list[tuple[str, int, float]], list[SampleBatch]]:
        """`process` as ((policy id, env steps, version) of each train batch, the train
        batches): called with `parts=True`, the second comes back by reference."""
        out = self.aggregator.process(batches, versions)
        return [(pid, batch.env_steps, version) for pid, batch, version in out], [
            batch for _, batch, _ in out
        ]

    def reset(self, seed: int | None) -> None:
        """Drops the waiting rows and the replay buffers; new replay streams from `seed`."""
        self.aggregator = Aggregator(self._spec, self._index + 1, seed)

    def pid(self) -> int:
        return os.getpid()


def make_aggregator_host(index: int, spec: AggregatorSpec) -> AggregatorHost:
    """The worker factory of aggregation workers (`impala_tf.workers.WorkerSpec.factory`)."""
    return AggregatorHost(index, spec)


class _StoredReply:
    """The train batches of one aggregation worker's reply, left in the store, shared by their
    `BatchRef`s: fetched whole by the first `get` (whatever thread calls it), freed from the store
    right after, or once every ref was released unread. If the store lost them, every ref not
    yet released raises `BatchLost`, and their env steps are counted once (`lost`)."""

    def __init__(self, body: StoredValue, env_steps: list[int], lost: collections.deque):
        self._body: StoredValue | None = body
        self._steps = list(env_steps)
        self._batches: list[SampleBatch | None] | None = None
        self._open = set(range(len(self._steps)))  # Refs neither got nor released.
        self._lock = threading.Lock()
        self._lost = lost  # Env steps of batches that could not be fetched (for the driver).
        self._error: str | None = None

    def get(self, index: int) -> SampleBatch:
        with self._lock:
            if self._error is not None:
                raise BatchLost(self._error)
            if index not in self._open:
                raise BatchLost("this train batch was fetched or released already")
            if self._batches is None:
                try:
                    self._batches = list(resolve(self._body))
                except Exception as e:  # noqa: BLE001 - a store that lost it (a dead node).
                    self._error = f"train batch lost before the learner read it: {e}"
                    self._lost.append(sum(self._steps[i] for i in self._open))
                    self._open.clear()
                    self._free()
                    raise BatchLost(self._error) from e
                release(self._body)  # A private copy is here: the store's goes now.
                self._body = None
            self._open.discard(index)
            batch, self._batches[index] = self._batches[index], None
            if not self._open:
                self._free()
            return batch

    def release(self, index: int) -> None:
        with self._lock:
            self._open.discard(index)
            if not self._open:
                self._free()

    def _free(self) -> None:
        release(self._body)
        self._body, self._batches = None, None


class BatchRef(BatchHandle):
    """One train batch of an aggregation worker's reply, left in the store (Ray's object store,
    or the shared memory segment of `impala_tf.workers.shared_values`) until the learner's
    loader fetches it (module docstring)."""

    __slots__ = ("_index", "_reply", "env_steps")

    def __init__(self, reply: _StoredReply, index: int, env_steps: int):
        self._reply, self._index, self.env_steps = reply, index, int(env_steps)

    def get(self) -> SampleBatch:
        return self._reply.get(self._index)

    def release(self) -> None:
        self._reply.release(self._index)


class AggregationStage:
    """Aggregation in the driver or in aggregation workers (see the module docstring).

    Args:
      spec: What each aggregator is built from (the driver's and the workers'), with the
        number of workers and the fragments out per worker.
      counters: The driver's counters.
      backend: The workers' backend (the actors'), used when `spec.num_workers` > 0.
    """

    def __init__(self, spec: AggregatorSpec, counters: Counters, backend: Any = None):
        self.spec = spec
        self.counters = counters
        self.local = Aggregator(spec)
        self.max_in_flight = int(spec.max_in_flight)
        self.workers: WorkerGroup | None = None
        self._rng = random.Random(spec.seed)
        # Call id -> (env steps it carries, the fragment's batches it was passed: released on
        # the answer or the worker's failure).
        self._calls: dict[int, tuple[int, Any]] = {}
        # Train batches taken while looking for a free worker (`process`), for the next `fetch`.
        self._ready: list[Output] = []
        # Env steps of train batches the learners' loaders could not fetch (`BatchRef`).
        self._lost: collections.deque[int] = collections.deque()
        restarts = RestartPolicy(
            "aggregation worker",
            enabled=True,
            max_restarts=None,
            enabled_key="num_aggregation_workers",
            max_key="num_aggregation_workers",
        )
        if spec.num_workers > 0:
            worker_spec = WorkerSpec(
                role="aggregation worker",
                factory=make_aggregator_host,
                make_args=lambda _: (spec,),
                start_method="spawn",  # numpy only: spawning is safe and cheap.
                num_cpus=1.0,
            )
            self.workers = WorkerGroup(backend, worker_spec, spec.num_workers, restarts=restarts)

    def process(self, fragment: Fragment) -> list[Output]:
        """Aggregates `fragment` here, or sends it to a worker with room for it (its batches
        come from `fetch`)."""
        versions = fragment.policy_versions
        if self.workers is not None:
            free = self._free_workers()
            if not free:  # Replies not yet taken still count as in flight: take them first.
                self._ready.extend(self._poll(0.0))
                free = self._free_workers()
            if free:
                worker = self._rng.choice(free)
                call_id = self.workers.call(
                    worker, AggregatorHost.process_parts, fragment.batches, versions, parts=True
                )
                if call_id is not None:
                    self._calls[call_id] = (fragment.env_steps, fragment.batches)
                    return []
            self.counters.num_times_no_aggregation_worker_available += 1
        batches = resolve(fragment.batches)
        release(fragment.batches)
        return self.local.process(batches, versions)

    def _free_workers(self) -> list[int]:
        """The healthy workers with fewer than `max_in_flight` fragments outstanding."""
        return [
            i
            for i in self.workers.healthy_ids()
            if self.workers.outstanding(i) < self.max_in_flight
        ]

    def fetch(self, timeout_s: float = 0.0) -> list[Output]:
        """The train batches the workers finished; restarts the workers that died."""
        if self.workers is None:
            return []
        out, self._ready = self._ready + self._poll(timeout_s), []
        while self._lost:
            self.counters.num_env_steps_lost_in_aggregation += self._lost.popleft()
        return out

    def _poll(self, timeout_s: float) -> list[Output]:
        """Takes the workers' replies (their train batches) and failures (restarts them)."""
        replies, failures = self.workers.poll(timeout_s)
        out: list[Output] = []
        for reply in replies:
            release(self._calls.pop(reply.call_id, (0, None))[1])
            heads, body = reply.value
            if not heads or reply.stale:  # Nothing, or aggregated before a reset.
                release(body)
            elif isinstance(body, StoredValue):  # Left in the store for the learners' loaders.
                stored = _StoredReply(body, [steps for _, steps, _ in heads], self._lost)
                out += [
                    (pid, BatchRef(stored, i, steps), version)
                    for i, (pid, steps, version) in enumerate(heads)
                ]
            else:  # Sent by value (no room in shared memory).
                out += [(pid, batch, version) for (pid, _, version), batch in zip(heads, body)]
        for failure in failures:
            lost = 0
            for call_id in failure.lost_calls:
                steps, sent = self._calls.pop(call_id, (0, None))
                release(sent)
                lost += steps
            worker, error = failure.worker_id, failure.error
            logger.warning("Aggregation worker %d failed (%s); restarting it.", worker, error)
            restarts = self.counters.num_aggregation_worker_restarts
            self.workers.restart_failed(failure, restarts)  # Raises when no restart is allowed.
            self.counters.num_aggregation_worker_restarts += 1
            self.counters.num_env_steps_lost_in_aggregation += lost
        return out

    def reset(self, seed: int | None, state: Mapping[str, Any] | None = None) -> None:
        """Drops everything held (a restore); the driver's part restarts from `state` if given.

        Replay streams start anew from `seed`; replies to fragments sent before are dropped.
        """
        self.local = Aggregator(self.spec, seed=seed)
        self._drop_ready()
        if state:
            self.local.set_state(state)
        if self.workers is not None:
            self.workers.fence()
            for worker in self.workers.healthy_ids():
                self.workers.call(worker, AggregatorHost.reset, seed, reply=False)

    def _drop_ready(self) -> None:
        """Drops the train batches kept for the next `fetch`, freeing the stores of handles."""
        for _, batch, _ in self._ready:
            release_unread(batch)
        self._ready = []

    def pids(self) -> dict[int, int]:
        """{worker id: OS pid} of the healthy aggregation workers ({} without workers)."""
        return {} if self.workers is None else self.workers.pids()

    def stop(self) -> None:
        self._drop_ready()
        if self.workers is not None:
            self.workers.stop()
        for _, sent in self._calls.values():
            release(sent)
        self._calls.clear()
