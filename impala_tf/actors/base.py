"""The one interface through which the driver talks to its actors.

Actors and the learner meet only through data: fragments come in (`fetch_ready`), weights go out
(`broadcast_weights`). Two pools implement it: `LocalActorPool` (local processes, the embedded
default) and `RayActorPool` (Ray actors, `actor_backend="ray"`, `impala_tf.actors.ray_pool`).
"""

from __future__ import annotations

import abc
import dataclasses

import numpy as np

from impala_tf.actors.env_runner import Fragment
from impala_tf.filters import Filter

__all__ = ["ActorFailure", "ActorPool", "ActorStateUnsupported"]


class ActorStateUnsupported(RuntimeError):
    """The pool cannot snapshot or restore its actors (an optional capability)."""


@dataclasses.dataclass
class ActorFailure:
    """An actor that died or raised.

    Attributes:
      actor_id: Which actor (0-based).
      error: What happened, with the remote traceback when there is one.
      fatal: A restart cannot help (e.g. the env returns observations of the wrong shape or
        non-finite data): the driver raises instead of restarting.
    """

    actor_id: int
    error: str
    fatal: bool = False


class ActorPool(abc.ABC):
    """A set of actors that sample fragments on request (RLlib's env-runner group)."""

    num_actors: int

    @abc.abstractmethod
    def request_samples(self, actor_ids: list[int], count: int = 1) -> None:
        """Asks each actor in `actor_ids` for `count` more fragments (asynchronously)."""

    @abc.abstractmethod
    def fetch_ready(self, timeout_s: float) -> tuple[list[Fragment], list[ActorFailure]]:
        """Returns the fragments ready now (waiting up to `timeout_s` for a first one), and the
        actors found dead since the last call."""

    @abc.abstractmethod
    def broadcast_weights(
        self,
        weights: list[np.ndarray],
        policy_version: int,
        actor_ids: list[int],
        obs_filter: Filter | None = None,
    ) -> None:
        """Sends policy weights (without waiting) to the actors in `actor_ids`.

        `obs_filter` (an `impala_tf.filters.Filter`, or None for none) is the driver's merged
        observation filter; each actor syncs its own to it with the weights.
        """

    @abc.abstractmethod
    def restart(self, actor_id: int, weights: list[np.ndarray], policy_version: int) -> None:
        """Replaces a failed actor by a fresh one holding `weights`."""

    @abc.abstractmethod
    def healthy_actor_ids(self) -> list[int]:
        """The actors currently alive."""

    def get_actor_states(self, actor_ids: list[int], timeout_s: float) -> dict[int, dict]:
        """Snapshots of idle actors' `EnvRunner.get_state()`, for an exact resume.

        Only meaningful for actors with no sample request outstanding (the deterministic mode
        keeps them so between training steps). A pool that cannot snapshot raises
        `ActorStateUnsupported`; the driver then resumes without actor state.
        """
        raise ActorStateUnsupported(f"{type(self).__name__} cannot snapshot its actors")

    def set_actor_states(self, states: dict[int, dict]) -> None:
        """Applies `EnvRunner.set_state(state)` in each actor of `states` (asynchronously,
        in order with the other commands sent to it)."""
        raise ActorStateUnsupported(f"{type(self).__name__} cannot restore its actors")

    @abc.abstractmethod
    def stop(self) -> None:
        """Ends every process or remote actor the pool started. Safe to call twice."""
