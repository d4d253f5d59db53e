r"""impala-evaluate: runs a trained policy from a checkpoint and reports its episode returns.

  impala-evaluate --checkpoint=runs/cartpole --episodes=10
  impala-evaluate --checkpoint=runs/cartpole --episodes=3 --seed=1 --video=cartpole.gif

`--checkpoint` takes a checkpoint directory (what `Impala.save` writes) or a training logdir.
The policy acts in one env (worker index 0, seeded from `--seed` or the checkpoint's `seed`, so
a seeded run is reproducible), with the checkpoint's `evaluation_config` applied. `--explore`
defaults to that config's `explore` (RLlib's default: True, sampling actions); pass
`--explore=false` to take the most likely action.

Prints a readable summary, then one JSON line:
`{"episodes", "episode_reward_mean", "episode_reward_min", "episode_reward_max",
"episode_len_mean"}`. `--video` records the first `--video_episodes` episodes with gymnasium's
`rgb_array` rendering: `.gif` is written with Pillow (or a built-in GIF encoder without it),
`.mp4` with imageio (`pip install imageio[ffmpeg]`).
"""

from __future__ import annotations

import json
import logging
import os
import struct
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import gymnasium as gym
import numpy as np
from absl import app, flags
from absl import logging as absl_logging

from impala_tf.bin import _common  # noqa: F401 - defines --verbose.

if TYPE_CHECKING:
    from impala_tf.config import ImpalaConfig
    from impala_tf.rollout.fragment import Episode

__all__ = [
    "FrameRecorder",
    "encode_gif",
    "summarize",
    "video_format",
    "write_gif",
    "write_mp4",
    "run",
]

FLAGS = flags.FLAGS

flags.DEFINE_string("checkpoint", None, "Checkpoint directory, or a training logdir.")
flags.DEFINE_integer("episodes", 10, "Number of episodes to run.", lower_bound=1)
flags.DEFINE_bool(
    "explore", None, "Sample actions (true) or take the mode (false); default: the config's."
)
flags.DEFINE_string("video", None, "Record a video to this .gif or .mp4 file.")
flags.DEFINE_integer("video_episodes", 1, "Episodes recorded with --video.", lower_bound=1)
flags.DEFINE_integer("video_max_frames", 5000, "Frames recorded at most.", lower_bound=1)
flags.DEFINE_float("fps", None, "Video frame rate; default: the env's render_fps (else 30).")
flags.DEFINE_integer("seed", None, "Seeds the env and the action sampling (config key `seed`).")
flags.DEFINE_string(
    "policy_id",
    None,
    "Report the mean return of this policy's agents per episode (multi-agent checkpoints); "
    "default: the return summed over the agents.",
)

_VIDEO_FORMATS = (".gif", ".mp4")
_DEFAULT_FPS = 30.0


def summarize(episodes: Sequence[Episode]) -> dict[str, float | int]:
    """The summary printed as JSON: episode count, return mean/min/max, mean length.

    The statistics are `impala_tf.driver.metrics.summarize_episodes`', the one episode summary.

    Args:
      episodes: The finished episodes (`impala_tf.rollout.fragment.Episode`).
    """
    from impala_tf.driver.metrics import summarize_episodes

    stats = summarize_episodes(episodes)
    return {
        "episodes": stats["num_episodes"],
        **{
            key: stats[key]
            for key in (
                "episode_reward_mean",
                "episode_reward_min",
                "episode_reward_max",
                "episode_len_mean",
            )
        },  # fmt: skip
    }


# Video ----------------------------------------------------------------------------------------


def video_format(path: str) -> str:
    """Returns ".gif" or ".mp4" for `path`, checking now that the file can be written later.

    Raises:
      ValueError: for another extension, or `.mp4` without imageio installed.
    """
    ext = os.path.splitext(path)[1].lower()
    if ext not in _VIDEO_FORMATS:
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


class FrameRecorder(gym.Wrapper):
    """Keeps the `rgb_array` frames of the first `max_episodes` episodes of an env.

    One frame after each reset and one after each step, so an episode of n steps gives n + 1
    frames; recording stops after `max_frames`. A reset with no step since the previous one (an
    env runner built, then reset with the evaluation's seed) replaces that reset's frame instead
    of counting as an episode.

    Args:
      env: An env made with `render_mode="rgb_array"`.
      max_episodes: Episodes to record, from the first reset.
      max_frames: Frames kept at most.
    """

    def __init__(self, env: gym.Env, max_episodes: int = 1, max_frames: int = 5000):
        super().__init__(env)
        self.max_episodes = int(max_episodes)
        self.max_frames = int(max_frames)
        self.frames: list[np.ndarray] = []
        self.hit_frame_limit = False
        self._episode = 0
        self._stepped = False

    def _capture(self) -> None:
        if self._episode > self.max_episodes:
            return
        if len(self.frames) >= self.max_frames:
            self.hit_frame_limit = True
            return
        frame = self.env.render()
        if frame is None:
            raise RuntimeError(
                "The env rendered no frame: it must be made with render_mode='rgb_array'."
            )
        self.frames.append(np.asarray(frame, np.uint8))

    def reset(self, **kwargs):
        out = self.env.reset(**kwargs)
        if self._stepped or self._episode == 0:
            self._episode += 1
        elif self.frames and self._episode <= self.max_episodes:
            # A reset with no step since the last one started no episode: its frame goes.
            self.frames.pop()
        self._stepped = False
        self._capture()
        return out

    def step(self, action):
        out = self.env.step(action)
        self._stepped = True
        self._capture()
        return out


def _recording_config(
    config: ImpalaConfig, recorders: list[FrameRecorder], max_episodes: int, max_frames: int
) -> ImpalaConfig:
    """A copy of `config` whose env renders `rgb_array` frames into a new `FrameRecorder`.

    The env is still made by `make_env` from the checkpoint's env id and `env_config`, with
    `render_mode="rgb_array"` added; each recorder made is appended to `recorders`.
    """
    from impala_tf.envs.make import make_env

    render_config = config.copy()
    render_config.env_config = {**(config.env_config or {}), "render_mode": "rgb_array"}

    def env_creator(context):
        env = make_env(render_config, context.worker_index, context.vector_index)
        recorder = FrameRecorder(env, max_episodes=max_episodes, max_frames=max_frames)
        recorders.append(recorder)
        return recorder

    recording = config.copy()
    recording.env = env_creator
    return recording


def _lzw_compress(indices: bytes, min_code_size: int = 8) -> bytes:
    """GIF's variable-length LZW (codes of min_code_size + 1 to 12 bits, packed LSB first)."""
    clear = 1 << min_code_size
    end = clear + 1
    out = bytearray()
    bits = 0
    num_bits = 0
    code_size = min_code_size + 1
    next_code = end + 1
    table: dict[int, int] = {}

    def emit(code: int) -> None:
        nonlocal bits, num_bits, code_size
        bits |= code << num_bits
        num_bits += code_size
        while num_bits >= 8:
            out.append(bits & 0xFF)
            bits >>= 8
            num_bits -= 8
        # The decoder widens its codes once its table (one entry behind ours) fills this width.
        if next_code >= (1 << code_size) and code_size < 12:
            code_size += 1

    emit(clear)
    prefix = indices[0]
    for byte in indices[1:]:
        key = (prefix << 8) | byte
        code = table.get(key)
        if code is not None:
            prefix = code
            continue
        emit(prefix)
        if next_code < 4096:
            table[key] = next_code
            next_code += 1
        else:  # The table is full: start a new one.
            emit(clear)
            table.clear()
            next_code = end + 1
            code_size = min_code_size + 1
        prefix = byte
    emit(prefix)
    emit(end)
    if num_bits:
        out.append(bits & 0xFF)
    return bytes(out)


def _sub_blocks(data: bytes) -> bytes:
    blocks = bytearray()
    for i in range(0, len(data), 255):
        chunk = data[i : i + 255]
        blocks.append(len(chunk))
        blocks += chunk
    blocks.append(0)
    return bytes(blocks)


def encode_gif(frames: Sequence[np.ndarray], fps: float) -> bytes:
    """Encodes RGB frames as a looping GIF89a, in pure Python (the fallback without Pillow).

    Colours are quantised to a fixed 3-3-2 bit palette (256 colours): coarse, but it needs no
    palette search and suffices for looking at a policy.

    Args:
      frames: uint8 [H, W, 3] (or [H, W, 4]; alpha is dropped) arrays, all the same size.
      fps: Frames per second (GIF delays are in hundredths of a second).

    Returns:
      The file's bytes.
    """
    if not frames:
        raise ValueError("No frames to encode.")
    height, width = frames[0].shape[:2]
    index = np.arange(256)
    palette = np.stack(
        [((index >> 5) & 7) * 255 // 7, ((index >> 2) & 7) * 255 // 7, (index & 3) * 255 // 3],
        axis=1,
    ).astype(np.uint8)
    delay = max(1, round(100.0 / fps))
    # Screen descriptor: a global table of 2**(7+1) colours, 8 bits per primary.
    out = bytearray(b"GIF89a" + struct.pack("<HHBBB", width, height, 0xF7, 0, 0))
    out += palette.tobytes()
    out += b"\x21\xff\x0bNETSCAPE2.0\x03\x01" + struct.pack("<H", 0) + b"\x00"  # Loop forever.
    for frame in frames:
        rgb = np.asarray(frame, np.uint8)[..., :3]
        if rgb.shape[:2] != (height, width):
            raise ValueError(f"Frame of shape {rgb.shape} in a video of {height}x{width}.")
        quantised = (rgb[..., 0] >> 5) << 5 | (rgb[..., 1] >> 5) << 2 | rgb[..., 2] >> 6
        out += b"\x21\xf9\x04\x04" + struct.pack("<H", delay) + b"\x00\x00"
        out += b"\x2c" + struct.pack("<HHHHB", 0, 0, width, height, 0)
        out += b"\x08" + _sub_blocks(_lzw_compress(quantised.astype(np.uint8).tobytes()))
    out += b"\x3b"
    return bytes(out)


def write_gif(path: str, frames: Sequence[np.ndarray], fps: float, use_pillow: bool = True) -> None:
    """Writes `frames` (uint8 [H, W, 3]) as a looping GIF, with Pillow when it is installed."""
    if use_pillow:
        try:
            from PIL import Image
        except ImportError:
            use_pillow = False
    if not use_pillow:
        with open(path, "wb") as f:
            f.write(encode_gif(frames, fps))
        return
    images = [Image.fromarray(np.asarray(f, np.uint8)[..., :3]) for f in frames]
    images[0].save(path, save_all=True, append_images=images[1:], duration=1000.0 / fps, loop=0)


def write_mp4(path: str, frames: Sequence[np.ndarray], fps: float) -> None:
    """Writes `frames` as an .mp4 with imageio's ffmpeg plugin."""
    import imageio.v2 as imageio

    try:
        imageio.mimsave(path, [np.asarray(f, np.uint8) for f in frames], fps=fps)
    except (ImportError, RuntimeError, ValueError) as e:
        raise RuntimeError(
            f"imageio could not write {path!r} ({e}); install ffmpeg support with "
            "pip install 'imageio[ffmpeg]', or record a .gif instead."
        ) from e


# Binary ---------------------------------------------------------------------------------------


def _error(message: str) -> int:
    print(f"impala-evaluate: error: {message}", file=sys.stderr, flush=True)
    return 1


def main(argv: list[str]) -> int:
    del argv
    from impala_tf.quiet import quiet_start

    quiet_start(FLAGS.verbose)  # Before anything imports TensorFlow.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not FLAGS["verbosity"].present:  # absl turns INFO on after parsing; TF logs much there.
        absl_logging.set_verbosity(absl_logging.WARNING)
    from impala_tf import checkpoints, evaluation
    from impala_tf.envs.spaces import probe_spaces

    try:
        ext = video_format(FLAGS.video) if FLAGS.video else None
        checkpoint_dir = checkpoints.resolve_checkpoint_dir(FLAGS.checkpoint)
        config = checkpoints.load_config(checkpoint_dir).get_evaluation_config()
        # One env: each episode runs start to end in order, reproducibly for a given seed.
        config.env_runners(num_envs_per_env_runner=1)
        if FLAGS.seed is not None:
            config.debugging(seed=FLAGS.seed)
        spaces = probe_spaces(config)
    except (FileNotFoundError, ValueError) as e:
        return _error(str(e))
    explore = bool(config.explore if FLAGS.explore is None else FLAGS.explore)
    env_name = config.env
    recorders: list[FrameRecorder] = []
    if ext:
        config = _recording_config(config, recorders, FLAGS.video_episodes, FLAGS.video_max_frames)
    try:
        # Every policy acts; returns are summed over the agents, or --policy_id's agents' mean.
        episodes = evaluation.evaluate_checkpoint(
            checkpoint_dir, config, FLAGS.episodes, explore, FLAGS.policy_id, spaces
        )
    except ValueError as e:
        return _error(str(e))
    except gym.error.DependencyNotInstalled as e:  # e.g. pygame, to render classic control.
        return _error(f"{e} (needed to render --video)" if ext else str(e))

    if ext:
        recorder = recorders[0]
        fps = FLAGS.fps or float(recorder.metadata.get("render_fps") or _DEFAULT_FPS)
        if recorder.hit_frame_limit:
            logging.warning("Video cut at --video_max_frames=%d frames.", FLAGS.video_max_frames)
        (write_gif if ext == ".gif" else write_mp4)(FLAGS.video, recorder.frames, fps)
        print(
            f"impala-evaluate: wrote {len(recorder.frames)} frames at {fps:g} fps to {FLAGS.video}",
            flush=True,
        )

    if not episodes:
        return _error(f"--policy_id={FLAGS.policy_id} controlled no agent in any episode.")
    summary = summarize(episodes)
    print(
        f"impala-evaluate: {summary['episodes']} episodes of {env_name} from {checkpoint_dir} "
        f"(explore={explore}, seed={config.seed}): return mean "
        f"{summary['episode_reward_mean']:.3f}, min {summary['episode_reward_min']:.3f}, "
        f"max {summary['episode_reward_max']:.3f}; length mean {summary['episode_len_mean']:.1f}",
        flush=True,
    )
    print(json.dumps(summary), flush=True)
    return 0


def run() -> None:
    """Console-script entry point."""
    flags.mark_flag_as_required("checkpoint")
    app.run(main)


if __name__ == "__main__":
    run()
