"""Keras callbacks for IMPALA training: results, progress, checkpoints, stopping.

Keras callbacks are called from two places:

* the learner thread (`Impala(config, callbacks=[...])`): `on_train_begin` / `on_train_end`
  once, and `on_train_batch_begin` / `on_train_batch_end` around each update, with the learner
  stats (`policy_loss`, `vf_loss`, `entropy`, `total_loss`, `cur_lr`, ...) as logs;
* the driver loop, `impala_tf.training.loop.fit(algorithm, callbacks=[...])` (which `impala-train`
  runs): one training iteration is one epoch. `on_train_begin`, then per iteration
  `on_epoch_begin(epoch)` and `on_epoch_end(epoch, logs)` with `epoch = training_iteration - 1`
  (zero-based, as in Keras), then `on_train_end`. `logs` is an `IterationLogs`: the result dict
  flattened to numbers under slash/separated RLlib keys (`"episode_reward_mean"`,
  `"evaluation/episode_reward_mean"`, `"info/learner/default_policy/learner_stats/vf_loss"`), as
  Keras' own callbacks expect, with the full nested result at `logs.result`. A callback that sets
  `self.model.stop_training = True` (the model is the `ImpalaLearner`) ends training after the
  iteration, so `keras.callbacks.EarlyStopping(monitor="episode_reward_mean", mode="max")` works.

The callbacks here are driver-loop callbacks (`AlgorithmCallback`s: `fit` hands them the
algorithm): `ResultLogger` (result.json and TensorBoard), `ProgressLogger` (the console line),
`StopOnCriteria` with `StopAtReward`, `StopAtTimesteps` and `StopAfterTime`, `PeriodicCheckpoint`
(every N iterations, keeping the last K) and `BestCheckpoint` (whenever a metric improves).
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import keras

from impala_tf import checkpoints
from impala_tf.training.reporting import ResultWriter, flatten, lookup, progress_line, stop_reached

if TYPE_CHECKING:
    from impala_tf.driver.algorithm import Impala

__all__ = [
    "AlgorithmCallback",
    "BestCheckpoint",
    "IterationLogs",
    "PeriodicCheckpoint",
    "ProgressLogger",
    "ResultLogger",
    "StopAfterTime",
    "StopAtReward",
    "StopAtTimesteps",
    "StopOnCriteria",
    "load_callbacks",
    "result_of",
]

logger = logging.getLogger(__name__)


class IterationLogs(dict):
    """The `logs` of `on_epoch_end`: a flat {slash/key: float} dict plus the nested result.

    Attributes:
      result: The `train()` result dict it was made from.
    """

    def __init__(self, result: Mapping[str, Any]):
        super().__init__(flatten(result))
        self.result = result


def result_of(logs: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """The nested result behind `logs` (`logs` itself when it is a plain dict)."""
    return getattr(logs, "result", None) or logs or {}


def _value(logs: Mapping[str, Any] | None, key: str) -> float | None:
    """The finite number at `key` (slash/separated) of the iteration's result, or None."""
    value = lookup(result_of(logs), key)
    if value is None and logs is not None:
        value = logs.get(key)
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def load_callbacks(specs: Iterable[str]) -> list[keras.callbacks.Callback]:
    """Imports callbacks by `module.path:factory` (what `impala-train --callbacks` takes).

    Args:
      specs: Each names a `keras.callbacks.Callback`, or a callable (e.g. a class) that takes
        no arguments and returns one or a list of them; `factory` may be dotted (`Cls.make`).

    Returns:
      The callbacks, in order.

    Raises:
      ValueError: naming the spec, if it is malformed, cannot be imported, or makes something
        other than callbacks.
    """
    out: list[keras.callbacks.Callback] = []
    for spec in specs:
        module_name, sep, attr = spec.partition(":")
        if not sep or not module_name or not attr:
            raise ValueError(f"a callback is given as module.path:factory, got {spec!r}")
        try:
            target: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                target = getattr(target, part)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"cannot import callback {spec!r}: {e}") from e
        if isinstance(target, keras.callbacks.Callback):
            made = target
        elif callable(target):
            made = target()
        else:
            raise ValueError(f"{spec!r} is a {type(target).__name__}: not a callback or factory")
        made = list(made) if isinstance(made, (list, tuple)) else [made]
        for callback in made:
            if not isinstance(callback, keras.callbacks.Callback):
                raise ValueError(
                    f"{spec!r} made {type(callback).__name__!r}, not a keras.callbacks.Callback"
                )
        out.extend(made)
    return out


class AlgorithmCallback(keras.callbacks.Callback):
    """A driver-loop callback that may use the algorithm (`self.algorithm`, set by `fit`)."""

    def __init__(self):
        super().__init__()
        self.algorithm: Impala | None = None

    def set_algorithm(self, algorithm: Impala) -> None:
        self.algorithm = algorithm

    def _require_algorithm(self) -> Impala:
        if self.algorithm is None:
            raise RuntimeError(
                f"{type(self).__name__} needs the algorithm: run it through "
                "impala_tf.training.loop.fit(algorithm, callbacks=[...]) or call set_algorithm "
                "first."
            )
        return self.algorithm


# Results ----------------------------------------------------------------------------------------


class ResultLogger(AlgorithmCallback):
    """Writes each iteration's result to `<logdir>/result.json` and TensorBoard.

    See `impala_tf.training.reporting` for the TensorBoard tags (stepped by `timesteps_total`).

    Args:
      logdir: The run's directory.
      tensorboard: Write TensorBoard event files.
      raw: Also write every result key under `raw/`.
      histogram_freq: Every this many iterations, histograms of the models' weights under
        `weights/` (0: never).
    """

    def __init__(
        self, logdir: str, tensorboard: bool = True, raw: bool = True, histogram_freq: int = 0
    ):
        super().__init__()
        self.logdir = logdir
        self.tensorboard = tensorboard
        self.raw = raw
        self.histogram_freq = int(histogram_freq)
        self.writer: ResultWriter | None = None

    def on_train_begin(self, logs=None):
        if self.writer is None:
            self.writer = ResultWriter(self.logdir, tensorboard=self.tensorboard, raw=self.raw)

    def on_epoch_end(self, epoch, logs=None):
        self.on_train_begin()
        result = result_of(logs)
        self.writer.write(result)
        iteration = int(result.get("training_iteration", epoch + 1))
        if self.histogram_freq and iteration % self.histogram_freq == 0:
            learners = self._require_algorithm().learners
            several = len(learners.learners) > 1
            with learners.locked():  # Each policy's weights from one update.
                values = [
                    (f"{pid}/{v.path}" if several else v.path, v.numpy())
                    for pid, learner in learners.learners.items()
                    for v in learner.model.weights
                ]
            self.writer.write_histograms(ResultWriter.step_of(result), values)

    def on_train_end(self, logs=None):
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class ProgressLogger(AlgorithmCallback):
    """Prints one line per iteration (`impala_tf.training.reporting.progress_line`).

    Args:
      timestep_budget: The `timesteps_total` stop criterion, for the ETA.
      verbose: Also print the full result dict as indented JSON.
      print_fn: Where lines go (default: `print`, flushed).
    """

    def __init__(
        self,
        timestep_budget: float | None = None,
        verbose: bool = False,
        print_fn: Callable[[str], Any] | None = None,
    ):
        super().__init__()
        self.timestep_budget = timestep_budget
        self.verbose = verbose
        self.print_fn = print_fn or functools.partial(print, flush=True)

    def on_epoch_end(self, epoch, logs=None):
        result = result_of(logs)
        self.print_fn(progress_line(result, self.timestep_budget))
        if self.verbose:
            self.print_fn(json.dumps(result, indent=2, default=str))


# Stopping ---------------------------------------------------------------------------------------


class StopOnCriteria(AlgorithmCallback):
    """Stops training when any criterion is met: `result[key] >= threshold` (Tune's rule).

    Args:
      stop: {result key: threshold}; keys are slash/separated paths into the result dict, e.g.
        `episode_reward_mean`, `timesteps_total`, `time_total_s`, `training_iteration`,
        `evaluation/episode_reward_mean`. A missing or NaN value never stops.

    Attributes:
      reason: `"key=value >= threshold"` for the criterion that stopped training, else None.
    """

    def __init__(self, stop: Mapping[str, float]):
        super().__init__()
        self.stop = dict(stop)
        self.reason: str | None = None

    def on_train_begin(self, logs=None):
        self.reason = None

    def reached(self, logs: Mapping[str, Any] | None) -> str | None:
        """The first criterion the result behind `logs` meets, as a readable string, or None."""
        return stop_reached(result_of(logs), self.stop)

    def on_epoch_end(self, epoch, logs=None):
        reason = self.reached(logs)
        if reason:
            self.reason = reason
            self.model.stop_training = True


class StopAtReward(StopOnCriteria):
    """Stops when `metric` (default: the smoothed training return) reaches `reward`."""

    def __init__(self, reward: float, metric: str = "episode_reward_mean"):
        super().__init__({metric: reward})


class StopAtTimesteps(StopOnCriteria):
    """Stops once `timesteps_total` (env steps sampled) reaches `timesteps`."""

    def __init__(self, timesteps: int):
        super().__init__({"timesteps_total": timesteps})


class StopAfterTime(StopOnCriteria):
    """Stops once `time_total_s` (training time, summed over resumed runs) reaches `seconds`."""

    def __init__(self, seconds: float):
        super().__init__({"time_total_s": seconds})


# Checkpoints ------------------------------------------------------------------------------------


class PeriodicCheckpoint(AlgorithmCallback):
    """Saves a checkpoint every `every_n_iterations` iterations, keeping the newest `keep`.

    Checkpoints go to `<directory>/checkpoint_<iteration>` (`checkpoints.checkpoint_path`); older
    ones beyond `keep` are deleted after each save (`checkpoints.prune_checkpoints`).

    Args:
      directory: Where the numbered checkpoints go, normally `<logdir>/checkpoints`.
      every_n_iterations: Save when `training_iteration` is a multiple of it (0: only at the end).
      keep: How many to keep (`keep_checkpoints_num`); None keeps all.
      save_at_end: Also save when training ends, unless that iteration was just saved.

    Attributes:
      last_checkpoint: The directory written last, or None.
    """

    def __init__(
        self,
        directory: str,
        every_n_iterations: int = 1,
        keep: int | None = None,
        save_at_end: bool = True,
    ):
        super().__init__()
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be >= 1 or None, got {keep}")
        self.directory = directory
        self.every_n_iterations = int(every_n_iterations or 0)
        self.keep = keep
        self.save_at_end = save_at_end
        self.last_checkpoint: str | None = None
        self._last_iteration: int | None = None

    def save_now(self) -> str:
        """Saves the algorithm's current state now (and prunes); returns the directory."""
        algorithm = self._require_algorithm()
        iteration = algorithm.iteration
        path = algorithm.save(checkpoints.checkpoint_path(self.directory, iteration))
        checkpoints.prune_checkpoints(self.directory, self.keep, protect=path)
        self.last_checkpoint, self._last_iteration = path, iteration
        return path

    def on_epoch_end(self, epoch, logs=None):
        iteration = int(result_of(logs).get("training_iteration", epoch + 1))
        if self.every_n_iterations and iteration % self.every_n_iterations == 0:
            self.save_now()

    def on_train_end(self, logs=None):
        if self.save_at_end and self._last_iteration != self._require_algorithm().iteration:
            self.save_now()


class BestCheckpoint(AlgorithmCallback):
    """Keeps the checkpoint of the iteration with the best value of a metric.

    Whenever `monitor` improves on the best value so far, the algorithm is saved to `directory`
    (replaced atomically) and `<directory>.json` records `{"monitor", "value", "iteration"}`.
    That record is read back at `on_train_begin`, so a resumed run only replaces the best
    checkpoint with a better one.

    Args:
      directory: The best checkpoint's directory, e.g. `<logdir>/best`.
      monitor: A slash/separated result key, e.g. `episode_reward_mean` or
        `evaluation/episode_reward_mean` (iterations without it are skipped).
      mode: `"max"` or `"min"`.
      min_delta: An improvement must exceed the best by more than this.

    Attributes:
      best: The best value so far (None before the first).
      best_iteration: Its `training_iteration`.
    """

    def __init__(
        self,
        directory: str,
        monitor: str = "episode_reward_mean",
        mode: str = "max",
        min_delta: float = 0.0,
    ):
        super().__init__()
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
        self.directory = directory
        self.monitor = monitor
        self.mode = mode
        self.min_delta = float(min_delta)
        self.best: float | None = None
        self.best_iteration: int | None = None

    @property
    def record_path(self) -> str:
        return self.directory.rstrip(os.sep) + ".json"

    def _improves(self, value: float) -> bool:
        if self.best is None:
            return True
        if self.mode == "max":
            return value > self.best + self.min_delta
        return value < self.best - self.min_delta

    def on_train_begin(self, logs=None):
        if self.best is not None or not os.path.isfile(self.record_path):
            return
        with open(self.record_path, encoding="utf-8") as f:
            record = json.load(f)
        if record.get("monitor") == self.monitor and record.get("mode", "max") == self.mode:
            self.best, self.best_iteration = float(record["value"]), record.get("iteration")

    def on_epoch_end(self, epoch, logs=None):
        value = _value(logs, self.monitor)
        if value is None or not self._improves(value):
            return
        algorithm = self._require_algorithm()
        algorithm.save(self.directory)
        self.best, self.best_iteration = value, algorithm.iteration
        record = {
            "monitor": self.monitor,
            "mode": self.mode,
            "value": value,
            "iteration": algorithm.iteration,
        }
        tmp = self.record_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.replace(tmp, self.record_path)
        logger.info("New best %s=%g at iteration %d", self.monitor, value, algorithm.iteration)
