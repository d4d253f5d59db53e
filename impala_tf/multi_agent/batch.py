"""`MultiAgentBatch`: per-policy `SampleBatch`es plus the env steps they came from (RLlib's).

RLlib counts two things separately: env steps (one per `env.step()` call, however many agents
acted) and agent steps (one per agent that acted). A multi-agent fragment of T env steps in B
envs is `env_steps = T * B`; its policy batches hold the agent steps, each policy's as
[R, T, ...] sequences of one agent (`impala_tf.multi_agent.runner`), so `agent_steps()` is the
sum of their sizes. With four CartPole agents, one fragment's agent steps are up to four times
its env steps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from impala_tf.sample_batch import SampleBatch, concat_samples

__all__ = ["MultiAgentBatch"]


class MultiAgentBatch:
    """Policy batches keyed by policy id, and the env steps that produced them.

    Args:
      policy_batches: {policy_id: SampleBatch of [R, T, ...] sequences}.
      env_steps: Env steps the batches were sampled in (RLlib's `count`).
    """

    def __init__(self, policy_batches: Mapping[str, SampleBatch], env_steps: int):
        self.policy_batches = dict(policy_batches)
        self.count = int(env_steps)

    def env_steps(self) -> int:
        """Env steps (RLlib's `MultiAgentBatch.env_steps()`)."""
        return self.count

    def agent_steps(self) -> int:
        """Agent steps: the sum of the policy batches' steps (RLlib's `agent_steps()`)."""
        return sum(b.env_steps for b in self.policy_batches.values())

    def map(self, fn: Callable[[SampleBatch], SampleBatch]) -> MultiAgentBatch:
        """A new batch with `fn` applied to every policy batch (e.g. coding observations)."""
        return MultiAgentBatch({p: fn(b) for p, b in self.policy_batches.items()}, self.count)

    @staticmethod
    def concat(batches: list[MultiAgentBatch]) -> MultiAgentBatch:
        """Concatenates the rows of each policy and sums the env steps."""
        ids = sorted({p for b in batches for p in b.policy_batches})
        merged = {
            p: concat_samples([b.policy_batches[p] for b in batches if p in b.policy_batches])
            for p in ids
        }
        return MultiAgentBatch(merged, sum(b.count for b in batches))

    def __repr__(self) -> str:
        parts = ", ".join(f"{p}: {len(b)} rows" for p, b in sorted(self.policy_batches.items()))
        return f"MultiAgentBatch(env_steps={self.count}, {{{parts}}})"
