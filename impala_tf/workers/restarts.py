"""`RestartPolicy`: the driver's rules for a failed worker, raise or restart it.

Written once for actors and aggregation workers. The policy holds the rules only (restarts
allowed at all, how many over the run, how many failures of one worker in a row); the restarts
so far are the driver's count (`impala_tf.driver.counters.Counters`, e.g.
`num_env_runner_restarts`), which the caller passes in, so a resumed run restores that one count
and nothing here.
"""

from __future__ import annotations

import collections

from impala_tf.workers.protocol import WorkerFailure

__all__ = ["RestartPolicy"]


class RestartPolicy:
    """What to do when a worker fails, written once for actors and aggregation workers.

    A failure raises RuntimeError when a restart cannot help or is not allowed; otherwise the
    worker is restarted (`WorkerGroup.restart_failed`) and the caller counts one restart.

    Args:
      role: "actor" or "aggregation worker" (capitalised in messages).
      enabled: Restarts are allowed at all (the config key `enabled_key`).
      max_restarts: Most restarts over the run (the config key `max_key`); None for no limit.
      max_in_a_row: Failures of one worker with no reply in between before giving up.
      enabled_key: Config key of `enabled`, named in messages.
      max_key: Config key of `max_restarts`, named in messages.
    """

    def __init__(
        self,
        role: str,
        *,
        enabled: bool,
        max_restarts: int | None,
        max_in_a_row: int = 3,
        enabled_key: str = "restart_failed_env_runners",
        max_key: str = "max_num_env_runner_restarts",
    ):
        self.role = role
        self.enabled = bool(enabled)
        self.max_restarts = max_restarts
        self.max_in_a_row = int(max_in_a_row)
        self.enabled_key = enabled_key
        self.max_key = max_key
        self._in_a_row: collections.Counter[int] = collections.Counter()

    def on_failure(self, failure: WorkerFailure, restarts_so_far: int) -> None:
        """Returns if `failure.worker_id` may be restarted, or raises RuntimeError saying why not.

        Args:
          failure: The worker's failure.
          restarts_so_far: The restarts counted so far over the run (a resumed run's included),
            held against `max_restarts`.
        """
        name = f"{self.role[:1].upper()}{self.role[1:]} {failure.worker_id}"
        if failure.fatal:  # E.g. wrong observation shape, NaN data: a restart cannot help.
            raise RuntimeError(f"{name} failed: {failure.error}")
        if not self.enabled:
            raise RuntimeError(f"{name} failed and {self.enabled_key}=False: {failure.error}")
        self._in_a_row[failure.worker_id] += 1
        if self._in_a_row[failure.worker_id] >= self.max_in_a_row:
            raise RuntimeError(
                f"{name} failed {self.max_in_a_row} times in a row without a reply in between; "
                f"giving up. Last error: {failure.error}"
            )
        restarts_so_far = int(restarts_so_far)
        if self.max_restarts is not None and restarts_so_far >= self.max_restarts:
            raise RuntimeError(
                f"{name} failed after {restarts_so_far} restarts "
                f"({self.max_key}={self.max_restarts}): {failure.error}"
            )

    def succeeded(self, worker_id: int) -> None:
        """A reply of `worker_id` arrived: its failures in a row start again from zero."""
        self._in_a_row.pop(worker_id, None)
