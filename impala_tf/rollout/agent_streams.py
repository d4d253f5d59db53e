"""The per-agent streams of a multi-agent runner, and cutting them into [R, T] sequences.

T is time (`rollout_fragment_length`), R the sequences a policy completed, L a policy's
`model.max_seq_len`, C = ceil(T / L). Every (env, agent, policy) of a
`impala_tf.rollout.multi_agent_runner.MultiAgentEnvRunner` keeps an `AgentStream`: its steps
not yet emitted (each a list indexed by the `STEP_OBS` ... `STEP_VERSION` constants; the
bootstrap value and the reward may be filled in after the step) and the recurrent state at every
step that starts a chunk of L steps. `emit_sequences` pops every stream's completed [T] sequences
into one `SampleBatch` per policy with the single-agent runner's columns
(`impala_tf.rollout.env_runner`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from impala_tf.data.sample_batch import SampleBatch
from impala_tf.rollout.fragment import POLICY_VERSION

__all__ = [
    "STEP_ACT",
    "STEP_LOGITS",
    "STEP_LOGP",
    "STEP_OBS",
    "STEP_REW",
    "STEP_TERM",
    "STEP_TRUNC",
    "STEP_VB",
    "STEP_VERSION",
    "STEP_VF",
    "AgentStream",
    "emit_sequences",
]

# One step of a stream is a list (its bootstrap value and reward may be filled in later):
(
    STEP_OBS,
    STEP_ACT,
    STEP_LOGITS,
    STEP_LOGP,
    STEP_VF,
    STEP_REW,
    STEP_TERM,
    STEP_TRUNC,
    STEP_VB,
    STEP_VERSION,
) = range(10)


class AgentStream:
    """The steps of one (env, agent, policy) not yet emitted, and its chunk start states."""

    __slots__ = ("steps", "starts")

    def __init__(self):
        self.steps: list[list] = []
        self.starts: list[tuple] = []  # State at every step whose index % T % L == 0.

    def __getstate__(self):
        return self.steps, self.starts

    def __setstate__(self, state):
        self.steps, self.starts = state


def emit_sequences(
    streams: Mapping[tuple, AgentStream],
    horizon: int,
    chunk_len: Mapping[str, int],
    zero_state: Mapping[str, tuple],
) -> dict[str, SampleBatch]:
    """Pops every completed [T] sequence of `streams` into its policy's [R, T, ...] batch.

    Args:
      streams: {(env index, agent id, policy id): stream}.
      horizon: T.
      chunk_len: {policy id: L}.
      zero_state: {policy id: the policy's zero recurrent state (() if none)}.
    """
    seqs: dict[str, list[tuple[list, list]]] = {}
    for key in sorted(streams, key=str):
        stream = streams[key]
        steps = stream.steps
        while len(steps) >= horizon and steps[horizon - 1][STEP_VB] is not None:
            chunks = -(-horizon // chunk_len[key[2]])
            seqs.setdefault(key[2], []).append((steps[:horizon], stream.starts[:chunks]))
            stream.steps = steps = steps[horizon:]
            stream.starts = stream.starts[chunks:]
    out = {}
    for pid in sorted(seqs):
        rows = seqs[pid]
        cols = list(zip(*(step for steps, _ in rows for step in steps)))
        shape = (len(rows), horizon)

        def col(i: int, dtype: Any = None, cols: list = cols, shape: tuple = shape):
            values = np.asarray(cols[i], dtype)
            return values.reshape(shape + values.shape[1:])

        columns = {
            "obs": col(STEP_OBS),
            "actions": col(STEP_ACT),
            "rewards": col(STEP_REW, np.float32),
            "terminateds": col(STEP_TERM, bool),
            "truncateds": col(STEP_TRUNC, bool),
            "action_dist_inputs": col(STEP_LOGITS, np.float32),
            "action_logp": col(STEP_LOGP, np.float32),
            "vf_preds": col(STEP_VF, np.float32),
            "values_bootstrapped": col(STEP_VB, np.float32),
            POLICY_VERSION: col(STEP_VERSION, np.int64),
        }
        for s in range(len(zero_state[pid])):
            columns[f"state_in_{s}"] = np.asarray(
                [[start[s] for start in starts] for _, starts in rows]
            )
        out[pid] = SampleBatch(columns)
    return out
