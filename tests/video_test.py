"""Evaluation videos (`impala_tf.envs.video`): GIF encoding with Pillow, the episode recorder,
Atari frames, and RLlib's `render_env` / `record_env` during training, read back from TensorBoard's
event files and from the `record_env` files.

The recorder is tested on small fake envs whose frames say which episode and step they show;
training runs on `small_config`'s CartPole and two-agent MultiAgentCartPole, which render real
CartPoles with pygame (the test extra's `gymnasium[classic-control]`).
"""

from __future__ import annotations

import io
import json
import os
import re

import gymnasium as gym
import numpy as np
import pytest
from PIL import Image

from impala_tf.envs.video import EpisodeRecorder, Recording, Video, encode_gif, write_video
from tests.support.configs import small_config


def _gif_frames(data: bytes) -> tuple[Image.Image, list[np.ndarray]]:
    """The GIF's info and its frames decoded to rgb arrays."""
    gif = Image.open(io.BytesIO(data))
    frames = []
    for i in range(gif.n_frames):
        gif.seek(i)
        frames.append(np.asarray(gif.convert("RGB")))
    return gif, frames


# Encoding ---------------------------------------------------------------------------------------


def test_encode_gif_round_trips_frames_of_few_colours():
    rng = np.random.default_rng(0)
    palette = rng.integers(0, 256, size=(6, 3), dtype=np.uint8)
    frames = [palette[rng.integers(0, 6, size=(12, 20))] for _ in range(5)]
    data = encode_gif(frames, fps=25)
    assert data.startswith(b"GIF89a")
    gif, decoded = _gif_frames(data)
    assert gif.size == (20, 12) and gif.n_frames == 5
    assert gif.info["loop"] == 0 and gif.info["duration"] == 40  # 25 fps.
    for got, want in zip(decoded, frames, strict=True):
        np.testing.assert_array_equal(got, want)  # Six colours: no quantisation loss.
    with pytest.raises(ValueError, match="No frames"):
        encode_gif([], fps=25)


def test_write_video_writes_a_gif_and_refuses_other_formats(tmp_path):
    frames = np.zeros((3, 8, 8, 3), np.uint8)
    frames[np.arange(3), 0, np.arange(3)] = 255
    write_video(str(tmp_path / "a.gif"), frames, fps=10)
    gif, decoded = _gif_frames((tmp_path / "a.gif").read_bytes())
    assert gif.n_frames == 3 and gif.info["duration"] == 100
    np.testing.assert_array_equal(np.stack(decoded), frames)
    with pytest.raises(ValueError, match="use a .gif or .mp4"):
        write_video(str(tmp_path / "a.avi"), frames, fps=10)


# The recorder -----------------------------------------------------------------------------------


class Counter(gym.Env):
    """Episodes of `length` steps whose frames show (episode, step) in pixel [0, 0].

    `render_mode=None` renders nothing; `image_obs` makes observations rgb images of the frame.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 20}

    def __init__(self, length=3, render_mode="rgb_array", image_obs=False, width=10):
        self.length, self.render_mode, self.image_obs, self.width = (
            length,
            render_mode,
            image_obs,
            width,
        )
        shape = (4, width, 3) if image_obs else (1,)
        self.observation_space = gym.spaces.Box(0, 255, shape, np.uint8)
        self.action_space = gym.spaces.Discrete(2)
        self.episode, self.t, self.renders = -1, 0, 0

    def _frame(self):
        frame = np.zeros((4, self.width, 3), np.uint8)
        frame[0, 0] = (self.episode, self.t, 7)
        return frame

    def _obs(self):
        return self._frame() if self.image_obs else np.zeros(1, np.uint8)

    def reset(self, *, seed=None, options=None):
        self.episode, self.t = self.episode + 1, 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        return self._obs(), 1.0, self.t >= self.length, False, {}

    def render(self):
        self.renders += 1
        return self._frame() if self.render_mode == "rgb_array" else None


def _play(env, episodes):
    for _ in range(episodes):
        env.reset()
        done = False
        while not done:
            _, _, terminated, truncated, _ = env.step(0)
            done = terminated or truncated
    env.reset()  # As an env runner does after an episode ends.


def _shown(recording: Recording) -> list[tuple[int, int]]:
    return [(int(f[0, 0, 0]), int(f[0, 0, 1])) for f in recording.frames]


def test_recorder_keeps_the_asked_episodes_only_while_recording():
    env = Counter(length=3)
    recorder = EpisodeRecorder(env, max_frames=100)
    _play(recorder, 1)
    assert env.renders == 0 and recorder.stop() == []  # Off until started.

    recorder.start(2)
    recorder.reset()  # A reset with no step (the evaluation's seeded reset) begins no episode.
    _play(recorder, 3)
    recordings = recorder.stop()
    assert [_shown(r) for r in recordings] == [
        [(3, 0), (3, 1), (3, 2), (3, 3)],  # n steps: n + 1 frames.
        [(4, 0), (4, 1), (4, 2), (4, 3)],
    ]
    assert all(r.fps == 20 and not r.cut for r in recordings)
    assert recordings[0].frames.dtype == np.uint8 and recordings[0].frames.shape == (4, 4, 10, 3)
    renders = env.renders
    _play(recorder, 1)
    assert env.renders == renders  # Stopped: no more rendering.

    recorder.start(5)  # The episode begun by the last reset is never played: left out.
    _play(recorder, 1)
    assert [len(r.frames) for r in recorder.stop()] == [4]


def test_recorder_bounds_frames_per_episode_and_their_width():
    recorder = EpisodeRecorder(Counter(length=6, width=40), max_frames=3, max_width=20)
    recorder.start(1)
    _play(recorder, 1)
    (recording,) = recorder.stop()
    assert recording.cut and recording.frames.shape == (3, 2, 20, 3)  # 4 x 40 -> 2 x 20.

    full = EpisodeRecorder(Counter(length=2, width=40), max_frames=3, max_width=None)
    full.start(1)
    _play(full, 1)
    (recording,) = full.stop()
    assert not recording.cut and recording.frames.shape == (3, 4, 40, 3)


def test_recorder_falls_back_to_image_observations_and_explains_an_env_without_frames():
    recorder = EpisodeRecorder(Counter(length=2, render_mode=None, image_obs=True))
    recorder.start(1)
    _play(recorder, 1)
    (recording,) = recorder.stop()
    assert _shown(recording) == [(0, 0), (0, 1), (0, 2)]

    recorder = EpisodeRecorder(Counter(length=2, render_mode=None))
    recorder.start(1)
    with pytest.raises(ValueError, match="rendered no frame.*render_mode.*rgb_array"):
        recorder.reset()


def test_video_repr_is_short_and_save_writes_the_gif(tmp_path):
    frames = np.zeros((2, 4, 6, 3), np.uint8)
    frames[1] = 255
    video = Video.encode(Recording(frames, 12.5))
    assert (video.width, video.height, video.num_frames) == (6, 4, 2)
    assert re.fullmatch(r"Video\(2 frames, 6x4, 12.5 fps, \d+ bytes GIF\)", repr(video))
    video.save(str(tmp_path / "sub" / "v.gif"))
    assert (tmp_path / "sub" / "v.gif").read_bytes() == video.gif


# Atari ------------------------------------------------------------------------------------------


def test_evaluator_records_atari_in_colour_at_the_screen_size():
    from impala_tf.config import ImpalaConfig
    from impala_tf.driver.evaluation import Evaluator
    from impala_tf.driver.specs import evaluator_spec, probe_spaces
    from impala_tf.models import build_model

    config = ImpalaConfig(
        env="ALE/Pong-v5",
        env_config={"max_episode_steps": 60},  # Up to 30 reset no-ops, then >= 30 steps.
        model={"dim": 42, "conv_filters": [[4, [8, 8], 4], [8, [6, 6], 6]]},
        render_env=True,
        video_max_frames=8,
        video_max_width=None,
        seed=1,
    )
    obs, act = probe_spaces(config).policies["default_policy"]
    assert obs.shape == (42, 42, 4)  # The policy sees DeepMind's grey frames ...
    weights = {"default_policy": (build_model(obs, act, config.model).get_weights(), 0)}
    evaluator = Evaluator(evaluator_spec(config))
    try:
        episodes = evaluator.run(weights, None, 1, seed=1)
    finally:
        evaluator.close()
    (recording,) = evaluator.videos
    assert episodes[0].length + 1 > 8 and recording.cut
    frames = recording.frames
    assert frames.shape == (8, 210, 160, 3)  # ... the video ale-py's colour screen.
    assert np.any(frames[..., 0] != frames[..., 1])


# Training: TensorBoard and files ---------------------------------------------------------------


@pytest.mark.parametrize("policies", [1, 2], ids=["single_agent", "multi_agent"])
def test_render_env_writes_animated_gifs_to_tensorboard_and_record_env_to_files(tmp_path, policies):
    import tensorflow as tf
    from tensorboard.backend.event_processing import event_accumulator

    from impala_tf.training.callbacks import ResultLogger
    from impala_tf.training.loop import fit

    config = small_config(
        policies,
        num_env_runners=1,
        min_time_s_per_iteration=0,
        evaluation_interval=1,
        evaluation_duration=3,
        evaluation_config={
            "render_env": True,
            "record_env": "clips",
            "video_episodes": 2,
            "video_max_frames": 40,
            "video_max_width": 120,
            "video_interval": 2,
        },
    )
    algo = config.build(logdir=str(tmp_path))
    try:
        fit(algo, [ResultLogger(str(tmp_path))], max_iterations=3)
    finally:
        algo.stop()
    # A CartPole frame is 600 x 400; the multi-agent one shows the two side by side.
    size = (120, 80) if policies == 1 else (120, 40)

    results = [json.loads(line) for line in (tmp_path / "result.json").read_text().splitlines()]
    media = [r["evaluation"].get("episode_media") for r in results]
    assert media[1] is None  # video_interval=2: the first and third evaluations record.
    for entry in (media[0], media[2]):
        assert len(entry["video"]) == 2  # Two of the three episodes.
        for described in entry["video"]:
            frames = int(re.match(r"Video\((\d+) frames, (\d+)x(\d+)", described).group(1))
            assert 2 <= frames <= 40
            assert f"{size[0]}x{size[1]}" in described

    accumulator = event_accumulator.EventAccumulator(
        str(tmp_path), size_guidance={event_accumulator.TENSORS: 0}
    )
    accumulator.Reload()
    events = accumulator.Tensors("evaluation/video")
    assert [e.step for e in events] == [
        results[0]["timesteps_total"],
        results[2]["timesteps_total"],
    ]
    metadata = accumulator.SummaryMetadata("evaluation/video")
    assert metadata.plugin_data.plugin_name == "images"
    for event in events:
        width, height, *gifs = tf.make_ndarray(event.tensor_proto)
        assert (int(width), int(height)) == size and len(gifs) == 2
        for data in gifs:
            gif, frames = _gif_frames(data)
            assert gif.format == "GIF" and gif.is_animated and gif.size == size
            assert 1 < gif.n_frames <= 40 and frames[0].shape == (size[1], size[0], 3)

    files = sorted(os.listdir(tmp_path / "clips"))
    assert files == [f"iteration_{i:06d}_episode_{k}.gif" for i in (1, 3) for k in (0, 1)]
    assert (tmp_path / "clips" / files[-1]).read_bytes() == gifs[-1]  # The same GIF.
