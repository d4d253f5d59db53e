"""Tests for impala_tf.frames: exact frame-stack coding, fallbacks, zlib, bytes, transport."""

from __future__ import annotations

import collections
import pickle
import time

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from impala_tf import pipeline
from impala_tf.config import ImpalaConfig
from impala_tf.driver.plan import make_plan
from impala_tf.driver.sampling import EnvRunnerGroup
from impala_tf.frames import FrameStackColumn, encode_frame_stacks, encode_observations
from impala_tf.models import build_model
from impala_tf.rollout.env_runner import EnvRunner
from impala_tf.sample_batch import CompressedColumn, SampleBatch, decompress
from tests.support import envs


def stacked_obs(b, t, k, *, size=6, s=1, episode_len=None, seed=0, levels=256):
    """[B, T, size, size, k*s] uint8 stacks as DeepMind's FrameStack builds them, and the starts.

    Episode starts (reset: k copies of the first frame) fall every `episode_len` steps, offset
    per env, so they land mid-fragment.
    """
    rng = np.random.default_rng(seed)
    obs = np.empty((b, t, size, size, k * s), np.uint8)
    starts = np.zeros((b, t), bool)
    for row in range(b):
        stack = None
        for step in range(t):
            frame = rng.integers(0, levels, (size, size, s), dtype=np.uint8)
            if stack is None or (episode_len and (step + row) % episode_len == 0):
                stack = np.concatenate([frame] * k, axis=-1)
                starts[row, step] = True
            else:
                stack = np.concatenate([stack[..., s:], frame], axis=-1)
            obs[row, step] = stack
    return obs, starts


def fragment(obs: np.ndarray) -> SampleBatch:
    b, t = obs.shape[:2]
    return SampleBatch(
        {"obs": obs, "rewards": np.ones((b, t), np.float32), "actions": np.zeros((b, t), int)}
    )


def test_round_trip_is_exact_with_episode_starts_mid_fragment():
    obs, starts = stacked_obs(3, 20, 4, episode_len=7)
    coded = encode_frame_stacks(obs)
    assert isinstance(coded, FrameStackColumn) and coded.frame_channels == 1
    # Keyframes: the fragment start and every episode start, nothing else.
    expected = starts.copy()
    expected[:, 0] = True
    np.testing.assert_array_equal(coded.keyframe_mask, expected)
    decoded = coded.decode()
    assert decoded.dtype == np.uint8 and decoded.flags.writeable
    np.testing.assert_array_equal(decoded, obs)


def test_rgb_stacks_shift_by_three_channels():
    obs, _ = stacked_obs(2, 9, 4, s=3, episode_len=5)
    coded = encode_frame_stacks(obs)
    assert coded is not None and coded.frame_channels == 3
    assert coded.new_frames.shape[1:] == (6, 6, 3)
    np.testing.assert_array_equal(coded.decode(), obs)


def test_non_shifting_observations_fall_back_to_full_stacks():
    rng = np.random.default_rng(1)
    obs = rng.integers(0, 256, (2, 10, 6, 6, 4), dtype=np.uint8)
    assert encode_frame_stacks(obs) is None
    out = encode_observations(fragment(obs), compress_observations=False)
    assert out["obs"] is obs
    zipped = encode_observations(fragment(obs), compress_observations=True)
    assert isinstance(zipped["obs"], CompressedColumn)
    np.testing.assert_array_equal(decompress(zipped)["obs"], obs)


def test_non_contiguous_observations_are_coded_exactly():
    obs, _ = stacked_obs(2, 9, 4, episode_len=4)
    strided = np.asfortranarray(obs)
    coded = encode_frame_stacks(strided)
    assert coded is not None
    np.testing.assert_array_equal(coded.decode(), obs)


def test_env_whose_stacks_shift_only_sometimes_is_still_exact():
    shifting, _ = stacked_obs(2, 12, 4, episode_len=5)
    obs = shifting.copy()
    obs[1, 3] = 255 - obs[1, 3]  # A step that does not follow from the one before.
    obs[0, 8, ..., 0] ^= 1  # An old frame that differs by one bit.
    coded = encode_frame_stacks(obs)
    assert coded is not None
    assert coded.keyframe_mask[1, 3] and coded.keyframe_mask[0, 8]
    np.testing.assert_array_equal(coded.decode(), obs)


@pytest.mark.parametrize(
    "obs",
    [
        np.zeros((2, 5, 6, 6, 4), np.float32),  # not uint8
        np.zeros((2, 5, 6, 6), np.uint8),  # no channel axis
        np.zeros((2, 5, 6, 6, 1), np.uint8),  # a single frame
    ],
)
def test_observations_the_coding_does_not_apply_to_travel_unchanged(obs):
    assert encode_frame_stacks(obs) is None
    assert encode_observations(fragment(obs), compress_observations=False)["obs"] is obs


@settings(max_examples=60, deadline=None)
@given(
    b=st.integers(1, 3),
    t=st.integers(1, 8),
    k=st.integers(2, 8),  # 2, 4 and 8 take the machine-word path, the others slices.
    episode_len=st.integers(1, 5),
    seed=st.integers(0, 2**16),
    levels=st.integers(1, 3),
    zlib=st.booleans(),
)
def test_round_trip_property(b, t, k, episode_len, seed, levels, zlib):
    # Few pixel levels make reset stacks that happen to look shifted: still exact.
    obs, _ = stacked_obs(b, t, k, size=2, episode_len=episode_len, seed=seed, levels=levels)
    out = encode_observations(fragment(obs), compress_observations=zlib)
    np.testing.assert_array_equal(decompress(out)["obs"], obs)


def test_composes_with_compress_observations():
    obs, _ = stacked_obs(2, 16, 4, size=12, episode_len=6, levels=4)
    plain = encode_observations(fragment(obs), compress_observations=False)
    zipped = encode_observations(fragment(obs), compress_observations=True)
    assert isinstance(plain["obs"], FrameStackColumn)
    assert isinstance(zipped["obs"], FrameStackColumn)
    assert isinstance(zipped["obs"].keyframes, CompressedColumn)
    assert isinstance(zipped["obs"].new_frames, CompressedColumn)
    assert zipped["obs"].nbytes < plain["obs"].nbytes  # 4 levels of 256 compress well.
    for batch in (plain, zipped):
        restored = decompress(pickle.loads(pickle.dumps(batch)))
        np.testing.assert_array_equal(restored["obs"], obs)
        np.testing.assert_array_equal(restored["rewards"], 1.0)


def test_a_pong_sized_fragment_costs_about_a_quarter():
    k, b, t = 4, 5, 50
    obs, _ = stacked_obs(b, t, k, size=84, episode_len=23)
    raw = len(pickle.dumps(fragment(obs)["obs"]))
    coded_batch = encode_observations(fragment(obs), compress_observations=False)
    coded = len(pickle.dumps(coded_batch["obs"]))
    keys = int(coded_batch["obs"].keyframe_mask.sum())
    frames_sent = keys * k + (b * t - keys)
    assert coded == pytest.approx(raw * frames_sent / (b * t * k), rel=0.01)
    assert coded / raw < 0.3  # 1/k plus the keyframes at the starts.


def _image_config(**overrides) -> ImpalaConfig:
    config = (
        ImpalaConfig()
        .environment(envs.stacked_frames, env_config={"size": 10, "k": 4, "episode_len": 6})
        .env_runners(num_env_runners=1, num_envs_per_env_runner=2, rollout_fragment_length=9)
        .training(train_batch_size=18, model={"vf_share_layers": True})
        .reporting(min_time_s_per_iteration=0.5)
        .debugging(seed=0)
    )
    return config.update_from_dict(overrides)


@pytest.mark.slow
def test_actor_processes_send_coded_frames():
    config = _image_config(max_requests_in_flight_per_env_runner=2)
    plan = make_plan(config)
    (obs_space, act_space) = plan.spaces.policies["default_policy"]
    weights = build_model(obs_space, act_space, config.model).get_weights()
    actors = EnvRunnerGroup(config, plan, collections.Counter())
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
        column = batch["obs"]
        assert isinstance(column, FrameStackColumn)
        obs = decompress(batch)["obs"]
        assert obs.shape == (2, 9, 10, 10, 4)
        # The decoded stacks shift wherever no episode began (every 6 steps here).
        for t in range(1, 9):
            np.testing.assert_array_equal(
                ~column.keyframe_mask[:, t],
                np.all(obs[:, t, ..., :-1] == obs[:, t - 1, ..., 1:], axis=(1, 2, 3)),
            )
        assert column.keyframe_mask.sum() < column.keyframe_mask.size / 2


@pytest.mark.slow
def test_training_on_coded_zlib_frames_end_to_end():
    algo = _image_config(compress_observations=True, num_aggregation_workers=0).build()
    try:
        results = [algo.train() for _ in range(2)]
    finally:
        algo.stop()
    assert results[-1]["num_env_steps_trained"] > 0


def test_uint8_frames_reach_the_learner_shards_unchanged():
    config = _image_config(compress_observations=True)
    runner = EnvRunner(config, worker_index=1)
    obs_space, act_space = runner.observation_space, runner.action_space
    weights = build_model(obs_space, act_space, config.model).get_weights()
    runner.set_weights({"default_policy": (weights, 0)})
    batch = runner.sample().batches["default_policy"]
    sent = pickle.loads(pickle.dumps(encode_observations(batch, compress_observations=True)))
    assert isinstance(sent["obs"], FrameStackColumn)
    signature = pipeline.batch_signature(config, obs_space, act_space)
    (shard,) = pipeline.replica_shards(sent, signature, 1)
    assert signature["obs"].dtype == tf.uint8 and shard["obs"].dtype == np.uint8
    np.testing.assert_array_equal(shard["obs"], batch["obs"].reshape(-1, 10, 10, 4))
