"""`CircularBuffer`: APPO's learner queue, RLlib's circular buffer of train batches.

It holds the `num_batches` (N) newest train batches. The learner draws from it at random, each
batch at most `iterations_per_batch` (K) times: a draw picks one of the remaining uses of every
batch held, uniformly, so a batch with more uses left is likelier. A put never waits: the
newest batch pushes out the oldest, used or not (a batch is gone after N newer ones). A draw
waits only while no batch has a use left. So the learner trains up to K times on each batch
when sampling is slow, and skips batches when sampling outpaces it, never holding the actors
back (RLlib's APPO: `circular_buffer_num_batches`, `circular_buffer_iterations_per_batch`).

A batch pushed out before any draw is counted, with its env steps, in `stats()`
(`learner_thread_env_steps_dropped`, RLlib's name) and released (`TrainBatch.release`).

It has the queue methods the learner thread and the driver's learner group use (`put`,
`put_nowait`, `get`, `get_nowait`, `qsize`, `drain`, `stats`), as
`impala_tf.data.train_batch.LearnerQueue` has.
"""

from __future__ import annotations

import collections
import queue
import random
import threading
import time
from typing import Any

__all__ = ["CircularBuffer"]


class _Entry:
    __slots__ = ("item", "uses")

    def __init__(self, item: Any, uses: int):
        self.item = item
        self.uses = uses


class CircularBuffer:
    """RLlib's APPO circular buffer (module docstring).

    Args:
      num_batches: N, the batches held.
      iterations_per_batch: K, the draws of each batch at most.
      seed: Seed of the draws (None: from the OS).
    """

    def __init__(self, num_batches: int, iterations_per_batch: int, seed: int | None = None):
        if num_batches < 1 or iterations_per_batch < 1:
            raise ValueError(
                "A circular buffer needs num_batches >= 1 and iterations_per_batch >= 1, got "
                f"{num_batches} and {iterations_per_batch}."
            )
        self.num_batches = int(num_batches)
        self.iterations_per_batch = int(iterations_per_batch)
        self._entries: collections.deque[_Entry] = collections.deque()
        self._uses = 0  # The uses left over all entries.
        self._ready = threading.Condition()
        self._rng = random.Random(seed)
        self.num_added = 0
        self.num_dropped = 0
        self.env_steps_dropped = 0

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        """Adds a train batch (a `TrainBatch`), pushing out the oldest when N are held; never
        waits (`block` and `timeout` are accepted for the queue interface)."""
        del block, timeout
        with self._ready:
            if len(self._entries) == self.num_batches:
                self._drop(self._entries.popleft())
            self._entries.append(_Entry(item, self.iterations_per_batch))
            self._uses += self.iterations_per_batch
            self.num_added += 1
            self._ready.notify()

    def put_nowait(self, item: Any) -> None:
        self.put(item)

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """Draws a batch (one of its uses); waits while none has a use left.

        Raises:
          queue.Empty: nothing to draw after `timeout` seconds (at once without `block`).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._ready:
            while self._uses == 0:
                remaining = None if deadline is None else deadline - time.monotonic()
                if not block or (remaining is not None and remaining <= 0):
                    raise queue.Empty
                self._ready.wait(remaining)
            draw = self._rng.randrange(self._uses)
            for entry in self._entries:
                if draw < entry.uses:
                    entry.uses -= 1
                    self._uses -= 1
                    return entry.item
                draw -= entry.uses
        raise AssertionError("unreachable: the uses left add up to `_uses`")

    def get_nowait(self) -> Any:
        return self.get(block=False)

    def qsize(self) -> int:
        """The batches held that have a use left."""
        with self._ready:
            return sum(1 for entry in self._entries if entry.uses > 0)

    def drain(self) -> int:
        """Empties the buffer (a restore), releasing the batches never drawn; returns how many
        batches had a use left."""
        with self._ready:
            removed = sum(1 for entry in self._entries if entry.uses > 0)
            for entry in self._entries:
                if entry.uses == self.iterations_per_batch:
                    entry.item.release()
            self._entries.clear()
            self._uses = 0
            return removed

    def stats(self) -> dict[str, float]:
        """For the result dict's `info.learner_queue`: batches added, and batches (and their
        env steps) pushed out before any draw."""
        with self._ready:
            return {
                "circular_buffer_num_added": self.num_added,
                "circular_buffer_num_dropped": self.num_dropped,
                "learner_thread_env_steps_dropped": self.env_steps_dropped,
            }

    def _drop(self, entry: _Entry) -> None:
        self._uses -= entry.uses
        if entry.uses == self.iterations_per_batch:  # Never drawn: no loader holds it.
            self.num_dropped += 1
            self.env_steps_dropped += int(entry.item.env_steps)
            entry.item.release()
