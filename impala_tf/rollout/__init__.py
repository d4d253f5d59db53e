"""Rollout: env runners step envs with their policies and cut `Fragment`s.

`make_env_runner` builds the runner of a `RunnerSpec` (`impala_tf.rollout.spec`, resolved from
a config by `impala_tf.driver.specs.runner_spec`): `EnvRunner` for a single-agent env (one policy,
`"default_policy"`; vectorised, the fast path) or `MultiAgentEnvRunner` for a `MultiAgentEnv`
(one policy per mapped agent). Both keep one contract (`sample`, `set_weights`, `get_state`,
`set_state`, `reset`, `run_episodes`, `wrap_env`, `close`) and emit the one `Fragment` type
(`impala_tf.rollout.fragment`). `impala_tf.rollout.host` is what an actor worker hosts around a
runner. Nothing here imports TensorFlow unless a policy needs it.
"""

from __future__ import annotations

from typing import Any

from impala_tf.envs.faults import StepProgress
from impala_tf.rollout.spec import RunnerSpec

__all__ = ["make_env_runner"]


def make_env_runner(
    spec: RunnerSpec,
    worker_index: int = 1,
    explore: bool | None = None,
    update_filter: bool = True,
    progress: StepProgress | None = None,
    remote: Any = None,
) -> Any:
    """The env runner of `spec` (see the package docstring).

    Args:
      spec: What the runner is built from (`impala_tf.driver.specs.runner_spec` of a config).
      worker_index: 1-based index of the runner; 0 is the driver's evaluation runner.
      explore: Overrides `spec.explore`.
      update_filter: Update the observation filters with what is seen (actors).
      progress: Shared progress record for hang reports.
      remote: Central inference: (connection to the inference server, {policy_id: recurrent
        state shapes}).
    """
    kwargs = dict(
        worker_index=worker_index,
        explore=explore,
        update_filter=update_filter,
        progress=progress,
        remote=remote,
    )
    if spec.multi_agent:
        from impala_tf.rollout.multi_agent_runner import MultiAgentEnvRunner

        return MultiAgentEnvRunner(spec, **kwargs)
    from impala_tf.rollout.env_runner import EnvRunner

    return EnvRunner(spec, **kwargs)
