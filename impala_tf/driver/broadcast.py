"""`Broadcaster`: when and which weights go to the actors (RLlib's `training_step`, its step 8).

Every `broadcast_interval` training steps in which some trained policy has a new update, the
actors that sampled since their last weights get `{policy_id: (weights, num_grad_updates)}` of
every policy, with the driver's merged observation filters (`num_weight_broadcasts` counts
these). Each policy's weights are read between two of its updates; the driver never waits for a
running update to read them (`LearnerThread.policy_snapshot(wait=False)`): it then sends what
the learner thread published after its previous update, and the thread publishes again when the
running update ends, for the next training step's try. A policy's weights are never older than
the last ones sent: a snapshot older than that is replaced by what was sent (so is one of a
policy with no new update). Lockstep runs read with `wait=True` (no update runs between steps).

Bounded broadcasts (a departure from RLlib, `min_time_s_per_broadcast`): besides
`broadcast_interval` (RLlib's meaning kept: the least training steps, with a new update, between
broadcasts), a broadcast also waits until `min_time_s_per_broadcast` seconds have passed since
the last one. The reasoning: an actor applies at most one weight set per fragment (the worker
host coalesces what arrived meanwhile, `impala_tf.workers.host`), so weights sent more often than
the actors can use are wasted, and each broadcast costs the driver one `ray.put` of every
policy's weights (4 MB for the Pong CNN) and a copy to every node, or on local processes one
write into shared memory that every actor copies out again (`impala_tf.workers.shared_arrays`;
it was a pickle per actor). RLlib broadcasts after every training step with a new update, so on
a fast learner (a GPU doing hundreds of updates per second) its weight traffic grows with the
learner's speed. With the floor, broadcasts are at most 1 / floor per second whatever the
learner does.

The default, "auto", sets the floor from the weights' size: bytes / `AUTO_BYTES_PER_S` (40 MB/s),
so weight traffic out of the driver stays under 40 MB/s per destination node: 0.1 s (10 per
second) for the 4 MB Pong CNN, 7 ms for the 0.27 MB CartPole MLP. A floor costs policy lag (up to
the floor's worth of updates, which V-trace corrects but which slows learning): with a fixed 0.1
s floor CartPole needed a median 1.55M env steps to 450 (one seed of 4 not within 2M), against
1.30M with no floor and 1.21M with "auto" (BENCHMARKS.md, `tools.bench_cartpole --floors`). A
CPU learner updates CartPole about every 12 ms, over the auto floor's 7 ms, and Pong every
200 ms, over its 0.1 s: the auto floor binds only where broadcasts are fast and heavy. 0
restores RLlib's behaviour. Deterministic (lockstep) runs ignore the floor: a clock must not
decide what a seeded run trains on.

Departure from RLlib: RLlib sends to the actors that sampled in this step; an actor that sampled
while no newer weights could be read waits here for the next step's try instead of being
skipped until it samples again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from impala_tf.driver.counters import Counters
from impala_tf.driver.learners import LearnerGroup
from impala_tf.driver.sampling import EnvRunnerGroup

__all__ = ["AUTO_BYTES_PER_S", "Broadcaster", "weight_bytes"]

#: `min_time_s_per_broadcast: auto`: the floor is the weights' bytes over this many bytes/s.
AUTO_BYTES_PER_S = 40e6

Weights = dict[str, tuple[list[np.ndarray], int]]


def weight_bytes(weights: Weights) -> int:
    """Bytes of every policy's weight arrays in `weights`."""
    return sum(int(np.asarray(w).nbytes) for arrays, _ in weights.values() for w in arrays or ())


class Broadcaster:
    """Sends the learners' weights to the actors (see the module docstring).

    Args:
      learners: The learner group (the weights' source).
      actors: The env runner group (the weights' destination, and the filters).
      interval: `broadcast_interval`, the least training steps between broadcasts.
      counters: The driver's counters (`num_weight_broadcasts`).
      wait: Read weights waiting for a running update (lockstep runs).
      min_time_s: `min_time_s_per_broadcast`: the least seconds between broadcasts (0: none),
        or "auto" (the first weights' bytes / `AUTO_BYTES_PER_S`).
      clock: Seconds, monotonic (tests pass their own).
    """

    def __init__(
        self,
        learners: LearnerGroup,
        actors: EnvRunnerGroup,
        interval: int,
        counters: Counters,
        wait: bool = False,
        min_time_s: float | str = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.learners = learners
        self.actors = actors
        self.interval = int(interval)
        self.counters = counters
        self.wait = wait
        self.min_time_s = None if min_time_s == "auto" else float(min_time_s)
        self._clock = clock
        self._last_time = -float("inf")
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

    def restarted(self, actor_ids: Iterable[int]) -> None:
        """Sends the newest weights to restarted actors. What the others were sent is
        unchanged: they still get the next broadcast."""
        actor_ids = sorted(actor_ids)
        if actor_ids:
            self.actors.broadcast(self.latest(), actor_ids)

    def get_state(self) -> dict[str, int]:
        """Plain data: the training steps since the last broadcast."""
        return {"steps_since_broadcast": self.steps_since_broadcast}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Restores `get_state()`."""
        self.steps_since_broadcast = int(state.get("steps_since_broadcast", 0))

    def resume(self, held: Mapping[int, Weights | None]) -> None:
        """After a restore: `held` is {actor id: the weights its restored snapshot holds, or
        None}. Actors without weights get the learners' (restored) ones; when every actor
        holds its own, broadcasts go on from those."""
        weights = self.learners.weights()
        self.send([i for i, w in held.items() if w is None], weights)
        kept = [w for w in held.values() if w is not None]
        if kept and len(kept) == len(held):
            self.sent = {**weights, **kept[0]}

    def step(self, sampled: Iterable[int]) -> bool:
        """One training step's broadcast decision; True when weights were sent."""
        self.steps_since_broadcast += 1
        self._awaiting.update(sampled)
        if not self._awaiting or self.steps_since_broadcast < self.interval:
            return False
        if self.min_time_s is None:  # "auto", from the weights sent at the start.
            self.min_time_s = weight_bytes(self.sent) / AUTO_BYTES_PER_S
        if self.min_time_s > 0 and self._clock() - self._last_time < self.min_time_s:
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
        self._last_time = self._clock()
        self.counters.num_weight_broadcasts += 1
        return True
