"""`Fragment`: what an env runner returns per sample request, for one policy or many.

B is batch (env sequences), T is time (`rollout_fragment_length`). A fragment holds, per policy
id, a `SampleBatch` of [B, T, ...] sequences that policy acted in (`batches`; a single-agent
runner's is `{"default_policy": batch}`), the env steps and agent steps it took (RLlib counts
both: one env step per `env.step()`, one agent step per agent that acted), the `num_grad_updates`
of each policy's weights loaded when sampling (`policy_versions`; the per-step `policy_version`
column of each batch says which weights chose each step) and the episodes that ended in it.

`Episode` is the one record of a finished episode: its return summed over the agents (RLlib's
`episode_reward`), its length in env steps, each policy's agents' own returns (RLlib's
`policy_reward_*` inputs; `{"default_policy": [return]}` for a single-agent env), and what the
episode callbacks set (`custom_metrics`, `hist_data`; `impala_tf.config.callbacks`).

This module imports numpy only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from impala_tf.config.policies import DEFAULT_POLICY_ID
from impala_tf.data.sample_batch import SampleBatch

__all__ = ["DEFAULT_POLICY_ID", "Episode", "Fragment", "POLICY_VERSION"]

#: Per-step column: `num_grad_updates` of the weights that chose the step's action (int64 [B, T]).
POLICY_VERSION = "policy_version"


class Episode(NamedTuple):
    """One finished episode.

    Attributes:
      ret: Its return, summed over the agents (unclipped rewards).
      length: Its length in env steps.
      policy_returns: {policy_id: [the return of each agent that acted with it]}.
      custom_metrics: {name: number} the episode callbacks set (RLlib's `custom_metrics`).
      hist_data: {name: [numbers]} the episode callbacks set (RLlib's `hist_data`).
    """

    ret: float
    length: int
    policy_returns: dict[str, list[float]]
    custom_metrics: dict[str, float] = {}  # noqa: RUF012 - never mutated; a NamedTuple field.
    hist_data: dict[str, list[float]] = {}  # noqa: RUF012


@dataclasses.dataclass
class Fragment:
    """What an env runner sends per sample request (see the module docstring).

    Attributes:
      batches: {policy_id: SampleBatch of [B, T, ...] sequences}; a policy that completed no
        sequence in this fragment has no entry.
      env_steps: Env steps taken (T * num_envs).
      agent_steps: Agent steps taken (env steps for a single-agent env).
      policy_versions: {policy_id: `num_grad_updates` of the weights loaded when sampling}.
      episodes: The episodes that ended in this fragment.
      actor_id: Index of the actor that produced it (0-based).
      sample_time_s: Wall time spent producing it.
      filter_deltas: {policy_id: the observation filter's changes while sampling}
        (`impala_tf.acting.filters.Filter.delta()`), for the driver to merge; None without filters.
      num_nonfinite_episodes_dropped: Episodes cut for a non-finite observation or reward
        (`drop_nonfinite_episodes`).
    """

    batches: dict[str, SampleBatch]
    env_steps: int
    agent_steps: int
    policy_versions: dict[str, int]
    episodes: list[Episode] = dataclasses.field(default_factory=list)
    actor_id: int = 0
    sample_time_s: float = 0.0
    filter_deltas: dict[str, Any] | None = None
    num_nonfinite_episodes_dropped: int = 0

    def map_batches(self, fn) -> Fragment:
        """This fragment with `fn` applied to every policy batch (e.g. coding observations)."""
        return dataclasses.replace(self, batches={p: fn(b) for p, b in self.batches.items()})
