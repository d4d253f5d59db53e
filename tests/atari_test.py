"""Atari: DeepMind preprocessing, the vector-env and wrapper paths, runner metrics, YAMLs."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import cv2
import gymnasium as gym
import numpy as np
import pytest

from impala_tf.config import ImpalaConfig
from impala_tf.driver.specs import env_spec, runner_spec
from impala_tf.envs import atari
from impala_tf.envs.atari_vector import AtariVectorEnvBatch
from impala_tf.envs.batch import GymEnvBatch
from impala_tf.envs.make import EnvSpec, make_env, make_env_batch
from impala_tf.rollout.env_runner import EnvRunner
from tests.support.processes import kill_session, log_tail, run_in_background

atari.ensure_registered("PongNoFrameskip-v4")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(env="PongNoFrameskip-v4", **overrides) -> ImpalaConfig:
    config = ImpalaConfig(env=env, num_env_runners=1, seed=1, **overrides)
    config.validate(require_env=True)
    return config


def _env_spec(config: ImpalaConfig, num_envs: int) -> EnvSpec:
    """`config`'s env spec, for a runner of `num_envs` envs."""
    return dataclasses.replace(env_spec(config), num_envs=num_envs)


def _raw(game_id: str, seed: int, **kwargs) -> gym.Env:
    env = gym.make(game_id, obs_type="grayscale", **kwargs)
    env.reset(seed=seed)
    return env


def _warp(frame: np.ndarray, dim: int) -> np.ndarray:
    return cv2.resize(frame, (dim, dim), interpolation=cv2.INTER_AREA)


def test_is_atari_and_lazy_registration():
    assert atari.is_atari("PongNoFrameskip-v4")
    assert atari.is_atari("ALE/Breakout-v5")
    assert not atari.is_atari("ALE/Breakout-v5", {"obs_type": "ram"})
    assert not atari.is_atari("CartPole-v1")
    assert atari.is_atari(gym.make("ALE/Pong-v5"))
    assert not atari.is_atari(gym.make("ALE/Pong-v5", obs_type="ram"))
    with pytest.raises(TypeError, match="is_atari"):
        atari.is_atari(3)


@pytest.mark.parametrize("dim", [42, 64, 84])
@pytest.mark.parametrize("framestack", [True, False])
def test_shapes_and_dtypes(dim, framestack):
    config = _config(model={"dim": dim, "framestack": framestack})
    env = make_env(env_spec(config), worker_index=1)
    k = 4 if framestack else 1
    assert env.observation_space.shape == (dim, dim, k)
    assert env.observation_space.dtype == np.uint8
    obs, _ = env.reset(seed=0)
    assert obs.shape == (dim, dim, k) and obs.dtype == np.uint8
    obs, *_ = env.step(0)
    assert obs.shape == (dim, dim, k) and obs.dtype == np.uint8
    batch = make_env_batch(_env_spec(config, num_envs=2), worker_index=1)
    assert isinstance(batch, AtariVectorEnvBatch)
    assert batch.observation_space == env.observation_space
    assert batch.reset([11, 12]).shape == (2, dim, dim, k)


def test_colour_frames_on_request():
    env = atari.DeepMindPreprocessing(gym.make("PongNoFrameskip-v4"), dim=42, grayscale=False)
    obs, _ = env.reset(seed=0)
    assert obs.shape == (42, 42, 12) and obs.dtype == np.uint8
    np.testing.assert_array_equal(obs[..., :3], obs[..., 9:])  # Reset fills the stack.
    with pytest.raises(ValueError, match="obs_type='rgb'"):
        atari.DeepMindPreprocessing(gym.make("PongNoFrameskip-v4", obs_type="grayscale"),
                                    grayscale=False)  # fmt: skip


def test_max_pooling_action_repeat_and_fire_reset():
    """Each step repeats the action 4 frames and max-pools the last two; reset presses FIRE."""
    env = atari.DeepMindPreprocessing(
        gym.make("BreakoutNoFrameskip-v4", obs_type="grayscale"),
        dim=84,
        noop_max=1,
        fire_after_life_loss=False,  # The raw env below does not serve after a lost life.
    )
    obs, _ = env.reset(seed=5)
    raw = _raw("BreakoutNoFrameskip-v4", 5)
    fire = raw.unwrapped.get_action_meanings().index("FIRE")
    screen, *_ = raw.step(fire)  # noop_max=1 in a FIRE game: no NOOP, one FIRE frame.
    assert env.unwrapped.ale.getEpisodeFrameNumber() == 1
    for i in range(4):
        np.testing.assert_array_equal(obs[..., i], _warp(screen, 84))
    rng = np.random.default_rng(0)
    pooled_differs = False
    for _ in range(60):
        action = int(rng.integers(4))
        obs, reward, *_ = env.step(action)
        frames, total = [], 0.0
        for _ in range(4):
            screen, r, *_ = raw.step(action)
            frames.append(screen)
            total += r
        expected = np.maximum(frames[-2], frames[-1])
        pooled_differs |= not np.array_equal(expected, frames[-1])
        np.testing.assert_array_equal(obs[..., -1], _warp(expected, 84))
        assert reward == total
    assert pooled_differs  # The inputs reached the max-pooling branch.


class _ActionLog(gym.Wrapper):
    """Keeps every action the wrapped env was stepped with."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.actions: list[int] = []

    def step(self, action):
        self.actions.append(int(action))
        return self.env.step(action)


@pytest.mark.parametrize("game, fire", [("ALE/Pong-v5", 1), ("ALE/Freeway-v5", None)])
def test_reset_presses_fire_last_only_in_games_with_fire(game, fire):
    log = _ActionLog(gym.make(game, obs_type="grayscale"))
    env = atari.DeepMindPreprocessing(log, frame_skip=1)
    for seed in range(3):
        log.actions.clear()
        env.reset(seed=seed)
        assert log.actions, "a reset takes at least one step"
        if fire is None:  # Freeway has no FIRE: NOOPs only.
            assert set(log.actions) == {0}
        else:
            assert log.actions[-1] == fire and set(log.actions[:-1]) <= {0}


def test_action_repeat_only_for_envs_that_do_not_skip_frames():
    env = make_env(
        env_spec(_config(env="ALE/Freeway-v5", env_config={"frameskip": 1})), worker_index=1
    )
    assert env.frame_skip == 4
    # v5 ids skip 4 frames themselves: no extra action repeat, no max-pooling (as RLlib).
    v5 = make_env(env_spec(_config(env="ALE/Pong-v5")), worker_index=1)
    assert v5.frame_skip == 1
    assert isinstance(
        make_env_batch(_env_spec(_config(env="ALE/Pong-v5"), num_envs=2), 1), GymEnvBatch
    )


def test_noop_reset_takes_1_to_30_frames():
    env = atari.DeepMindPreprocessing(gym.make("ALE/Freeway-v5", frameskip=1,
                                               obs_type="grayscale"))  # fmt: skip
    frames = set()
    for seed in range(40):
        env.reset(seed=seed)
        frames.add(env.unwrapped.ale.getEpisodeFrameNumber())
    assert min(frames) >= 1 and max(frames) <= 30 and len(frames) > 10


def test_episodic_life_ends_training_episodes_not_games():
    env = atari.DeepMindPreprocessing(
        gym.make("BreakoutNoFrameskip-v4", obs_type="grayscale"),
        dim=42,
        episodic_life=True,
        fire_after_life_loss=False,
    )
    obs, _ = env.reset(seed=3)
    rng = np.random.default_rng(3)
    life_ends = 0
    while True:
        lives = env.unwrapped.ale.lives()
        obs, _, terminated, truncated, info = env.step(int(rng.integers(4)))
        if info["game_over"]:
            break
        if terminated:
            life_ends += 1
            assert env.unwrapped.ale.lives() == lives - 1
            frame = env.unwrapped.ale.getEpisodeFrameNumber()
            again, reset_info = env.reset()
            assert not reset_info["game_over"]
            np.testing.assert_array_equal(again, obs)  # The game goes on.
            assert env.unwrapped.ale.getEpisodeFrameNumber() == frame
    assert life_ends == 4  # Breakout has 5 lives.


def test_fire_games_serve_again_after_a_lost_life():
    """RLlib's EpisodicLifeEnv + FireResetEnv: NOOP, FIRE, action 2 after each lost life.

    A policy that never presses FIRE still plays whole Breakout games: each lost life is followed
    by a served ball. Without the serve the game would wait at the first lost life.
    """
    env = atari.DeepMindPreprocessing(
        gym.make("BreakoutNoFrameskip-v4", obs_type="grayscale"), dim=42, episodic_life=True
    )
    obs, _ = env.reset(seed=5)
    life_ends = steps = 0
    while steps < 5_000:
        obs, _, terminated, _, info = env.step(0)  # NOOP only.
        steps += 1
        if info["game_over"]:
            break
        if terminated:
            life_ends += 1
            frame = env.unwrapped.ale.getEpisodeFrameNumber()
            again, reset_info = env.reset()
            assert not reset_info["game_over"]
            assert env.unwrapped.ale.getEpisodeFrameNumber() == frame + 3 * atari.FRAME_SKIP
            # The stack is refilled with the frame after the serve (RLlib's FrameStack reset).
            for k in range(1, again.shape[-1]):
                np.testing.assert_array_equal(again[..., k], again[..., 0])
    assert info["game_over"] and life_ends == 4, (steps, life_ends)
    # Whole games (evaluation, no episodic life): the serve happens inside the step.
    env = atari.DeepMindPreprocessing(gym.make("BreakoutNoFrameskip-v4", obs_type="grayscale"))
    env.reset(seed=5)
    for _ in range(5_000):
        _, _, terminated, truncated, info = env.step(0)
        assert terminated == info["game_over"] and not truncated
        if terminated:
            break
    assert info["game_over"] and env.unwrapped.ale.lives() == 0
    # Pong has FIRE but no lives: nothing to serve, and the vector env keeps it.
    pong = env_spec(_config(env="PongNoFrameskip-v4"))
    breakout = env_spec(_config(env="BreakoutNoFrameskip-v4"))
    assert atari.vector_env_kwargs(pong, True, 2) is not None
    assert atari.vector_env_kwargs(breakout, True, 2) is None
    assert atari.vector_env_kwargs(breakout, False, 2) is not None


@pytest.mark.parametrize("worker_index", [0, 1])
def test_runner_reports_whole_games_with_clipped_training_rewards(worker_index):
    """Training runners end episodes at lost lives; returns are whole games."""
    config = _config(
        env="BreakoutNoFrameskip-v4",
        num_envs_per_env_runner=2,
        rollout_fragment_length=100,
        model={"dim": 42, "conv_filters": [[4, 8, 4], [8, 4, 2], [16, 3, 1]]},
    )
    runner = EnvRunner(runner_spec(config), worker_index=worker_index)
    # Breakout serves again after a lost life: the wrapper path, also for training.
    assert not isinstance(runner.env_batch, AtariVectorEnvBatch)
    terminations, returns, lengths, rewards = 0, [], [], []
    while len(returns) < 2:
        fragment = runner.sample()
        batch = fragment.batches["default_policy"]
        # Frames sent once (impala_tf.models.frames): the stacks' newest frames, 42x42 gray.
        frames = batch["obs_frames"]
        assert frames.dtype == np.uint8 and frames.shape[1:] == (100 + 3, 42, 42, 1)
        terminations += int(batch["terminateds"].sum())
        rewards.append(batch["rewards"])
        returns += [e.ret for e in fragment.episodes]
        lengths += [e.length for e in fragment.episodes]
    rewards = np.concatenate(rewards, axis=None)
    assert set(np.unique(rewards)) <= {0.0, 1.0}  # Clipped to the sign (Breakout pays 1, 4, 7).
    assert all(length > 20 for length in lengths)
    if worker_index == 1:
        assert terminations >= 4 * len(returns)  # 5 lives per game.
    else:
        assert terminations == len(returns)  # Evaluation: episodes are games.
    runner.close()


def test_unclipped_returns_and_preprocessor_pref_off():
    config = _config(env="ALE/Pong-v5", preprocessor_pref=None, num_envs_per_env_runner=1)
    env = make_env(env_spec(config), worker_index=1)
    assert env.observation_space.shape == (210, 160, 3)
    assert env_spec(config).clip_rewards_for(True) is None
    assert env_spec(_config()).clip_rewards_for(True) is True
    assert env_spec(_config(clip_rewards=False)).clip_rewards_for(True) is False
    assert env_spec(_config(env="CartPole-v1")).clip_rewards_for(False) is None
    assert atari.vector_env_kwargs(env_spec(config), training=True, num_envs=2) is None
    rllib = _config(env="ALE/Pong-v5", preprocessor_pref="rllib")
    assert make_env(env_spec(rllib)).observation_space.shape == (210, 160, 3)
    with pytest.raises(ValueError, match="preprocessor_pref"):
        _config(preprocessor_pref="dqn")


@pytest.mark.parametrize("game", ["pong", "breakout"])
def test_vector_env_and_wrapper_paths_are_identical(game):
    """Same seeds and actions give the same observations, rewards and episode ends.

    The one documented difference is the no-op count at reset: ale-py draws it from its C++
    mt19937, the wrapper from the env's numpy generator. `noop_max=1` makes it the same.
    """
    game_id = {"pong": "PongNoFrameskip-v4", "breakout": "BreakoutNoFrameskip-v4"}[game]
    kwargs = atari.vector_env_kwargs(
        env_spec(_config(env=game_id)), training=True, num_envs=2, fire_after_life_loss=False
    )
    kwargs.update(noop_max=1, num_threads=1)
    vector = AtariVectorEnvBatch(**kwargs)
    wrapped = GymEnvBatch(
        [
            atari.DeepMindPreprocessing(
                gym.make(game_id, obs_type="grayscale"),
                noop_max=1,
                episodic_life=True,
                fire_after_life_loss=False,
            )
            for _ in range(2)
        ]
    )
    np.testing.assert_array_equal(vector.reset([1001, 1002]), wrapped.reset([1001, 1002]))
    rng = np.random.default_rng(0)
    ends = terminations = 0
    for _ in range(900 if game == "pong" else 400):
        actions = rng.integers(0, vector.action_space.n, 2)
        a, b = vector.step(actions), wrapped.step(actions)
        np.testing.assert_array_equal(a.obs, b.obs)
        np.testing.assert_array_equal(a.rewards, b.rewards)
        np.testing.assert_array_equal(a.terminateds, b.terminateds)
        np.testing.assert_array_equal(a.truncateds, b.truncateds)
        np.testing.assert_array_equal(a.episode_ends, b.episode_ends)
        np.testing.assert_array_equal(a.stack_restarts, b.stack_restarts)  # impala_tf.models.frames
        ends += int(a.episode_ends.sum())
        terminations += int(a.terminateds.sum())
    assert ends >= 1 and (game == "pong" or terminations > ends)  # Resets and life losses ran.
    vector.close()


@pytest.mark.parametrize(
    "game_id, env_config, path",
    [
        ("PongNoFrameskip-v4", {"max_num_frames_per_episode": 400}, AtariVectorEnvBatch),
        ("BreakoutNoFrameskip-v4", {}, GymEnvBatch),  # Serves after lost lives refill stacks.
    ],
)
def test_frames_rebuild_the_stacks_of_both_atari_paths(game_id, env_config, path):
    """A runner sending frames (`impala_tf.models.frames`) and one sending stacks, same seed and
    weights: the stacks rebuilt from the frames are the env's, refills included."""
    from impala_tf.models import build_model
    from impala_tf.models.frames import rebuild_stacks_np

    config = _config(
        env=game_id, env_config=env_config, num_envs_per_env_runner=2,
        rollout_fragment_length=50, model={"dim": 42},
    )  # fmt: skip
    spec = runner_spec(config)
    framed, plain = EnvRunner(spec, worker_index=1), EnvRunner(spec, worker_index=1)
    assert isinstance(framed.env_batch, path) and framed.frame_stack == (4, 1)
    plain.frame_stack = None
    model = build_model(framed.observation_space, framed.action_space, config.model)
    for runner in (framed, plain):
        runner.set_weights({"default_policy": (model.get_weights(), 0)})
    refills = 0
    for _ in range(3 if path is AtariVectorEnvBatch else 6):
        a = framed.sample().batches["default_policy"]
        b = plain.sample().batches["default_policy"]
        np.testing.assert_array_equal(a["actions"], b["actions"])
        np.testing.assert_array_equal(rebuild_stacks_np(a["obs_frames"], a["obs_restarts"]),
                                      b["obs"])  # fmt: skip
        refills += int(a["obs_restarts"].sum())
    assert refills > 0  # Resets (Pong, 100-step games) or serves (Breakout) happened.


# Trained for two iterations: Pong's vector-env path. Breakout's gymnasium-wrapper path runs in
# tune_test (RLlib's unedited four-game atari-impala.yaml); RLlib's GPU-sized Pong copies
# (pong-impala, pong-impala-fast) differ from pong-impala-small only in values: config_test
# reads and validates every shipped YAML.
ATARI_YAMLS = ("pong-impala-small",)


@pytest.fixture(scope="module")
def atari_yaml_runs(tmp_path_factory) -> dict[str, tuple[int, object, str]]:
    """Every Atari YAML for two iterations, the binaries started together; (code, logdir, log)."""
    root = tmp_path_factory.mktemp("atari-yamls")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": REPO}
    started = {}
    for name in ATARI_YAMLS:
        args = [
            sys.executable, "-m", "impala_tf.bin.train", f"--config=configs/{name}.yaml",
            f"--logdir={root / name}", "--stop_iters=2", "--set=num_env_runners=1",
            "--set=num_envs_per_env_runner=2", "--set=rollout_fragment_length=10",
            "--set=train_batch_size=20", "--set=min_time_s_per_iteration=0.3",
            "--set=num_gpus=0", "--set=num_multi_gpu_tower_stacks=1",
            "--set=model.conv_filters=[[4, 8, 4], [8, 4, 2], [16, 3, 1]]",
        ]  # fmt: skip
        log = root / f"{name}.log"
        started[name] = (run_in_background(args, REPO, env, log), log)
    runs = {}
    for name, (process, log) in started.items():
        try:
            code = process.wait(timeout=600)
        finally:
            kill_session(process)
        runs[name] = (code, root / name, log_tail(log))
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("name", ATARI_YAMLS)
def test_impala_train_runs_each_atari_yaml(atari_yaml_runs, name):
    code, logdir, log = atari_yaml_runs[name]
    assert code == 0, log
    with open(logdir / "result.json") as f:
        results = [json.loads(line) for line in f]
    assert [r["training_iteration"] for r in results] == [1, 2]
    assert results[-1]["num_env_steps_trained"] > 0
