"""`Impala`: the IMPALA algorithm (RLlib's `IMPALA`), for one policy or many.

Built by `ImpalaConfig.build()` or `impala-train` (`impala_tf.driver.factory.build_algorithm`).
Each `train()` call runs training steps for at least `min_time_s_per_iteration` seconds and
`min_sample_timesteps_per_iteration` env steps and returns RLlib's result dict; every
`evaluation_interval` iterations it also runs `evaluate()`. A single-agent config is the
one-policy case (`"default_policy"`); a multi-agent one (RLlib's `policies`,
`policy_mapping_fn`, `policies_to_train`, or a `MultiAgentEnv`) has one learner per policy.

`Impala` is a thin facade over the driver's collaborators (`impala_tf.driver`), each readable
alone:

* `plan` (`RuntimePlan`): the modes decided once at build time (backend, inference, schedule);
* `actors` (`EnvRunnerGroup`): the env runners, sample requests, restarts, observation filters;
* `aggregation` (`AggregationStage`): decompression, replay and train-batch cutting, in the
  driver or in aggregation workers;
* `learners` (`LearnerGroup`): each policy's `ImpalaLearner` and learner thread;
* `broadcaster` (`Broadcaster`): when and which weights go to the actors;
* `schedule`: the training step, asynchronous or lockstep (`deterministic=True`);
* `metrics` (`Metrics`): counters, the episode window and the result dict;
* checkpoints (`SavedState`): `save` and `restore`.

`Impala(config, deterministic=True)` samples and trains in lockstep (one fragment is sampled,
trained on and answered with a broadcast before the next is requested), so that a run with a
fixed seed is reproducible update for update and, resumed from a checkpoint, continues exactly as
if it had not stopped (`save` then also snapshots the actors' envs).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import time
import weakref
from collections.abc import Mapping
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from impala_tf.acting import filters as filter_lib
from impala_tf.acting.actions import ActionAdapter
from impala_tf.acting.trained_policy import Policy
from impala_tf.checkpoints import load_config, read_state, resolve_checkpoint_dir, restore_model
from impala_tf.config.base import AlgorithmConfig
from impala_tf.config.callbacks import Callbacks
from impala_tf.config.policies import policy_config
from impala_tf.driver.aggregation import AggregationStage
from impala_tf.driver.broadcast import Broadcaster
from impala_tf.driver.evaluation import Evaluator, evaluation_media, evaluation_metrics
from impala_tf.driver.learners import LearnerGroup
from impala_tf.driver.metrics import Metrics
from impala_tf.driver.plan import RuntimePlan, check_deterministic, make_plan
from impala_tf.driver.sampling import EnvRunnerGroup, make_backend
from impala_tf.driver.schedule import make_schedule
from impala_tf.driver.specs import aggregator_spec, sampling_spec
from impala_tf.driver.state import Progress, SavedState
from impala_tf.learning import devices
from impala_tf.learning.learner import ImpalaLearner
from impala_tf.learning.thread import LearnerThread
from impala_tf.models.catalog import build_model
from impala_tf.rollout.fragment import DEFAULT_POLICY_ID
from impala_tf.utils.seeds import Stream, sampler_seeds, stream_seed

__all__ = ["Impala", "MultiAgentImpala", "check_deterministic", "make_strategy"]

logger = logging.getLogger(__name__)


def make_strategy(config: AlgorithmConfig) -> tf.distribute.Strategy:
    """The learner's `tf.distribute` strategy for `num_gpus` / `_fake_gpus`.

    Call it before any TensorFlow op: it first makes the GPU settings that must precede
    TensorFlow's initialisation (`devices.configure_gpus`: memory growth on, or with
    `num_gpus: 0` the GPUs hidden).

    One device: the default strategy (TensorFlow places ops on the GPU if there is one and
    `num_gpus > 0`); with `num_gpus: 0` and GPUs that could no longer be hidden, a
    `OneDeviceStrategy` on the CPU. N > 1: `MirroredStrategy` over N GPUs, or over N logical
    CPU devices with `_fake_gpus=True` (these must be configured before TensorFlow initialises;
    we do that here when we can).
    """
    pin_to_cpu = devices.configure_gpus(config.num_gpus)
    n = config.num_learner_devices
    if pin_to_cpu:
        return tf.distribute.OneDeviceStrategy("/cpu:0")
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


class Impala:
    """The IMPALA algorithm: actors sample asynchronously, learner threads train with V-trace.

    Args:
      config: A validated (or validatable) config with `env` set.
      callbacks: Keras callbacks for the learner threads (called around each update).
      deterministic: Sample and train in lockstep, for runs that a seed reproduces exactly and
        checkpoints that resume exactly (see the module docstring; `check_deterministic` lists
        what the config needs). Slower: actors and learners never overlap.
      logdir: The run's directory; the train batches of skipped non-finite updates are saved
        in `<logdir>/nonfinite/` (`impala_tf.learning.nonfinite`). None: a temporary directory, made
        when the first one is saved.
      plan: The run's modes when the caller decided them already
        (`impala_tf.driver.factory.build_algorithm` does, to start the actors' fork server
        early); None decides them here, probing the env once.
    """

    def __init__(
        self,
        config: AlgorithmConfig,
        callbacks: list[keras.callbacks.Callback] | None = None,
        deterministic: bool = False,
        logdir: str | None = None,
        *,
        plan: RuntimePlan | None = None,
    ):
        if plan is None:
            config.validate(require_env=True)
            plan = make_plan(config, deterministic)
        self._setup(config, plan, logdir)
        self._start(callbacks)

    def _setup(self, config: AlgorithmConfig, plan: RuntimePlan, logdir: str | None) -> None:
        """The algorithm's plain state, before any process or learner exists."""
        self.config = config
        self.plan = plan
        self.deterministic = plan.deterministic
        self.logdir = logdir
        self._stopped = False
        self._started = False
        self._checkpoint: str | None = None  # `from_checkpoint`: restored when started.
        self._policies: dict[str, Policy] = {}
        self._pending_weights: dict[str, list[np.ndarray]] = {}  # Set before the start.
        self.actors: EnvRunnerGroup | None = None
        self.learners: LearnerGroup | None = None
        self.aggregation: AggregationStage | None = None
        self._evaluator: Evaluator | None = None
        self.progress = Progress()
        self.metrics = Metrics(
            config.metrics_num_episodes_for_smoothing, plan.trained, plan.multi_agent
        )
        self.callbacks = Callbacks(plan.callbacks, "the driver")

    def _start(self, callbacks: list[keras.callbacks.Callback] | None = None) -> None:
        """Starts the actors, the learners and their threads, and the driver loop."""
        config, plan = self.config, self.plan
        self._started = True
        self._policies = {}  # Policies from a checkpoint give way to the learners' own.
        # TF sets its logical devices on first use: choose them before anything else runs.
        self.strategy = make_strategy(config)
        if config.seed is not None:
            keras.utils.set_random_seed(int(config.seed))
        counters = self.metrics.counters
        _live_algorithms.add(self)
        try:
            # Actors import and build their envs while the learners are built here.
            self.actors = EnvRunnerGroup(sampling_spec(config, plan), plan, counters)
            self.learners = LearnerGroup(config, plan, self.strategy, callbacks, self.logdir)
            self.learners.start()
            workers = int(config.num_aggregation_workers)
            backend = make_backend(self.actors.spec, plan) if workers else None
            self.aggregation = AggregationStage(
                aggregator_spec(config, self.learners.rows), counters, backend
            )
        except BaseException:
            self.stop()
            raise
        self.broadcaster = Broadcaster(
            self.learners,
            self.actors,
            config.broadcast_interval,
            counters,
            wait=self.deterministic,
            min_time_s=0.0 if self.deterministic else config.min_time_s_per_broadcast,
        )
        self.schedule = make_schedule(
            plan, self.actors, self.aggregation, self.learners, self.broadcaster, self.metrics,
            fetch_wait_s=config.timeout_s_sampler_manager,
            aggregation_wait_s=config.timeout_s_aggregator_manager,
        )  # fmt: skip
        self.saved_state = SavedState(
            config, plan, self.progress, self.metrics, self.learners, self.actors,
            self.aggregation, self.broadcaster,
        )  # fmt: skip
        self.broadcaster.send(self.actors.healthy_ids())
        self.schedule.start()
        try:
            if self._checkpoint is not None:
                self.saved_state.restore(self._checkpoint)
            if self._pending_weights:
                self.set_weights(self._pending_weights)
            self.callbacks("on_algorithm_init", algorithm=self)
        except BaseException:
            self.stop()
            raise

    def _ensure_started(self) -> None:
        """Starts an algorithm loaded with `from_checkpoint` (its first train, save, ...)."""
        if not self._started:
            if self._stopped:
                raise RuntimeError("this algorithm was stopped before it started")
            self._start()

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint: str,
        *,
        config: AlgorithmConfig | None = None,
        logdir: str | None = None,
    ) -> Impala:
        """Loads a checkpoint (RLlib's `Algorithm.from_checkpoint`); starts no process.

        The returned algorithm's policies are ready at once (`get_policy`,
        `compute_single_action`, `compute_actions`, `get_weights`), built from the
        checkpoint's config and weights in this process. Its first `train()`, `evaluate()` or
        `save()` starts the actors and learners and restores the checkpoint into them, so that
        training continues from it.

        Args:
          checkpoint: A checkpoint directory, or a training logdir (its newest checkpoint).
          config: The config to use instead of the checkpoint's (needed when the run was
            trained on an `env` callable, which a checkpoint cannot store).
          logdir: The run's directory once training starts.

        Raises:
          FileNotFoundError: there is no checkpoint there.
          ValueError: the checkpoint holds no config and none is given, or the config is
            invalid.
        """
        checkpoint_dir = resolve_checkpoint_dir(checkpoint)
        if config is None:
            config = load_config(checkpoint_dir)
        config.validate(require_env=True)
        algo = cls.__new__(cls)
        algo._setup(config, make_plan(config), logdir)
        algo._checkpoint = checkpoint_dir
        return algo

    # Single-policy views ------------------------------------------------------------------------

    @property
    def policy_ids(self) -> list[str]:
        return self.plan.policy_ids

    @property
    def learner(self) -> ImpalaLearner:
        """The first trained policy's learner (the only one of a single-agent run); Keras
        callbacks of `impala_tf.training.loop.fit` get it as their model."""
        return self.learners.learners[self.learners.first]

    @property
    def learner_thread(self) -> LearnerThread:
        """The first trained policy's learner thread (the only one of a single-agent run)."""
        return self.learners.threads[self.learners.first]

    @property
    def _first(self) -> str:
        return (list(self.plan.trained) or self.plan.policy_ids)[0]

    @property
    def observation_space(self) -> Any:
        return self.plan.spaces.policies[self._first][0]

    @property
    def action_space(self) -> Any:
        return self.plan.spaces.policies[self._first][1]

    @property
    def iteration(self) -> int:
        return self.progress.iteration

    def get_policy_weights(self, policy_id: str = DEFAULT_POLICY_ID) -> list[np.ndarray]:
        """One policy's current weights (numpy arrays, as the actors receive them)."""
        return self.get_weights([policy_id])[policy_id]

    # Policies you can call ----------------------------------------------------------------------

    def get_policy(self, policy_id: str = DEFAULT_POLICY_ID) -> Policy:
        """The policy `policy_id` (RLlib's `Algorithm.get_policy`): `.model`, weights, actions.

        Of a built algorithm it follows the learner (`impala_tf.acting.trained_policy`); of one
        loaded with `from_checkpoint` and not trained since, it holds the checkpoint's weights.

        Raises:
          KeyError: no such policy (the message lists them).
        """
        if policy_id not in self.plan.spaces.policies:
            raise KeyError(f"No policy {policy_id!r}; policies: {self.policy_ids}.")
        policy = self._policies.get(policy_id)
        if policy is None:
            policy = self._policies[policy_id] = self._make_policy(policy_id)
        return policy

    def _make_policy(self, pid: str) -> Policy:
        obs_space, act_space = self.plan.spaces.policies[pid]
        pconfig = policy_config(self.config, pid)
        spec = self.plan.models[pid]
        # As the driver's evaluation runner (and so `impala-evaluate`) seeds its samplers.
        seed = sampler_seeds(self.config.seed, 0, self.plan.policy_ids, self.plan.multi_agent)[pid]
        if self._started:
            learner = self.learners.learners[pid]

            def newer(version: int) -> tuple[list[np.ndarray], int] | None:
                if int(learner.num_grad_updates.numpy()) == version:
                    return None
                return self.learners.snapshot(pid, wait=True)

            return Policy(
                pid, learner.model, spec, obs_space, act_space, pconfig,
                lambda: self.actors.filters[pid], seed, newer,
                lambda weights: self.set_weights({pid: weights}),
            )  # fmt: skip
        model = build_model(obs_space, act_space, spec, precision=pconfig.acting_precision)
        restore_model(model, self._checkpoint, pid)
        saved = read_state(self._checkpoint)["observation_filters"].get(pid)
        if saved is not None:
            obs_filter = filter_lib.filter_from_state(saved)
        else:
            obs_filter = filter_lib.get_filter(self.config.observation_filter, obs_space.shape)
        return Policy(pid, model, spec, obs_space, act_space, pconfig, lambda: obs_filter, seed)

    def get_weights(self, policies: list[str] | None = None) -> dict[str, list[np.ndarray]]:
        """{policy_id: weights} of `policies` (default: all), RLlib's `Algorithm.get_weights`.

        Raises:
          KeyError: a policy id that is not one of this algorithm's.
        """
        ids = self.policy_ids if policies is None else list(policies)
        unknown = sorted(set(ids) - set(self.policy_ids))
        if unknown:
            raise KeyError(f"No policies {unknown}; policies: {self.policy_ids}.")
        if self._started:
            return {pid: self.learners.snapshot(pid, wait=True)[0] for pid in ids}
        return {pid: self.get_policy(pid).get_weights() for pid in ids}

    def set_weights(self, weights: Mapping[str, list[np.ndarray]]) -> None:
        """Sets policies' weights (RLlib's `Algorithm.set_weights`): the learners' (between two
        updates), then the actors get them; before the algorithm starts (`from_checkpoint`),
        the policies', which training then starts from.

        Raises:
          KeyError: a policy id that is not one of this algorithm's.
          ValueError: weights that do not fit the policy's model.
        """
        unknown = sorted(set(weights) - set(self.policy_ids))
        if unknown:
            raise KeyError(f"No policies {unknown}; policies: {self.policy_ids}.")
        if not self._started:
            for pid, w in weights.items():
                self.get_policy(pid).set_weights(w)
                self._pending_weights[pid] = [np.asarray(a) for a in w]
            return
        with self.learners.locked():
            for pid, w in weights.items():
                self.learners.learners[pid].set_policy_weights([np.asarray(a) for a in w])
        self.broadcaster.send(self.actors.healthy_ids())

    def compute_single_action(
        self,
        observation: Any = None,
        state: list[Any] | None = None,
        *,
        prev_action: Any = None,
        prev_reward: Any = None,
        info: Any = None,
        input_dict: Mapping[str, Any] | None = None,
        policy_id: str = DEFAULT_POLICY_ID,
        full_fetch: bool = False,
        explore: bool | None = None,
        timestep: Any = None,
        episode: Any = None,
        unsquash_action: bool | None = None,
        clip_action: bool | None = None,
    ) -> Any:
        """The action for one observation, as an env runner computes it (RLlib's
        `Algorithm.compute_single_action`).

        The observation goes through the policy's observation filter (not updated), the
        policy acts (sampling when `explore`, default the config's), and the action is
        unsquashed to the env's bounds (`unsquash_action`, default `normalize_actions`) or
        clipped (`clip_action`, default `clip_actions`), as the env sees it.

        Args:
          observation: One observation as the env returns it (or `input_dict["obs"]`).
          state: The recurrent state (a list of [H] arrays; `get_policy().get_initial_state()`
            before an episode's first step); None for feed-forward policies.
          prev_action: Must be None (no model here takes previous actions).
          prev_reward: Must be None (nor previous rewards).
          info: Accepted for RLlib's signature; unused.
          input_dict: `{"obs": observation}` instead of `observation`.
          policy_id: The policy that acts.
          full_fetch: Also return the state and extra fetches (as when `state` is given).
          explore: Sample (True) or take the most likely action (False).
          timestep: Accepted for RLlib's signature; unused.
          episode: Accepted for RLlib's signature; unused.
          unsquash_action: Unsquash a Box action to the env's bounds (None: `normalize_actions`).
          clip_action: Clip a Box action to the env's bounds (None: `clip_actions`).

        Returns:
          The action; `(action, state out, extra fetches)` when `state` is given or
          `full_fetch`.
        """
        del info, timestep, episode
        if prev_action is not None or prev_reward is not None:
            raise ValueError(
                "compute_single_action: prev_action / prev_reward are not supported (no model "
                "takes previous actions or rewards: lstm_use_prev_action is not supported)."
            )
        if input_dict is not None:
            observation = input_dict["obs"]
        batch_state = None if state is None else [np.asarray(s)[None] for s in state]
        actions, state_out, extra = self.compute_actions(
            np.asarray(observation)[None],
            batch_state,
            policy_id=policy_id,
            full_fetch=True,
            explore=explore,
            unsquash_action=unsquash_action,
            clip_action=clip_action,
        )
        action = actions[0]
        if state is None and not full_fetch:
            return action
        return action, [s[0] for s in state_out], {k: v[0] for k, v in extra.items()}

    def compute_actions(
        self,
        observations: Any,
        state: list[Any] | None = None,
        *,
        policy_id: str = DEFAULT_POLICY_ID,
        full_fetch: bool = False,
        explore: bool | None = None,
        unsquash_action: bool | None = None,
        clip_action: bool | None = None,
    ) -> Any:
        """Actions for several observations (RLlib's `Algorithm.compute_actions`).

        Args:
          observations: A batch [B, *obs_shape], or RLlib's `{agent or env id: observation}`.
          state: The recurrent state: a list of [B, H] arrays (None: the initial state).
          policy_id: The policy that acts.
          full_fetch: Also return the state and extra fetches (as when `state` is given).
          explore: Sample (True) or take the most likely action (False).
          unsquash_action: As in `compute_single_action`.
          clip_action: As in `compute_single_action`.

        Returns:
          The actions, [B, *action_shape] (or a dict with the keys of `observations`); with
          `state` or `full_fetch`, `(actions, state out, extra fetches)`.
        """
        policy = self.get_policy(policy_id)
        keys = list(observations) if isinstance(observations, Mapping) else None
        obs = np.stack([observations[k] for k in keys]) if keys is not None else observations
        actions, state_out, extra = policy.compute_actions(policy.filter(obs), state, explore)
        config = policy.config
        adapter = ActionAdapter(
            policy.action_space,
            config.normalize_actions if unsquash_action is None else unsquash_action,
            config.clip_actions if clip_action is None else clip_action,
        )
        actions = adapter(actions)
        if keys is not None:
            actions = dict(zip(keys, actions))
        if state is None and not full_fetch:
            return actions
        return actions, state_out, extra

    # Iterations ---------------------------------------------------------------------------------

    def training_step(self) -> None:
        """One pass of the driver loop (`impala_tf.driver.schedule`)."""
        self._ensure_started()
        self.schedule.step()

    def train(self) -> dict[str, Any]:
        """Runs one training iteration and returns RLlib's result dict."""
        if self._stopped:
            raise RuntimeError("train() called on a stopped algorithm")
        self._ensure_started()
        start = time.perf_counter()
        counters = self.metrics.counters
        before = counters.copy()
        self.metrics.episodes_this_iter = 0
        min_time = float(self.config.min_time_s_per_iteration or 0)
        min_steps = int(self.config.min_sample_timesteps_per_iteration or 0)
        while True:
            self.training_step()
            elapsed = time.perf_counter() - start
            sampled = counters.num_env_steps_sampled - before.num_env_steps_sampled
            trained = counters.num_env_steps_trained - before.num_env_steps_trained
            if elapsed >= min_time and sampled >= min_steps and trained > 0:
                break
        self.progress.iteration += 1
        train_elapsed = time.perf_counter() - start
        interval = self.config.evaluation_interval
        evaluate = interval and self.progress.iteration % interval == 0
        evaluation = self.evaluate() if evaluate else None
        elapsed = time.perf_counter() - start
        self.progress.time_total_s += elapsed
        runtime = {
            "num_healthy_workers": len(self.actors.healthy_ids()),
            "num_in_flight_async_sample_reqs": self.actors.num_in_flight(),
            "node_ip": self.actors.node_ip,
        }
        # Throughputs exclude the evaluation.
        result = self.metrics.result(
            before, train_elapsed, self.progress.iteration, self.progress.time_total_s, runtime
        )
        result["time_this_iter_s"] = elapsed
        self.learners.add_learner_metrics(result)
        if evaluation is not None:
            result["evaluation"] = evaluation
        self.callbacks("on_train_result", algorithm=self, result=result)
        return result

    def evaluate(self) -> dict[str, Any]:
        """Runs `evaluation_duration` episodes with the learners' current weights.

        The episodes run one after another in one env of an env runner in this process, built
        from `config.get_evaluation_config()` (`impala_tf.driver.evaluation`). In a seeded run their
        seeds derive from the seed and the iteration, so an evaluation is reproducible (and the
        same after a resume). Sampling pauses meanwhile; the learners go on with the batches
        already queued. With `render_env` / `record_env` in the evaluation config, recorded
        episodes come back as GIFs under `episode_media`
        (`impala_tf.driver.evaluation.evaluation_media`; files in `record_env`'s directory, relative
        to the logdir, named by the iteration).

        Returns:
          RLlib's `evaluation` metrics: `episode_reward_mean/min/max`, `episode_len_mean`,
          `episodes_this_iter`, `num_env_steps_sampled_this_iter`, `policy_reward_*`,
          `time_this_iter_s`, and the same under `env_runners` with the new API stack's names;
          plus `episode_media: {"video": [impala_tf.envs.video.Video, ...]}` when episodes were
          recorded.
        """
        self._ensure_started()
        start = time.perf_counter()
        self.callbacks("on_evaluate_start", algorithm=self)
        if self._evaluator is None:
            self._evaluator = Evaluator(
                self.config.get_evaluation_config(),
                self.plan.spaces,
                models=self.plan.models,
                callbacks=self.plan.callbacks,
            )
        episodes = self._evaluator.run(
            self.broadcaster.latest(),
            self.actors.filters_to_send(),
            int(self.config.evaluation_duration),
            stream_seed(self.config.seed, Stream.EVALUATION, self.progress.iteration),
        )
        name = f"iteration_{self.progress.iteration:06d}"
        media = evaluation_media(self._evaluator, self.logdir, name)
        metrics = evaluation_metrics(episodes, self.plan.multi_agent, time.perf_counter() - start)
        if media is not None:
            metrics["episode_media"] = media
        self.callbacks("on_evaluate_end", algorithm=self, evaluation_metrics=metrics)
        return metrics

    # Checkpoints --------------------------------------------------------------------------------

    def save(self, checkpoint_dir: str) -> str:
        """Saves the learners, the driver's state and what resuming needs (`SavedState.save`).

        Returns:
          `checkpoint_dir`.
        """
        self._ensure_started()
        return self.saved_state.save(checkpoint_dir)

    def restore(self, checkpoint_dir: str) -> None:
        """Restores a checkpoint of any layout; the run continues from there
        (`SavedState.restore`)."""
        if not self._started and not self._stopped:
            self._checkpoint = resolve_checkpoint_dir(checkpoint_dir)  # Restored at the start.
            self._policies = {}
            return
        self._ensure_started()
        self.saved_state.restore(checkpoint_dir)

    # Shutdown -----------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stops the learner threads and every process the algorithm started. Safe to repeat."""
        if self._stopped:
            return
        self._stopped = True
        # Aggregation workers before the actors: the actors' store removes the fragments it
        # still holds, which an aggregation worker may be reading.
        for part in (self._evaluator, self.learners, self.aggregation, self.actors):
            if part is None:
                continue
            try:
                part.close() if isinstance(part, Evaluator) else part.stop()
            except Exception as e:  # noqa: BLE001 - stopping goes on with the other parts.
                logger.warning("Stopping %s failed: %s", type(part).__name__, e)
        _live_algorithms.discard(self)

    def __enter__(self) -> Impala:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


#: RLlib's multi-agent IMPALA is this same class (kept as a name for compatibility).
MultiAgentImpala = Impala

_live_algorithms: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for algo in list(_live_algorithms):
        algo.stop()
