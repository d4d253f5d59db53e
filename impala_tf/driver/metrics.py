"""The driver's counters, its window of finished episodes, and RLlib's result dict.

`Metrics` counts what the driver sees (RLlib's lifetime counters: `num_env_steps_sampled`,
`num_agent_steps_sampled`, `num_env_steps_trained`, ...), keeps the last
`metrics_num_episodes_for_smoothing` episodes and each trained policy's latest learner stats,
and builds `train()`'s result dict (`result`). `summarize_episodes` is the one summary of a set of
episodes, used for that window, for `evaluate()` and by `impala-evaluate`.

Learner stats: RLlib's `learner_stats` are the last update's, as RLlib reports them; every
update of the iteration is summarised beside them in `update_stats` (ours): for each stat,
`<name>_mean`, `<name>_min` and `<name>_max` over the iteration's updates (RLlib's stats, the
diagnostics of `impala_tf.learning.learner.DIAGNOSTIC_KEYS`, and the policy lag
`diff_num_grad_updates_vs_sampler_policy`), and `num_updates`. A short collapse inside an
iteration shows there (an entropy minimum, a gradient-norm maximum) when the last update has
recovered.

Steps trained: a learner thread reports the agent steps of each train batch it trained on (a
policy's batch is `train_batch_size` of ITS agent steps); `num_agent_steps_trained` sums them,
and `num_env_steps_trained` adds them scaled by the sampled env-to-agent step ratio (1 for a
single-agent env, where the two counts are equal; a multi-agent policy's batch matches no fixed
set of env steps).
"""

from __future__ import annotations

import collections
import os
import platform
import socket
import time
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from impala_tf.config.callbacks import custom_metric_stats, hist_stats
from impala_tf.driver.counters import COUNTERS, Counters
from impala_tf.rollout.fragment import Episode, Fragment

__all__ = [
    "COUNTERS",
    "Counters",
    "LEARNER_INFO",
    "LEARNER_STATS_KEY",
    "Metrics",
    "summarize_episodes",
]

#: Learner stats `update_stats` does not summarise: counters, not per-update measurements.
_NOT_SUMMARISED = frozenset({"num_agent_steps_trained", "num_grad_updates_lifetime"})

#: RLlib's names of the result's `info` entries: `result["info"][LEARNER_INFO][policy_id]
#: [LEARNER_STATS_KEY]` holds a policy's learner stats.
LEARNER_INFO = "learner"
LEARNER_STATS_KEY = "learner_stats"


def summarize_episodes(episodes: Iterable[Episode], multi_agent: bool = False) -> dict[str, Any]:
    """RLlib's episode metrics of `episodes` (NaN where there are none).

    Args:
      episodes: Finished episodes.
      multi_agent: Add `policy_reward_mean/min/max` ({policy_id: statistic} over the returns of
        that policy's agents); for a single-agent env they are empty, as in RLlib.

    Returns:
      `episode_reward_mean/min/max`, `episode_len_mean`, `num_episodes`,
      `num_env_steps` (the episodes' summed lengths), `policy_reward_mean/min/max`, and
      RLlib's `custom_metrics` and `hist_stats` (`impala_tf.config.callbacks`).
    """
    episodes = list(episodes)
    returns = [e.ret for e in episodes]
    nan = float("nan")

    def stat(fn, values):
        return float(fn(values)) if values else nan

    per_policy: dict[str, list[float]] = collections.defaultdict(list)
    if multi_agent:
        for episode in episodes:
            for pid, values in episode.policy_returns.items():
                per_policy[pid].extend(values)
    out: dict[str, Any] = {
        "episode_reward_mean": stat(np.mean, returns),
        "episode_reward_min": stat(np.min, returns),
        "episode_reward_max": stat(np.max, returns),
        "episode_len_mean": stat(np.mean, [e.length for e in episodes]),
        "num_episodes": len(episodes),
        "num_env_steps": int(sum(e.length for e in episodes)),
    }
    for name, fn in (("mean", np.mean), ("min", np.min), ("max", np.max)):
        out[f"policy_reward_{name}"] = {p: stat(fn, v) for p, v in sorted(per_policy.items())}
    out["custom_metrics"] = custom_metric_stats(episodes)
    out["hist_stats"] = hist_stats(episodes, sorted(per_policy))
    return out


def new_api_episode_stats(summary: Mapping[str, Any]) -> dict[str, Any]:
    """The same statistics under the new API stack's `env_runners` names."""
    return {
        "episode_return_mean": summary["episode_reward_mean"],
        "episode_return_min": summary["episode_reward_min"],
        "episode_return_max": summary["episode_reward_max"],
        "episode_len_mean": summary["episode_len_mean"],
        "num_episodes": summary["num_episodes"],
    }


class Metrics:
    """Counters, the episode window and learner stats of one driver (see the module docstring).

    Args:
      smoothing: Episodes in the window (`metrics_num_episodes_for_smoothing`).
      trained: The ids of the trained policies (their learner stats go in the result).
      multi_agent: Report `policy_reward_*` per policy.
    """

    def __init__(self, smoothing: int, trained: Iterable[str], multi_agent: bool):
        self.counters = Counters()
        self.episodes: collections.deque[Episode] = collections.deque(maxlen=int(smoothing))
        self.episodes_total = 0
        self.episodes_this_iter = 0
        self.trained = list(trained)
        self.multi_agent = multi_agent
        self.learner_stats: dict[str, dict[str, Any]] = {}
        # {policy_id: {stat: [n, sum, min, max]}} over the iteration's updates.
        self._update_stats: dict[str, dict[str, list[float]]] = {}
        self._env_steps_trained = 0.0

    # Recording ----------------------------------------------------------------------------------

    def record_fragment(self, fragment: Fragment) -> None:
        """Counts a fragment's steps and episodes."""
        c = self.counters
        c.num_env_steps_sampled += fragment.env_steps
        c.num_agent_steps_sampled += fragment.agent_steps
        c.num_nonfinite_episodes_dropped += fragment.num_nonfinite_episodes_dropped
        self.episodes.extend(fragment.episodes)
        self.episodes_total += len(fragment.episodes)
        self.episodes_this_iter += len(fragment.episodes)

    def record_learner_output(self, policy_id: str, agent_steps: int, stats: Mapping) -> None:
        """Counts one update of `policy_id` (its train batch's agent steps and stats)."""
        c = self.counters
        stats = dict(stats)
        if stats.pop("update_skipped", False):
            c.num_nonfinite_updates_skipped += 1
        c.num_agent_steps_trained += agent_steps
        sampled_agents = c.num_agent_steps_sampled
        ratio = c.num_env_steps_sampled / sampled_agents if sampled_agents else 1.0
        self._env_steps_trained += agent_steps * ratio
        c.num_env_steps_trained = int(round(self._env_steps_trained))
        self.learner_stats[policy_id] = stats
        summary = self._update_stats.setdefault(policy_id, {})
        for key, value in stats.items():
            if key in _NOT_SUMMARISED or not isinstance(value, (int, float)):
                continue
            value = float(value)
            if not np.isfinite(value):
                continue
            entry = summary.get(key)
            if entry is None:
                summary[key] = [1, value, value, value]
            else:
                entry[0] += 1
                entry[1] += value
                entry[2] = min(entry[2], value)
                entry[3] = max(entry[3], value)

    def _take_update_stats(self, policy_id: str) -> dict[str, float]:
        """`update_stats` of `policy_id`'s updates since the last result (then forgotten)."""
        summary = self._update_stats.pop(policy_id, {})
        out: dict[str, float] = {"num_updates": max((e[0] for e in summary.values()), default=0)}
        for key, (n, total, low, high) in sorted(summary.items()):
            out[f"{key}_mean"] = total / n
            out[f"{key}_min"] = low
            out[f"{key}_max"] = high
        return out

    # The result dict ----------------------------------------------------------------------------

    def result(
        self,
        before: Counters,
        elapsed_s: float,
        iteration: int,
        time_total_s: float,
        runtime: Mapping[str, Any],
    ) -> dict[str, Any]:
        """RLlib's result dict of the iteration that started with counters `before`.

        Args:
          before: The counters when the iteration started.
          elapsed_s: The iteration's training time (throughputs divide by it).
          iteration: `training_iteration`.
          time_total_s: `time_total_s`.
          runtime: `num_healthy_workers`, `num_in_flight_async_sample_reqs` and `node_ip`
            (the driver's node address, `EnvRunnerGroup.node_ip`).
        """
        c = self.counters
        summary = summarize_episodes(self.episodes, self.multi_agent)
        counters = c.as_dict()
        sampled = c.num_env_steps_sampled - before.num_env_steps_sampled
        trained = c.num_env_steps_trained - before.num_env_steps_trained
        learner = {}
        for pid in self.trained:
            stats = dict(self.learner_stats.get(pid, {}))
            diff = stats.pop("diff_num_grad_updates_vs_sampler_policy", 0.0)
            learner[pid] = {
                "learner_stats": stats,
                "num_agent_steps_trained": int(stats.get("num_agent_steps_trained", 0)),
                "num_grad_updates_lifetime": int(stats.get("num_grad_updates_lifetime", 0)),
                "diff_num_grad_updates_vs_sampler_policy": diff,
                "update_stats": self._take_update_stats(pid),
            }
        elapsed = max(elapsed_s, 1e-9)
        env_runners = new_api_episode_stats({**summary, "num_episodes": self.episodes_this_iter})
        env_runners["num_env_steps_sampled_lifetime"] = c.num_env_steps_sampled
        return {
            "episode_reward_mean": summary["episode_reward_mean"],
            "episode_reward_min": summary["episode_reward_min"],
            "episode_reward_max": summary["episode_reward_max"],
            "episode_len_mean": summary["episode_len_mean"],
            "episodes_this_iter": self.episodes_this_iter,
            "episodes_total": self.episodes_total,
            "policy_reward_mean": summary["policy_reward_mean"],
            "policy_reward_min": summary["policy_reward_min"],
            "policy_reward_max": summary["policy_reward_max"],
            "custom_metrics": summary["custom_metrics"],
            "hist_stats": summary["hist_stats"],
            "env_runners": env_runners,
            "training_iteration": iteration,
            "timesteps_total": c.num_env_steps_sampled,
            "time_this_iter_s": elapsed_s,
            "time_total_s": time_total_s,
            **counters,
            "num_env_steps_sampled_this_iter": sampled,
            "num_env_steps_trained_this_iter": trained,
            "num_env_steps_sampled_throughput_per_sec": sampled / elapsed,
            "num_env_steps_trained_throughput_per_sec": trained / elapsed,
            "num_healthy_workers": int(runtime["num_healthy_workers"]),
            "num_in_flight_async_sample_reqs": int(runtime["num_in_flight_async_sample_reqs"]),
            "counters": dict(counters),
            "info": {"learner": learner, **counters},
            "timestamp": int(time.time()),
            "date": time.strftime("%Y-%m-%d_%H-%M-%S"),
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
            "node_ip": str(runtime["node_ip"]),
            "platform": platform.platform(),
        }

    # Saved state (plain data) -------------------------------------------------------------------

    def get_state(self) -> dict[str, Any]:
        """The counters, the episode window and the trained-step tally, as JSON-able data."""
        return {
            "counters": self.counters.as_dict(),
            "episodes": [
                [e.ret, e.length, e.policy_returns, e.custom_metrics, e.hist_data]
                for e in self.episodes
            ],
            "episodes_total": self.episodes_total,
            "env_steps_trained": self._env_steps_trained,
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Restores `get_state()` (older checkpoints' episodes are [return, length] pairs, or
        triples without the callbacks' custom metrics and hist data).

        The counters are updated in place: the driver's collaborators hold the same object.
        """
        self.counters.load(state["counters"])
        self.episodes.clear()
        for entry in state["episodes"]:
            returns = entry[2] if len(entry) > 2 else {}
            metrics = entry[3] if len(entry) > 3 else {}
            hist = entry[4] if len(entry) > 4 else {}
            self.episodes.append(
                Episode(float(entry[0]), int(entry[1]), dict(returns), dict(metrics), dict(hist))
            )
        self.episodes_total = int(state["episodes_total"])
        trained = state.get("env_steps_trained")
        self._env_steps_trained = float(
            self.counters.num_env_steps_trained if trained is None else trained
        )
