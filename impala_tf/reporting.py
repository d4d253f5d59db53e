"""Where results go: `result.json` lines, TensorBoard scalars and the console progress line.

Each `train()` result dict is written as one JSON line with RLlib's names, as scalars to
TensorBoard (tags are the flattened keys, e.g. `info/learner/default_policy/learner_stats/vf_loss`,
stepped by `timesteps_total`), and summarised in one readable console line.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

__all__ = ["ResultWriter", "flatten", "progress_line"]


def flatten(result: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """Yields (slash/separated/key, value) for every finite numeric leaf of a nested dict."""
    for key, value in result.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from flatten(value, name + "/")
        elif isinstance(value, (bool, np.bool_)):
            continue
        elif isinstance(value, (int, float, np.integer, np.floating)):
            value = float(value)
            if math.isfinite(value):
                yield name, value


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


class ResultWriter:
    """Appends results to `<logdir>/result.json` and writes them as TensorBoard scalars.

    Args:
      logdir: The run's directory (created if missing).
      tensorboard: Also write TensorBoard event files under `logdir`.
    """

    def __init__(self, logdir: str, tensorboard: bool = True):
        os.makedirs(logdir, exist_ok=True)
        self.logdir = logdir
        self._json = open(os.path.join(logdir, "result.json"), "a", encoding="utf-8")  # noqa: SIM115
        self._writer = None
        if tensorboard:
            import tensorflow as tf

            self._tf = tf
            self._writer = tf.summary.create_file_writer(logdir)

    def write(self, result: Mapping[str, Any]) -> None:
        self._json.write(json.dumps(result, default=_json_default) + "\n")
        self._json.flush()
        if self._writer is not None:
            step = int(result.get("timesteps_total", result.get("training_iteration", 0)))
            with self._writer.as_default(step=step):
                for tag, value in flatten(result):
                    self._tf.summary.scalar(tag, value)
            self._writer.flush()

    def close(self) -> None:
        self._json.close()
        if self._writer is not None:
            self._writer.close()


def _fmt(value: Any, spec: str = ".1f") -> str:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return "-"
    return format(value, spec) if math.isfinite(value) else "-"


def progress_line(result: Mapping[str, Any], timestep_budget: float | None = None) -> str:
    """One compact line per iteration: iteration, steps, return, throughput, losses, ETA."""
    stats = (
        result.get("info", {}).get("learner", {}).get("default_policy", {}).get("learner_stats", {})
    )
    line = (
        f"iter {result.get('training_iteration', 0):>4d}  "
        f"t={_fmt(result.get('time_total_s'))}s  "
        f"steps {int(result.get('timesteps_total', 0)):>9,d}  "
        f"return {_fmt(result.get('episode_reward_mean'))} "
        f"[{_fmt(result.get('episode_reward_min'), '.0f')}, "
        f"{_fmt(result.get('episode_reward_max'), '.0f')}]  "
        f"sampled {_fmt(result.get('num_env_steps_sampled_throughput_per_sec'), ',.0f')}/s  "
        f"trained {_fmt(result.get('num_env_steps_trained_throughput_per_sec'), ',.0f')}/s  "
        f"pi {_fmt(stats.get('policy_loss'), '.3f')} vf {_fmt(stats.get('vf_loss'), '.3f')} "
        f"H {_fmt(stats.get('entropy'), '.3f')}"
    )
    if timestep_budget:
        total = float(result.get("timesteps_total", 0))
        rate = total / max(float(result.get("time_total_s", 0.0)), 1e-9)
        if 0 < total < timestep_budget and rate > 0:
            line += f"  ETA {(timestep_budget - total) / rate:.0f}s"
    return line
