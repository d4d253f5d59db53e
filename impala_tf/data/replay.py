"""Mix-in experience replay: each new batch is returned at once, plus some random old ones.

Batches are `SampleBatch`es of any layout ([B, T, ...] sequences in this library); the buffer
stores and returns whole batches and never looks inside them.

This is RLlib's `MixInMultiAgentReplayBuffer` in LOCKSTEP mode (one buffer for all policies):

* `add(batch)` stores a copy in a ring of `capacity` slots (the oldest is overwritten) and
  remembers it as new;
* `replay()` returns every batch added since the previous `replay()`, followed by randomly chosen
  stored batches: `replay_ratio / (1 - replay_ratio)` of them per new batch on average (exactly
  with one `add` per `replay`, as IMPALA's driver does). A `replay_ratio` of 0 disables mixing;
  1 returns one random stored batch and nothing new.

Config mapping, and where we differ from RLlib. IMPALA's config key `replay_proportion` = p
documents "replayed with a p:1 proportion to new data", i.e. p old batches per new batch, which is
the buffer's `replay_ratio = p / (1 + p)`. RLlib's IMPALA instead passes `replay_ratio = 1 / p`,
so p = 1 gives a ratio of 1 (replay only, new data never reaches the learner directly) and p = 2
gives 0.5 (one old batch per new one, not two). We use `replay_ratio_from_proportion(p)` =
p / (1 + p), which gives the documented meaning; an RLlib YAML with `replay_proportion` therefore
replays as its comment says, not as RLlib did.
"""

from __future__ import annotations

import math
import random
from typing import Any

from impala_tf.data.sample_batch import SampleBatch, concat_samples, decompress

__all__ = ["MixInReplayBuffer", "replay_ratio_from_proportion"]


def replay_ratio_from_proportion(replay_proportion: float) -> float:
    """Maps the config's `replay_proportion` p (old batches per new one) to a replay ratio.

    Args:
        replay_proportion: p >= 0; 0 disables replay, `math.inf` means replay only.

    Returns:
        p / (1 + p), the fraction of returned batches that are replayed, in [0, 1].

    Raises:
        ValueError: p is negative or NaN.
    """
    p = float(replay_proportion)
    if math.isnan(p) or p < 0:
        raise ValueError(f"replay_proportion must be >= 0, got {replay_proportion}")
    if math.isinf(p):
        return 1.0
    return p / (1.0 + p)


class MixInReplayBuffer:
    """Ring of stored batches that mixes random old batches into the stream of new ones.

    Not thread-safe: one caller (the driver or an aggregation worker) adds and replays.
    """

    def __init__(self, capacity: int, replay_ratio: float, seed: int | None = None):
        """Creates an empty buffer.

        Args:
            capacity: number of batches kept for replay; 0 means 1 (IMPALA's
                `replay_buffer_num_slots` default).
            replay_ratio: fraction of returned batches that are replayed, in [0, 1]; 0.5 means
                one old batch per new batch, 0.9 nine per new batch.
            seed: seed of the buffer's own random generator (None: from the OS).

        Raises:
            ValueError: `capacity` < 0 or `replay_ratio` outside [0, 1]; the message names it.
        """
        if isinstance(capacity, bool) or int(capacity) != capacity or capacity < 0:
            raise ValueError(f"capacity must be an integer >= 0, got {capacity!r}")
        ratio = float(replay_ratio)
        if not 0.0 <= ratio <= 1.0:  # Also rejects NaN.
            raise ValueError(f"replay_ratio must be in [0, 1], got {replay_ratio!r}")
        self.capacity = max(int(capacity), 1)
        self.replay_ratio = ratio
        # Old batches per new batch; unused at ratio 1, where there is no new data to mix with.
        self._proportion = ratio / (1.0 - ratio) if ratio < 1.0 else math.inf
        self._rng = random.Random(seed)
        self._slots: list[SampleBatch] = []
        self._next_slot = 0
        self._new: list[SampleBatch] = []
        self._added_count = 0
        self._replayed_count = 0

    def __len__(self) -> int:
        return len(self._slots)

    def add(self, batch: SampleBatch) -> None:
        """Stores a copy of `batch` and marks it as new for the next `replay()`.

        Compressed batches are decompressed first. The copy means later changes to `batch`
        (or to arrays it shares with a transport buffer) never reach the stored data.

        Args:
            batch: a SampleBatch.
        """
        stored = decompress(batch).copy()
        if len(self._slots) < self.capacity:
            self._slots.append(stored)
        else:
            self._slots[self._next_slot] = stored
            self._next_slot = (self._next_slot + 1) % self.capacity
        self._new.append(stored)
        self._added_count += 1

    def replay(self) -> SampleBatch | None:
        """Returns the batches added since the last call mixed with random stored ones.

        Returns:
            None if nothing was ever added, or if nothing was added since the last call and
            `replay_ratio` < 1. Otherwise a new SampleBatch (sharing no memory with the buffer):
            the new batches in the order they were added, followed by the replayed ones. At
            ratio 1 it is one random stored batch only.
        """
        if not self._slots or (not self._new and self.replay_ratio < 1.0):
            return None
        output, self._new = self._new, []
        if self.replay_ratio == 0.0:
            return concat_samples(output)
        if self.replay_ratio == 1.0:
            self._replayed_count += 1
            return concat_samples([self._rng.choice(self._slots)])
        # RLlib's rule, kept as is: draw while random() < n * proportion, lowering proportion by
        # one per draw. With n = 1 new batch the number drawn is floor(proportion) plus one more
        # with probability frac(proportion), mean exactly `proportion`. With n > 1 the threshold
        # falls in steps of n, so the mean is only close to n * proportion when proportion <= 1.
        num_new = len(output)
        proportion = self._proportion
        while self._rng.random() < num_new * proportion:
            proportion -= 1.0
            output.append(self._rng.choice(self._slots))
            self._replayed_count += 1
        return concat_samples(output)

    def stats(self) -> dict[str, int]:
        """Returns counters: `added_count` and `replayed_count` (batches), `num_entries`."""
        return {
            "added_count": self._added_count,
            "replayed_count": self._replayed_count,
            "num_entries": len(self._slots),
        }

    def get_state(self) -> dict[str, Any]:
        """The buffer as plain data (dicts of numpy columns, the generator's state), for a
        checkpoint; `set_state` restores it."""
        return {
            "slots": [dict(b) for b in self._slots],
            "next_slot": self._next_slot,
            "new": [dict(b) for b in self._new],
            "rng": self._rng.getstate(),
            "added_count": self._added_count,
            "replayed_count": self._replayed_count,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores `get_state()` (slots beyond `capacity` are dropped)."""
        self._slots = [SampleBatch(b) for b in state["slots"]][: self.capacity]
        self._next_slot = int(state["next_slot"]) % self.capacity
        self._new = [SampleBatch(b) for b in state["new"]]
        rng = state["rng"]
        self._rng.setstate((rng[0], tuple(rng[1]), rng[2]))
        self._added_count = int(state["added_count"])
        self._replayed_count = int(state["replayed_count"])
