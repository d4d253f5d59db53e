"""End-to-end tests of impala-train (asynchronous, the default mode), run as a subprocess:
TensorBoard files, callbacks from import paths, in-training evaluation, checkpoints kept and
resumed, the console output, and the errors it explains.

The callbacks below are imported by the binary as `tests.train_binary_test:...`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import keras
import pytest

from impala_tf import checkpoints
from tests.support.binaries import run_binary_in_one_process

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TIMEOUT_S = 240
_MARKS = "IMPALA_TF_TEST_MARKS"


class EpochMarker(keras.callbacks.Callback):
    """Appends `epoch <n> <episode_reward_mean in logs>` to the file $IMPALA_TF_TEST_MARKS."""

    def on_epoch_end(self, epoch, logs=None):
        with open(os.environ[_MARKS], "a") as f:
            f.write(f"epoch {epoch} {'episode_reward_mean' in logs}\n")


class UpdateMarker(keras.callbacks.Callback):
    """Appends `update <vf_loss in logs>` per learner update."""

    def on_train_batch_end(self, batch, logs=None):
        with open(os.environ[_MARKS], "a") as f:
            f.write(f"update {'vf_loss' in logs}\n")


def train(*args, marks=None):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": REPO}
    if marks:
        env[_MARKS] = str(marks)
    return subprocess.run(
        [sys.executable, "-m", "impala_tf.bin.train", *map(str, args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=_TIMEOUT_S,
    )


RUN_ARGS = [
    "--seed=3",
    "--set=num_env_runners=1",
    "--set=num_envs_per_env_runner=4",
    "--set=rollout_fragment_length=10",
    "--set=train_batch_size=40",
    "--set=min_time_s_per_iteration=0.3",
    "--set=lr_schedule=[[0, 0.01], [100000, 0.001]]",
    "--set=evaluation_interval=2",
    "--set=evaluation_duration=2",
    "--set=keep_checkpoints_num=2",
    "--set=model.fcnet_hiddens=[16]",
    "--callbacks=tests.train_binary_test:EpochMarker",
    "--learner_callbacks=tests.train_binary_test:UpdateMarker",
    "--save_best=evaluation/episode_reward_mean",
    "--histogram_freq=3",
]


def test_train_then_resume(tmp_path):
    """Trains 3 iterations, then resumes the logdir for a fourth (one test, so that the two
    runs happen once however the tests are distributed)."""
    logdir, marks = tmp_path / "run", tmp_path / "marks.txt"
    first = train(f"--logdir={logdir}", "--stop_iters=3", "--verbose", *RUN_ARGS, marks=marks)
    assert first.returncode == 0, first.stderr[-3000:]
    with open(logdir / "result.json") as f:
        first_results = [json.loads(line) for line in f]
    first_checkpoints = sorted(os.listdir(logdir / "checkpoints"))
    second = train(f"--logdir={logdir}", "--stop_iters=4", marks=marks)
    assert second.returncode == 0, second.stderr[-3000:]
    with open(logdir / "result.json") as f:
        results = [json.loads(line) for line in f]

    check_console(first.stdout, second.stdout)
    check_evaluation(first_results, results)
    check_tensorboard(logdir, results)
    check_callbacks(marks.read_text().splitlines())
    check_checkpoints(logdir, first_checkpoints)
    check_resume(logdir, first_results, results)


def check_console(first, second):
    progress = [line for line in first.splitlines() if line.startswith("iter ")]
    assert [line.split()[1] for line in progress] == ["1", "2", "3"]
    assert "eval " in progress[1] and "eval " not in progress[0]
    assert all(" ETA " in line and " pi " in line for line in progress)
    assert '"training_iteration": 3' in first  # --verbose
    assert "stopped at training_iteration=3 >= 3" in first
    check_timeline(first)
    assert "timeline" not in second  # Only with --verbose.
    assert "resuming from" in second and "checkpoint_000003" in second
    assert '"training_iteration"' not in second  # --verbose is not a stored flag.


def check_timeline(stdout):
    # --verbose: where start-up and shut-down went, phase by phase, in the order they ended.
    (line,) = [line for line in stdout.splitlines() if "timeline (s since process start)" in line]
    marks = [part.rsplit(" ", 1) for part in line.split(": ", 2)[2].split(", ")]
    names, seconds = [name for name, _ in marks], [float(s) for _, s in marks]
    assert names == [
        "flags",
        "plan",
        "fork server",
        "tensorflow",
        "built",
        "iteration 1",
        "stop line",
        "stopped Evaluator",
        "stopped LearnerGroup",
        "stopped AggregationStage",
        "stopped EnvRunnerGroup",
    ], names
    assert seconds == sorted(seconds) and 0 < seconds[0] < seconds[-1] < 120, seconds


def check_evaluation(first_results, results):
    assert ["evaluation" in r for r in first_results] == [False, True, False]
    evaluation = first_results[1]["evaluation"]
    assert evaluation["episodes_this_iter"] == 2
    assert evaluation["episode_reward_min"] <= evaluation["episode_reward_mean"]
    assert evaluation["episode_reward_mean"] <= evaluation["episode_reward_max"]
    assert evaluation["env_runners"]["episode_return_mean"] == evaluation["episode_reward_mean"]
    assert "evaluation" in results[3]


def check_tensorboard(logdir, results):
    import tensorflow as tf
    from tensorboard.backend.event_processing import event_accumulator

    accumulator = event_accumulator.EventAccumulator(
        str(logdir), size_guidance={event_accumulator.TENSORS: 0}
    )
    accumulator.Reload()
    tags = set(accumulator.Tags()["tensors"])
    assert {
        "episode/return_mean",
        "episode/length_mean",
        "evaluation/return_mean",
        "learner/policy_loss",
        "learner/vf_loss",
        "learner/entropy",
        "learner/learning_rate",
        "learner/entropy_coeff",
        "learner/off_policyness",
        "learner_queue/size_mean",
        "timing/learner_grad_time_ms",
        "throughput/env_steps_sampled_per_s",
        "throughput/env_steps_trained_per_s",
        "counters/env_steps_trained",
    } <= tags
    assert any(t.startswith("weights/") for t in tags)  # --histogram_freq=3
    steps = [r["timesteps_total"] for r in results]
    assert [e.step for e in accumulator.Tensors("learner/vf_loss")] == steps
    lrs = [
        float(tf.make_ndarray(e.tensor_proto)) for e in accumulator.Tensors("learner/learning_rate")
    ]
    stats = [r["info"]["learner"]["default_policy"]["learner_stats"] for r in results]
    assert lrs == pytest.approx([s["cur_lr"] for s in stats])


def check_callbacks(marks):
    epochs = [line for line in marks if line.startswith("epoch")]
    assert epochs == ["epoch 0 True", "epoch 1 True", "epoch 2 True", "epoch 3 True"]
    updates = [line for line in marks if line.startswith("update")]
    assert updates and set(updates) == {"update True"}


def check_checkpoints(logdir, first_checkpoints):
    assert first_checkpoints == ["checkpoint_000002", "checkpoint_000003"]
    assert sorted(os.listdir(logdir / "checkpoints")) == ["checkpoint_000003", "checkpoint_000004"]
    assert checkpoints.resolve_checkpoint_dir(str(logdir)).endswith("checkpoint_000004")
    record = json.loads((logdir / "best.json").read_text())
    assert record["monitor"] == "evaluation/episode_reward_mean"
    assert record["iteration"] in (2, 4)
    assert checkpoints.read_driver_state(str(logdir / "best"))["iteration"] == record["iteration"]


def check_resume(logdir, first_results, results):
    assert [r["training_iteration"] for r in results] == [1, 2, 3, 4]
    assert results[:3] == first_results  # Appended, nothing rewritten.
    for key in ("timesteps_total", "num_env_steps_trained", "episodes_total", "time_total_s"):
        values = [r[key] for r in results]
        assert values == sorted(values), key
        # A short resumed iteration may end before its fresh episodes do (CI saw 204, 204).
        assert values[3] > values[2] or key == "episodes_total", key
    assert results[3]["episodes_total"] >= first_results[2]["episodes_total"]  # Carried over.
    stats = [r["info"]["learner"]["default_policy"]["learner_stats"] for r in results]
    trained = [s["num_agent_steps_trained"] for s in stats]
    assert trained[3] > trained[2]  # The learner's counter continued from the checkpoint.
    # lr follows the schedule of the steps trained: it went on falling instead of restarting.
    assert stats[3]["cur_lr"] < stats[2]["cur_lr"] < 0.01
    expected = 0.01 + (0.001 - 0.01) * trained[3] / 100000
    assert stats[3]["cur_lr"] == pytest.approx(expected, rel=0.05)
    wall = [r["time_since_start_s"] for r in results]
    assert wall == sorted(wall)
    params = json.loads((logdir / "params.json").read_text())
    assert params["stop"]["training_iteration"] == 4
    assert params["flags"]["callbacks"] == ["tests.train_binary_test:EpochMarker"]


def test_resume_discards_results_after_the_checkpoint_and_stops_if_done(tmp_path):
    logdir = tmp_path / "run"
    ckpt = logdir / "checkpoints" / "checkpoint_000002"
    ckpt.mkdir(parents=True)
    (ckpt / checkpoints.DRIVER_STATE_FILE).write_text(
        json.dumps({"iteration": 2, "counters": {"num_env_steps_sampled": 80}, "config": {}})
    )
    (logdir / "params.json").write_text(json.dumps({"stop": {"training_iteration": 2}}))
    lines = [{"training_iteration": i, "timesteps_total": 40 * i} for i in (1, 2, 3)]
    (logdir / "result.json").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"cut')
    proc = train(f"--logdir={logdir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "already stopped at training_iteration=2 >= 2" in proc.stdout
    kept = [json.loads(line) for line in (logdir / "result.json").read_text().splitlines()]
    assert [r["training_iteration"] for r in kept] == [1, 2]
    discarded = (logdir / "result.discarded.json").read_text().splitlines()
    assert len(discarded) == 2 and json.loads(discarded[0])["training_iteration"] == 3


_ERRORS = {  # run name: (arguments, what the error says)
    "noresume": (["--noresume"], "holds checkpoints"),
    "callback": (["--callbacks=tests.train_binary_test:nothing_here"], "cannot import callback"),
    "memory": (
        [*RUN_ARGS, "--set=num_env_runners=1000000"],
        "`num_env_runners`=1000000 needs about",
    ),
}


def test_errors_are_explained(tmp_path):
    # One case after another through the binary's flags and `main`, in one fresh process (a
    # process each would import TensorFlow three times).
    ckpt = tmp_path / "noresume" / "checkpoints" / "checkpoint_000001"
    ckpt.mkdir(parents=True)
    (ckpt / checkpoints.DRIVER_STATE_FILE).write_text("{}")
    runs = run_binary_in_one_process(
        "impala_tf.bin.train",
        {name: [f"--logdir={tmp_path / name}", *args] for name, (args, _) in _ERRORS.items()},
        cwd=REPO,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": REPO},
        log_dir=tmp_path,
    )
    for name, (_, message) in _ERRORS.items():
        code, output = runs[name]
        assert code == 1, (name, output[-3000:])
        assert "impala-train: error: " in output and message in output, (name, output[-3000:])
