"""Tests of impala_tf.training.callbacks and impala_tf.training.loop.fit, driven by a scripted fake
algorithm.

The fake has the parts of `Impala` the loop and the callbacks use (`train`, `save`, `iteration`,
`learner`, and `learners` with `learners` and `locked()` for the weight histograms), with the
real signatures, so each test runs in milliseconds; tests/train_binary_test.py runs them for real.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading

import keras
import pytest

from impala_tf import checkpoints
from impala_tf.training.callbacks import (
    BestCheckpoint,
    IterationLogs,
    PeriodicCheckpoint,
    ProgressLogger,
    ResultLogger,
    StopAfterTime,
    StopAtReward,
    StopAtTimesteps,
    StopOnCriteria,
    load_callbacks,
)
from impala_tf.training.loop import fit


class _Learners:
    """`LearnerGroup`'s weight-reading part: `learners` ({policy_id: learner}) and `locked()`."""

    def __init__(self, learner):
        self.learners = {"default_policy": learner}
        self._lock = threading.RLock()
        self.times_locked = 0

    @contextlib.contextmanager
    def locked(self):
        with self._lock:
            self.times_locked += 1
            yield


class FakeAlgorithm:
    """Returns scripted rewards, 100 env steps and 2 s per iteration; `save` writes a stub."""

    def __init__(self, rewards, start_iteration=0, evaluation_rewards=None):
        self.rewards = list(rewards)
        self.evaluation_rewards = evaluation_rewards
        self._iteration = start_iteration
        self.learner = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        self.learner.model = self.learner  # `ResultLogger` histograms read learner.model.
        self.learners = _Learners(self.learner)
        self.saves = []

    @property
    def iteration(self):
        return self._iteration

    def train(self):
        reward = self.rewards[self._iteration % len(self.rewards)]
        self._iteration += 1
        result = {
            "training_iteration": self._iteration,
            "timesteps_total": 100 * self._iteration,
            "time_total_s": 2.0 * self._iteration,
            "episode_reward_mean": reward,
            "info": {"learner": {"default_policy": {"learner_stats": {"vf_loss": 1.0}}}},
            "date": "today",
        }
        if self.evaluation_rewards is not None:
            result["evaluation"] = {
                "episode_reward_mean": self.evaluation_rewards[self._iteration - 1]
            }
        return result

    def save(self, checkpoint_dir):
        os.makedirs(checkpoint_dir, exist_ok=True)
        with open(os.path.join(checkpoint_dir, checkpoints.DRIVER_STATE_FILE), "w") as f:
            json.dump({"iteration": self._iteration}, f)
        self.saves.append((os.path.basename(checkpoint_dir), self._iteration))
        return checkpoint_dir


class Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.calls = []

    def on_train_begin(self, logs=None):
        self.calls.append(("train_begin",))

    def on_epoch_begin(self, epoch, logs=None):
        self.calls.append(("epoch_begin", epoch))

    def on_epoch_end(self, epoch, logs=None):
        self.calls.append(("epoch_end", epoch, logs))

    def on_train_end(self, logs=None):
        self.calls.append(("train_end",))


def test_fit_calls_keras_hooks_with_one_epoch_per_iteration():
    algo = FakeAlgorithm([1.0, 2.0, 3.0])
    recorder = Recorder()
    last = fit(algo, [recorder], max_iterations=3)
    assert last["training_iteration"] == 3
    assert [c[:2] for c in recorder.calls] == [
        ("train_begin",),
        ("epoch_begin", 0),
        ("epoch_end", 0),
        ("epoch_begin", 1),
        ("epoch_end", 1),
        ("epoch_begin", 2),
        ("epoch_end", 2),
        ("train_end",),
    ]
    assert recorder.model is algo.learner
    logs = recorder.calls[2][2]
    assert isinstance(logs, IterationLogs)
    # Flat numbers under slash/separated RLlib keys, the nested result alongside.
    assert logs["episode_reward_mean"] == 1.0
    assert logs["info/learner/default_policy/learner_stats/vf_loss"] == 1.0
    assert "date" not in logs
    assert logs.result["date"] == "today"


def test_fit_continues_the_epochs_of_a_resumed_algorithm():
    algo = FakeAlgorithm([1.0], start_iteration=5)
    recorder = Recorder()
    fit(algo, [recorder], max_iterations=2)
    assert [c[1] for c in recorder.calls if c[0] == "epoch_end"] == [5, 6]


def test_fit_refuses_to_run_forever():
    with pytest.raises(ValueError, match="never stop"):
        fit(FakeAlgorithm([1.0]))


def test_keras_early_stopping_stops_training():
    algo = FakeAlgorithm([1.0, 2.0, 2.0, 2.0, 2.0, 9.0])
    stopper = keras.callbacks.EarlyStopping(monitor="episode_reward_mean", mode="max", patience=2)
    last = fit(algo, [stopper], max_iterations=20)
    assert last["training_iteration"] == 4  # No improvement in iterations 3 and 4.


@pytest.mark.parametrize(
    ("callback", "stops_at"),
    [
        (StopAtReward(3.0), 3),
        (StopAtTimesteps(450), 5),
        (StopAfterTime(7.0), 4),
        (StopOnCriteria({"training_iteration": 2, "episode_reward_mean": 100}), 2),
        (StopAtReward(35.0, metric="evaluation/episode_reward_mean"), 4),
    ],
)
def test_stop_callbacks(callback, stops_at):
    algo = FakeAlgorithm([1.0, 2.0, 3.0, 2.0, 1.0, 0.0], evaluation_rewards=[10, 20, 30, 40, 50])
    last = fit(algo, [callback], max_iterations=10)
    assert last["training_iteration"] == stops_at
    assert callback.reason is not None


def test_a_missing_or_nan_metric_never_stops():
    algo = FakeAlgorithm([float("nan")])
    stopper = StopOnCriteria({"episode_reward_mean": -1e9, "evaluation/episode_reward_mean": 0})
    last = fit(algo, [stopper], max_iterations=3)
    assert last["training_iteration"] == 3
    assert stopper.reason is None


def test_periodic_checkpoint_saves_every_n_and_at_the_end_keeping_k(tmp_path):
    root = tmp_path / "checkpoints"
    stale = root / "checkpoint_000001.tmp-abc"  # A write killed earlier.
    stale.mkdir(parents=True)
    algo = FakeAlgorithm([1.0])
    saver = PeriodicCheckpoint(str(root), every_n_iterations=2, keep=2)
    fit(algo, [saver], max_iterations=5)
    assert algo.saves == [
        ("checkpoint_000002", 2),
        ("checkpoint_000004", 4),
        ("checkpoint_000005", 5),
    ]
    assert sorted(os.listdir(root)) == ["checkpoint_000004", "checkpoint_000005"]
    assert saver.last_checkpoint == checkpoints.checkpoint_path(str(root), 5)
    assert checkpoints.resolve_checkpoint_dir(str(tmp_path)) == saver.last_checkpoint


def test_periodic_checkpoint_does_not_save_the_last_iteration_twice(tmp_path):
    algo = FakeAlgorithm([1.0])
    fit(algo, [PeriodicCheckpoint(str(tmp_path), every_n_iterations=1)], max_iterations=2)
    assert [iteration for _, iteration in algo.saves] == [1, 2]


def test_periodic_checkpoint_needs_the_algorithm(tmp_path):
    saver = PeriodicCheckpoint(str(tmp_path))
    with pytest.raises(RuntimeError, match="needs the algorithm"):
        saver.save_now()


def test_best_checkpoint_keeps_the_best_across_resumes(tmp_path):
    best = tmp_path / "best"
    algo = FakeAlgorithm([1.0, 3.0, 2.0, 5.0, 4.0])
    saver = BestCheckpoint(str(best), monitor="episode_reward_mean")
    fit(algo, [saver], max_iterations=5)
    assert [iteration for _, iteration in algo.saves] == [1, 2, 4]
    assert (saver.best, saver.best_iteration) == (5.0, 4)
    record = json.loads((tmp_path / "best.json").read_text())
    assert record == {"monitor": "episode_reward_mean", "mode": "max", "value": 5.0, "iteration": 4}

    # A resumed run (new callback object) only replaces it with something better.
    resumed = FakeAlgorithm([6.0, 4.5], start_iteration=5)  # 4.5, then 6.0.
    fit(resumed, [BestCheckpoint(str(best))], max_iterations=2)
    assert resumed.saves == [("best", 7)]


def test_best_checkpoint_min_mode_and_missing_metric(tmp_path):
    algo = FakeAlgorithm([3.0, 1.0, 2.0], evaluation_rewards=None)
    lowest = BestCheckpoint(str(tmp_path / "low"), mode="min")
    absent = BestCheckpoint(str(tmp_path / "eval"), monitor="evaluation/episode_reward_mean")
    fit(algo, [lowest, absent], max_iterations=3)
    assert [iteration for name, iteration in algo.saves if name == "low"] == [1, 2]
    assert absent.best is None and not (tmp_path / "eval").exists()
    with pytest.raises(ValueError, match="mode"):
        BestCheckpoint(str(tmp_path), mode="up")


def test_result_and_progress_loggers(tmp_path):
    lines = []
    algo = FakeAlgorithm([1.0, 2.0])
    fit(
        algo,
        [
            ResultLogger(str(tmp_path), histogram_freq=2),
            ProgressLogger(timestep_budget=1000, verbose=True, print_fn=lines.append),
        ],
        max_iterations=2,
    )
    results = [json.loads(line) for line in (tmp_path / "result.json").read_text().splitlines()]
    assert [r["training_iteration"] for r in results] == [1, 2]
    assert results[0]["date"] == "today"  # The whole result, not the flat logs.
    progress = [line for line in lines if line.startswith("iter")]
    assert len(progress) == 2 and "ETA" in progress[0]
    assert json.loads(lines[1])["training_iteration"] == 1  # --verbose: the full dict.

    from tensorboard.backend.event_processing import event_accumulator

    accumulator = event_accumulator.EventAccumulator(str(tmp_path))
    accumulator.Reload()
    tags = accumulator.Tags()["tensors"]
    assert "episode/return_mean" in tags
    assert [t for t in tags if t.startswith("weights/")]  # Histograms at iteration 2 only.
    histogram_steps = {
        e.step for t in tags if t.startswith("weights/") for e in accumulator.Tensors(t)
    }
    assert histogram_steps == {200}
    assert algo.learners.times_locked == 1  # The weights were read between two updates.


# load_callbacks (impala-train --callbacks) ----------------------------------------------------

_A_CALLBACK = keras.callbacks.Callback()
_NOT_A_FACTORY = 3


def _two_callbacks():
    return [Recorder(), keras.callbacks.TerminateOnNaN()]


def _not_callbacks():
    return [Recorder(), object()]


def test_load_callbacks_from_import_paths():
    loaded = load_callbacks(
        [
            f"{__name__}:Recorder",  # a class
            f"{__name__}:_two_callbacks",  # a factory returning a list
            f"{__name__}:_A_CALLBACK",  # an instance
            "keras.callbacks:TerminateOnNaN",
        ]
    )
    kinds = [type(c).__name__ for c in loaded]
    assert kinds == ["Recorder", "Recorder", "TerminateOnNaN", "Callback", "TerminateOnNaN"]
    assert loaded[3] is _A_CALLBACK


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon", "module.path:factory"),
        (":Recorder", "module.path:factory"),
        ("tests.no_such_module:x", "cannot import callback"),
        (f"{__name__}:missing", "cannot import callback"),
        (f"{__name__}:_NOT_A_FACTORY", "not a callback or factory"),
        (f"{__name__}:_not_callbacks", "made 'object', not a keras.callbacks.Callback"),
    ],
)
def test_load_callbacks_explains_bad_specs(spec, message):
    with pytest.raises(ValueError, match=message) as info:
        load_callbacks([spec])
    assert spec in str(info.value) or "module.path" in message
