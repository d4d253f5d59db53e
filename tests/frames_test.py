"""Tests for impala_tf.models.frames: frames sent once, stacks rebuilt in the learner's graph,
exactly."""

from __future__ import annotations

import pickle
import time

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from impala_tf.acting.inference import InferenceServer
from impala_tf.config import ImpalaConfig
from impala_tf.data.sample_batch import CompressedColumn, SampleBatch, decompress
from impala_tf.driver.counters import Counters
from impala_tf.driver.plan import make_plan
from impala_tf.driver.sampling import EnvRunnerGroup
from impala_tf.driver.specs import runner_spec, sampling_spec
from impala_tf.learning import pipeline
from impala_tf.learning.learner import ImpalaLearner
from impala_tf.models import build_model
from impala_tf.models.frames import (
    join_frames,
    rebuild_stacks,
    rebuild_stacks_np,
    ring_step_np,
    split_stacks,
)
from impala_tf.rollout.env_runner import EnvRunner
from impala_tf.rollout.host import make_runner_host
from tests.support import envs
from tests.support.envs import stacked_obs
from tests.support.inference import RecordingConnection


def as_frames(obs: np.ndarray, k: int) -> np.ndarray:
    """What an env runner stores: the stack at t = 0 as k frames, then each newest frame."""
    b, t, h, w, c = obs.shape
    s = c // k
    first = np.moveaxis(obs[:, 0].reshape(b, h, w, k, s), 3, 1)
    return np.concatenate([first, obs[:, 1:, ..., -s:]], axis=1)


@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(1, 3),
    t=st.integers(1, 12),
    k=st.integers(2, 4),
    s=st.sampled_from([1, 3]),
    episode_len=st.one_of(st.none(), st.integers(1, 6)),
    seed=st.integers(0, 10),
)
def test_rebuilt_stacks_are_the_env_stacks(b, t, k, s, episode_len, seed):
    obs, restarts = stacked_obs(b, t, k, s=s, episode_len=episode_len, seed=seed, levels=4)
    frames = as_frames(obs, k)
    assert frames.shape == (b, t + k - 1, 6, 6, s)
    np.testing.assert_array_equal(rebuild_stacks_np(frames, restarts), obs)
    rebuilt = rebuild_stacks(tf.constant(frames), tf.constant(restarts))
    assert rebuilt.shape == obs.shape and rebuilt.dtype == tf.uint8
    np.testing.assert_array_equal(rebuilt.numpy(), obs)


def test_a_refill_at_the_last_step_and_back_to_back_refills():
    obs, restarts = stacked_obs(2, 6, 4, episode_len=1)  # A new episode at every step.
    np.testing.assert_array_equal(rebuild_stacks_np(as_frames(obs, 4), restarts), obs)
    obs, restarts = stacked_obs(1, 5, 4, episode_len=4)  # Row 0: a refill at t = 4 only.
    assert restarts[0].tolist() == [False, False, False, False, True]
    np.testing.assert_array_equal(rebuild_stacks_np(as_frames(obs, 4), restarts), obs)


@pytest.mark.parametrize("k, s", [(4, 1), (2, 3)])
def test_stacks_kept_as_rings_of_frames_are_the_env_stacks(k, s):
    """What the inference server does: the first stacks written whole, then each step's newest
    frame into its env's ring; the stacks gathered from the rings are the env's."""
    obs, restarts = stacked_obs(3, 9, k, s=s, episode_len=3, seed=k)
    rows = np.arange(len(obs))
    rings = split_stacks(tf.constant(obs[:, 0]), k).numpy()  # [B, k, H, W, s], oldest first.
    np.testing.assert_array_equal(join_frames(tf.constant(rings)).numpy(), obs[:, 0])
    newest, age = np.full(len(obs), k - 1), np.full(len(obs), k - 1)
    for t in range(1, 9):
        newest, age, positions = ring_step_np(newest, age, restarts[:, t], k)
        rings[rows, newest] = obs[:, t, ..., -s:]
        stacks = join_frames(tf.constant(rings[rows[:, None], positions]))
        np.testing.assert_array_equal(stacks.numpy(), obs[:, t])
    assert restarts[:, 1:].any() and not restarts[:, 1:].all()


def _config(**env_config) -> ImpalaConfig:
    config = (
        ImpalaConfig()
        .environment(
            envs.stacked_frames, env_config={"size": 10, "k": 4, "episode_len": 6, **env_config}
        )
        .env_runners(num_env_runners=1, num_envs_per_env_runner=2, rollout_fragment_length=9)
        .training(train_batch_size=18, model={"vf_share_layers": True})
        .reporting(min_time_s_per_iteration=0.5)
        .debugging(seed=0)
    )
    return config


def _runner(config: ImpalaConfig, weights: list | None = None) -> EnvRunner:
    runner = EnvRunner(runner_spec(config), worker_index=1)
    if weights is None:
        model = build_model(runner.observation_space, runner.action_space, config.model)
        weights = model.get_weights()
    runner.set_weights({"default_policy": (weights, 0)})
    return runner


def test_a_runner_sends_each_frame_once_and_the_stacks_rebuild_exactly():
    framed = _runner(_config())
    plain = _runner(_config(declare=False), framed.get_weights()["default_policy"])
    assert framed.frame_stack == (4, 1) and plain.frame_stack is None
    for _ in range(3):
        a = framed.sample().batches["default_policy"]
        b = plain.sample().batches["default_policy"]
        assert "obs" not in a and a["obs_frames"].shape == (2, 9 + 3, 10, 10, 1)
        assert a["obs_restarts"].shape == (2, 9) and not a["obs_restarts"][:, 0].any()
        np.testing.assert_array_equal(a["actions"], b["actions"])  # The same trajectories.
        np.testing.assert_array_equal(rebuild_stacks_np(a["obs_frames"], a["obs_restarts"]),
                                      b["obs"])  # fmt: skip
    # Episodes of 6 steps in fragments of 9: refills land mid-fragment.
    assert a["obs_restarts"].any()
    assert a["obs_frames"].nbytes / b["obs"].nbytes == pytest.approx((9 + 3) / (9 * 4))


def test_the_plan_and_the_signature_follow_the_env():
    config = _config()
    plan = make_plan(config)
    assert plan.spaces.frame_stacks == {"default_policy": (4, 1)}
    assert make_plan(_config(declare=False)).spaces.frame_stacks == {}
    obs_space, act_space = plan.spaces.policies["default_policy"]
    signature = pipeline.batch_signature(config, obs_space, act_space, frame_stack=(4, 1))
    assert "obs" not in signature
    assert signature["obs_frames"].shape == (2, 12, 10, 10, 1)
    assert signature["obs_frames"].dtype == tf.uint8
    assert signature["obs_restarts"].shape == (18,)


def test_zlib_frames_travel_and_reach_the_learner_shards_unchanged():
    config = _config().env_runners(compress_observations=True)
    host = make_runner_host(0, runner_spec(config))
    obs_space, act_space = host.runner.observation_space, host.runner.action_space
    weights = build_model(obs_space, act_space, config.model).get_weights()
    host.set_weights({"default_policy": (weights, 0)})
    sent = pickle.loads(pickle.dumps(host.sample().batches["default_policy"]))
    assert isinstance(sent["obs_frames"], CompressedColumn)
    signature = pipeline.batch_signature(config, obs_space, act_space, frame_stack=(4, 1))
    (shard,) = pipeline.replica_shards(sent, signature, 1)
    frames = decompress(sent)["obs_frames"]
    np.testing.assert_array_equal(shard["obs_frames"], frames)
    assert shard["obs_restarts"].shape == (18,) and shard["obs_restarts"].dtype == bool


def test_the_learner_trains_on_frames_as_on_the_stacks():
    config = _config()
    framed = _runner(config).sample().batches["default_policy"]
    obs = rebuild_stacks_np(framed["obs_frames"], framed["obs_restarts"])
    plain = SampleBatch({k: v for k, v in framed.items() if not k.startswith("obs_")}, obs=obs)
    plan = make_plan(config)
    obs_space, act_space = plan.spaces.policies["default_policy"]
    stats = []
    for batch, stack in ((framed, (4, 1)), (plain, None)):
        tf.keras.utils.set_random_seed(0)
        learner = ImpalaLearner(config, obs_space, act_space)
        signature = pipeline.batch_signature(config, obs_space, act_space, frame_stack=stack)
        (shard,) = pipeline.replica_shards(batch, signature, 1)
        out = learner.train_step({k: tf.constant(v) for k, v in shard.items()})
        stats.append({k: float(v) for k, v in out.items()})
    assert stats[0] == stats[1]


@pytest.mark.slow
def test_actor_processes_and_aggregation_workers_carry_frames_to_training():
    config = (
        _config()
        .env_runners(compress_observations=True, num_env_runners=2)
        .training(replay_proportion=1.0, replay_buffer_num_slots=4, num_aggregation_workers=1)
    )
    algo = config.build()
    try:
        results = [algo.train() for _ in range(2)]
    finally:
        algo.stop()
    assert results[-1]["num_env_steps_trained"] > 0


def test_actor_processes_send_frames():
    config = _config().env_runners(max_requests_in_flight_per_env_runner=2)
    plan = make_plan(config)
    (obs_space, act_space) = plan.spaces.policies["default_policy"]
    weights = build_model(obs_space, act_space, config.model).get_weights()
    actors = EnvRunnerGroup(sampling_spec(config, plan), plan, Counters())
    try:
        actors.broadcast({"default_policy": (weights, 0)}, actors.healthy_ids())
        actors.top_up()
        fragments, deadline = [], time.monotonic() + 120
        while len(fragments) < 2 and time.monotonic() < deadline:
            got, failures = actors.fetch(timeout_s=1.0)
            assert not failures, failures
            fragments.extend(got)
    finally:
        actors.stop()
    assert len(fragments) == 2
    for f in fragments:
        batch = f.batches["default_policy"]
        assert batch["obs_frames"].shape == (2, 12, 10, 10, 1) and "obs" not in batch


def test_central_inference_takes_each_frame_once_and_samples_as_a_runner_acting_itself():
    """Two actors act through one server that keeps their stacks; actor 0 then restarts (a
    new connection under its id) and later rolls its envs back to a snapshot mid-episode: each
    samples what a runner acting on the env's own stacks samples, sending the stacks whole
    once and then a quarter of their bytes per step (k = 4)."""
    config = _config()
    plan = make_plan(config)
    obs_space, act_space = plan.spaces.policies["default_policy"]
    weights = build_model(obs_space, act_space, config.model).get_weights()
    server = InferenceServer(
        {"default_policy": (obs_space, act_space, config.model)},
        frame_stacks=plan.spaces.frame_stacks,
    )
    server.set_weights({"default_policy": (weights, 0)})

    def remote(actor_id: int) -> tuple[RecordingConnection, EnvRunner]:
        conn = RecordingConnection(server.attach(actor_id))
        runner = EnvRunner(runner_spec(config), actor_id + 1, remote=(conn, server.state_shapes))
        runner.set_weights({"default_policy": (None, 0)})
        return conn, runner

    def local(actor_id: int) -> EnvRunner:
        runner = EnvRunner(runner_spec(config), actor_id + 1)
        runner.set_weights({"default_policy": (weights, 0)})
        return runner

    def assert_same(got, want) -> None:
        got, want = got.batches["default_policy"], want.batches["default_policy"]
        for name in ("obs_frames", "obs_restarts", "actions"):
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        for name in ("action_dist_inputs", "vf_preds", "values_bootstrapped"):
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)

    try:
        actors = {i: (remote(i), local(i)) for i in (0, 1)}
        for _ in range(2):  # Episodes of 6 steps in fragments of 9: refills mid-fragment.
            for (_, runner), own in actors.values():
                assert_same(runner.sample(), own.sample())
        (conn, _), _ = actors[1]
        kept = conn.kept()
        assert len(kept) == 1 + 2 * 9  # The first step's stacks, then one message per step.
        stack_bytes = 2 * 10 * 10 * 4
        assert kept[0][1].nbytes == stack_bytes
        assert {m[1].nbytes for m in kept[1:]} == {stack_bytes // 4}
        # A restarted actor 0: its stacks travel whole once, nothing of its predecessor's read.
        (conn, runner), own = remote(0), local(0)
        assert_same(runner.sample(), own.sample())
        snapshot, own_snapshot = runner.get_state(), own.get_state()
        assert snapshot["envs"] is not None  # The envs mid-episode, restored below.
        first = runner.sample()
        assert_same(first, own.sample())
        runner.set_state(snapshot)
        own.set_state(own_snapshot)
        replay = runner.sample()
        assert_same(replay, first)  # The same steps again, from the same envs and samplers.
        assert_same(replay, own.sample())
        whole = [m[1].nbytes for m in conn.kept() if m[1].nbytes == stack_bytes]
        assert len(whole) == 2  # After the restart, and after the snapshot's envs came back.
    finally:
        server.stop()
