"""`Impala`: the IMPALA algorithm (RLlib's `IMPALA`), for one policy or many.

Built by `ImpalaConfig.build()` or `impala-train` (`impala_tf.driver.factory.build_algorithm`).
Each `train()` call runs training steps for at least `min_time_s_per_iteration` seconds and
`min_sample_timesteps_per_iteration` env steps and returns RLlib's result dict; every
`evaluation_interval` iterations it also runs `evaluate()`. A single-agent config is the
one-policy case (`"default_policy"`); a multi-agent one (RLlib's `policies`,
`policy_mapping_fn`, `policies_to_train`, or a `MultiAgentEnv`) has one learner per policy.

`Impala` is a thin facade over the driver's collaborators (`impala_tf.driver`):

* `plan` (`RuntimePlan`): the modes decided once at build time (backend, inference, schedule);
* `actors` (`EnvRunnerGroup`): the env runners, sample requests, restarts, observation filters;
* `aggregation` (`AggregationStage`): decompression, replay and train-batch cutting, in the
  driver or in aggregation workers;
* `learners` (`LearnerGroup`): each policy's `ImpalaLearner` and learner thread;
* `broadcaster` (`Broadcaster`): when and which weights go to the actors;
* `schedule`: the training step, asynchronous or lockstep (`deterministic=True`);
* `metrics` (`Metrics`): counters, the episode window and the result dict;
* `policies` (`Policies`): the policies to call (`get_policy`, `compute_single_action`, weights);
* checkpoints (`SavedState`): `save` and `restore`.
"""

from __future__ import annotations

import atexit
import logging
import time
import weakref
from collections.abc import Mapping
from typing import Any

import keras
import numpy as np

from impala_tf.acting.trained_policy import Policy
from impala_tf.checkpoints import load_config, resolve_checkpoint_dir
from impala_tf.config.base import AlgorithmConfig
from impala_tf.config.callbacks import Callbacks
from impala_tf.driver import specs
from impala_tf.driver.aggregation import AggregationStage
from impala_tf.driver.broadcast import Broadcaster
from impala_tf.driver.evaluation import Evaluator, evaluation_media, evaluation_metrics
from impala_tf.driver.learners import LearnerGroup
from impala_tf.driver.metrics import Metrics
from impala_tf.driver.plan import RuntimePlan, check_deterministic, make_plan
from impala_tf.driver.policies import Policies
from impala_tf.driver.sampling import EnvRunnerGroup, make_backend
from impala_tf.driver.schedule import make_schedule
from impala_tf.driver.state import Progress, SavedState
from impala_tf.learning.learner import ImpalaLearner
from impala_tf.learning.strategy import make_strategy
from impala_tf.learning.thread import LearnerThread
from impala_tf.rollout.fragment import DEFAULT_POLICY_ID
from impala_tf.utils import timeline
from impala_tf.utils.seeds import Stream, stream_seed

__all__ = ["Impala", "MultiAgentImpala", "check_deterministic"]

logger = logging.getLogger(__name__)


class Impala:
    """The IMPALA algorithm: actors sample asynchronously, learner threads train with V-trace.

    Args:
      config: A validated (or validatable) config with `env` set.
      callbacks: Keras callbacks for the learner threads (called around each update).
      deterministic: Sample and train in lockstep (one fragment is sampled, trained on and
        answered with a broadcast before the next is requested), so that a seeded run is
        reproducible update for update and, resumed from a checkpoint, continues exactly as if
        it had not stopped (`save` then also snapshots the actors' envs; `check_deterministic`
        lists what the config needs). Slower: actors and learners never overlap.
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
        self.policies = Policies(config, plan)
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
        # TF sets its logical devices on first use: choose them before anything else runs.
        self.strategy = make_strategy(config)
        if config.seed is not None:
            keras.utils.set_random_seed(int(config.seed))
        counters = self.metrics.counters
        _live_algorithms.add(self)
        try:
            # Actors import and build their envs while the learners are built here.
            self.actors = EnvRunnerGroup(specs.sampling_spec(config, plan), plan, counters)
            learners = specs.policy_learners(config, plan.models)
            self.learners = LearnerGroup(learners, plan, self.strategy, callbacks, self.logdir)
            self.learners.start()
            workers = int(config.num_aggregation_workers)
            backend = make_backend(self.actors.spec, plan) if workers else None
            self.aggregation = AggregationStage(
                specs.aggregator_spec(config, self.learners.rows), counters, backend
            )
        except BaseException:
            self.stop()
            raise
        self.broadcaster = Broadcaster(
            self.learners, self.actors, config.broadcast_interval, counters,
            wait=self.deterministic,
            min_time_s=0.0 if self.deterministic else config.min_time_s_per_broadcast,
        )  # fmt: skip
        self.schedule = make_schedule(
            plan, self.actors, self.aggregation, self.learners, self.broadcaster, self.metrics,
            fetch_wait_s=config.timeout_s_sampler_manager,
            aggregation_wait_s=config.timeout_s_aggregator_manager,
        )  # fmt: skip
        self.saved_state = SavedState(
            specs.checkpoint_spec(config, plan.policy_ids), plan, self.progress, self.metrics,
            self.learners, self.actors, self.aggregation, self.broadcaster,
        )  # fmt: skip
        self.broadcaster.send(self.actors.healthy_ids())
        self.schedule.start()
        try:
            if self._checkpoint is not None:
                self.saved_state.restore(self._checkpoint)
            self.policies.follow(self.learners, self.actors, self.broadcaster)
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

        The returned algorithm's policies are ready at once (`get_policy`, `compute_single_action`,
        `compute_actions`, `get_weights`), built from the checkpoint's config and weights in this
        process. Its first `train()`, `evaluate()` or `save()` starts the actors and learners and
        restores the checkpoint into them, so that training continues from it.

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
        algo.restore(checkpoint_dir)  # Not started: kept for the start, policies built from it.
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
    def observation_space(self) -> Any:
        return self.plan.spaces.policies[self.policies.first][0]

    @property
    def action_space(self) -> Any:
        return self.plan.spaces.policies[self.policies.first][1]

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
        return self.policies.get(policy_id)

    def get_weights(self, policies: list[str] | None = None) -> dict[str, list[np.ndarray]]:
        """{policy_id: weights} of `policies` (default: all), RLlib's `Algorithm.get_weights`.

        Raises:
          KeyError: a policy id that is not one of this algorithm's.
        """
        return self.policies.get_weights(policies)

    def set_weights(self, weights: Mapping[str, list[np.ndarray]]) -> None:
        """Sets policies' weights (RLlib's `Algorithm.set_weights`): the learners' (between two
        updates), then the actors get them; before the algorithm starts (`from_checkpoint`),
        the policies', which training then starts from.

        Raises:
          KeyError: a policy id that is not one of this algorithm's.
          ValueError: weights that do not fit the policy's model.
        """
        self.policies.set_weights(weights)

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
        return self.policies.compute_single_action(
            input_dict["obs"] if input_dict is not None else observation, state,
            prev_action=prev_action, prev_reward=prev_reward, policy_id=policy_id,
            full_fetch=full_fetch, explore=explore, unsquash_action=unsquash_action,
            clip_action=clip_action,
        )  # fmt: skip

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
        return self.policies.compute_actions(
            observations, state, policy_id=policy_id, full_fetch=full_fetch, explore=explore,
            unsquash_action=unsquash_action, clip_action=clip_action,
        )  # fmt: skip

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
        if self._evaluator is None:  # Its spec: the evaluation config's, resolved once.
            evaluation, plan = self.config.get_evaluation_config(), self.plan
            spec = specs.evaluator_spec(evaluation, plan.spaces, plan.models, plan.callbacks)
            self._evaluator = Evaluator(spec)
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
        """Restores a checkpoint (any layout); the run continues from it (`SavedState.restore`)."""
        if not self._started and not self._stopped:
            self._checkpoint = resolve_checkpoint_dir(checkpoint_dir)  # Restored at the start.
            self.policies.load(self._checkpoint)
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
            timeline.mark(f"stopped {type(part).__name__}")  # `impala-train --verbose` prints them.
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
