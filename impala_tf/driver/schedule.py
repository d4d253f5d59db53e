"""The training step: asynchronous (RLlib's IMPALA) or lockstep (deterministic runs).

`AsyncSchedule.step` is RLlib's old-stack `training_step` (docs/architecture.md, "From an env
step to a weight broadcast"):

1. a dead learner thread raises "The learner thread died while training!";
2. collect the fragments that are ready (asynchronous sampling, at most
   `max_requests_in_flight_per_env_runner` requests outstanding per actor), waiting up to
   `timeout_s_sampler_manager` for a first one (at least `MIN_FETCH_WAIT_S`); failed actors are
   restarted or raise (`impala_tf.driver.sampling`);
3. count `num_env_steps_sampled` / `num_agent_steps_sampled` and the finished episodes;
4. aggregate each fragment: decompress, mix-in replay, cut train batches per trained policy, in
   the driver or in aggregation workers (`impala_tf.driver.aggregation`), whose finished
   batches are collected waiting up to `timeout_s_aggregator_manager` for a first one;
5. put the train batches on the learners' queues: all but the last of each policy without
   blocking (a full queue drops the batch, `num_times_learner_queue_full`), the last waiting;
6. drain the learners' outputs into `num_env_steps_trained` / `num_agent_steps_trained`;
7. broadcast weights to the actors that sampled, every `broadcast_interval` steps with a new
   update (`impala_tf.driver.broadcast`).

`LockstepSchedule.step` samples one fragment, trains on every batch it completes and broadcasts
before the next is requested: actor and learner never overlap, so a seeded run is reproducible
update for update (`Impala(..., deterministic=True)`), and between steps the actor is idle, so
its state can be saved for an exact resume.

The schedule is chosen once, when the algorithm is built (`make_schedule`).
"""

from __future__ import annotations

from impala_tf.driver.aggregation import AggregationStage
from impala_tf.driver.broadcast import Broadcaster
from impala_tf.driver.learners import LearnerGroup
from impala_tf.driver.metrics import Metrics
from impala_tf.driver.plan import RuntimePlan
from impala_tf.driver.sampling import EnvRunnerGroup

__all__ = ["MIN_FETCH_WAIT_S", "AsyncSchedule", "LockstepSchedule", "make_schedule"]

#: The least a training step waits for a first fragment before going on. RLlib's default
#: `timeout_s_sampler_manager` of 0 polls without waiting; a driver loop that never waits spins
#: on its core, which the actors share on a small machine.
MIN_FETCH_WAIT_S = 0.02
#: Lockstep: the wait per try for the fragment it requested (the learners are checked between).
_LOCKSTEP_POLL_S = 0.1


class AsyncSchedule:
    """RLlib's asynchronous training step (see the module docstring).

    Args:
      fetch_wait_s: Seconds a step waits for a first fragment (`timeout_s_sampler_manager`,
        at least `MIN_FETCH_WAIT_S`).
      aggregation_wait_s: Seconds a step waits for a first reply of the aggregation workers
        (`timeout_s_aggregator_manager`).
    """

    def __init__(
        self,
        actors: EnvRunnerGroup,
        aggregation: AggregationStage,
        learners: LearnerGroup,
        broadcaster: Broadcaster,
        metrics: Metrics,
        *,
        fetch_wait_s: float = MIN_FETCH_WAIT_S,
        aggregation_wait_s: float = 0.0,
    ):
        self.actors = actors
        self.aggregation = aggregation
        self.learners = learners
        self.broadcaster = broadcaster
        self.metrics = metrics
        self.fetch_wait_s = max(float(fetch_wait_s), MIN_FETCH_WAIT_S)
        self.aggregation_wait_s = float(aggregation_wait_s)

    def start(self) -> None:
        """Sends the first sample requests."""
        self.actors.top_up()

    def step(self) -> None:
        """One pass of the driver loop."""
        self.learners.check()
        fragments, failures = self.actors.fetch(self.fetch_wait_s)
        self.broadcaster.restarted(self.actors.handle_failures(failures))
        batches = []
        for fragment in fragments:
            self.metrics.record_fragment(fragment)
            batches.extend(self.aggregation.process(fragment))
        batches.extend(self.aggregation.fetch(self.aggregation_wait_s))
        self.actors.top_up()
        if batches:
            self.learners.put(batches, self.metrics.counters)
        for pid, agent_steps, stats in self.learners.drain():
            self.metrics.record_learner_output(pid, agent_steps, stats)
        self.metrics.counters.num_training_step_calls += 1
        self.broadcaster.step(sorted({f.actor_id for f in fragments}))


class LockstepSchedule(AsyncSchedule):
    """Sample one fragment, train on it, broadcast; repeat (see the module docstring).

    Each train batch gives its policy's `num_sgd_iter` updates (the minibatch buffer's passes,
    read from the policy's learner settings).
    """

    def start(self) -> None:
        """Nothing: each step requests its own fragment."""

    def step(self) -> None:
        fragments = []
        while not fragments:
            self.learners.check()
            self.actors.request_idle()
            fragments, failures = self.actors.fetch(_LOCKSTEP_POLL_S)
            self.broadcaster.restarted(self.actors.handle_failures(failures))
        batches = []
        for fragment in fragments:
            self.metrics.record_fragment(fragment)
            batches.extend(self.aggregation.process(fragment))
        counters = self.metrics.counters
        for pid, batch, version in batches:
            self.learners.put_waiting(pid, batch, version)
            counters.num_samples_added_to_queue += batch.env_steps
        # The minibatch buffer serves each batch num_sgd_iter times, one output per update.
        for pid, _, _ in batches:
            for _ in range(self.learners.specs[pid].num_sgd_iter):
                self.metrics.record_learner_output(*self.learners.wait_output(pid))
        counters.num_training_step_calls += 1
        self.broadcaster.step(sorted({f.actor_id for f in fragments}))


def make_schedule(
    plan: RuntimePlan,
    actors: EnvRunnerGroup,
    aggregation: AggregationStage,
    learners: LearnerGroup,
    broadcaster: Broadcaster,
    metrics: Metrics,
    *,
    fetch_wait_s: float = 0.0,
    aggregation_wait_s: float = 0.0,
) -> AsyncSchedule:
    """The schedule of the plan: lockstep for a deterministic run, else asynchronous.

    Args:
      fetch_wait_s: How long an asynchronous step waits for a fragment
        (`timeout_s_sampler_manager`).
      aggregation_wait_s: How long it waits for the aggregation workers' batches
        (`timeout_s_aggregator_manager`).
    """
    parts = (actors, aggregation, learners, broadcaster, metrics)
    if plan.deterministic:
        return LockstepSchedule(*parts)
    return AsyncSchedule(*parts, fetch_wait_s=fetch_wait_s, aggregation_wait_s=aggregation_wait_s)
