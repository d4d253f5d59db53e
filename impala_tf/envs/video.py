"""Videos of evaluation episodes: an env's rgb frames, recorded and encoded as GIF or MP4.

One mechanism serves both places that record:

* evaluation during training, switched on by RLlib's keys in `evaluation_config`:
  `render_env: True` records evaluation episodes and `impala_tf.training.reporting` writes each as
  an animated GIF to TensorBoard (Images dashboard, tag `evaluation/video`, one sample per
  episode); `record_env` (RLlib 1.x: True, or a directory) also writes them as `.gif` files;
* `impala-evaluate --video=out.gif|out.mp4`, after training.

`impala_tf.driver.evaluation.Evaluator` makes its env with `env_config["render_mode"] = "rgb_array"`
(gymnasium's; an `env_creator` must pass it on) and wraps it in an `EpisodeRecorder`. A frame
is what `env.render()` returns, or, for an env that renders nothing, its observation when that
is an image (uint8 [H, W, 3], or [H, W] / [H, W, 1] grey): Atari frames come from ale-py's
`render()` in colour at 210 x 160, not the 84 x 84 grey observations the policy sees.

Bounds (`VideoSettings`, from the config keys of the same names; not RLlib keys):

* `video_episodes` (default 1): episodes recorded per evaluation, the first ones;
* `video_max_frames` (default 500): frames kept per episode (one after the reset and one after
  each step, so an episode of n steps has n + 1 frames); later frames are dropped;
* `video_max_width` (default 256): frames wider than this are downscaled to it, keeping their
  aspect ratio, when they are recorded (None keeps the env's size);
* `video_interval` (default 1): only every `video_interval`-th evaluation records, counted from
  the first evaluation of the process (which records).

So one evaluation holds at most `video_episodes * video_max_frames` frames of at most
`video_max_width` pixels in memory (at the defaults, 500 CartPole frames of 256 x 171 are 66 MB,
500 Atari frames of 160 x 210 are 50 MB) and writes `video_episodes` GIFs (measured: 40 CartPole
frames, 30 KB; 500 Pong frames, 110 KB, encoded in 0.6 s).

Encoding uses maintained libraries: GIFs with Pillow (a dependency of impala_tf), MP4s with
imageio's ffmpeg plugin (`pip install 'imageio[ffmpeg]'`, only for `impala-evaluate`).
"""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import gymnasium as gym
import numpy as np

__all__ = [
    "DEFAULT_FPS",
    "EpisodeRecorder",
    "Recording",
    "Video",
    "VideoSettings",
    "encode_gif",
    "rendering_env_config",
    "video_format",
    "write_video",
]

#: Frames per second of a video whose env declares no `render_fps`.
DEFAULT_FPS = 30.0
#: What `record_env=True` records into, relative to the run's logdir.
DEFAULT_RECORD_DIR = "videos"
_FORMATS = (".gif", ".mp4")


@dataclasses.dataclass(frozen=True)
class VideoSettings:
    """What an evaluation records (see the module docstring for each bound).

    Attributes:
      episodes: Episodes recorded per recording evaluation (`video_episodes`).
      max_frames: Frames kept per episode (`video_max_frames`).
      max_width: Frames are downscaled to at most this width; None keeps them
        (`video_max_width`).
      interval: Every this many evaluations record (`video_interval`).
      record_dir: Where `.gif` files go (`record_env`): a directory, relative to the run's
        logdir unless absolute; None writes no files.
    """

    episodes: int = 1
    max_frames: int = 500
    max_width: int | None = 256
    interval: int = 1
    record_dir: str | None = None

    @classmethod
    def from_config(cls, config: Any) -> VideoSettings | None:
        """The settings of an (evaluation) config; None unless `render_env` or `record_env`."""
        record = config.record_env
        if not (config.render_env or record):
            return None
        return cls(
            episodes=int(config.video_episodes),
            max_frames=int(config.video_max_frames),
            max_width=None if config.video_max_width is None else int(config.video_max_width),
            interval=int(config.video_interval),
            record_dir=(DEFAULT_RECORD_DIR if record is True else record) or None,
        )

    def directory(self, logdir: str | None) -> str | None:
        """`record_dir` resolved against `logdir` (the current directory when None)."""
        if self.record_dir is None:
            return None
        return os.path.join(logdir or os.curdir, os.path.expanduser(self.record_dir))


def rendering_env_config(env_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """`env_config` with gymnasium's `render_mode="rgb_array"` (what recording needs)."""
    return {**(env_config or {}), "render_mode": "rgb_array"}


class Recording(NamedTuple):
    """One recorded episode.

    Attributes:
      frames: uint8 [T, H, W, 3]: after the reset, then after each step.
      fps: The env's `render_fps` (`DEFAULT_FPS` when it declares none).
      cut: Frames after the first `max_frames` were dropped.
    """

    frames: np.ndarray
    fps: float
    cut: bool = False


class EpisodeRecorder(gym.Wrapper):
    """Keeps the rgb frames of the episodes an env plays while recording is on.

    Recording is off until `start(max_episodes)`. From then on each reset begins an episode,
    up to `max_episodes`, and one frame is kept after the reset and one after each step, at most
    `max_frames` per episode. A reset with no step since the previous one begins no new episode
    (its frame replaces the previous one). `stop()` ends recording and returns the episodes that
    took a step: an evaluation resets its env once more after its last episode, and that
    unplayed episode is left out.

    Args:
      env: The env, made with `render_mode="rgb_array"` unless its observations are images.
      max_frames: Frames kept per episode.
      max_width: Frames wider than this are downscaled to it (aspect ratio kept); None keeps
        them.
    """

    def __init__(self, env: gym.Env, max_frames: int = 500, max_width: int | None = None):
        super().__init__(env)
        self.max_frames = int(max_frames)
        self.max_width = None if max_width is None else int(max_width)
        self._max_episodes = 0
        self._episodes: list[list[np.ndarray]] = []
        self._stepped: list[bool] = []
        self._cut: list[bool] = []
        self._recording = False

    @property
    def fps(self) -> float:
        """The env's `render_fps`, else `DEFAULT_FPS`."""
        return float(self.metadata.get("render_fps") or DEFAULT_FPS)

    def start(self, max_episodes: int) -> None:
        """Records the next `max_episodes` episodes, from the next reset on."""
        self._max_episodes = int(max_episodes)
        self._episodes, self._stepped, self._cut = [], [], []
        self._recording = True

    def stop(self) -> list[Recording]:
        """Ends recording; returns the recorded episodes."""
        self._recording = False
        episodes = [
            Recording(np.stack(frames), self.fps, cut)
            for frames, stepped, cut in zip(self._episodes, self._stepped, self._cut)
            if stepped
        ]
        self._episodes, self._stepped, self._cut = [], [], []
        return episodes

    def reset(self, **kwargs: Any) -> tuple[Any, dict]:
        obs, info = self.env.reset(**kwargs)
        if self._recording:
            if self._stepped and not self._stepped[-1]:
                self._episodes[-1].clear()
            elif len(self._episodes) < self._max_episodes:
                self._episodes.append([])
                self._stepped.append(False)
                self._cut.append(False)
            else:
                self._recording = False
                return obs, info
            self._capture(obs)
        return obs, info

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict]:
        out = self.env.step(action)
        if self._recording and self._episodes:
            self._stepped[-1] = True
            if len(self._episodes[-1]) < self.max_frames:
                self._capture(out[0])
            else:
                self._cut[-1] = True
        return out

    def _capture(self, obs: Any) -> None:
        frame = self.env.render()
        if frame is None:
            frame = _image_of(obs)
        if frame is None:
            raise ValueError(
                f"Recording video: the env {self.env.spec.id if self.env.spec else self.env!r} "
                f"rendered no frame (its render_mode is {self.env.render_mode!r}) and its "
                "observations are not images. It must render rgb_array frames: impala_tf makes "
                "it with env_config['render_mode'] = 'rgb_array' (an env_creator must pass that "
                "on to its env)."
            )
        self._episodes[-1].append(downscale(frame, self.max_width))


def _image_of(obs: Any) -> np.ndarray | None:
    """`obs` as an rgb frame if it is an image: uint8 [H, W, 3], or grey [H, W] / [H, W, 1]."""
    if not isinstance(obs, np.ndarray) or obs.dtype != np.uint8:
        return None
    if obs.ndim == 3 and obs.shape[-1] == 3:
        return obs
    if obs.ndim == 2 or (obs.ndim == 3 and obs.shape[-1] == 1):
        return np.repeat(obs.reshape(obs.shape[:2] + (1,)), 3, axis=-1)
    return None


def downscale(frame: np.ndarray, max_width: int | None) -> np.ndarray:
    """An rgb frame (uint8 [H, W, 3+]) no wider than `max_width` (OpenCV's area filter).

    Alpha is dropped; the aspect ratio is kept (the height rounded, at least 1); a frame no
    wider than `max_width`, or any frame with `max_width=None`, keeps its size.
    """
    frame = np.ascontiguousarray(np.asarray(frame, np.uint8)[..., :3])
    height, width = frame.shape[:2]
    if max_width is None or width <= max_width:
        return frame
    import cv2

    new_height = max(1, round(height * max_width / width))
    return cv2.resize(frame, (max_width, new_height), interpolation=cv2.INTER_AREA)


def encode_gif(frames: Sequence[np.ndarray] | np.ndarray, fps: float) -> bytes:
    """Encodes rgb frames as a looping animated GIF with Pillow.

    Each frame gets its own 256-colour palette (Pillow's adaptive quantisation); Pillow merges
    identical consecutive frames into one that is shown longer.

    Args:
      frames: uint8 [H, W, 3] frames, all the same size (a [T, H, W, 3] array works).
      fps: Frames per second (GIF delays are hundredths of a second).

    Returns:
      The GIF file's bytes.
    """
    from PIL import Image

    if len(frames) == 0:
        raise ValueError("No frames to encode.")
    images = [Image.fromarray(np.asarray(f, np.uint8)[..., :3]) for f in frames]
    out = io.BytesIO()
    images[0].save(
        out, format="GIF", save_all=True, append_images=images[1:], duration=1000.0 / fps, loop=0
    )
    return out.getvalue()


@dataclasses.dataclass(frozen=True, repr=False)
class Video:
    """One recorded episode, encoded as an animated GIF (what TensorBoard shows).

    Attributes:
      gif: The GIF file's bytes.
      width: Frame width in pixels.
      height: Frame height in pixels.
      num_frames: Frames recorded (Pillow may store fewer: it merges equal consecutive ones).
      fps: Frames per second.
    """

    gif: bytes
    width: int
    height: int
    num_frames: int
    fps: float

    @classmethod
    def encode(cls, recording: Recording) -> Video:
        """Encodes a recorded episode."""
        frames, fps = recording.frames, recording.fps
        return cls(encode_gif(frames, fps), frames.shape[2], frames.shape[1], len(frames), fps)

    def save(self, path: str) -> None:
        """Writes the GIF to `path` (its directory is created)."""
        os.makedirs(os.path.dirname(path) or os.curdir, exist_ok=True)
        with open(path, "wb") as f:
            f.write(self.gif)

    def __repr__(self) -> str:  # What result.json shows instead of the bytes.
        return (
            f"Video({self.num_frames} frames, {self.width}x{self.height}, {self.fps:g} fps, "
            f"{len(self.gif)} bytes GIF)"
        )


def video_format(path: str) -> str:
    """The format of `path`, ".gif" or ".mp4", checked now so that it can be written later.

    Raises:
      ValueError: for another extension, or `.mp4` without imageio installed.
    """
    ext = os.path.splitext(path)[1].lower()
    if ext not in _FORMATS:
        raise ValueError(f"--video={path!r}: use a .gif or .mp4 file name.")
    if ext == ".mp4":
        try:
            import imageio  # noqa: F401
        except ImportError as e:
            raise ValueError(
                f"--video={path!r}: writing .mp4 needs imageio with ffmpeg "
                "(pip install 'imageio[ffmpeg]'), or record a .gif instead."
            ) from e
    return ext


def write_video(path: str, frames: Sequence[np.ndarray] | np.ndarray, fps: float) -> None:
    """Writes rgb frames to a `.gif` (Pillow) or `.mp4` (imageio with ffmpeg) file.

    Raises:
      ValueError: `path` is neither (`video_format`).
      RuntimeError: imageio could not write the .mp4 (the message says what to install).
    """
    if video_format(path) == ".gif":
        with open(path, "wb") as f:
            f.write(encode_gif(frames, fps))
        return
    import imageio.v2 as imageio

    try:
        imageio.mimsave(path, [np.asarray(f, np.uint8) for f in frames], fps=fps)
    except (ImportError, RuntimeError, ValueError) as e:
        raise RuntimeError(
            f"imageio could not write {path!r} ({e}); install ffmpeg support with "
            "pip install 'imageio[ffmpeg]', or record a .gif instead."
        ) from e
