"""`Impala`: the driver that wires actors, the loader and the learner thread (RLlib's `IMPALA`).

Built by `ImpalaConfig.build()`. Each `train()` call runs `training_step()` for at least
`min_time_s_per_iteration` seconds and returns RLlib's result dict. One training step
(SEMANTICS.md section 3, the old API stack's `training_step`):

1. a dead learner thread raises "The learner thread died while training!";
2. collect the fragments that are ready (asynchronous sampling, at most
   `max_requests_in_flight_per_env_runner` requests outstanding per actor); failed actors are
   restarted (`restart_failed_env_runners`) or raise;
3. decompress it, pass it through the mix-in replay buffer when `replay_proportion > 0`, and cut
   train batches — in an aggregation worker process picked at random when
   `num_aggregation_workers > 0` (`num_times_no_aggregation_worker_available` when none is
   healthy), else in the driver;
4. count `num_env_steps_sampled` / `num_agent_steps_sampled`;
5. concatenate them into train batches (`impala_tf.pipeline.BatchBuilder`);
6. put the batches on the learner queue: all but the last without blocking (a full queue drops
   the batch and counts `num_times_learner_queue_full`), the last waiting for room;
7. drain the learner's outqueue into `num_env_steps_trained` / `num_agent_steps_trained`;
8. every `broadcast_interval` steps with a new update, send the weights to the actors that
   sampled since their last weights (`num_weight_broadcasts`). The driver never waits for a
   running update to read them: the learner thread publishes them when that update ends
   (`LearnerThread.policy_snapshot`), and the next step sends them.

Every `evaluation_interval` iterations, `train()` also runs `evaluate()`: `evaluation_duration`
episodes in the driver process with the learner's weights, reported under `"evaluation"`.

`Impala(config, deterministic=True)` runs the same steps in lockstep instead (one fragment is
sampled, trained on and answered with a broadcast before the next is requested), so that a run
with a fixed seed is reproducible update for update and, resumed from a checkpoint, continues
exactly as if it had not stopped (`save` then also snapshots the actor's envs; see `save`).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
import platform
import queue
import socket
import time
import weakref
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from impala_tf import checkpoints, filters, pipeline, sequences
from impala_tf.actors.aggregation import Aggregator, AggregatorPoolBase, make_aggregator_pool
from impala_tf.actors.base import ActorFailure, ActorPool, ActorStateUnsupported
from impala_tf.actors.env_runner import EnvRunner, Fragment, make_env
from impala_tf.actors.local import LocalActorPool
from impala_tf.config import ImpalaConfig
from impala_tf.learner import ImpalaLearner
from impala_tf.learner_thread import LearnerThread, TrainBatch
from impala_tf.nonfinite import NonFiniteUpdatesError

__all__ = ["Impala", "check_deterministic", "make_strategy"]

logger = logging.getLogger(__name__)

#: An actor failing this many times in a row without producing a fragment is an error, not a
#: restart loop (e.g. an env that raises on construction).
_MAX_CONSECUTIVE_ACTOR_FAILURES = 3
_FETCH_TIMEOUT_S = 0.02
_QUEUE_PUT_POLL_S = 0.1
#: How long `save` waits for an actor's snapshot in deterministic mode.
_ACTOR_STATE_TIMEOUT_S = 120.0


def make_strategy(config: ImpalaConfig) -> tf.distribute.Strategy:
    """The learner's `tf.distribute` strategy for `num_gpus` / `_fake_gpus`.

    One device: the default strategy (TensorFlow places ops on the GPU if there is one). N > 1:
    `MirroredStrategy` over N GPUs, or over N logical CPU devices with `_fake_gpus=True` (these
    must be configured before TensorFlow initialises; we do that here when we can).
    """
    n = config.num_learner_devices
    if n <= 1:
        return tf.distribute.get_strategy()
    if config._fake_gpus:
        cpus = tf.config.list_physical_devices("CPU")
        # `list_logical_devices` initialises the runtime, after which logical devices can no
        # longer be configured: look at the (uninitialised) configuration first.
        if tf.config.get_logical_device_configuration(cpus[0]) is None:
            # If TF is already initialised this fails; the check below explains.
            with contextlib.suppress(RuntimeError):
                tf.config.set_logical_device_configuration(
                    cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(n)]
                )
        logical = tf.config.list_logical_devices("CPU")
        if len(logical) < n:
            raise RuntimeError(
                f"num_gpus={n} with _fake_gpus=True needs {n} logical CPU devices, but "
                f"TensorFlow was initialised with {len(logical)}: build the algorithm before "
                "running any TensorFlow op, or configure the logical devices yourself."
            )
        return _mirrored([d.name for d in logical[:n]])
    gpus = tf.config.list_logical_devices("GPU")
    if not gpus:
        logger.warning(
            "num_gpus=%d but no GPU is visible: training on the CPU (set _fake_gpus=True to "
            "simulate %d devices).",
            n,
            n,
        )
        return tf.distribute.get_strategy()
    if len(gpus) < n:
        raise ValueError(f"num_gpus={n} but only {len(gpus)} GPU(s) are visible")
    return _mirrored([d.name for d in gpus[:n]])


_MIRRORED: dict[tuple[str, ...], tf.distribute.MirroredStrategy] = {}


def _mirrored(devices: list[str]) -> tf.distribute.MirroredStrategy:
    """One `MirroredStrategy` per set of devices and process.

    TensorFlow numbers each new strategy's collective all-reduces from the same start, so two
    strategies over the same devices in one process (two algorithms built one after the other,
    as in tests) reuse instance keys, and the runtime aborts on the first two that differ in
    shape ("Shape mismatch in the collective instance ..."). Sharing the strategy keeps the
    numbering unique.
    """
    key = tuple(devices)
    if key not in _MIRRORED:
        _MIRRORED[key] = tf.distribute.MirroredStrategy(list(devices))
    return _MIRRORED[key]


def check_deterministic(config: ImpalaConfig) -> None:
    """Raises ValueError listing what keeps `config` from running with `deterministic=True`."""
    problems = []
    if config.seed is None:
        problems.append("a `seed`")
    if config.num_env_runners > 1:
        problems.append(f"one actor (`num_env_runners` <= 1, got {config.num_env_runners})")
    if config.num_aggregation_workers:
        problems.append("`num_aggregation_workers=0`")
    if config.min_time_s_per_iteration:
        problems.append(
            "`min_time_s_per_iteration=0` (iterations must end on sample counts, "
            "`min_sample_timesteps_per_iteration`, not on wall-clock time)"
        )
    if config.minibatch_buffer_size > 1 and config.num_sgd_iter > 1:
        problems.append(
            "`minibatch_buffer_size=1` or `num_sgd_iter=1` (the buffer would wait for "
            "further batches before finishing the passes over the first)"
        )
    if problems:
        raise ValueError("deterministic=True needs " + "; ".join(problems) + ".")


def _derived_seed(seed: int | None, *keys: int) -> int | None:
    """A seed for a new random stream of a seeded run (None for an unseeded one)."""
    if seed is None:
        return None
    entropy = [int(seed) % 2**63, *(int(k) for k in keys)]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


def _actor_pool_class(config: ImpalaConfig) -> type[ActorPool]:
    """The `ActorPool` of `config.actor_backend`."""
    if config.actor_backend == "ray":
        from impala_tf.actors.ray_pool import RayActorPool

        return RayActorPool
    return LocalActorPool


class Impala:
    """The IMPALA algorithm: actors sample asynchronously, a learner thread trains with V-trace.

    Args:
      config: A validated (or validatable) `ImpalaConfig` with `env` set.
      callbacks: Keras callbacks for the learner thread (called around each update).
      actor_pool_cls: The `ActorPool` implementation; None picks it from `actor_backend`:
        `LocalActorPool` (local processes, the default) or `RayActorPool` ("ray").
      deterministic: Sample and train in lockstep, for runs that a seed reproduces exactly and
        checkpoints that resume exactly (see the module docstring; `check_deterministic` lists
        what the config needs). Slower: actor and learner never overlap.
      logdir: The run's directory; the train batches of skipped non-finite updates are saved
        in `<logdir>/nonfinite/` (`impala_tf.nonfinite`). None: a temporary directory, made
        when the first one is saved.
    """

    def __init__(
        self,
        config: ImpalaConfig,
        callbacks: list[keras.callbacks.Callback] | None = None,
        actor_pool_cls: type[ActorPool] | None = None,
        deterministic: bool = False,
        logdir: str | None = None,
    ):
        config.validate(require_env=True)
        self.logdir = logdir
        if deterministic:
            check_deterministic(config)
        self.config = config
        self.deterministic = bool(deterministic)
        self._stopped = False
        self.pool: ActorPool | None = None
        self.learner_thread: LearnerThread | None = None
        # TF sets its logical devices on first use: choose them before anything else runs.
        self.strategy = make_strategy(config)
        if config.seed is not None:
            keras.utils.set_random_seed(int(config.seed))
        env = make_env(config, 0, 0)
        self.observation_space, self.action_space = env.observation_space, env.action_space
        env.close()
        # The master observation filter: the actors' changes merged, broadcast with the weights.
        self.obs_filter = filters.get_filter(
            config.observation_filter, self.observation_space.shape
        )
        try:
            # Actors import TensorFlow and build their envs while the learner is built here.
            if actor_pool_cls is None:
                actor_pool_cls = _actor_pool_class(config)
            self.pool = actor_pool_cls(config)
            _live_algorithms.add(self)
            with self.strategy.scope():
                self.learner = ImpalaLearner(config, self.observation_space, self.action_space)
            self.num_replicas = self.strategy.num_replicas_in_sync
            state_shapes = sequences.state_column_shapes(
                config.rollout_fragment_length,
                config.model["max_seq_len"],
                tuple(tuple(s.shape[1:]) for s in self.learner.model.initial_state(1)),
            )
            self._rows = pipeline.rows_per_batch(config, self.num_replicas)
            signature = pipeline.batch_signature(
                config, self.observation_space, self.action_space, self.num_replicas, state_shapes
            )
            self.learner_thread = LearnerThread(
                self.learner, self.strategy, signature, callbacks=callbacks
            )
            if logdir is not None:
                self.learner_thread.nonfinite.directory = os.path.join(logdir, "nonfinite")
            self.learner_thread.start()
        except BaseException:
            self.stop()
            raise
        # Decompression, mix-in replay and batch cutting: in aggregation worker processes when
        # `num_aggregation_workers` > 0, else here (the same `Aggregator`, in-process).
        self._local_aggregator = Aggregator(config, self._rows)
        self.aggregators: AggregatorPoolBase | None = None
        if config.num_aggregation_workers > 0:
            try:
                self.aggregators = make_aggregator_pool(config, self._rows)
            except BaseException:
                self.stop()
                raise
        self._counters: collections.Counter = collections.Counter()
        self._episodes: collections.deque = collections.deque(
            maxlen=int(config.metrics_num_episodes_for_smoothing)
        )
        self._episodes_total = 0
        self._iteration = 0
        self._time_total_s = 0.0
        self._steps_since_broadcast = 0
        self._broadcast_version = -1
        self._awaiting_weights: set[int] = set()  # Sampled since their last weights.
        self._failures_in_a_row = collections.Counter()
        self._in_flight = {i: 0 for i in range(self.pool.num_actors)}
        self._learner_info: dict[str, Any] = {}
        self._eval_runner: EnvRunner | None = None
        # Fragments sampled with older weights than this predate a `restore` and are dropped.
        self._min_policy_version = 0
        self._broadcast(list(self._in_flight))
        if not self.deterministic:  # Lockstep requests each fragment itself.
            self._top_up_requests()

    # Sampling --------------------------------------------------------------------------------

    def _top_up_requests(self) -> None:
        limit = int(self.config.max_requests_in_flight_per_env_runner)
        for actor_id in self.pool.healthy_actor_ids():
            missing = limit - self._in_flight[actor_id]
            if missing > 0:
                self.pool.request_samples([actor_id], missing)
                self._in_flight[actor_id] += missing

    def _policy_snapshot(self) -> tuple[list[np.ndarray], int]:
        """The policy weights and their `num_grad_updates`, read between two updates."""
        return self.learner_thread.policy_snapshot()

    def _broadcast(self, actor_ids: list[int]) -> None:
        self._send_weights(actor_ids, *self._policy_snapshot())

    def _send_weights(self, actor_ids: list[int], weights: list[np.ndarray], version: int) -> None:
        self.pool.broadcast_weights(weights, version, actor_ids, self._filter_to_send())
        self._broadcast_version = version

    def _filter_to_send(self) -> filters.Filter | None:
        if isinstance(self.obs_filter, filters.NoFilter):
            return None
        return self.obs_filter.as_serializable()

    def _handle_failures(self, failures: list[ActorFailure]) -> None:
        for failure in failures:
            self._in_flight[failure.actor_id] = 0
            self._counters["num_env_runner_failures"] += 1
            if failure.fatal:  # E.g. wrong observation shape, NaN data: a restart cannot help.
                raise RuntimeError(f"Actor {failure.actor_id} failed: {failure.error}")
            if not self.config.restart_failed_env_runners:
                raise RuntimeError(
                    f"Actor {failure.actor_id} failed and restart_failed_env_runners=False: "
                    f"{failure.error}"
                )
            self._failures_in_a_row[failure.actor_id] += 1
            if self._failures_in_a_row[failure.actor_id] >= _MAX_CONSECUTIVE_ACTOR_FAILURES:
                raise RuntimeError(
                    f"Actor {failure.actor_id} failed {_MAX_CONSECUTIVE_ACTOR_FAILURES} times in a "
                    f"row without producing a sample; giving up. Last error: {failure.error}"
                )
            restarts = self._counters["num_env_runner_restarts"]
            limit = self.config.max_num_env_runner_restarts
            if restarts >= limit:
                raise RuntimeError(
                    f"Actor {failure.actor_id} failed after {restarts} actor restarts "
                    f"(max_num_env_runner_restarts={limit}): {failure.error}"
                )
            logger.warning("Restarting actor %d after: %s", failure.actor_id, failure.error)
            self.pool.restart(failure.actor_id, *self._policy_snapshot())
            self._counters["num_env_runner_restarts"] += 1
            self._reseed_restarted(failure.actor_id)

    def _reseed_restarted(self, actor_id: int) -> None:
        """Gives a restarted actor env and sampler seeds of its own (a seeded run only).

        A new actor process derives its seeds from `seed` and its index, as the one it
        replaces did: without this it would replay the same episodes and actions.
        """
        if self.config.seed is None:  # Unseeded: the new process draws fresh randomness.
            return
        restarts = int(self._counters["num_env_runner_restarts"])
        seed = _derived_seed(self.config.seed, restarts, 4, actor_id)
        try:
            self.pool.set_actor_states({actor_id: {"seed": seed}})
        except ActorStateUnsupported as e:
            logger.warning("Restarted actor %d keeps its original seeds (%s).", actor_id, e)

    def _process_fragment(self, fragment: Fragment) -> list[TrainBatch]:
        self._in_flight[fragment.actor_id] = max(0, self._in_flight[fragment.actor_id] - 1)
        self._failures_in_a_row[fragment.actor_id] = 0
        if fragment.policy_version < self._min_policy_version:
            return []
        if fragment.filter_delta is not None:
            self.obs_filter.apply_changes(fragment.filter_delta)
        self._counters["num_env_steps_sampled"] += fragment.env_steps
        self._counters["num_agent_steps_sampled"] += fragment.env_steps
        self._counters["num_nonfinite_episodes_dropped"] += fragment.num_nonfinite_episodes_dropped
        for ret, length in zip(fragment.episode_returns, fragment.episode_lengths):
            self._episodes.append((ret, length))
        self._episodes_total += len(fragment.episode_returns)
        self._episodes_this_iter += len(fragment.episode_returns)
        if self.aggregators is not None:
            if self.aggregators.submit(fragment.batch, fragment.policy_version):
                return []
            self._counters["num_times_no_aggregation_worker_available"] += 1
        return [
            TrainBatch(b, version)
            for b, version in self._local_aggregator.process(
                fragment.batch, fragment.policy_version
            )
        ]

    def _fetch_aggregated(self) -> list[TrainBatch]:
        batches, failures = self.aggregators.fetch_ready()
        for index, error, lost_steps in failures:
            logger.warning("Aggregation worker %d failed (%s); restarted.", index, error)
            self._counters["num_aggregation_worker_restarts"] += 1
            self._counters["num_env_steps_lost_in_aggregation"] += lost_steps
        return [TrainBatch(b, version) for b, version in batches]

    def _place_on_learner_queue(self, batches: list[TrainBatch]) -> None:
        self._enqueue(self.learner_thread.inqueue, batches)

    def _enqueue(self, inqueue: queue.Queue, batches: list[TrainBatch]) -> None:
        """Puts all but the last batch without blocking (drops counted), then waits on the last.

        Waiting on the last one keeps the actors, loader and learner from thrashing when
        sampling outpaces training (RLlib does the same); a dead learner ends the wait.
        """
        for i, batch in enumerate(batches):
            if i < len(batches) - 1:
                try:
                    inqueue.put_nowait(batch)
                except queue.Full:
                    self._counters["num_times_learner_queue_full"] += 1
                    continue
            else:
                self._put_waiting(batch, inqueue)
            self._counters["num_samples_added_to_queue"] += batch.env_steps

    def _put_waiting(self, batch: TrainBatch, inqueue: queue.Queue | None = None) -> None:
        """Puts `batch` on `inqueue` (the learner thread's by default), checking the learner."""
        inqueue = self.learner_thread.inqueue if inqueue is None else inqueue
        while True:
            self._check_learner()
            try:
                inqueue.put(batch, timeout=_QUEUE_PUT_POLL_S)
                return
            except queue.Full:
                continue

    def _check_learner(self) -> None:
        thread = self.learner_thread
        if not thread.is_alive():
            if isinstance(thread.error, NonFiniteUpdatesError):
                raise thread.error
            raise RuntimeError("The learner thread died while training!") from thread.error

    def _drain_learner_outqueue(self) -> None:
        while True:
            try:
                self._record_learner_output(self.learner_thread.outqueue.get_nowait())
            except queue.Empty:
                break

    def _record_learner_output(self, item: tuple[int, int, dict[str, Any]]) -> None:
        env_steps, agent_steps, stats = item
        stats = dict(stats)
        if stats.pop("update_skipped", False):
            self._counters["num_nonfinite_updates_skipped"] += 1
        self._counters["num_env_steps_trained"] += env_steps
        self._counters["num_agent_steps_trained"] += agent_steps
        self._learner_info = stats

    def training_step(self) -> None:
        """One pass of the driver loop (see the module docstring)."""
        if self.deterministic:
            self._lockstep_step()
            return
        self._check_learner()
        fragments, failures = self.pool.fetch_ready(_FETCH_TIMEOUT_S)
        self._handle_failures(failures)
        sampled = sorted({f.actor_id for f in fragments})
        train_batches: list[TrainBatch] = []
        for fragment in fragments:
            train_batches.extend(self._process_fragment(fragment))
        if self.aggregators is not None:
            train_batches.extend(self._fetch_aggregated())
        self._top_up_requests()
        if train_batches:
            self._place_on_learner_queue(train_batches)
        self._drain_learner_outqueue()
        self._counters["num_training_step_calls"] += 1
        self._maybe_broadcast(sampled)

    def _maybe_broadcast(self, sampled: list[int]) -> None:
        """Sends new weights to the actors that sampled since the last broadcast.

        Never waits for a running update (except in lockstep, where none runs): the snapshot
        is then the learner thread's latest published one (`LearnerThread.policy_snapshot(
        wait=False)`). When that is not newer than the last broadcast, the actors wait for the
        next training step's try.
        """
        self._steps_since_broadcast += 1
        self._awaiting_weights.update(sampled)
        if not self._awaiting_weights or (
            self._steps_since_broadcast < self.config.broadcast_interval
            or int(self.learner.num_grad_updates.numpy()) == self._broadcast_version
        ):
            return
        snapshot = self.learner_thread.policy_snapshot(wait=self.deterministic)
        if snapshot is None or snapshot[1] <= self._broadcast_version:  # Not newer than sent.
            return
        healthy = set(self.pool.healthy_actor_ids())
        self._send_weights(sorted(self._awaiting_weights & healthy), *snapshot)
        self._awaiting_weights.clear()
        self._steps_since_broadcast = 0
        self._counters["num_weight_broadcasts"] += 1

    # Deterministic mode (lockstep) -------------------------------------------------------------

    def _lockstep_step(self) -> None:
        """Samples one fragment, trains on every batch it completes, then broadcasts.

        The actor is idle between steps (no request outstanding), so its state can be saved,
        and it always samples with the weights the previous steps produced.
        """
        fragments: list[Fragment] = []
        while not fragments:
            self._check_learner()
            for actor_id in self.pool.healthy_actor_ids():
                if self._in_flight[actor_id] == 0:
                    self.pool.request_samples([actor_id], 1)
                    self._in_flight[actor_id] = 1
            fragments, failures = self.pool.fetch_ready(_QUEUE_PUT_POLL_S)
            self._handle_failures(failures)
        batches = [b for fragment in fragments for b in self._process_fragment(fragment)]
        for batch in batches:
            self._put_waiting(batch)
            self._counters["num_samples_added_to_queue"] += batch.env_steps
        # The minibatch buffer serves each batch num_sgd_iter times, one output per update.
        for _ in range(len(batches) * int(self.config.num_sgd_iter)):
            while True:
                self._check_learner()
                try:
                    item = self.learner_thread.outqueue.get(timeout=_QUEUE_PUT_POLL_S)
                    break
                except queue.Empty:
                    continue
            self._record_learner_output(item)
        self._counters["num_training_step_calls"] += 1
        self._maybe_broadcast(sorted({f.actor_id for f in fragments}))

    # Evaluation ------------------------------------------------------------------------------

    def evaluate(self) -> dict[str, Any]:
        """Runs `evaluation_duration` episodes with the learner's current weights.

        The episodes run one after another in one env of an `EnvRunner` in this process,
        built from `config.get_evaluation_config()` (worker index 0). As in RLlib, it acts with
        that config's `explore` (default True: sampled actions, the policy that was trained);
        `evaluation_config={"explore": False}` evaluates the greedy policy. Each call starts new
        episodes; in a seeded run their seeds derive from the seed and the iteration, so an
        evaluation is reproducible (and the same after a resume). Sampling pauses meanwhile;
        the learner goes on with the batches already queued.

        Returns:
          RLlib's `evaluation` metrics: `episode_reward_mean/min/max`, `episode_len_mean`,
          `episodes_this_iter`, `num_env_steps_sampled_this_iter`, `time_this_iter_s`, and the
          same under `env_runners` with the new API stack's names.
        """
        start = time.perf_counter()
        if self._eval_runner is None:
            eval_config = self.config.get_evaluation_config()
            eval_config.env_runners(num_envs_per_env_runner=1)
            self._eval_runner = EnvRunner(eval_config, worker_index=0, update_filter=False)
        runner = self._eval_runner
        runner.set_weights(*self._policy_snapshot(), self._filter_to_send())
        runner.reset(_derived_seed(self.config.seed, self._iteration, 1))
        episodes = runner.run_episodes(int(self.config.evaluation_duration))
        returns = [r for r, _ in episodes]
        lengths = [n for _, n in episodes]
        metrics = {
            "episode_reward_mean": float(np.mean(returns)),
            "episode_reward_min": float(np.min(returns)),
            "episode_reward_max": float(np.max(returns)),
            "episode_len_mean": float(np.mean(lengths)),
            "episodes_this_iter": len(episodes),
            "num_env_steps_sampled_this_iter": int(np.sum(lengths)),
            "time_this_iter_s": time.perf_counter() - start,
        }
        metrics["env_runners"] = {
            "episode_return_mean": metrics["episode_reward_mean"],
            "episode_return_min": metrics["episode_reward_min"],
            "episode_return_max": metrics["episode_reward_max"],
            "episode_len_mean": metrics["episode_len_mean"],
            "num_episodes": len(episodes),
        }
        return metrics

    # Iterations -----------------------------------------------------------------------------

    def train(self) -> dict[str, Any]:
        """Runs one training iteration and returns RLlib's result dict."""
        if self._stopped:
            raise RuntimeError("train() called on a stopped algorithm")
        start = time.perf_counter()
        before = collections.Counter(self._counters)
        self._episodes_this_iter = 0
        min_time = float(self.config.min_time_s_per_iteration or 0)
        min_steps = int(self.config.min_sample_timesteps_per_iteration or 0)
        while True:
            self.training_step()
            elapsed = time.perf_counter() - start
            sampled = self._counters["num_env_steps_sampled"] - before["num_env_steps_sampled"]
            trained = self._counters["num_env_steps_trained"] - before["num_env_steps_trained"]
            if elapsed >= min_time and sampled >= min_steps and trained > 0:
                break
        self._iteration += 1
        train_elapsed = time.perf_counter() - start
        interval = self.config.evaluation_interval
        evaluation = self.evaluate() if interval and self._iteration % interval == 0 else None
        elapsed = time.perf_counter() - start
        self._time_total_s += elapsed
        result = self._result(before, train_elapsed)  # Throughputs exclude the evaluation.
        result["time_this_iter_s"] = elapsed
        if evaluation is not None:
            result["evaluation"] = evaluation
        return result

    def _result(self, before: collections.Counter, elapsed: float) -> dict[str, Any]:
        c = self._counters
        returns = [r for r, _ in self._episodes]
        lengths = [n for _, n in self._episodes]
        nan = float("nan")
        reward_mean = float(np.mean(returns)) if returns else nan
        episode_stats = {
            "episode_reward_mean": reward_mean,
            "episode_reward_min": float(np.min(returns)) if returns else nan,
            "episode_reward_max": float(np.max(returns)) if returns else nan,
            "episode_len_mean": float(np.mean(lengths)) if lengths else nan,
            "episodes_this_iter": self._episodes_this_iter,
            "episodes_total": self._episodes_total,
        }
        sampled_iter = c["num_env_steps_sampled"] - before["num_env_steps_sampled"]
        trained_iter = c["num_env_steps_trained"] - before["num_env_steps_trained"]
        counters = {
            key: int(c[key])
            for key in (
                "num_env_steps_sampled",
                "num_env_steps_trained",
                "num_agent_steps_sampled",
                "num_agent_steps_trained",
                "num_samples_added_to_queue",
                "num_times_learner_queue_full",
                "num_weight_broadcasts",
                "num_training_step_calls",
                "num_env_runner_failures",
                "num_env_runner_restarts",
                "num_nonfinite_episodes_dropped",
                "num_times_no_aggregation_worker_available",
                "num_aggregation_worker_restarts",
                "num_env_steps_lost_in_aggregation",
                "num_nonfinite_updates_skipped",
            )
        }
        stats = dict(self._learner_info)
        diff = stats.pop("diff_num_grad_updates_vs_sampler_policy", 0.0)
        learner_info = {
            "default_policy": {
                "learner_stats": stats,
                "num_agent_steps_trained": int(stats.get("num_agent_steps_trained", 0)),
                "num_grad_updates_lifetime": int(stats.get("num_grad_updates_lifetime", 0)),
                "diff_num_grad_updates_vs_sampler_policy": diff,
            }
        }
        result: dict[str, Any] = {
            **episode_stats,
            "env_runners": {
                "episode_return_mean": reward_mean,
                "episode_return_min": episode_stats["episode_reward_min"],
                "episode_return_max": episode_stats["episode_reward_max"],
                "episode_len_mean": episode_stats["episode_len_mean"],
                "num_episodes": self._episodes_this_iter,
                "num_env_steps_sampled_lifetime": c["num_env_steps_sampled"],
            },
            "training_iteration": self._iteration,
            "timesteps_total": c["num_env_steps_sampled"],
            "time_this_iter_s": elapsed,
            "time_total_s": self._time_total_s,
            **counters,
            "num_env_steps_sampled_this_iter": sampled_iter,
            "num_env_steps_trained_this_iter": trained_iter,
            "num_env_steps_sampled_throughput_per_sec": sampled_iter / max(elapsed, 1e-9),
            "num_env_steps_trained_throughput_per_sec": trained_iter / max(elapsed, 1e-9),
            "num_healthy_workers": len(self.pool.healthy_actor_ids()),
            "num_in_flight_async_sample_reqs": int(sum(self._in_flight.values())),
            "counters": dict(counters),
            "info": {"learner": learner_info, **counters},
            "timestamp": int(time.time()),
            "date": time.strftime("%Y-%m-%d_%H-%M-%S"),
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
            "node_ip": "127.0.0.1",
            "platform": platform.platform(),
        }
        self.learner_thread.add_learner_metrics(result)
        return result

    # Checkpoints ----------------------------------------------------------------------------

    def save(self, checkpoint_dir: str) -> str:
        """Saves the learner, the driver's counters and what resuming needs to `checkpoint_dir`.

        The learner part (weights, optimizer slots, update and step counters, hence the
        schedules) is written under the learner lock, so all of it comes from one update; the
        directory is replaced atomically (`impala_tf.checkpoints.write_checkpoint`). The driver
        part holds the counters, the iteration, the smoothing window of episodes, the broadcast
        bookkeeping, the merged observation filter (`observation_filter`) and the driver's
        `Aggregator`: the rows waiting to fill a train batch and,
        in deterministic mode only (it can be large), the mix-in replay buffer. In
        deterministic mode it also holds a snapshot of the (idle) actor: its weights, its
        action sampler and, when they can be pickled, its envs mid-episode (see
        `EnvRunner.get_state`). The state inside aggregation worker processes is not saved.

        Returns:
          `checkpoint_dir`.
        """
        state = {
            "iteration": self._iteration,
            "time_total_s": self._time_total_s,
            "counters": dict(self._counters),
            "episodes": list(self._episodes),
            "episodes_total": self._episodes_total,
            "steps_since_broadcast": self._steps_since_broadcast,
            "broadcast_version": self._broadcast_version,
            "deterministic": self.deterministic,
            "observation_filter": self.obs_filter.get_state(),
        }
        runtime: dict[str, Any] = {}
        if self.deterministic or self.config.replay_proportion == 0:
            runtime["aggregator"] = self._local_aggregator
        if self.deterministic:
            runtime["actors"] = self._actor_snapshots()
        with self.learner_thread.lock:
            return checkpoints.write_checkpoint(
                checkpoint_dir, self.learner, self.config, state, runtime
            )

    def _actor_snapshots(self) -> dict[int, dict]:
        try:
            snapshots = self.pool.get_actor_states(
                self.pool.healthy_actor_ids(), _ACTOR_STATE_TIMEOUT_S
            )
        except ActorStateUnsupported as e:
            logger.warning("Checkpoint without actor state (%s): resuming will not be exact.", e)
            return {}
        for actor_id, snapshot in snapshots.items():
            if snapshot.get("envs") is None:
                logger.warning(
                    "The envs of actor %d cannot be pickled (%s): a run resumed from this "
                    "checkpoint starts new episodes and will not match an uninterrupted run.",
                    actor_id,
                    snapshot.get("envs_error"),
                )
        return snapshots

    def restore(self, checkpoint_dir: str) -> None:
        """Restores what `save` wrote; the run continues from there.

        The actors continue from their snapshots when the checkpoint has them (deterministic
        mode); otherwise they get the restored weights and start new episodes, with env and
        sampler seeds derived from `seed` and the restored step count (so a resumed run does
        not replay the random streams of its beginning). A replay buffer not in the
        checkpoint starts empty. Fragments sampled before the restore are dropped, and so are
        the train batches on the learner queue, those loaded or buffered for the learner, and
        gradients accumulated from microbatches (`LearnerThread.flush`): nothing sampled before
        the restore trains after it.
        """
        checkpoint_dir = checkpoints.resolve_checkpoint_dir(checkpoint_dir)
        with self.learner_thread.lock:
            # No batch taken before the restore trains after it; accumulators start empty.
            self.learner_thread.flush()
            checkpoints.learner_checkpoint(self.learner).read(
                os.path.join(checkpoint_dir, checkpoints.LEARNER_PREFIX)
            ).assert_consumed()
        while True:  # Outputs of updates before the restore would count twice.
            try:
                self.learner_thread.outqueue.get_nowait()
            except queue.Empty:
                break
        state = checkpoints.read_driver_state(checkpoint_dir)
        runtime = checkpoints.read_runtime_state(checkpoint_dir)
        self._iteration = int(state["iteration"])
        self._time_total_s = float(state["time_total_s"])
        self._counters = collections.Counter(state["counters"])
        self._episodes.clear()
        self._episodes.extend(tuple(e) for e in state["episodes"])
        self._episodes_total = int(state["episodes_total"])
        self._steps_since_broadcast = int(state.get("steps_since_broadcast", 0))
        if state.get("observation_filter") is not None:
            self.obs_filter = filters.filter_from_state(state["observation_filter"])
        steps = int(self._counters["num_env_steps_sampled"])
        seed = self.config.seed
        if runtime.get("aggregator") is not None:
            self._local_aggregator = runtime["aggregator"]
        else:  # A fresh replay stream, not the one the run started with.
            reseeded = self.config.copy()
            reseeded.seed = _derived_seed(seed, steps, 2)
            self._local_aggregator = Aggregator(reseeded, self._rows)
        snapshots = runtime.get("actors") or {}
        states: dict[int, dict] = {}
        for actor_id in self.pool.healthy_actor_ids():
            actor_state = dict(snapshots.get(actor_id) or {})
            if actor_state.get("envs") is None:
                actor_state["seed"] = _derived_seed(seed, steps, 3, actor_id)
            states[actor_id] = actor_state
        try:
            self.pool.set_actor_states(states)
        except ActorStateUnsupported as e:
            logger.warning("Actors keep their state (%s): resuming is not exact.", e)
        self._broadcast([i for i, s in states.items() if s.get("weights") is None])
        if snapshots:
            self._broadcast_version = int(state.get("broadcast_version", self._broadcast_version))
        self._min_policy_version = self._broadcast_version

    @property
    def iteration(self) -> int:
        return self._iteration

    # Shutdown -------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stops the learner thread and every actor process. Safe to call more than once."""
        if self._stopped:
            return
        self._stopped = True
        if getattr(self, "_eval_runner", None) is not None:
            self._eval_runner.close()
        if self.learner_thread is not None:
            self.learner_thread.stop()
        if self.pool is not None:
            self.pool.stop()
        if getattr(self, "aggregators", None) is not None:
            self.aggregators.stop()
        _live_algorithms.discard(self)

    def __enter__(self) -> Impala:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


_live_algorithms: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for algo in list(_live_algorithms):
        algo.stop()
