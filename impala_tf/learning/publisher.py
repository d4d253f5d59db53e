"""`PolicyPublisher`: the learner's version and weights, as the driver reads them from its thread.

`version` is the learner's `num_grad_updates` as a host int, which the learner thread sets from
each update's stats (`impala_tf.learning.reports.UpdateReports.read`), so the driver
(`LearnerGroup.versions()`, read every training step) never reads a device value; after `forget`
(a flush, before a restore loads the counter) the next use reads the variable once.

`snapshot` reads the policy weights with their `num_grad_updates` between two updates, holding
the thread's update lock; every weight read for actors, evaluation and checkpoints comes from
here or holds that lock, so all variables come from the same update. A driver that must not
wait (its broadcasts, which would otherwise wait most of an update each time) gets, while an
update runs, the weights published after the latest update, and asks for them again: the
thread calls `publish_if_wanted` under the lock after each update it queues.
"""

from __future__ import annotations

import threading

import numpy as np

from impala_tf.learning.learner import ImpalaLearner

__all__ = ["PolicyPublisher"]


class PolicyPublisher:
    """The learner's host-side version and its published weights (module docstring).

    Args:
      learner: The learner.
      lock: The learner thread's update lock, held during each update.
    """

    def __init__(self, learner: ImpalaLearner, lock: threading.RLock):
        self.learner = learner
        self.lock = lock
        # None: read the variable at the next use (after `forget`).
        self._version_lock = threading.Lock()
        self._version: int | None = int(learner.num_grad_updates.numpy())
        # Weights published after an update for a driver that would not wait.
        self._wanted = False
        self._published: tuple[list[np.ndarray], int] | None = None

    @property
    def version(self) -> int:
        """`num_grad_updates` after the latest update read, a host int (reads no device value,
        except once after `forget`)."""
        with self._version_lock:
            if self._version is None:
                self._version = int(self.learner.num_grad_updates.numpy())
            return self._version

    def set_version(self, version: int | None) -> None:
        """Sets `version` (the learner thread, from an update's stats)."""
        with self._version_lock:
            self._version = version

    def snapshot(self, wait: bool) -> tuple[list[np.ndarray], int] | None:
        """The policy weights and their `num_grad_updates`, read between two updates.

        Args:
          wait: True: waits for a running update to end, then reads. False: never waits:
            reads now when no update is running; else returns what was published after the
            latest update (None before the first) and asks for a publication when the running
            update ends.

        Returns:
          `(weights, num_grad_updates)`, or None (only with `wait=False`).
        """
        if not self.lock.acquire(blocking=wait):
            self._wanted = True
            return self._published
        try:
            return self._read()
        finally:
            self.lock.release()

    def _read(self) -> tuple[list[np.ndarray], int]:
        # The counter is read with the weights (not `version`, which may not count a queued
        # update yet): both come after every update queued so far.
        weights = self.learner.get_policy_weights()
        return weights, int(self.learner.num_grad_updates.numpy())

    def publish_if_wanted(self) -> None:
        """After an update, under the lock: publishes the weights if the driver asked."""
        if self._wanted:
            self._wanted = False
            self._published = self._read()

    def forget(self) -> None:
        """Under the lock, before a restore: drops the published weights (weights from before
        a restore must not be broadcast after it) and `version` (the restore loads the counter
        next: it is read at the next use)."""
        self._published = None
        self.set_version(None)
