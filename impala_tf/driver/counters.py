"""`Counters`: the driver's lifetime counters, RLlib's names, as typed fields.

One `Counters` object is shared by the driver's collaborators, each of which counts its own
events by attribute (`counters.num_weight_broadcasts += 1`), so a reader or a tool can go from a
counter to every place that writes it. `driver.metrics.Metrics` puts them in the result dict
(top level, `counters` and `info`) and in checkpoints (`as_dict`, `load`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

__all__ = ["COUNTERS", "Counters"]


@dataclasses.dataclass
class Counters:
    """The driver's lifetime counters (RLlib's names; ours are marked).

    Attributes:
      num_env_steps_sampled: Env steps the actors sampled.
      num_env_steps_trained: Env steps trained (agent steps scaled to env steps).
      num_agent_steps_sampled: Agent steps sampled.
      num_agent_steps_trained: Agent steps trained.
      num_samples_added_to_queue: Env steps put on the learner queues.
      num_times_learner_queue_full: Train batches dropped at a full learner queue.
      num_weight_broadcasts: Weight broadcasts to the actors.
      num_training_step_calls: Training steps.
      num_env_runner_failures: Actor failures seen.
      num_env_runner_restarts: Actors restarted.
      num_nonfinite_episodes_dropped: Ours: episodes dropped for a non-finite value.
      num_times_no_aggregation_worker_available: Fragments kept back with every aggregation
        worker busy.
      num_aggregation_worker_restarts: Ours: aggregation workers restarted.
      num_env_steps_lost_in_aggregation: Ours: env steps lost with a dead aggregation worker.
      num_nonfinite_updates_skipped: Ours: learner updates skipped as non-finite.
    """

    num_env_steps_sampled: int = 0
    num_env_steps_trained: int = 0
    num_agent_steps_sampled: int = 0
    num_agent_steps_trained: int = 0
    num_samples_added_to_queue: int = 0
    num_times_learner_queue_full: int = 0
    num_weight_broadcasts: int = 0
    num_training_step_calls: int = 0
    num_env_runner_failures: int = 0
    num_env_runner_restarts: int = 0
    num_nonfinite_episodes_dropped: int = 0
    num_times_no_aggregation_worker_available: int = 0
    num_aggregation_worker_restarts: int = 0
    num_env_steps_lost_in_aggregation: int = 0
    num_nonfinite_updates_skipped: int = 0

    def as_dict(self) -> dict[str, int]:
        """Every counter by name, as ints (the result dict's and the checkpoints')."""
        return {name: int(getattr(self, name)) for name in COUNTERS}

    def load(self, values: Mapping[str, int]) -> None:
        """Sets every counter from `values` in place (the collaborators hold this object); a
        counter `values` lacks (a checkpoint written before it existed) is 0."""
        for name in COUNTERS:
            setattr(self, name, int(values.get(name, 0)))

    def copy(self) -> Counters:
        return dataclasses.replace(self)


#: The counters' names, in the result dict's order.
COUNTERS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Counters))
