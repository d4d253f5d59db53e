"""`Broadcaster`: when and which weights go to the actors (SEMANTICS.md section 3, step 8).

Every `broadcast_interval` training steps in which some trained policy has a new update, the
actors that sampled since their last weights get `{policy_id: (weights, num_grad_updates)}` of
every policy, with the driver's merged observation filters (`num_weight_broadcasts` counts
these). Each policy's weights are read between two of its updates; the driver never waits for a
running update to read them (`LearnerThread.policy_snapshot(wait=False)`): it then sends what
the learner thread published after its previous update, and the thread publishes again when the
running update ends, for the next training step's try. A policy's weights are never older than
the last ones sent: a snapshot older than that is replaced by what was sent (so is one of a
policy with no new update). Lockstep runs read with `wait=True` (no update runs between steps).

Departure from RLlib: RLlib sends to the actors that sampled in this step; an actor that sampled
while no newer weights could be read waits here for the next step's try instead of being
skipped until it samples again.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

import numpy as np

from impala_tf.driver.learners import LearnerGroup
from impala_tf.driver.sampling import EnvRunnerGroup

__all__ = ["Broadcaster"]

Weights = dict[str, tuple[list[np.ndarray], int]]


class Broadcaster:
    """Sends the learners' weights to the actors (see the module docstring).

    Args:
      learners: The learner group (the weights' source).
      actors: The env runner group (the weights' destination, and the filters).
      interval: `broadcast_interval`, the least training steps between broadcasts.
      counters: The driver's counters (`num_weight_broadcasts`).
      wait: Read weights waiting for a running update (lockstep runs).
    """

    def __init__(
        self,
        learners: LearnerGroup,
        actors: EnvRunnerGroup,
        interval: int,
        counters: collections.Counter,
        wait: bool = False,
    ):
        self.learners = learners
        self.actors = actors
        self.interval = int(interval)
        self.counters = counters
        self.wait = wait
        self.steps_since_broadcast = 0
        self._awaiting: set[int] = set()  # Sampled since their last weights.
        self.sent: Weights = {}

    def send(self, actor_ids: Iterable[int], weights: Weights | None = None) -> Weights:
        """Sends `weights` (default: every policy's, read now) to `actor_ids`, not counted as a
        broadcast (start, restarts, restores); returns what was sent."""
        weights = self.learners.weights() if weights is None else weights
        self.actors.broadcast(weights, sorted(actor_ids))
        self.sent = dict(weights)
        return weights

    def latest(self) -> Weights:
        """Every policy's newest weights, read between updates (evaluation, restarts)."""
        return self.learners.weights()

    def step(self, sampled: Iterable[int]) -> bool:
        """One training step's broadcast decision; True when weights were sent."""
        self.steps_since_broadcast += 1
        self._awaiting.update(sampled)
        if not self._awaiting or self.steps_since_broadcast < self.interval:
            return False
        versions = self.learners.versions()
        changed = [p for p in self.learners.trained if versions[p] != self.sent[p][1]]
        if not changed:
            return False
        weights = dict(self.sent)
        newer = False
        for pid in changed:
            snapshot = self.learners.snapshot(pid, wait=self.wait)
            if snapshot is not None and snapshot[1] > self.sent[pid][1]:
                weights[pid] = snapshot
                newer = True
        if not newer:  # Nothing newer than sent could be read without waiting.
            return False
        healthy = set(self.actors.healthy_ids())
        self.actors.broadcast(weights, sorted(self._awaiting & healthy))
        self.sent = weights
        self._awaiting.clear()
        self.steps_since_broadcast = 0
        self.counters["num_weight_broadcasts"] += 1
        return True
