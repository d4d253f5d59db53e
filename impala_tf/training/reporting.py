"""Where results go: `result.json` lines, TensorBoard summaries and the console progress line.

Each `train()` result dict is written as one JSON line with RLlib's names, and to TensorBoard as
scalars stepped by `timesteps_total` (env steps sampled), under readable tags
(`tensorboard_scalars`):

* `episode/`: `return_mean`, `return_min`, `return_max`, `length_mean`, `episodes_this_iter`,
  `episodes_total` (the smoothing window of `metrics_num_episodes_for_smoothing` episodes);
* `evaluation/`: `return_mean`, `return_min`, `return_max`, `length_mean`, `episodes`,
  `time_s` (iterations that ran `evaluate()`);
* `learner/`: every learner stat by its RLlib name (`policy_loss`, `vf_loss`, `entropy`,
  `total_loss`, `vf_explained_var`, `grad_gnorm`, `var_gnorm`, ...) and the diagnostics
  (`mean_rho`, `rho_clipped_frac`, `pg_advantage_mean`, `vf_error_mean`, `logit_range_mean`,
  ...; `impala_tf.learning.learner.DIAGNOSTIC_KEYS`), the last update's, with `cur_lr` as
  `learning_rate`; plus `entropy_coeff`, `num_grad_updates` and `off_policyness` (RLlib's
  `diff_num_grad_updates_vs_sampler_policy`: updates between the weights that sampled a batch
  and the learner's weights when it trained on it); `learner/updates/`: each stat's mean, min
  and max over every update of the iteration (`update_stats`, e.g. `entropy_min`,
  `grad_gnorm_unclipped_max`);
* `learner_queue/`: `size_mean`, `size_std`, `size_p0` ... `size_p100` (over the learner's last
  50 steps), `times_full` (batches dropped on a full queue);
* `timing/`: `iteration_s`, `learner_grad_time_ms`, `learner_load_time_ms`,
  `learner_load_wait_time_ms`, `learner_dequeue_time_ms`;
* `throughput/`: `env_steps_sampled_per_s`, `env_steps_trained_per_s`;
* `counters/`: every lifetime counter without its `num_` prefix (`env_steps_sampled`,
  `weight_broadcasts`, `env_runner_restarts`, ...), `healthy_env_runners`, `training_iteration`;
* multi-agent runs (`impala_tf.multi_agent`): `learner/<policy_id>/<stat>` per trained policy
  and `episode/<policy_id>/return_mean|min|max` (RLlib's `policy_reward_*`);
* `custom_metrics/`: RLlib's `custom_metrics` of the callbacks (`<name>_mean`, `_min`, `_max`;
  `impala_tf.config.callbacks`), and `evaluation/custom_metrics/` of an evaluation;
* `raw/`: the whole result flattened with RLlib's keys (`raw/info/learner/default_policy/...`),
  so that any key, also ones added later, can be found by its RLlib name.

Histograms: RLlib's `hist_stats` (`episode_reward`, `episode_lengths`, per policy
`policy_<id>_reward`, and the callbacks' `hist_data`) under `hist_stats/<name>`; optionally the
models' weights under `weights/<variable path>` (with several policies,
`weights/<policy_id>/<variable path>`).

Evaluation videos (RLlib's `render_env` / `record_env` in `evaluation_config`,
`impala_tf.envs.video`): the episodes an evaluation recorded (its result's
`evaluation/episode_media/video`) go to the Images dashboard as animated GIFs under
`evaluation/video`, one sample per episode. `tf.summary.image` would re-encode the frames as
still PNGs, so the GIF bytes are written as they are, in the images plugin's own layout
([width, height, image, ...] strings; what `tf.summary.image` writes, and what TensorBoard makes
of TF1's `Summary.Image`), with `tf.summary.write`. In `result.json` a video shows as a short
`Video(...)` description.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from impala_tf.checkpoints.store import json_default
from impala_tf.config.policies import DEFAULT_POLICY_ID

if TYPE_CHECKING:
    from impala_tf.envs.video import Video

__all__ = [
    "ResultWriter",
    "flatten",
    "lookup",
    "mlflow_store",
    "progress_line",
    "stop_reached",
    "tensorboard_scalars",
    "truncate_results",
]

#: A run's results, one RLlib result dict per line, and those a resume left behind.
RESULT_FILE = "result.json"
DISCARDED_FILE = "result.discarded.json"

_POLICY = "info/learner/default_policy"
_STATS = f"{_POLICY}/learner_stats"

# (tag, slash/separated result key) of the tags that are not generated from a whole sub-dict.
_CURATED: tuple[tuple[str, str], ...] = (
    ("episode/return_mean", "episode_reward_mean"),
    ("episode/return_min", "episode_reward_min"),
    ("episode/return_max", "episode_reward_max"),
    ("episode/length_mean", "episode_len_mean"),
    ("episode/episodes_this_iter", "episodes_this_iter"),
    ("episode/episodes_total", "episodes_total"),
    ("evaluation/return_mean", "evaluation/episode_reward_mean"),
    ("evaluation/return_min", "evaluation/episode_reward_min"),
    ("evaluation/return_max", "evaluation/episode_reward_max"),
    ("evaluation/length_mean", "evaluation/episode_len_mean"),
    ("evaluation/episodes", "evaluation/episodes_this_iter"),
    ("evaluation/time_s", "evaluation/time_this_iter_s"),
    ("learner/learning_rate", f"{_STATS}/cur_lr"),
    ("learner/off_policyness", f"{_POLICY}/diff_num_grad_updates_vs_sampler_policy"),
    ("learner/num_grad_updates", f"{_POLICY}/num_grad_updates_lifetime"),
    ("learner_queue/size_mean", "info/learner_queue/size_mean"),
    ("learner_queue/size_std", "info/learner_queue/size_std"),
    ("learner_queue/times_full", "num_times_learner_queue_full"),
    ("timing/iteration_s", "time_this_iter_s"),
    ("throughput/env_steps_sampled_per_s", "num_env_steps_sampled_throughput_per_sec"),
    ("throughput/env_steps_trained_per_s", "num_env_steps_trained_throughput_per_sec"),
    ("counters/healthy_env_runners", "num_healthy_workers"),
    ("counters/training_iteration", "training_iteration"),
)
# Learner stats with a curated tag above, or repeated in `default_policy` itself.
_STATS_ELSEWHERE = frozenset({"cur_lr", "num_grad_updates_lifetime"})
_QUANTILES = (0, 10, 50, 90, 100)


def _as_finite(value: Any) -> float | None:
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def flatten(result: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """Yields (slash/separated/key, value) for every finite numeric leaf of a nested dict."""
    for key, value in result.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from flatten(value, name + "/")
        else:
            number = _as_finite(value)
            if number is not None:
                yield name, number


def lookup(result: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """The value at a slash/separated `key` of a nested result dict (`default` if missing).

    A key present as is (e.g. a flattened dict's) is returned first.
    """
    if key in result:
        return result[key]
    value: Any = result
    for part in key.split("/"):
        if not isinstance(value, Mapping) or part not in value:
            return default
        value = value[part]
    return value


def stop_reached(result: Mapping[str, Any], stop: Mapping[str, float]) -> str | None:
    """The first stop criterion `result` meets (`value >= threshold`, Tune's rule), or None.

    Args:
      result: A result dict (nested, or flattened with slash/separated keys).
      stop: {slash/separated result key: threshold}; a missing or NaN value never stops.

    Returns:
      `"key=value >= threshold"` for the first criterion met, else None.
    """
    for key, threshold in stop.items():
        value = _as_finite(lookup(result, key))
        if value is not None and value >= threshold:
            return f"{key}={value:g} >= {threshold:g}"
    return None


def tensorboard_scalars(result: Mapping[str, Any], raw: bool = True) -> dict[str, float]:
    """The TensorBoard scalars of one result: {tag: value} (see the module docstring).

    Missing keys and non-finite values (a NaN return before the first episode) give no tag.

    Args:
      result: A `train()` result dict.
      raw: Also include every numeric leaf under `raw/<RLlib key>`.
    """
    scalars: dict[str, float] = {}

    def put(tag: str, value: Any) -> None:
        number = _as_finite(value)
        if number is not None:
            scalars[tag] = number

    for tag, key in _CURATED:
        put(tag, lookup(result, key))
    for name, value in (lookup(result, _STATS) or {}).items():
        if name not in _STATS_ELSEWHERE:
            put(f"learner/{name}", value)
    for pid, info in (lookup(result, "info/learner") or {}).items():
        if not isinstance(info, Mapping):
            continue
        group = "learner/updates" if pid == DEFAULT_POLICY_ID else f"learner/{pid}/updates"
        for name, value in (info.get("update_stats") or {}).items():
            put(f"{group}/{name}", value)
        if pid == DEFAULT_POLICY_ID:
            continue  # Multi-agent: one group per policy (impala_tf.multi_agent).
        for name, value in (info.get("learner_stats") or {}).items():
            put(f"learner/{pid}/{name}", value)
        put(f"learner/{pid}/off_policyness", info.get("diff_num_grad_updates_vs_sampler_policy"))
    for stat in ("mean", "min", "max"):
        for pid, value in (result.get(f"policy_reward_{stat}") or {}).items():
            put(f"episode/{pid}/return_{stat}", value)
    for prefix, key in (("", "custom_metrics"), ("evaluation/", "evaluation/custom_metrics")):
        for name, value in (lookup(result, key) or {}).items():
            put(f"{prefix}custom_metrics/{name}", value)
    quantiles = lookup(result, "info/learner_queue/size_quantiles") or []
    for q, value in zip(_QUANTILES, quantiles):
        put(f"learner_queue/size_p{q}", value)
    for name, value in (lookup(result, "info/timing_breakdown") or {}).items():
        put(f"timing/{name}", value)
    for name, value in (result.get("counters") or {}).items():
        put(f"counters/{name.removeprefix('num_')}", value)
    if raw:
        for name, value in flatten(result):
            scalars[f"raw/{name}"] = value
    return scalars


class ResultWriter:
    """Appends results to `<logdir>/result.json` and writes them as TensorBoard summaries.

    Args:
      logdir: The run's directory (created if missing).
      tensorboard: Also write TensorBoard event files under `logdir`.
      raw: Also write the `raw/` scalars (see the module docstring).
    """

    def __init__(self, logdir: str, tensorboard: bool = True, raw: bool = True):
        os.makedirs(logdir, exist_ok=True)
        self.logdir = logdir
        self.raw = raw
        self._json = open(os.path.join(logdir, RESULT_FILE), "a", encoding="utf-8")  # noqa: SIM115
        self._writer = None
        if tensorboard:
            import tensorflow as tf

            self._tf = tf
            self._writer = tf.summary.create_file_writer(logdir)

    @staticmethod
    def step_of(result: Mapping[str, Any]) -> int:
        """The TensorBoard step of a result: `timesteps_total` (else `training_iteration`)."""
        return int(result.get("timesteps_total", result.get("training_iteration", 0)))

    def write(self, result: Mapping[str, Any]) -> None:
        """Appends `result` to `result.json` and writes its scalars (and evaluation videos) to
        TensorBoard."""
        self._json.write(json.dumps(result, default=json_default) + "\n")
        self._json.flush()
        if self._writer is not None:
            with self._writer.as_default(step=self.step_of(result)):
                # One op writes them all: a result has ~300 scalars, and an eager
                # `tf.summary.scalar` each held up every iteration by 0.2-0.4 s.
                summary = self._summary(result, self.raw)
                self._tf.summary.experimental.write_raw_pb(summary.SerializeToString())
                videos = lookup(result, "evaluation/episode_media/video")
                if videos:
                    self._write_gifs("evaluation/video", videos)
            self._writer.flush()

    @staticmethod
    def _summary(result: Mapping[str, Any], raw: bool) -> Any:
        """The result's scalars and `hist_stats` histograms as one `Summary` proto.

        Each value is what `tf.summary.scalar` / `tf.summary.histogram` write (a float32
        scalar, or [30, 3] float64 buckets, with the plugin's metadata), built in numpy.
        """
        from tensorboard.compat.proto import summary_pb2
        from tensorboard.plugins.histogram.summary_v2 import histogram_pb
        from tensorboard.plugins.scalar.summary_v2 import scalar_pb

        summary = summary_pb2.Summary()
        for tag, value in tensorboard_scalars(result, raw=raw).items():
            summary.value.extend(scalar_pb(tag, value).value)
        for name, values in (result.get("hist_stats") or {}).items():
            if len(values):
                summary.value.extend(histogram_pb(f"hist_stats/{name}", values).value)
        return summary

    def _write_gifs(self, tag: str, videos: Sequence[Video]) -> None:
        """One image summary of GIFs (one sample each), which TensorBoard shows animated."""
        from tensorboard.plugins.image import metadata as image_metadata

        metadata = image_metadata.create_summary_metadata(
            display_name=tag,
            description="Evaluation episodes (`render_env`), one sample per episode.",
        )
        size = [str(videos[0].width).encode(), str(videos[0].height).encode()]
        tensor = self._tf.constant(size + [video.gif for video in videos])
        self._tf.summary.write(tag, tensor, metadata=metadata)

    def write_histograms(self, step: int, values: Iterable[tuple[str, Any]]) -> None:
        """Writes one histogram per (name, array) under `weights/<name>`.

        Args:
          step: The TensorBoard step (`timesteps_total`).
          values: (name, array) pairs, e.g. each model variable's path and value.
        """
        if self._writer is None:
            return
        with self._writer.as_default(step=int(step)):
            for name, value in values:
                self._tf.summary.histogram(f"weights/{name}", value)
        self._writer.flush()

    def close(self) -> None:
        self._json.close()
        if self._writer is not None:
            self._writer.close()


def _fmt(value: Any, spec: str = ".1f") -> str:
    """`value` formatted with `spec`; `nan`/`inf` as such (never hidden), missing as `-`."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        return "-"
    return format(value, spec) if math.isfinite(value) else str(value)


def progress_line(result: Mapping[str, Any], timestep_budget: float | None = None) -> str:
    """One compact line per iteration: iteration, steps, return, throughput, losses, ETA.

    The return is the smoothed training return `mean [min, max]`, followed by `eval` and the
    evaluation's mean in iterations that evaluated. The ETA (with a `timestep_budget`) assumes
    the average rate so far (`timesteps_total / time_total_s`) holds.
    """
    stats = lookup(result, _STATS)
    if stats is None:  # Multi-agent: the first policy's losses.
        policies = lookup(result, "info/learner") or {}
        first = next(iter(policies.values()), {})
        stats = first.get("learner_stats") if isinstance(first, Mapping) else None
    stats = stats or {}
    line = (
        f"iter {result.get('training_iteration', 0):>4d}  "
        f"t={_fmt(result.get('time_total_s'))}s  "
        f"steps {int(result.get('timesteps_total', 0)):>9,d}  "
        f"return {_fmt(result.get('episode_reward_mean'))} "
        f"[{_fmt(result.get('episode_reward_min'), '.0f')}, "
        f"{_fmt(result.get('episode_reward_max'), '.0f')}]  "
    )
    evaluation = result.get("evaluation")
    if isinstance(evaluation, Mapping):
        line += f"eval {_fmt(evaluation.get('episode_reward_mean'))}  "
    line += (
        f"sampled {_fmt(result.get('num_env_steps_sampled_throughput_per_sec'), ',.0f')}/s  "
        f"trained {_fmt(result.get('num_env_steps_trained_throughput_per_sec'), ',.0f')}/s  "
        f"pi {_fmt(stats.get('policy_loss'), '.3f')} vf {_fmt(stats.get('vf_loss'), '.3f')} "
        f"H {_fmt(stats.get('entropy'), '.3f')}"
    )
    if timestep_budget:
        total = float(result.get("timesteps_total", 0))
        rate = total / max(float(result.get("time_total_s", 0.0)), 1e-9)
        if 0 < total < timestep_budget and rate > 0:
            line += f"  ETA {_duration((timestep_budget - total) / rate)}"
    return line


def _duration(seconds: float) -> str:
    """`42s`, `3m05s`, `2h07m`: short and readable at any scale."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def truncate_results(logdir: str, iteration: int) -> dict | None:
    """Keeps the results up to `iteration` in result.json; returns the last one kept.

    Results after it (logged after the checkpoint a run resumes from) are appended to
    `result.discarded.json`.
    """
    path = os.path.join(logdir, RESULT_FILE)
    if not os.path.isfile(path):
        return None
    kept, discarded, last = [], [], None
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                result = json.loads(line)
            except json.JSONDecodeError:  # A line cut by the kill that ended the run.
                discarded.append(line)
                continue
            if int(result.get("training_iteration", 0)) <= iteration:
                kept.append(line)
                last = result
            else:
                discarded.append(line)
    if discarded:
        with open(os.path.join(logdir, DISCARDED_FILE), "a", encoding="utf-8") as f:
            f.writelines(line if line.endswith("\n") else line + "\n" for line in discarded)
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(line if line.endswith("\n") else line + "\n" for line in kept)
        os.replace(tmp, path)
        print(
            f"impala_tf: moved {len(discarded)} result(s) logged after iteration {iteration} "
            f"to {DISCARDED_FILE}",
            flush=True,
        )
    return last


def mlflow_store(uri: str | None) -> str:
    """The MLflow store to use: `uri`, else `MLFLOW_TRACKING_URI`, else `file:./mlruns`.

    Here, not beside the MLflow logger (`impala_tf.training.trackers`, which imports Keras), so
    that a search's driver gives Tune's MLflow callback the same store without importing
    TensorFlow."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or "file:" + os.path.abspath("mlruns")
    if uri.startswith("file:") or "://" not in uri:
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's opt-in.
    return uri
