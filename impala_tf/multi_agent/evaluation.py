"""Evaluating and exporting multi-agent checkpoints (`impala-evaluate` / `impala-export`).

A multi-agent checkpoint (`MultiAgentImpala.save`) holds the driver state at its top and one
complete single-policy checkpoint per policy under `policies/<policy_id>/`. `impala-export
--policy_id=P` exports policy P from there (with its observation filter). `impala-evaluate` runs
whole multi-agent episodes with every policy restored and reports the return summed over the
agents; with `--policy_id=P` it reports the returns of the agents that P controlled (RLlib's
`policy_reward_*`).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from impala_tf import checkpoints

__all__ = [
    "is_multi_agent_checkpoint",
    "load_multi_agent_runner",
    "policy_checkpoint_dir",
    "run_multi_agent_episodes",
]


def is_multi_agent_checkpoint(checkpoint_dir: str) -> bool:
    """Whether `checkpoint_dir` was written by `MultiAgentImpala.save`."""
    return bool(checkpoints.read_driver_state(checkpoint_dir).get("multi_agent"))


def policy_checkpoint_dir(checkpoint_dir: str, policy_id: str) -> str:
    """The single-policy checkpoint of `policy_id` inside a multi-agent checkpoint.

    Raises:
      ValueError: the checkpoint is not multi-agent, or has no such policy (the message lists
        the policies it has).
    """
    checkpoint_dir = checkpoints.resolve_checkpoint_dir(checkpoint_dir)
    state = checkpoints.read_driver_state(checkpoint_dir)
    if not state.get("multi_agent"):
        raise ValueError(
            f"--policy_id={policy_id}: {checkpoint_dir} is a single-policy checkpoint."
        )
    if policy_id not in state.get("policy_ids", []):
        raise ValueError(
            f"--policy_id={policy_id}: no such policy in {checkpoint_dir}; it has "
            f"{state.get('policy_ids')}."
        )
    return os.path.join(checkpoint_dir, "policies", policy_id)


def load_multi_agent_runner(checkpoint_dir: str, explore: bool = False, config: Any = None):
    """A `MultiAgentEnvRunner` (worker index 0) acting with every policy of a checkpoint.

    Returns:
      `(config, runner)`; the observation filters are the run's, not updated.
    """
    from impala_tf.filters import filter_from_state
    from impala_tf.models import build_model
    from impala_tf.multi_agent.runner import MultiAgentEnvRunner

    checkpoint_dir = checkpoints.resolve_checkpoint_dir(checkpoint_dir)
    config = checkpoints.load_config(checkpoint_dir) if config is None else config
    state = checkpoints.read_driver_state(checkpoint_dir)
    runner = MultiAgentEnvRunner(config, worker_index=0, explore=explore, update_filter=False)
    try:
        weights = {}
        for pid in runner.policies:
            model = build_model(*runner.spaces[pid], runner.config.model)
            checkpoints.restore_model(model, policy_checkpoint_dir(checkpoint_dir, pid))
            weights[pid] = (model.get_weights(), 0)
        filters = {
            pid: filter_from_state(f)
            for pid, f in (state.get("observation_filters") or {}).items()
            if f is not None and pid in runner.policies
        }
        runner.set_weights(weights, 0, filters or None)
    except BaseException:
        runner.close()
        raise
    return config, runner


def run_multi_agent_episodes(
    runner: Any, num_episodes: int, policy_id: str | None = None
) -> list[tuple[float, int]]:
    """Runs `num_episodes` episodes; (return, length) pairs.

    The return is summed over the agents, or with `policy_id` the mean return of the agents
    that policy controlled in the episode (episodes where it controlled none are skipped; the
    split assumes one env and the same number of such agents in every episode).
    """
    out: list[tuple[float, int]] = []
    while len(out) < num_episodes:
        fragment = runner.sample()
        if policy_id is None:
            out.extend(zip(fragment.episode_returns, fragment.episode_lengths))
            continue
        rewards = fragment.policy_rewards.get(policy_id, [])
        # One env (evaluation): episodes end in order, each with its agents' returns.
        per_episode = len(rewards) // max(1, len(fragment.episode_returns))
        for k, length in enumerate(fragment.episode_lengths):
            mine = rewards[k * per_episode : (k + 1) * per_episode]
            if mine:
                out.append((float(np.mean(mine)), length))
    return out[:num_episodes]
