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
`rgb_array` rendering, one after another in one file: `.gif` is written with Pillow, `.mp4` with
imageio (`pip install 'imageio[ffmpeg]'`). The recording is the one training-time evaluation
uses (`impala_tf.envs.video`; the flags set its `video_*` keys), at the env's size unless
`--video_max_width` is given. Without `--video` nothing is recorded, whatever the checkpoint's
`render_env` / `record_env` say.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import gymnasium as gym
import numpy as np
from absl import flags
from absl import logging as absl_logging

from impala_tf.bin import _common  # Defines --verbose.
from impala_tf.envs.video import Recording, video_format, write_video

if TYPE_CHECKING:
    from impala_tf.rollout.fragment import Episode

__all__ = ["summarize", "run"]

FLAGS = flags.FLAGS

flags.DEFINE_string("checkpoint", None, "Checkpoint directory, or a training logdir.")
flags.DEFINE_integer("episodes", 10, "Number of episodes to run.", lower_bound=1)
flags.DEFINE_bool(
    "explore", None, "Sample actions (true) or take the mode (false); default: the config's."
)
flags.DEFINE_string("video", None, "Record a video to this .gif or .mp4 file.")
flags.DEFINE_integer("video_episodes", 1, "Episodes recorded with --video.", lower_bound=1)
flags.DEFINE_integer(
    "video_max_frames", 5000, "Frames recorded per episode at most.", lower_bound=2
)
flags.DEFINE_integer(
    "video_max_width",
    None,
    "Downscale frames wider than this many pixels; default: the env's size.",
    lower_bound=16,
)
flags.DEFINE_float("fps", None, "Video frame rate; default: the env's render_fps (else 30).")
flags.DEFINE_integer("seed", None, "Seeds the env and the action sampling (config key `seed`).")
flags.DEFINE_string(
    "policy_id",
    None,
    "Report the mean return of this policy's agents per episode (multi-agent checkpoints); "
    "default: the return summed over the agents.",
)


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


# Binary ---------------------------------------------------------------------------------------


def _error(message: str) -> int:
    print(f"impala-evaluate: error: {message}", file=sys.stderr, flush=True)
    return 1


def main(argv: list[str]) -> int:
    del argv
    from impala_tf.utils.quiet import import_tensorflow, quiet_start

    # Before anything imports TensorFlow; it is imported once the flags that name files check
    # out, so that a wrong path or video format is told at once.
    quiet_start(FLAGS.verbose, import_now=False)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not FLAGS["verbosity"].present:  # absl turns INFO on after parsing; TF logs much there.
        absl_logging.set_verbosity(absl_logging.WARNING)
    from impala_tf import checkpoints
    from impala_tf.driver.specs import probe_spaces

    _common.import_from_cwd()  # Custom models and callbacks may live in the user's module.
    try:
        ext = video_format(FLAGS.video) if FLAGS.video else None
        checkpoint_dir = checkpoints.resolve_checkpoint_dir(FLAGS.checkpoint)
        import_tensorflow()  # Quietly, before the config imports a user's model module.
        config = checkpoints.load_config(checkpoint_dir).get_evaluation_config()
        # One env: each episode runs start to end in order, reproducibly for a given seed.
        config.env_runners(num_envs_per_env_runner=1)
        if FLAGS.seed is not None:
            config.debugging(seed=FLAGS.seed)
        spaces = probe_spaces(config)
    except (FileNotFoundError, ValueError) as e:
        return _error(str(e))
    from impala_tf.driver import evaluation

    explore = bool(config.explore if FLAGS.explore is None else FLAGS.explore)
    config.update_from_dict(
        {
            "render_env": bool(ext),
            "record_env": False,  # The file is --video's.
            "video_episodes": FLAGS.video_episodes,
            "video_max_frames": FLAGS.video_max_frames,
            "video_max_width": FLAGS.video_max_width,
            "video_interval": 1,
        }
    )
    recordings: list[Recording] = []
    try:
        # Every policy acts; returns are summed over the agents, or --policy_id's agents' mean.
        episodes = evaluation.evaluate_checkpoint(
            checkpoint_dir, config, FLAGS.episodes, explore, FLAGS.policy_id, spaces, recordings
        )
    except ValueError as e:
        return _error(str(e))
    except gym.error.DependencyNotInstalled as e:  # e.g. pygame, to render classic control.
        return _error(f"{e} (needed to render --video)" if ext else str(e))

    if ext and recordings:
        fps = FLAGS.fps or recordings[0].fps
        if any(r.cut for r in recordings):
            logging.warning("Episodes cut at --video_max_frames=%d frames.", FLAGS.video_max_frames)
        frames = np.concatenate([r.frames for r in recordings])
        try:
            write_video(FLAGS.video, frames, fps)
        except RuntimeError as e:
            return _error(str(e))
        print(
            f"impala-evaluate: wrote {len(frames)} frames at {fps:g} fps to {FLAGS.video}",
            flush=True,
        )

    if not episodes:
        return _error(f"--policy_id={FLAGS.policy_id} controlled no agent in any episode.")
    summary = summarize(episodes)
    print(
        f"impala-evaluate: {summary['episodes']} episodes of {config.env} from {checkpoint_dir} "
        f"(explore={explore}, seed={config.seed}): return mean "
        f"{summary['episode_reward_mean']:.3f}, min {summary['episode_reward_min']:.3f}, "
        f"max {summary['episode_reward_max']:.3f}; length mean {summary['episode_len_mean']:.1f}",
        flush=True,
    )
    print(json.dumps(summary), flush=True)
    return 0


def run() -> None:
    """Console-script entry point (also `python -m impala_tf.bin.evaluate`)."""
    flags.mark_flag_as_required("checkpoint")
    _common.run_binary(main, __name__, __doc__)


if __name__ == "__main__":
    run()
