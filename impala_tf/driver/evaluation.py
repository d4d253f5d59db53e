"""The one evaluation path: training-time evaluation, `impala-evaluate` and export.

An `Evaluator` runs whole episodes in one env of an env runner in the calling process (worker
index 0, the driver's; the single-agent or multi-agent runner, as `impala_tf.rollout` picks),
acting with the weights and observation filters it is given, the filters not updated. It is
built from an `impala_tf.driver.specs.EvaluatorSpec`, which `evaluator_spec` resolves once from
the evaluation config (`AlgorithmConfig.get_evaluation_config()`). As in RLlib it acts with the
evaluation config's `explore` (default True: sampled actions, the policy that was trained);
`evaluation_config={"explore": False}` evaluates the greedy policy. Each `run` starts new
episodes seeded from its `seed`, so an evaluation is reproducible.

With RLlib's `render_env` or `record_env` set in the evaluation config, the evaluator makes its
env with `render_mode="rgb_array"`, wraps it in an `impala_tf.envs.video.EpisodeRecorder` and
keeps the frames of the first `video_episodes` episodes of every `video_interval`-th run in `videos`
(`impala_tf.envs.video` has the bounds); `evaluation_media` encodes them as GIFs for the result
and TensorBoard and writes them to `record_env`'s directory.

* `Impala.evaluate()` runs one with the learners' current weights (RLlib's `evaluation` entry
  of the result, `evaluation_metrics`);
* `evaluate_checkpoint` runs one with a checkpoint's policies (`impala-evaluate`);
* `load_policy_model` rebuilds one policy's model from a checkpoint (`impala-export`).

Episode statistics come from `impala_tf.driver.metrics.summarize_episodes`, the one summary:
returns summed over a multi-agent episode's agents, and `policy_reward_*` per policy.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from impala_tf.acting import filters as filter_lib
from impala_tf.checkpoints.reading import read_state, restore_model
from impala_tf.checkpoints.store import resolve_checkpoint_dir
from impala_tf.config.base import AlgorithmConfig
from impala_tf.config.policies import policy_config
from impala_tf.driver.metrics import new_api_episode_stats, summarize_episodes
from impala_tf.driver.plan import policy_model
from impala_tf.driver.specs import EvaluatorSpec, evaluator_spec, probe_spaces
from impala_tf.envs.spaces import EnvSpaces
from impala_tf.envs.video import EpisodeRecorder, Recording, Video
from impala_tf.models.catalog import build_model
from impala_tf.models.spec import ModelSpec
from impala_tf.rollout import make_env_runner
from impala_tf.rollout.fragment import Episode

__all__ = [
    "Evaluator",
    "evaluate_checkpoint",
    "evaluation_media",
    "evaluation_metrics",
    "load_checkpoint_policies",
    "load_policy_model",
    "policy_episodes",
]


class Evaluator:
    """Runs evaluation episodes one after another in one env (see the module docstring).

    Args:
      spec: What it is built from (`impala_tf.driver.specs.evaluator_spec` of the evaluation
        config): its env runner's spec (one env) and what it records.

    Attributes:
      video: What is recorded (`spec.video`); None records nothing.
      recorder: The `EpisodeRecorder` around the env, when `video` is set.
      videos: The episodes the last `run` recorded (`impala_tf.envs.video.Recording`: frames and
        fps); empty when it recorded none.
    """

    def __init__(self, spec: EvaluatorSpec):
        self.video = spec.video
        self.runner = make_env_runner(spec.runner, worker_index=0, update_filter=False)
        self.recorder: EpisodeRecorder | None = None
        if self.video is not None:
            video = self.video
            self.recorder = self.runner.wrap_env(
                lambda env: EpisodeRecorder(env, video.max_frames, video.max_width)
            )
        self.videos: list[Recording] = []
        self._runs = 0

    def run(
        self,
        weights: Mapping[str, tuple],
        filters: Mapping[str, filter_lib.Filter] | None,
        num_episodes: int,
        seed: int | None,
    ) -> list[Episode]:
        """`num_episodes` new episodes with these weights ({policy_id: (weights, version)}).

        The first `video.episodes` of them are recorded into `videos` when this is the first
        run or `video.interval` runs after the last one that recorded.
        """
        record = self.recorder is not None and self._runs % self.video.interval == 0
        self._runs += 1
        self.videos = []
        if record:
            self.recorder.start(self.video.episodes)
        try:
            self.runner.set_weights(weights, filters)
            self.runner.reset(seed)
            return self.runner.run_episodes(int(num_episodes))
        finally:
            if record:
                self.videos = self.recorder.stop()

    def close(self) -> None:
        self.runner.close()


def evaluation_media(
    evaluator: Evaluator, logdir: str | None, name: str
) -> dict[str, list[Video]] | None:
    """The videos of the evaluator's last run as RLlib's `episode_media` entry of a result.

    Each recorded episode is encoded once as an animated GIF (`impala_tf.envs.video.Video`),
    which `impala_tf.training.reporting` writes to TensorBoard; with `record_env` it is also written
    to `<record_env directory>/<name>_episode_<k>.gif`.

    Args:
      evaluator: An `Evaluator` that has run.
      logdir: The run's directory, which a relative `record_env` directory is relative to
        (the current directory when None).
      name: The files' name stem, e.g. `iteration_000010`.

    Returns:
      `{"video": [Video, ...]}`, or None when the last run recorded nothing.
    """
    if not evaluator.videos:
        return None
    videos = [Video.encode(recording) for recording in evaluator.videos]
    directory = evaluator.video.directory(logdir)
    if directory is not None:
        for k, video in enumerate(videos):
            video.save(os.path.join(directory, f"{name}_episode_{k}.gif"))
    return {"video": videos}


def evaluation_metrics(
    episodes: Sequence[Episode], multi_agent: bool, elapsed_s: float
) -> dict[str, Any]:
    """RLlib's `evaluation` entry of a result dict for the episodes of one evaluation."""
    summary = summarize_episodes(episodes, multi_agent)
    metrics = {
        "episode_reward_mean": summary["episode_reward_mean"],
        "episode_reward_min": summary["episode_reward_min"],
        "episode_reward_max": summary["episode_reward_max"],
        "episode_len_mean": summary["episode_len_mean"],
        "episodes_this_iter": summary["num_episodes"],
        "num_env_steps_sampled_this_iter": summary["num_env_steps"],
        "policy_reward_mean": summary["policy_reward_mean"],
        "policy_reward_min": summary["policy_reward_min"],
        "policy_reward_max": summary["policy_reward_max"],
        "custom_metrics": summary["custom_metrics"],
        "hist_stats": summary["hist_stats"],
        "time_this_iter_s": elapsed_s,
    }
    metrics["env_runners"] = new_api_episode_stats(summary)
    return metrics


def policy_episodes(episodes: Sequence[Episode], policy_id: str) -> list[Episode]:
    """Each episode's return as the mean return of `policy_id`'s agents in it.

    Episodes where the policy controlled no agent are left out.
    """
    out = []
    for episode in episodes:
        mine = episode.policy_returns.get(policy_id)
        if mine:
            mean = float(np.mean(mine))
            out.append(Episode(mean, episode.length, {policy_id: list(mine)}))
    return out


def load_checkpoint_policies(
    checkpoint_dir: str,
    config: AlgorithmConfig,
    spaces: EnvSpaces,
    models: Mapping[str, ModelSpec] | None = None,
) -> tuple[dict[str, tuple], dict[str, filter_lib.Filter] | None]:
    """Every policy's weights and the run's observation filters, from a checkpoint.

    Each policy's model is rebuilt from its resolved model (`models`, else its config) and
    spaces and its `model` part restored (`impala_tf.checkpoints.reading.restore_model`).

    Returns:
      ({policy_id: (weights, 0)}, {policy_id: Filter} or None without filters).
    """
    checkpoint_dir = resolve_checkpoint_dir(checkpoint_dir)
    weights = {}
    for pid, (obs, act) in spaces.policies.items():
        pconfig = policy_config(config, pid)
        spec = models[pid] if models is not None else policy_model(config, pid)
        model = build_model(obs, act, spec, precision=pconfig.acting_precision)
        restore_model(model, checkpoint_dir, pid)
        weights[pid] = (model.get_weights(), 0)
    saved = read_state(checkpoint_dir)["observation_filters"]
    filters = {
        pid: filter_lib.filter_from_state(state)
        for pid, state in saved.items()
        if state is not None and pid in spaces.policies
    }
    return weights, filters or None


def evaluate_checkpoint(
    checkpoint_dir: str,
    config: AlgorithmConfig,
    num_episodes: int,
    explore: bool | None = None,
    policy_id: str | None = None,
    spaces: EnvSpaces | None = None,
    recordings: list[Recording] | None = None,
) -> list[Episode]:
    """Runs `num_episodes` episodes with a checkpoint's policies (`impala-evaluate`).

    Args:
      checkpoint_dir: Anything `resolve_checkpoint_dir` accepts.
      config: The config to run (the checkpoint's, its `evaluation_config` applied; its `seed`
        seeds the episodes).
      num_episodes: Episodes to run.
      explore: Overrides the config's `explore`.
      policy_id: Report the mean return of this policy's agents per episode instead of the
        return summed over the agents.
      spaces: The env's spaces when the caller probed them already.
      recordings: Receives the episodes recorded when `config` sets `render_env` or
        `record_env` (the first `video_episodes`; `Evaluator.videos`).

    Raises:
      ValueError: `policy_id` is not a policy of the checkpoint (the message lists them).
    """
    spaces = probe_spaces(config) if spaces is None else spaces
    if policy_id is not None and policy_id not in spaces.policies:
        raise ValueError(
            f"--policy_id={policy_id}: no such policy in {checkpoint_dir}; it has "
            f"{spaces.policy_ids}."
        )
    models = {pid: policy_model(config, pid) for pid in spaces.policies}
    weights, filters = load_checkpoint_policies(checkpoint_dir, config, spaces, models)
    evaluator = Evaluator(evaluator_spec(config, spaces, models, explore=explore))
    try:
        episodes = evaluator.run(weights, filters, num_episodes, config.seed)
        if recordings is not None:
            recordings.extend(evaluator.videos)
    finally:
        evaluator.close()
    return episodes if policy_id is None else policy_episodes(episodes, policy_id)


def load_policy_model(
    checkpoint_dir: str, config: AlgorithmConfig, policy_id: str | None = None
) -> tuple[Any, Any, filter_lib.Filter | None]:
    """One policy's model, action space and observation filter, from a checkpoint (export).

    Args:
      checkpoint_dir: Anything `resolve_checkpoint_dir` accepts.
      config: The checkpoint's config.
      policy_id: The policy; None for a checkpoint with one policy.

    Returns:
      (the `ActorCritic` with the policy's weights, its action space, its merged observation
      filter or None for `NoFilter`).

    Raises:
      ValueError: `policy_id` is None for a checkpoint of several policies, or names none of
        them (the message lists them).
    """
    checkpoint_dir = resolve_checkpoint_dir(checkpoint_dir)
    spaces = probe_spaces(config)
    if policy_id is None:
        if len(spaces.policies) > 1:
            raise ValueError(
                f"{checkpoint_dir} holds several policies {spaces.policy_ids}: pass --policy_id."
            )
        policy_id = spaces.policy_ids[0]
    if policy_id not in spaces.policies:
        raise ValueError(
            f"--policy_id={policy_id}: no such policy in {checkpoint_dir}; it has "
            f"{spaces.policy_ids}."
        )
    obs, act = spaces.policies[policy_id]
    pconfig = policy_config(config, policy_id)
    spec = policy_model(config, policy_id)
    model = build_model(obs, act, spec, precision=pconfig.acting_precision)
    restore_model(model, checkpoint_dir, policy_id)
    saved = read_state(checkpoint_dir)["observation_filters"].get(policy_id)
    obs_filter = filter_lib.filter_from_state(saved) if saved is not None else None
    if isinstance(obs_filter, filter_lib.NoFilter):
        obs_filter = None
    return model, act, obs_filter
