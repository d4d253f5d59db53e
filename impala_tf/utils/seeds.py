"""Every random stream of a seeded run (`seed`), named in one place.

* The envs, as RLlib seeds them: env j of env runner i (i = 0 is the driver's evaluation runner)
  starts from `seed + 1000 i + j` (`env_seed`).
* The action samplers: a single-agent runner's policy samples from its first env's seed; policy k
  (sorted ids) of a multi-agent runner from that plus `7919 (k + 1)` (`sampler_seeds`). Whatever
  acts as a runner would (`impala_tf.acting.trained_policy`) takes its seeds from here too.
* Mix-in replay: policy k's buffer in aggregator n (0: the driver's) draws from
  `seed + 10000 + n + 1000 k` (`replay_seed`).
* Streams the driver starts during a run (`Stream`): evaluation episodes of each iteration, the
  replay and actors after a restore, a restarted actor, the draws of APPO's circular buffer.
  Each is `derived_seed(seed, key, stream)`, a `numpy.random.SeedSequence` of the run's seed
  and the stream's key, so no two draw alike (the buffers of several APPO policies share one).

An unseeded run (`seed=None`) gets None everywhere: each stream seeds itself from the OS.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import numpy as np

__all__ = [
    "Stream",
    "derived_seed",
    "env_seed",
    "replay_seed",
    "sampler_seeds",
    "stream_seed",
]

#: Env j of runner i starts from `seed + i * this + j` (RLlib's scheme).
MAX_ENVS_PER_RUNNER = 1000
#: Policy k of a multi-agent runner samples from its first env's seed + `this * (k + 1)`.
SAMPLER_STRIDE = 7919
#: Replay buffers draw from `seed + this + aggregator index + 1000 * policy index`.
REPLAY_OFFSET = 10_000


class Stream(enum.IntEnum):
    """The streams the driver starts during a run; the value is the stream's key."""

    #: Evaluation episodes of an iteration (keyed by the iteration).
    EVALUATION = 1
    #: Mix-in replay after a restore (keyed by the env steps sampled at the save).
    RESTORED_REPLAY = 2
    #: An actor's envs and sampler after a restore (keyed by those steps and the actor id).
    RESTORED_ACTOR = 3
    #: A restarted actor (keyed by the run's restarts so far and the actor id).
    RESTARTED_ACTOR = 4
    #: The draws of a learner's queue when it samples (APPO's circular buffer; key 0).
    LEARNER_BUFFER = 5


def env_seed(seed: int | None, worker_index: int, vector_index: int) -> int | None:
    """The seed of env `vector_index` of env runner `worker_index` (None if `seed` is None)."""
    if seed is None:
        return None
    return int(seed) + worker_index * MAX_ENVS_PER_RUNNER + vector_index


def sampler_seeds(
    seed: int | None, worker_index: int, policy_ids: Sequence[str], multi_agent: bool
) -> dict[str, int | None]:
    """The action samplers' seeds of a runner's policies (None in an unseeded run)."""
    base = env_seed(seed, worker_index, 0)
    if not multi_agent:
        return {pid: base for pid in policy_ids}
    return {
        pid: None if base is None else base + SAMPLER_STRIDE * (k + 1)
        for k, pid in enumerate(sorted(policy_ids))
    }


def replay_seed(seed: int | None, aggregator_index: int, policy_index: int) -> int | None:
    """The seed of policy `policy_index`'s replay buffer in aggregator `aggregator_index`."""
    if seed is None:
        return None
    return int(seed) + REPLAY_OFFSET + aggregator_index + 1000 * policy_index


def derived_seed(seed: int | None, *keys: int) -> int | None:
    """A seed for a new random stream of a seeded run (None for an unseeded one)."""
    if seed is None:
        return None
    entropy = [int(seed) % 2**63, *(int(k) for k in keys)]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


def stream_seed(seed: int | None, stream: Stream, key: int, *more: int) -> int | None:
    """The seed of `stream` for `key` (and `more` keys, such as an actor id)."""
    return derived_seed(seed, key, int(stream), *more)
