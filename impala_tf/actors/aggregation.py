"""Tree aggregation: worker processes between the actors and the learner (RLlib's
`AggregatorWorker`, `num_aggregation_workers`).

The driver hands each fragment to a random healthy aggregator; the aggregator decompresses its
observations (`compress_observations=True` makes actors send them zlib-compressed), passes it
through its own mix-in replay buffer (`replay_proportion`, `replay_buffer_num_slots`), cuts
fixed-size train batches from the result, and sends those back for the learner queue. This
moves decompression, replay and concatenation out of the driver process, whose single GIL also
serves the learner thread. A dead aggregator is restarted; fragments it held are lost (counted).

Aggregators need numpy only: no TensorFlow is imported in them.

`AggregatorPoolBase` is the driver's interface to a set of aggregation workers;
`AggregatorPool` (local processes) and `impala_tf.actors.ray_aggregation.RayAggregatorPool`
(Ray actors, `actor_backend="ray"`) implement it, both running the same `Aggregator`.
`make_aggregator_pool` picks one from the config.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import multiprocessing as mp
import queue
import random
import traceback
from multiprocessing import connection

from impala_tf.actors import main_guard
from impala_tf.actors.workers import CommandQueue, end_worker
from impala_tf.batching import BatchBuilder
from impala_tf.config import ImpalaConfig
from impala_tf.replay import MixInReplayBuffer, replay_ratio_from_proportion
from impala_tf.sample_batch import SampleBatch, decompress

__all__ = ["AggregatorPool", "AggregatorPoolBase", "Aggregator", "make_aggregator_pool"]

logger = logging.getLogger(__name__)

_JOIN_S = 1.0


class Aggregator:
    """What one aggregation worker does to the batches it receives (also usable in-process).

    Args:
      config: Uses `replay_proportion`, `replay_buffer_num_slots` and `seed`.
      rows: Sequences per train batch (`impala_tf.pipeline.rows_per_batch`).
      index: The worker's index (varies the replay seed).
    """

    def __init__(self, config: ImpalaConfig, rows: int, index: int = 0):
        seed = None if config.seed is None else int(config.seed) + 10_000 + index
        self._replay = (
            MixInReplayBuffer(
                capacity=config.replay_buffer_num_slots,
                replay_ratio=replay_ratio_from_proportion(config.replay_proportion),
                seed=seed,
            )
            if config.replay_proportion > 0
            else None
        )
        self._builder = BatchBuilder(rows)

    def process(self, batch: SampleBatch, version: float) -> list[tuple[SampleBatch, float]]:
        """Decompresses, mixes in replay, and returns the completed (train batch, version)s."""
        batch = decompress(batch)
        if self._replay is not None:
            self._replay.add(batch)
            batch = self._replay.replay()
            if batch is None:
                return []
        return self._builder.add(batch, version)


def _aggregator_main(index: int, config: ImpalaConfig, rows: int, results, commands) -> None:
    parent = mp.parent_process()
    try:
        aggregator = Aggregator(config, rows, index)
        while True:
            try:
                msg = commands.get(timeout=1.0)
            except queue.Empty:
                if parent is not None and not parent.is_alive():
                    return
                continue
            if msg[0] == "stop":
                return
            _, batch, version = msg
            out = aggregator.process(batch, version)
            results.send(("batches", out, batch.env_steps))
    except (KeyboardInterrupt, BrokenPipeError):
        return
    except BaseException as e:  # noqa: BLE001 - reported to the driver.
        with contextlib.suppress(BrokenPipeError, OSError):
            results.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}", 0))
        raise SystemExit(1) from e


class _Worker:
    def __init__(self, process, results, commands):
        self.process = process
        self.results = results
        self.commands = commands
        self.healthy = True
        self.in_flight_steps = 0


class AggregatorPoolBase(abc.ABC):
    """`num_aggregation_workers` aggregation workers, each running an `Aggregator`."""

    num_workers: int

    @abc.abstractmethod
    def healthy_ids(self) -> list[int]:
        """The workers currently alive."""

    @abc.abstractmethod
    def submit(self, batch: SampleBatch, version: float) -> bool:
        """Sends a fragment's batch to a random healthy worker; False if none is healthy."""

    @abc.abstractmethod
    def fetch_ready(self) -> tuple[list[tuple[SampleBatch, float]], list[tuple[int, str, int]]]:
        """Returns the train batches ready now, and (index, error, lost env steps) of the
        workers found dead, which are restarted."""

    @abc.abstractmethod
    def wait(self, timeout_s: float) -> None:
        """Waits up to `timeout_s` for any worker to have output."""

    @abc.abstractmethod
    def pids(self) -> list[int]:
        """Process ids of the live workers (for tests and monitoring)."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Ends every worker. Safe to call twice."""


def make_aggregator_pool(config: ImpalaConfig, rows: int) -> AggregatorPoolBase:
    """The aggregation workers of `config.actor_backend`: local processes or Ray actors."""
    if config.actor_backend == "ray":
        from impala_tf.actors.ray_aggregation import RayAggregatorPool

        return RayAggregatorPool(config, rows)
    return AggregatorPool(config, rows)


class AggregatorPool(AggregatorPoolBase):
    """`num_aggregation_workers` local aggregation processes.

    Args:
      config: The algorithm config.
      rows: Sequences per train batch.
      start_method: multiprocessing start method (aggregators never import TensorFlow, so the
        default "spawn" is safe and cheap).
    """

    def __init__(self, config: ImpalaConfig, rows: int, start_method: str = "spawn"):
        self.config = config
        self.rows = rows
        self.num_workers = int(config.num_aggregation_workers)
        self._ctx = mp.get_context(start_method)
        self._workers: dict[int, _Worker] = {}
        self._rng = random.Random(config.seed)
        self._stopped = False
        # A script building at module level without a main guard must not re-run in children.
        self._unguarded_main = main_guard.unguarded_main_call()
        for i in range(self.num_workers):
            self._start(i)

    def _start(self, index: int) -> None:
        recv_end, send_end = self._ctx.Pipe(duplex=False)
        commands = CommandQueue(self._ctx)
        process = self._ctx.Process(
            target=_aggregator_main,
            args=(index, self._config_arg(), self.rows, send_end, commands),
            name=f"impala-aggregator-{index}",
            daemon=True,
        )
        with main_guard.without_main_preparation(self._unguarded_main):
            process.start()
        send_end.close()
        self._workers[index] = _Worker(process, recv_end, commands)

    def _config_arg(self):
        return main_guard.by_value(self.config) if self._unguarded_main else self.config

    def healthy_ids(self) -> list[int]:
        return [i for i, w in self._workers.items() if w.healthy]

    def submit(self, batch: SampleBatch, version: float) -> bool:
        """Sends a fragment's batch to a random healthy aggregator; False if none is healthy."""
        healthy = self.healthy_ids()
        if not healthy:
            return False
        worker = self._workers[self._rng.choice(healthy)]
        worker.commands.put(("batch", batch, version))
        worker.in_flight_steps += batch.env_steps
        return True

    def fetch_ready(self) -> tuple[list[tuple[SampleBatch, float]], list[tuple[int, str, int]]]:
        """Returns the train batches ready now, and (index, error, lost env steps) of the
        aggregators found dead, which are restarted."""
        batches: list[tuple[SampleBatch, float]] = []
        failures: list[tuple[int, str, int]] = []
        for index, worker in list(self._workers.items()):
            error = None
            try:
                while worker.results.poll():
                    kind, payload, steps = worker.results.recv()
                    if kind == "batches":
                        batches.extend(payload)
                        worker.in_flight_steps -= steps
                    else:
                        error = payload
                        break
            except (EOFError, OSError):
                error = f"aggregator process exited (exit code {worker.process.exitcode})"
            if error is None and not worker.process.is_alive():
                error = f"aggregator process exited (exit code {worker.process.exitcode})"
            if error is not None:
                failures.append((index, error, max(0, worker.in_flight_steps)))
                self._terminate(worker)
                logger.warning("Restarting aggregator %d after: %s", index, error)
                self._start(index)
        return batches, failures

    def wait(self, timeout_s: float) -> None:
        """Waits up to `timeout_s` for any aggregator to have output."""
        connection.wait([w.results for w in self._workers.values()], timeout_s)

    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers.values() if w.process.is_alive()]

    @staticmethod
    def _terminate(worker: _Worker) -> None:
        worker.healthy = False
        end_worker(worker.process, worker.commands, worker.results, _JOIN_S)

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for worker in self._workers.values():
            with contextlib.suppress(ValueError, OSError):
                worker.commands.put(("stop",))
        for worker in self._workers.values():
            worker.process.join(_JOIN_S)
            with contextlib.suppress(ValueError, OSError):
                self._terminate(worker)
