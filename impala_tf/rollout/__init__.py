"""Rollout: env runners step envs with their policies and cut `Fragment`s.

`make_env_runner` builds the runner of a config: `EnvRunner` for a single-agent env (one policy,
`"default_policy"`; vectorised, the fast path) or `MultiAgentEnvRunner` for a `MultiAgentEnv`
(one policy per mapped agent). Both keep one contract (`sample`, `set_weights`, `get_state`,
`set_state`, `reset`, `run_episodes`, `wrap_env`, `close`) and emit the one `Fragment` type
(`impala_tf.rollout.fragment`). `impala_tf.rollout.host` is what an actor worker hosts around a
runner. Nothing here imports TensorFlow unless a policy needs it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from impala_tf.config.base import AlgorithmConfig
from impala_tf.envs.faults import StepProgress
from impala_tf.models.spec import ModelSpec
from impala_tf.portable import Portable

__all__ = ["make_env_runner"]


def make_env_runner(
    config: AlgorithmConfig,
    multi_agent: bool,
    worker_index: int = 1,
    explore: bool | None = None,
    update_filter: bool = True,
    progress: StepProgress | None = None,
    remote: Any = None,
    models: Mapping[str, ModelSpec] | None = None,
    callbacks: Portable | None = None,
) -> Any:
    """The env runner of `config` (see the package docstring).

    Args:
      config: The algorithm config (or the evaluation config).
      multi_agent: The env is a `MultiAgentEnv` (`impala_tf.envs.spaces.EnvSpaces`).
      worker_index: 1-based index of the runner; 0 is the driver's evaluation runner.
      explore: Overrides `config.explore`.
      update_filter: Update the observation filters with what is seen (actors).
      progress: Shared progress record for hang reports.
      remote: Central inference: (connection to the inference server, {policy_id: recurrent
        state shapes}).
      models: {policy_id: the policy's resolved model} (`RuntimePlan.models`); None resolves
        them from `config` here.
      callbacks: The run's resolved `callbacks` class (`RuntimePlan.callbacks`).
    """
    kwargs = dict(
        worker_index=worker_index,
        explore=explore,
        update_filter=update_filter,
        progress=progress,
        remote=remote,
        models=models,
        callbacks=callbacks,
    )
    if multi_agent:
        from impala_tf.rollout.multi_agent_runner import MultiAgentEnvRunner

        return MultiAgentEnvRunner(config, **kwargs)
    from impala_tf.rollout.env_runner import EnvRunner

    return EnvRunner(config, **kwargs)
