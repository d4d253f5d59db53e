"""Exact resume: actor snapshots, and impala-train --deterministic, 4 iterations straight vs
2 + resume + 2.

The end-to-end test runs the real binary in subprocesses. Its config makes every part of the
state matter at the break: two envs per actor with episodes running across it, a train batch
left half filled, mix-in replay, two SGD passes per batch, lr and entropy schedules, evaluation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from impala_tf import checkpoints
from impala_tf.config import ImpalaConfig
from impala_tf.driver.specs import runner_spec
from impala_tf.models import build_model
from impala_tf.rollout.env_runner import EnvRunner
from impala_tf.rollout.fragment import DEFAULT_POLICY_ID
from impala_tf.training.reporting import flatten
from tests.support.envs import unpicklable_cartpole

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": REPO}
_TIMEOUT_S = 240

# EnvRunner snapshots -------------------------------------------------------------------------


def _runner(env="CartPole-v1", model=None, seed=0):
    config = (
        ImpalaConfig()
        .environment(env)
        .env_runners(num_envs_per_env_runner=2, rollout_fragment_length=8)
        .training(model=model or {"fcnet_hiddens": [8]})
        .debugging(seed=seed)
    )
    runner = EnvRunner(runner_spec(config), worker_index=1)
    net = build_model(runner.observation_space, runner.action_space, config.model)
    rng = np.random.default_rng(1)
    weights = [rng.normal(scale=0.5, size=w.shape) for w in net.get_weights()]
    runner.set_weights({DEFAULT_POLICY_ID: (weights, 4)})
    return runner


def _same_fragments(a, b, count=3):
    for _ in range(count):
        fa, fb = a.sample(), b.sample()
        batch_a, batch_b = fa.batches[DEFAULT_POLICY_ID], fb.batches[DEFAULT_POLICY_ID]
        assert batch_a.keys() == batch_b.keys()
        for key in batch_a:
            np.testing.assert_array_equal(batch_a[key], batch_b[key], err_msg=key)
        assert fa.episodes == fb.episodes
        assert fa.policy_versions == fb.policy_versions


@pytest.mark.parametrize(
    "model", [{"fcnet_hiddens": [8]}, {"fcnet_hiddens": [8], "use_lstm": True}]
)
def test_a_restored_snapshot_continues_the_same_episodes(model):
    """Numpy (MLP) and TensorFlow (LSTM) policies: sampler, envs, episodes, RNN state."""
    original = _runner(model=model)
    for _ in range(3):  # Into the middle of some episodes.
        original.sample()
    snapshot = original.get_state()
    assert snapshot["envs"] is not None and snapshot["envs_error"] is None
    copy = _runner(model=model, seed=99)  # Other seed, other weights: all replaced.
    zeros = [w * 0 for w in copy.get_weights()[DEFAULT_POLICY_ID]]
    copy.set_weights({DEFAULT_POLICY_ID: (zeros, 0)})
    copy.set_state(snapshot)
    _same_fragments(original, copy)


def test_unpicklable_envs_restart_their_episodes_from_a_seed():
    original = _runner(env=unpicklable_cartpole)
    original.sample()
    snapshot = original.get_state()
    assert snapshot["envs"] is None and "simulator handle" in snapshot["envs_error"]
    a, b = _runner(env=unpicklable_cartpole), _runner(env=unpicklable_cartpole)
    a.set_state({**snapshot, "seed": 5})
    b.reset(5)
    b.set_state({"policy_rngs": snapshot["policy_rngs"]})
    _same_fragments(a, b)
    # A reset with a seed is a fresh start: the first fragment of a new runner with that seed.
    c = _runner(seed=5)
    c.sample()
    c.reset(5)
    _same_fragments(c, _runner(seed=5), count=1)


# impala-train --deterministic ------------------------------------------------------------------


RUN_ARGS = [
    "--deterministic",
    "--seed=7",
    "--set=num_env_runners=1",
    "--set=num_envs_per_env_runner=2",
    "--set=rollout_fragment_length=10",
    # 4 sequences per batch, 2 per fragment, 5 fragments per iteration: half a batch waits.
    "--set=train_batch_size=40",
    "--set=min_time_s_per_iteration=0",
    "--set=min_sample_timesteps_per_iteration=100",
    "--set=num_sgd_iter=2",
    "--set=replay_proportion=0.5",
    "--set=replay_buffer_num_slots=3",
    "--set=lr_schedule=[[0, 0.01], [2000, 0.001]]",
    "--set=entropy_coeff_schedule=[[0, 0.02], [2000, 0.0]]",
    "--set=evaluation_interval=2",
    "--set=evaluation_duration=2",
    "--set=model.fcnet_hiddens=[16]",
]

# Result keys that measure wall-clock time or the process, and windows of the learner thread's
# recent timings and queue sizes, which a restarted process begins afresh. Everything else (the
# lifetime counters, `timesteps_total`, `num_grad_updates_lifetime`, ...) must match.
_WALL_CLOCK = frozenset(
    {
        "time_this_iter_s",
        "time_total_s",
        "time_since_start_s",
        "timestamp",
        "pid",
        "num_env_steps_sampled_throughput_per_sec",
        "num_env_steps_trained_throughput_per_sec",
        "evaluation/time_this_iter_s",
    }
)
_WINDOWS = ("info/learner_queue/", "info/timing_breakdown/")


def start(*args):
    return subprocess.Popen(
        [sys.executable, "-m", "impala_tf.bin.train", *args],
        cwd=REPO,
        env=_ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc):
    stdout, stderr = proc.communicate(timeout=_TIMEOUT_S)
    assert proc.returncode == 0, stderr[-3000:]
    return stdout


def results(logdir):
    with open(os.path.join(logdir, "result.json")) as f:
        return [json.loads(line) for line in f]


def comparable(result):
    return {k: v for k, v in flatten(result) if k not in _WALL_CLOCK and not k.startswith(_WINDOWS)}


def checkpoint_tensors(logdir):
    directory = checkpoints.resolve_checkpoint_dir(logdir)
    reader = tf.train.load_checkpoint(checkpoints.learner_prefix(directory))
    names = [n for n in reader.get_variable_to_shape_map() if "OBJECT_GRAPH" not in n]
    return directory, {name: reader.get_tensor(name) for name in names}


def test_resumed_deterministic_run_matches_an_uninterrupted_one(tmp_path):
    straight_dir, resumed_dir = str(tmp_path / "straight"), str(tmp_path / "resumed")
    straight = start(f"--logdir={straight_dir}", "--stop_iters=4", *RUN_ARGS)
    finish(start(f"--logdir={resumed_dir}", "--stop_iters=2", *RUN_ARGS))
    # Only the logdir and a new stop criterion: the config and flags come from the run.
    out = finish(start(f"--logdir={resumed_dir}", "--stop_iters=4"))
    finish(straight)
    assert "resuming from" in out and "checkpoint_000002" in out

    a, b = results(straight_dir), results(resumed_dir)
    assert [r["training_iteration"] for r in b] == [1, 2, 3, 4]
    lifetime = {
        "timesteps_total",
        "num_env_steps_trained",
        "env_runners/num_env_steps_sampled_lifetime",
        "info/learner/default_policy/num_grad_updates_lifetime",
        "evaluation/episode_reward_mean",
    }
    for left, right in zip(a, b, strict=True):
        assert comparable(left) == comparable(right), left["training_iteration"]
        assert lifetime - {"evaluation/episode_reward_mean"} <= comparable(left).keys()
    assert lifetime <= comparable(b[3]).keys()
    stats = [r["info"]["learner"]["default_policy"]["learner_stats"] for r in b]
    assert stats[3]["cur_lr"] < stats[2]["cur_lr"] < 0.01  # The schedule moved on, not back.
    assert stats[3]["entropy_coeff"] < stats[2]["entropy_coeff"]
    assert "evaluation" in b[3] and "evaluation" not in b[2]
    assert b[3]["time_since_start_s"] > b[2]["time_since_start_s"]
    assert b[3]["time_total_s"] > b[2]["time_total_s"]

    # The final checkpoints hold the same values bit for bit: weights, both Adam slots and its
    # step count, the update and step counters.
    (dir_a, tensors_a), (dir_b, tensors_b) = (
        checkpoint_tensors(straight_dir),
        checkpoint_tensors(resumed_dir),
    )
    assert os.path.basename(dir_a) == os.path.basename(dir_b) == "checkpoint_000004"
    assert tensors_a.keys() == tensors_b.keys()
    assert len(tensors_a) > 10
    for name, value in tensors_a.items():
        np.testing.assert_array_equal(value, tensors_b[name], err_msg=name)
    state_a, state_b = (checkpoints.read_driver_state(d) for d in (dir_a, dir_b))
    keys = ("iteration", "counters", "episodes", "episodes_total", "env_steps_trained")
    for key in (*keys, "steps_since_broadcast", "observation_filters"):
        assert state_a[key] == state_b[key], key
