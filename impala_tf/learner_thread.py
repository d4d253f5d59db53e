"""`LearnerThread`: the background thread that trains the `ImpalaLearner` on queued batches.

RLlib's contract (SEMANTICS.md section 3): the driver puts train batches on a bounded `inqueue`
(`learner_queue_size`); the thread takes them through a `MinibatchBuffer` (each batch reused
`num_sgd_iter` times, `minibatch_buffer_size` slots), trains, and puts `(env_steps, agent_steps,
stats)` on an unbounded `outqueue`. If no batch arrives for `learner_queue_timeout` seconds the
thread stops with a `LearnerQueueTimeout` that names the settings to change.

Here the buffer feeds the `tf.data` loader of `impala_tf.pipeline`, which prefetches batches onto
the learner devices; the thread pulls each distributed batch from it and runs one compiled,
distributed `train_step`, calling the Keras callbacks it was given around each step (so
`keras.callbacks.Callback`s work as under `fit`).

Timers (mean milliseconds in `info.timing_breakdown`): `learner_dequeue_time_ms` waiting on the
inqueue, `learner_load_time_ms` assembling a batch for the loader, `learner_load_wait_time_ms`
waiting for the loader's next device batch, `learner_grad_time_ms` the update itself.
"""

from __future__ import annotations

import collections
import copy
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import keras
import tensorflow as tf

from impala_tf import pipeline
from impala_tf.learner import ImpalaLearner
from impala_tf.sample_batch import SampleBatch
from impala_tf.stats import TimerStat, WindowStat, timer_ms

__all__ = ["LearnerQueueTimeout", "LearnerThread", "MinibatchBuffer", "TrainBatch"]

_POLL_S = 0.1


class LearnerQueueTimeout(RuntimeError):
    """The learner waited `learner_queue_timeout` seconds without receiving a batch."""


class TrainBatch:
    """A train batch on the learner queue, with what the driver knows about its origin.

    Attributes:
      batch: `SampleBatch` of `rows_per_batch(config)` sequences.
      policy_version: Mean `num_grad_updates` of the weights that sampled it.
    """

    __slots__ = ("batch", "policy_version")

    def __init__(self, batch: SampleBatch, policy_version: float = 0.0):
        self.batch = batch
        self.policy_version = policy_version

    @property
    def env_steps(self) -> int:
        return self.batch.env_steps


class MinibatchBuffer:
    """RLlib's ring of `size` batches, each served `num_passes` times before it is replaced.

    Args:
      inqueue: Where new batches come from.
      size: Number of slots (`minibatch_buffer_size`).
      timeout: Seconds to wait for a new batch before `LearnerQueueTimeout`.
      num_passes: Times each batch is served (`num_sgd_iter`).
      stopped: Event that ends a wait early (then `get` raises `queue.Empty`).
    """

    def __init__(
        self,
        inqueue: queue.Queue,
        size: int,
        timeout: float,
        num_passes: int,
        stopped: threading.Event | None = None,
    ):
        self.inqueue = inqueue
        self.size = max(1, int(size))
        self.timeout = float(timeout)
        self.num_passes = max(1, int(num_passes))
        self.stopped = stopped or threading.Event()
        self.buffers: list[Any] = [None] * self.size
        self.ttl = [0] * self.size
        self.idx = 0

    def _wait(self) -> Any:
        deadline = time.monotonic() + self.timeout
        while not self.stopped.is_set():
            try:
                return self.inqueue.get(timeout=min(_POLL_S, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise LearnerQueueTimeout(
                        f"The learner received no train batch for {self.timeout:g} s "
                        f"(learner_queue_timeout={self.timeout:g}). The actors are sampling too "
                        "slowly for the learner: raise `learner_queue_timeout`, or add actors "
                        "(`num_env_runners`, `num_envs_per_env_runner`), or check that the env "
                        "steps at all."
                    ) from None
        raise queue.Empty

    def get(self) -> tuple[Any, bool]:
        """Returns (batch, released): `released` is True when this was the batch's last pass."""
        if self.ttl[self.idx] <= 0:
            self.buffers[self.idx] = self._wait()
            self.ttl[self.idx] = self.num_passes
        batch = self.buffers[self.idx]
        self.ttl[self.idx] -= 1
        released = self.ttl[self.idx] <= 0
        if released:
            self.buffers[self.idx] = None
        self.idx = (self.idx + 1) % self.size
        return batch, released


class LearnerThread(threading.Thread):
    """Trains `learner` on the batches put on `inqueue`; a daemon thread.

    Args:
      learner: The `ImpalaLearner` (built inside `strategy.scope()`).
      strategy: The learner's distribution strategy.
      signature: `pipeline.batch_signature(...)` of one replica's shard.
      callbacks: Keras callbacks called around each update (`on_train_batch_begin/end` with the
        stats as logs, `on_train_begin/end`).
    """

    def __init__(
        self,
        learner: ImpalaLearner,
        strategy: tf.distribute.Strategy,
        signature: dict[str, tf.TensorSpec],
        callbacks: list[keras.callbacks.Callback] | None = None,
    ):
        super().__init__(name="impala-learner", daemon=True)
        config = learner.config
        self.learner = learner
        self.strategy = strategy
        self.inqueue: queue.Queue = queue.Queue(maxsize=int(config.learner_queue_size))
        self.outqueue: queue.Queue = queue.Queue()
        self._stopped = threading.Event()
        self.minibatch_buffer = MinibatchBuffer(
            self.inqueue,
            size=config.minibatch_buffer_size,
            timeout=config.learner_queue_timeout,
            num_passes=config.num_sgd_iter,
            stopped=self._stopped,
        )
        self.learner_queue_size = WindowStat("size", 50)
        self.queue_timer = TimerStat()
        self.load_timer = TimerStat()
        self.load_wait_timer = TimerStat()
        self.grad_timer = TimerStat()
        self.num_steps = 0
        self.stats: dict[str, Any] = {}
        self.error: BaseException | None = None
        # Held during each update, so a checkpoint sees weights, optimizer state and counters
        # from the same step.
        self.lock = threading.RLock()
        self._meta: collections.deque = collections.deque()
        self._callbacks = keras.callbacks.CallbackList(
            callbacks or [], add_history=False, add_progbar=False, model=learner
        )
        self._dataset = pipeline.make_dataset(self._batches, signature, config, strategy)
        # Autograph is not needed (the graph code is explicit) and costs seconds of tracing.
        self._train_fn = tf.function(self._distributed_step, autograph=False)

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def _batches(self) -> Iterator[SampleBatch]:
        """The loader's source: batches from the minibatch buffer, timed."""
        while not self._stopped.is_set():
            try:
                with self.queue_timer:
                    item, _ = self.minibatch_buffer.get()
            except queue.Empty:
                return
            except LearnerQueueTimeout as e:
                self.error = e
                return
            with self.load_timer:
                batch = pipeline.decompress_if_needed(item.batch)
            self._meta.append((item.env_steps, item.policy_version))
            yield batch

    def _distributed_step(self, data):
        outputs = self.strategy.run(self.learner.train_step, args=(data,))
        # Every replica returns the same (all-reduced) stats.
        return self.strategy.experimental_local_results(outputs)[0]

    def run(self) -> None:
        # An error ends the thread and is kept in `self.error`; the driver, seeing the thread
        # dead, raises RLlib's "The learner thread died while training!" from it.
        try:
            self._callbacks.on_train_begin()
            # Trace the update now, while the actors start, rather than on the first batch.
            self._train_fn.get_concrete_function(self._dataset.element_spec)
            iterator = iter(self._dataset)
            while not self._stopped.is_set() and self.error is None:
                with self.load_wait_timer:
                    try:
                        data = next(iterator)
                    except (StopIteration, tf.errors.OutOfRangeError):
                        break
                self.step(data)
            if self.error is None:
                self._callbacks.on_train_end()
        except BaseException as e:  # noqa: BLE001 - handed to the driver.
            if self.error is None:
                self.error = e

    def step(self, data) -> None:
        """Runs one update on a distributed batch and reports it."""
        env_steps, policy_version = self._meta.popleft()
        self._callbacks.on_train_batch_begin(self.num_steps)
        with self.grad_timer, self.lock:
            updates_before = int(self.learner.num_grad_updates.numpy())
            stats = {k: v.numpy().item() for k, v in self._train_fn(data).items()}
        stats["diff_num_grad_updates_vs_sampler_policy"] = float(updates_before - policy_version)
        self.stats = stats
        self.num_steps += 1
        self.outqueue.put((env_steps, env_steps, stats))
        self.learner_queue_size.push(self.inqueue.qsize())
        self._callbacks.on_train_batch_end(self.num_steps - 1, logs=stats)

    def stop(self, timeout: float = 10.0) -> None:
        """Asks the thread to finish its current step and exit; waits up to `timeout`."""
        self._stopped.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)

    def add_learner_metrics(self, result: dict[str, Any]) -> dict[str, Any]:
        """Adds `info.learner_queue` and `info.timing_breakdown` to a result dict (RLlib's)."""
        info = result.setdefault("info", {})
        info["learner_queue"] = self.learner_queue_size.stats()
        info["timing_breakdown"] = {
            "learner_grad_time_ms": timer_ms(self.grad_timer),
            "learner_load_time_ms": timer_ms(self.load_timer),
            "learner_load_wait_time_ms": timer_ms(self.load_wait_timer),
            "learner_dequeue_time_ms": timer_ms(self.queue_timer),
        }
        return result

    def latest_stats(self) -> dict[str, Any]:
        return copy.deepcopy(self.stats)
