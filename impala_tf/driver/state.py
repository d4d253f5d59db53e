"""Saving and restoring a driver: one checkpoint layout for one policy or many.

`save` writes every policy's learner, the driver's plain-data state and, when there is some,
the runtime state JSON cannot hold (`impala_tf.checkpoints.store` has the layout and the atomic
write). `restore` reads any layout back (also checkpoints written before this one) and restarts
the run from there; nothing sampled or queued before a restore trains after it.

What a checkpoint holds, beyond the learners (weights, optimizer slots, update and step counters,
hence the schedules), all read under the learner locks so each policy's parts come from one
update: the iteration and total time, the counters, the episode window, the broadcast
bookkeeping, the merged observation filters, the rows waiting to fill a train batch and, in
deterministic mode only (they can be large), the replay buffers and a snapshot of the (idle)
actors: their weights, action samplers and, when they can be pickled, their envs mid-episode.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from impala_tf.checkpoints.reading import learner_prefix, read_runtime_state, read_state
from impala_tf.checkpoints.store import (
    learner_checkpoint,
    resolve_checkpoint_dir,
    write_checkpoint,
)
from impala_tf.config.policies import policy_config
from impala_tf.config.registry import config_class
from impala_tf.driver.aggregation import AggregationStage
from impala_tf.driver.broadcast import Broadcaster
from impala_tf.driver.learners import LearnerGroup
from impala_tf.driver.metrics import Metrics
from impala_tf.driver.plan import RuntimePlan
from impala_tf.driver.sampling import EnvRunnerGroup
from impala_tf.driver.specs import CheckpointSpec
from impala_tf.models.spec import registered_paths
from impala_tf.rollout.fragment import DEFAULT_POLICY_ID
from impala_tf.utils.seeds import Stream, stream_seed

__all__ = ["Progress", "SavedState", "check_pixel_centering"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Progress:
    """How far the run is: `training_iteration` and `time_total_s`."""

    iteration: int = 0
    time_total_s: float = 0.0


class SavedState:
    """Writes and reads a driver's checkpoints (see the module docstring).

    Args:
      spec: What the checkpoints need of the config: the config as stored, `seed`, each
        policy's `model.center_pixels` (`impala_tf.driver.specs.checkpoint_spec`).
      plan: The run's plan.
      progress: The iteration and total time.
      metrics: The counters and episode window.
      learners: The learner group.
      actors: The env runner group (filters, snapshots, reseeding).
      aggregation: The aggregation stage (its waiting rows and replay buffers).
      broadcaster: The broadcast bookkeeping.
    """

    def __init__(
        self,
        spec: CheckpointSpec,
        plan: RuntimePlan,
        progress: Progress,
        metrics: Metrics,
        learners: LearnerGroup,
        actors: EnvRunnerGroup,
        aggregation: AggregationStage,
        broadcaster: Broadcaster,
    ):
        self.spec = spec
        self.plan = plan
        self.progress = progress
        self.metrics = metrics
        self.learners = learners
        self.actors = actors
        self.aggregation = aggregation
        self.broadcaster = broadcaster

    def save(self, checkpoint_dir: str) -> str:
        """Writes a checkpoint to `checkpoint_dir` (replaced atomically); returns it."""
        deterministic = self.plan.deterministic
        state = {
            "iteration": self.progress.iteration,
            "time_total_s": self.progress.time_total_s,
            **self.metrics.get_state(),
            **self.broadcaster.get_state(),
            "deterministic": deterministic,
            "multi_agent": self.plan.multi_agent,
            "policy_ids": self.plan.policy_ids,
            **self.actors.get_state(),
            # So that another process can build registered custom models (`load_config`).
            "custom_models": registered_paths(self.plan.models),
        }
        runtime: dict[str, Any] = {"aggregator": self.aggregation.local.get_state(deterministic)}
        if deterministic:
            runtime["actors"] = self._actor_snapshots()
        with self.learners.locked():
            return write_checkpoint(
                checkpoint_dir, self.learners.learners, self.spec.config, state, runtime
            )

    def _actor_snapshots(self) -> dict[int, dict]:
        snapshots = self.actors.get_states()
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
        """Restores what `save` (or an older layout) wrote; the run continues from there.

        The actors continue from their snapshots when the checkpoint has them (deterministic
        mode); otherwise they get the restored weights and start new episodes, with env and
        sampler seeds derived from `seed` and the restored step count (so a resumed run does
        not replay the random streams of its beginning). A replay buffer not in the checkpoint
        starts empty. Fragments requested before the restore are dropped, and so are the train
        batches queued, loaded or buffered for the learners, their accumulated microbatch
        gradients, and the rows held by the aggregation workers.

        Raises:
          ValueError: the checkpoint lacks a policy of this run, or a policy's
            `model.center_pixels` differs from the checkpoint's.
        """
        checkpoint_dir = resolve_checkpoint_dir(checkpoint_dir)
        state = read_state(checkpoint_dir)
        missing = sorted(set(self.plan.policy_ids) - set(state["policy_ids"]))
        if missing:
            raise ValueError(
                f"{checkpoint_dir} has no policies {missing} (it has {state['policy_ids']})."
            )
        check_pixel_centering(
            self.spec.center_pixels, state.get("config"), state.get("algorithm", "IMPALA")
        )
        runtime = read_runtime_state(checkpoint_dir)
        with self.learners.locked():
            # No batch taken before the restore trains after it; accumulators start empty.
            self.learners.flush()
            for pid, learner in self.learners.learners.items():
                prefix = learner_prefix(checkpoint_dir, pid)
                learner_checkpoint(learner).read(prefix).assert_consumed()
        self.progress.iteration = int(state["iteration"])
        self.progress.time_total_s = float(state["time_total_s"])
        # The counters, restored in place, are also the restarts held against their limits.
        self.metrics.set_state(state)
        self.broadcaster.set_state(state)
        self.actors.set_state(state)
        counters = self.metrics.counters
        steps, seed = int(counters.num_env_steps_sampled), self.spec.seed
        # A fresh replay stream (unless the checkpoint has the buffers), not the first one.
        self.aggregation.reset(
            stream_seed(seed, Stream.RESTORED_REPLAY, steps), runtime.get("aggregator")
        )
        snapshots = runtime.get("actors") or {}
        states: dict[int, dict] = {}
        for actor_id in self.actors.healthy_ids():
            actor_state = dict(snapshots.get(actor_id) or {})
            if actor_state.get("envs") is None:
                actor_state["seed"] = stream_seed(seed, Stream.RESTORED_ACTOR, steps, actor_id)
            states[actor_id] = actor_state
        self.actors.drop_in_flight()
        self.actors.set_states(states)
        self.broadcaster.resume(
            {i: None if s.get("weights") is None else _keyed_weights(s) for i, s in states.items()}
        )


def check_pixel_centering(
    center_pixels: Mapping[str, bool], stored: Mapping[str, Any] | None, algorithm: str = "IMPALA"
) -> None:
    """Raises ValueError when a policy's `model.center_pixels` is not the checkpoint's.

    A vision network's weights trained on 0..255 pixels do not fit -128..127 ones (nor the other
    way round), and nothing else would tell: the shapes are the same.

    Args:
      center_pixels: {policy_id: its `model.center_pixels` in this run}, for the policies to
        check (`impala_tf.driver.specs.CheckpointSpec.center_pixels`).
      stored: The config the checkpoint holds (None when it was trained on an env callable:
        nothing to compare); one written before the key existed was trained without it.
      algorithm: The checkpoint's `"algorithm"`, whose config class parses `stored`
        (checkpoints written before APPO existed name none: IMPALA's).
    """
    if not isinstance(stored, Mapping):
        return
    try:
        saved = config_class(algorithm).from_dict(stored)
    except (TypeError, ValueError):  # Specs stored as text: compare the top-level model only.
        saved = None
    for pid, centered in center_pixels.items():
        now = bool(centered)
        if saved is not None:
            then = bool(policy_config(saved, pid).model.get("center_pixels"))
        else:
            then = bool((stored.get("model") or {}).get("center_pixels"))
        if now != then:
            raise ValueError(
                f"The checkpoint's policy {pid!r} was trained with model.center_pixels={then}, "
                f"and this config has {now}: its conv weights do not fit pixels shifted the "
                f"other way. Set model.center_pixels={then} to continue from it."
            )


def _keyed_weights(snapshot: Mapping[str, Any]) -> dict[str, tuple]:
    """A runner snapshot's weights as {policy_id: (weights, version)} (older ones: a list)."""
    weights = snapshot["weights"]
    if isinstance(weights, Mapping):
        return {pid: (w, int(v)) for pid, (w, v) in weights.items()}
    return {DEFAULT_POLICY_ID: (weights, int(snapshot.get("policy_version", 0)))}
