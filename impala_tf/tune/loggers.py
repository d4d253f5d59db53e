"""Ray Tune's own tracker callbacks, as `impala-train`'s searches use them.

`WandbLoggerCallback` is Ray's (`ray.air.integrations.wandb`) with one change. When a search is
interrupted (Ctrl-C or SIGTERM: Tune saves the experiment and stops), Tune marks its running
trials TERMINATED without ending their logging, and Ray's callback then waited its whole
`upload_timeout` (30 minutes by default) for W&B runs that were never told to finish: the
process did not exit. Here every run still logging is told to finish when the search ends (its
results so far are written, offline or uploaded), and the process exits once W&B has them.
"""

from __future__ import annotations

from ray.air.integrations.wandb import WandbLoggerCallback as _RayWandbLoggerCallback

__all__ = ["WandbLoggerCallback"]


class WandbLoggerCallback(_RayWandbLoggerCallback):
    """Ray Tune's W&B callback; the runs of interrupted trials end with the search."""

    def on_experiment_end(self, trials, **info):
        # Runs whose logging actor has not returned: an END item makes it call `wandb.finish`
        # (one that already got its END ignores a second).
        for trial in list(self._trial_logging_futures):
            self._signal_logging_actor_stop(trial=trial)
        super().on_experiment_end(trials, **info)
