"""`RayAggregatorPool`: the aggregation workers as Ray actors (`actor_backend="ray"`).

Each worker is a Ray actor running the same `impala_tf.actors.aggregation.Aggregator` as a
local aggregation process (decompression, mix-in replay, batch cutting); this module only moves
batches in and out. A submitted batch is one `process` call; the results are collected with
`ray.wait` and copied out of the object store. A worker that dies is killed for good and made
anew (its replay buffer and the batches it held are lost, counted by the driver in
`num_aggregation_worker_restarts` and `num_env_steps_lost_in_aggregation`).
"""

from __future__ import annotations

import logging
import os
import random
from typing import Any

from impala_tf.actors import ray_session
from impala_tf.actors.aggregation import Aggregator, AggregatorPoolBase
from impala_tf.actors.ray_pool import actor_runtime_env, copy_out
from impala_tf.config import ImpalaConfig
from impala_tf.sample_batch import SampleBatch

__all__ = ["AggregatorActor", "RayAggregatorPool"]

logger = logging.getLogger(__name__)

_CALL_TIMEOUT_S = 120.0


class AggregatorActor:
    """What runs inside one Ray aggregation actor: an `Aggregator`.

    Args:
      config: The algorithm config.
      rows: Sequences per train batch.
      index: The worker's index (varies the replay seed).
    """

    def __init__(self, config: ImpalaConfig, rows: int, index: int):
        self._aggregator = Aggregator(config, rows, index)

    def process(self, batch: SampleBatch, version: float) -> tuple[list, int]:
        """The completed (train batch, version)s, and the env steps of `batch`."""
        return self._aggregator.process(batch, version), batch.env_steps

    def pid(self) -> int:
        return os.getpid()


class _Worker:
    def __init__(self, handle: Any):
        self.handle = handle
        self.pending: dict[Any, int] = {}  # `process` ref -> env steps it carries.


class RayAggregatorPool(AggregatorPoolBase):
    """`num_aggregation_workers` Ray actors running `Aggregator`s (one CPU each).

    Args:
      config: The algorithm config.
      rows: Sequences per train batch.
    """

    def __init__(self, config: ImpalaConfig, rows: int):
        self.config = config
        self.rows = rows
        self.num_workers = int(config.num_aggregation_workers)
        self._rng = random.Random(config.seed)
        self._stopped = False
        self._ray = ray_session.acquire(config)
        self._remote_cls = self._ray.remote(AggregatorActor)
        self._workers: dict[int, _Worker] = {}
        self._owner: dict[Any, int] = {}
        try:
            for i in range(self.num_workers):
                self._start(i)
        except BaseException:
            self.stop()
            raise

    def _start(self, index: int) -> None:
        handle = self._remote_cls.options(
            num_cpus=1, num_gpus=0, max_restarts=0, runtime_env=actor_runtime_env()
        ).remote(self.config, self.rows, index)
        self._workers[index] = _Worker(handle)

    def healthy_ids(self) -> list[int]:
        return list(self._workers)

    def submit(self, batch: SampleBatch, version: float) -> bool:
        if not self._workers:
            return False
        index = self._rng.choice(self.healthy_ids())
        ref = self._workers[index].handle.process.remote(batch, version)
        self._workers[index].pending[ref] = batch.env_steps
        self._owner[ref] = index
        return True

    def fetch_ready(self) -> tuple[list[tuple[SampleBatch, float]], list[tuple[int, str, int]]]:
        ray = self._ray
        batches: list[tuple[SampleBatch, float]] = []
        failures: list[tuple[int, str, int]] = []
        refs = list(self._owner)
        if not refs:
            return batches, failures
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in ready:
            index = self._owner.pop(ref, None)
            if index is None:  # Dropped with its worker's failure in this loop.
                continue
            worker = self._workers[index]
            steps = worker.pending.pop(ref)
            try:
                out, _ = copy_out(ray.get(ref))
            except ray.exceptions.RayError as e:
                lost = steps + sum(worker.pending.values())
                failures.append((index, f"{type(e).__name__}: {e}", lost))
                self._replace(index)
                continue
            batches.extend(out)
        return batches, failures

    def _replace(self, index: int) -> None:
        worker = self._workers[index]
        for ref in worker.pending:
            self._owner.pop(ref, None)
        self._ray.kill(worker.handle, no_restart=True)
        logger.warning("Restarting aggregator %d", index)
        self._start(index)

    def wait(self, timeout_s: float) -> None:
        refs = list(self._owner)
        if refs:
            self._ray.wait(refs, num_returns=1, timeout=timeout_s)

    def pids(self) -> list[int]:
        handles = [w.handle for w in self._workers.values()]
        return self._ray.get([h.pid.remote() for h in handles], timeout=_CALL_TIMEOUT_S)

    def actor_ids_in_ray(self) -> list[str]:
        """Ray's ids (hex) of the workers this pool holds."""
        return [w.handle._actor_id.hex() for w in self._workers.values()]

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for worker in self._workers.values():
            try:
                self._ray.kill(worker.handle, no_restart=True)
            except Exception as e:  # noqa: BLE001 - stop must go on with the others.
                logger.debug("ray.kill failed: %s", e)
            worker.pending.clear()
        self._owner.clear()
        ray_session.release()
