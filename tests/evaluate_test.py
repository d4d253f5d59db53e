"""Tests of impala_tf.checkpoints and the impala-evaluate binary (run as a subprocess).

Checkpoints are written from an `ImpalaLearner` with random weights (no algorithm, no actor
processes). Video is tested on a CartPole whose frames are drawn with numpy, since gymnasium's
CartPole renders with pygame, which is not a dependency; the binary imports this module through
the gymnasium id `tests.evaluate_test:ImpalaTfRenderedCartPole-v0`.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.envs.classic_control.cartpole import CartPoleEnv

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RENDER_ENV_ID = "ImpalaTfRenderedCartPole-v0"
RENDER_ENV = f"tests.evaluate_test:{RENDER_ENV_ID}"
FRAME_SHAPE = (24, 64, 3)


class RenderedCartPole(CartPoleEnv):
    """CartPole-v1 whose `rgb_array` frames are drawn with numpy.

    The top row counts the steps of the episode, so consecutive frames always differ (GIF
    writers may merge equal ones).
    """

    def reset(self, *, seed=None, options=None):
        self._steps = 0
        return super().reset(seed=seed, options=options)

    def step(self, action):
        self._steps += 1
        return super().step(action)

    def render(self):
        height, width, _ = FRAME_SHAPE
        frame = np.full(FRAME_SHAPE, 255, np.uint8)
        x = int(np.clip((self.state[0] + 2.4) / 4.8 * (width - 1), 2, width - 3))
        frame[height - 6 : height - 2, x - 2 : x + 3] = (0, 0, 192)
        frame[0, : self._steps % width] = 0
        return frame


if RENDER_ENV_ID not in gym.registry:
    gym.register(RENDER_ENV_ID, entry_point=RenderedCartPole, max_episode_steps=500)


def write_test_checkpoint(directory, env="CartPole-v1", model=None, seed=0):
    """Writes a checkpoint of a learner with random (not initial) weights; returns it."""
    from impala_tf.actors.env_runner import make_env
    from impala_tf.checkpoints import write_checkpoint
    from impala_tf.config import ImpalaConfig
    from impala_tf.learner import ImpalaLearner

    config = (
        ImpalaConfig()
        .environment(env)
        .training(model=model or {"fcnet_hiddens": [16]})
        .debugging(seed=seed)
    )
    probe = make_env(config)
    learner = ImpalaLearner(config, probe.observation_space, probe.action_space)
    probe.close()
    rng = np.random.default_rng(seed)
    learner.set_policy_weights(
        [rng.normal(scale=0.5, size=w.shape).astype(w.dtype) for w in learner.get_policy_weights()]
    )
    learner.num_grad_updates.assign(7)
    learner.num_agent_steps_trained.assign(3500)
    write_checkpoint(str(directory), learner, config, {"iteration": 3})
    return config, learner


def run_module(module, *args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        cwd=REPO,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": REPO},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_python(code, timeout=60):
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": REPO},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# impala_tf.checkpoints ---------------------------------------------------------------------------


def test_write_checkpoint_restores_every_learner_part(tmp_path):
    from impala_tf.checkpoints import (
        DRIVER_STATE_FILE,
        learner_checkpoint,
        load_config,
        read_driver_state,
    )
    from impala_tf.learner import ImpalaLearner

    config, learner = write_test_checkpoint(tmp_path / "ckpt")
    assert sorted(os.listdir(tmp_path / "ckpt")) == [
        DRIVER_STATE_FILE,
        "learner.data-00000-of-00001",
        "learner.index",
    ]
    state = read_driver_state(str(tmp_path / "ckpt"))
    assert state["iteration"] == 3
    assert state["config"] == json.loads(json.dumps(config.to_dict()))
    assert load_config(str(tmp_path / "ckpt")).to_dict() == config.to_dict()

    # What `Impala.restore` does: every part, optimizer slots and counters included.
    fresh = ImpalaLearner(config, learner.observation_space, learner.action_space)
    learner_checkpoint(fresh).read(str(tmp_path / "ckpt" / "learner")).assert_consumed()
    assert int(fresh.num_grad_updates.numpy()) == 7
    assert int(fresh.num_agent_steps_trained.numpy()) == 3500
    for got, want in zip(fresh.get_policy_weights(), learner.get_policy_weights(), strict=True):
        np.testing.assert_array_equal(got, want)


def test_load_config_refuses_a_checkpoint_of_an_env_callable(tmp_path):
    from impala_tf.checkpoints import load_config, read_driver_state, write_checkpoint
    from impala_tf.config import ImpalaConfig
    from impala_tf.learner import ImpalaLearner

    config = ImpalaConfig().environment(lambda ctx: gym.make("CartPole-v1"))
    config.training(model={"fcnet_hiddens": [4]})
    probe = gym.make("CartPole-v1")
    learner = ImpalaLearner(config, probe.observation_space, probe.action_space)
    write_checkpoint(str(tmp_path), learner, config)
    assert read_driver_state(str(tmp_path))["config"] is None
    with pytest.raises(ValueError, match="env_creator callable"):
        load_config(str(tmp_path))


def test_resolve_checkpoint_dir(tmp_path):
    from impala_tf.checkpoints import DRIVER_STATE_FILE, resolve_checkpoint_dir

    def make(path):
        path.mkdir(parents=True)
        (path / DRIVER_STATE_FILE).write_text("{}")
        return str(path)

    direct = make(tmp_path / "a" / "checkpoint")
    assert resolve_checkpoint_dir(direct) == direct
    assert resolve_checkpoint_dir(str(tmp_path / "a")) == direct  # A training logdir.
    make(tmp_path / "b" / "checkpoint" / "checkpoint_000002")
    latest = make(tmp_path / "b" / "checkpoint" / "checkpoint_000010")
    assert resolve_checkpoint_dir(str(tmp_path / "b")) == latest
    assert resolve_checkpoint_dir(str(tmp_path / "b" / "checkpoint")) == latest
    with pytest.raises(FileNotFoundError, match="No checkpoint at"):
        resolve_checkpoint_dir(str(tmp_path / "missing"))


def test_load_policy_restores_the_model_weights(tmp_path):
    from impala_tf.checkpoints import load_config, load_policy

    _, learner = write_test_checkpoint(tmp_path, model={"fcnet_hiddens": [16], "use_lstm": True})
    config, policy = load_policy(str(tmp_path), explore=False)
    assert config.model["use_lstm"] and not policy.explore
    for got, want in zip(policy.get_weights(), learner.get_policy_weights(), strict=True):
        np.testing.assert_array_equal(got, want)

    other = load_config(str(tmp_path))
    other.training(model={"fcnet_hiddens": [16], "use_lstm": True, "lstm_cell_size": 8})
    with pytest.raises((ValueError, AssertionError)):
        load_policy(str(tmp_path), config=other)


def test_restore_model_refuses_variables_a_checkpoint_cannot_hold(tmp_path):
    import keras
    import tensorflow as tf

    from impala_tf.checkpoints import DRIVER_STATE_FILE, restore_model, untracked_variables

    class ListTorso(keras.layers.Layer):
        def __init__(self):
            super().__init__(name="list_torso")
            self.hidden = [keras.layers.Dense(3, name="in_list")]
            self.head = keras.layers.Dense(2, name="attribute")

        def call(self, x):
            return self.head(self.hidden[0](x))

    model = ListTorso()
    model(tf.zeros([1, 4]))
    assert [v.path for v in untracked_variables(model)] == [
        "list_torso/in_list/kernel",
        "list_torso/in_list/bias",
    ]
    (tmp_path / DRIVER_STATE_FILE).write_text("{}")
    tf.train.Checkpoint(model=model).write(str(tmp_path / "learner"))
    with pytest.raises(ValueError, match="2 of the model's 4 variables"):
        restore_model(model, str(tmp_path))


def test_load_env_runner_is_reproducible_with_a_seed(tmp_path):
    from impala_tf.checkpoints import load_config, load_env_runner

    write_test_checkpoint(tmp_path)

    def episodes(seed, explore):
        config = load_config(str(tmp_path)).debugging(seed=seed)
        _, runner = load_env_runner(str(tmp_path), explore=explore, config=config)
        try:
            return runner.run_episodes(5)
        finally:
            runner.close()

    sampled = episodes(0, explore=True)
    assert len(sampled) == 5
    assert episodes(0, explore=True) == sampled
    assert episodes(1, explore=True) != sampled
    assert episodes(0, explore=False) != sampled


# The impala-evaluate binary ----------------------------------------------------------------------


def test_evaluate_reports_the_returns_and_records_a_gif(tmp_path):
    from PIL import Image

    from impala_tf.checkpoints import load_config, load_env_runner

    write_test_checkpoint(tmp_path / "ckpt", env=RENDER_ENV)
    video = tmp_path / "episode.gif"
    proc = run_module(
        "impala_tf.bin.evaluate",
        f"--checkpoint={tmp_path / 'ckpt'}",
        "--episodes=3",
        "--explore=false",
        "--seed=5",
        f"--video={video}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    assert "return mean" in lines[-2] and "explore=False" in lines[-2]

    config = load_config(str(tmp_path / "ckpt")).debugging(seed=5)
    _, runner = load_env_runner(str(tmp_path / "ckpt"), explore=False, config=config)
    episodes = runner.run_episodes(3)
    runner.close()
    returns = [r for r, _ in episodes]
    assert summary == {
        "episodes": 3,
        "episode_reward_mean": pytest.approx(np.mean(returns)),
        "episode_reward_min": min(returns),
        "episode_reward_max": max(returns),
        "episode_len_mean": pytest.approx(np.mean([n for _, n in episodes])),
    }

    with Image.open(video) as gif:
        # The first episode: one frame after the reset, one after each step.
        assert gif.n_frames == episodes[0][1] + 1
        assert gif.size == (FRAME_SHAPE[1], FRAME_SHAPE[0])
        assert gif.info["duration"] == 20  # The env's render_fps is 50.


@pytest.mark.parametrize(
    "args, message",
    [
        (["--checkpoint={tmp}/missing"], "No checkpoint at"),
        (["--checkpoint={tmp}", "--video={tmp}/out.avi"], "use a .gif or .mp4"),
    ],
)
def test_evaluate_explains_bad_arguments(tmp_path, args, message):
    proc = run_module("impala_tf.bin.evaluate", *(a.format(tmp=tmp_path) for a in args))
    assert proc.returncode == 1
    assert message in proc.stderr


def test_evaluate_mp4_without_imageio_says_what_to_install(tmp_path):
    import importlib.util

    write_test_checkpoint(tmp_path / "ckpt", env=RENDER_ENV)
    video = tmp_path / "episode.mp4"
    proc = run_module(
        "impala_tf.bin.evaluate",
        f"--checkpoint={tmp_path / 'ckpt'}",
        "--episodes=1",
        f"--video={video}",
    )
    if importlib.util.find_spec("imageio") is None:
        assert proc.returncode == 1
        assert "pip install 'imageio[ffmpeg]'" in proc.stderr
        assert not video.exists()
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert video.stat().st_size > 0


def test_evaluate_video_of_classic_control_needs_pygame(tmp_path):
    import importlib.util

    write_test_checkpoint(tmp_path / "ckpt")  # gymnasium's own CartPole-v1.
    video = tmp_path / "episode.gif"
    proc = run_module(
        "impala_tf.bin.evaluate",
        f"--checkpoint={tmp_path / 'ckpt'}",
        "--episodes=1",
        f"--video={video}",
    )
    if importlib.util.find_spec("pygame") is None:
        assert proc.returncode == 1
        assert "gymnasium[classic-control]" in proc.stderr
        assert "needed to render --video" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert video.stat().st_size > 0


def test_builtin_gif_encoder_decodes_to_the_332_palette(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    # Random pixels overflow the 4096-entry LZW table (a clear code mid-frame); the flat frame
    # grows long codes; odd sizes check the row layout.
    frames = [
        rng.integers(0, 256, (48, 90, 3), dtype=np.uint8),
        np.full((48, 90, 3), 77, np.uint8),
        rng.integers(0, 256, (48, 90, 3), dtype=np.uint8),
    ]
    np.save(tmp_path / "frames.npy", np.stack(frames))
    # The binary's module defines absl flags; importing it in this process could clash with
    # another binary's flags, so it runs in its own.
    proc = run_python(
        "import numpy as np\n"
        "from impala_tf.bin.evaluate import write_gif\n"
        f"frames = list(np.load({str(tmp_path / 'frames.npy')!r}))\n"
        f"write_gif({str(tmp_path / 'out.gif')!r}, frames, fps=25, use_pillow=False)\n"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    levels3 = np.arange(8) * 255 // 7
    levels2 = np.arange(4) * 255 // 3
    with Image.open(io.BytesIO((tmp_path / "out.gif").read_bytes())) as gif:
        assert gif.n_frames == len(frames)
        assert gif.info["loop"] == 0 and gif.info["duration"] == 40
        for i, frame in enumerate(frames):
            gif.seek(i)
            want = np.stack(
                [
                    levels3[frame[..., 0] >> 5],
                    levels3[frame[..., 1] >> 5],
                    levels2[frame[..., 2] >> 6],
                ],
                axis=-1,
            )
            np.testing.assert_array_equal(np.asarray(gif.convert("RGB")), want)
