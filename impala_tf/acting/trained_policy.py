"""`Policy`: a trained policy to call from Python (RLlib's `Policy`, as `get_policy()` gives it).

B is batch. A `Policy` holds one policy's Keras model (`.model`: the `ActorCritic`, or the
adapter around a custom model, whose `.net` is the user's own), its spaces, its per-policy
config and its observation filter, and computes actions as the env runners do: the same acting
path (`impala_tf.acting.factory.make_policy`: numpy for the catalog's MLPs, the model's
compiled step otherwise) and the same action sampler, seeded as the driver's evaluation runner seeds
it (`impala_tf.utils.seeds.sampler_seeds`, worker index 0). So with the same seed it takes the
actions `impala-evaluate` takes: every episode with `explore=False`, and the episodes'
sampled actions too as long as the calls come in the same order.

As in RLlib, `Policy.compute_single_action` / `compute_actions` take observations as the
policy sees them (after the observation filter) and return its actions as it chose them (in
[-1, 1] for Box actions with `normalize_actions`); `Impala.compute_single_action` applies the
filter before and the env's unsquashing or clipping after, as the env runners do.

A policy of a built algorithm follows its learner: before each call it loads the learner's
newest weights when an update changed them. A policy of `Impala.from_checkpoint` holds the
checkpoint's weights until `set_weights`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np

from impala_tf.acting.factory import make_policy
from impala_tf.acting.filters import Filter

__all__ = ["Policy"]


class Policy:
    """One policy: its model, weights and filter, and actions for observations.

    Args:
      policy_id: The policy's id (`"default_policy"` for a single-agent run).
      model: The policy's Keras model (built from its `ModelSpec`).
      spec: The policy's `impala_tf.models.spec.ModelSpec`.
      observation_space: The policy's observation space.
      action_space: The policy's action space.
      config: The policy's config (the algorithm's, its `PolicySpec` overrides applied).
      obs_filter: A callable returning the current observation filter (`observation_filter`).
      seed: The action sampler's seed (None: unseeded).
      source: For a built algorithm, returns the learner's `(weights, num_grad_updates)`, or
        None when nothing newer than `version` is there; None for a fixed policy.
      setter: For a built algorithm, sets the learner's weights (`set_weights` goes through
        it, so the learner and the actors get them); None sets this policy's model.

    Attributes:
      model: The Keras model (RLlib's `policy.model`).
      observation_space, action_space, config: As given.
    """

    def __init__(
        self,
        policy_id: str,
        model: Any,
        spec: Any,
        observation_space: gym.Space,
        action_space: gym.Space,
        config: Any,
        obs_filter: Callable[[], Filter],
        seed: int | None,
        source: Callable[[int], tuple[list[np.ndarray], int] | None] | None = None,
        setter: Callable[[list[np.ndarray]], None] | None = None,
    ):
        self.policy_id = policy_id
        self.model = model
        self.observation_space = observation_space
        self.action_space = action_space
        self.config = config
        self._filter = obs_filter
        self._source = source
        self._setter = setter
        self._version = -1
        self._actor = make_policy(
            observation_space,
            action_space,
            spec,
            explore=bool(config.explore),
            seed=seed,
            precision=config.acting_precision,
        )
        self._actor.set_weights(model.get_weights())
        self._sync()

    # Weights ----------------------------------------------------------------------------------

    def _sync(self) -> None:
        """Loads the learner's weights if an update changed them since the last call."""
        if self._source is None:
            return
        newer = self._source(self._version)
        if newer is not None:
            weights, self._version = newer
            self._actor.set_weights(weights)

    def get_weights(self) -> list[np.ndarray]:
        """The model's weights (numpy arrays, `keras.Model.get_weights()` order)."""
        self._sync()
        return self._actor.get_weights()

    def set_weights(self, weights: list[np.ndarray]) -> None:
        """Sets the weights this policy acts with (and its `model`'s; for a built algorithm,
        the learner's, which the actors then receive)."""
        weights = [np.asarray(w) for w in weights]
        if self._setter is not None:
            self._setter(weights)
        else:
            self.model.set_weights(weights)
        self._actor.set_weights(self.model.get_weights())

    def get_initial_state(self) -> list[np.ndarray]:
        """The recurrent state of one env before its first step ([] if not recurrent)."""
        return [s[0] for s in self._actor.initial_state(1)]

    def is_recurrent(self) -> bool:
        return bool(self._actor.is_recurrent)

    # Actions ----------------------------------------------------------------------------------

    def compute_actions(
        self,
        obs_batch: Any,
        state_batches: list[Any] | None = None,
        explore: bool | None = None,
    ) -> tuple[np.ndarray, list[np.ndarray], dict[str, np.ndarray]]:
        """Actions for a batch of (filtered) observations, as RLlib's `Policy.compute_actions`.

        Args:
          obs_batch: [B, *obs_shape] observations, after the observation filter.
          state_batches: The recurrent state, a list of [B, H] arrays (None: the initial state).
          explore: Sample (True) or take the most likely action (False); None: the config's.

        Returns:
          (actions [B, *action_shape], state out as a list of [B, H] arrays, extra fetches:
          `action_dist_inputs` [B, A], `action_logp` [B], `vf_preds` [B]).
        """
        self._sync()
        obs = np.asarray(obs_batch, self.observation_space.dtype or np.float32)
        if state_batches is None:
            state = self._actor.initial_state(len(obs))
        else:
            state = tuple(np.asarray(s, np.float32) for s in state_batches)
        sampler = self._actor.sampler
        saved = sampler.explore
        sampler.explore = bool(self.config.explore if explore is None else explore)
        try:
            step = self._actor.step(obs, state)
        finally:
            sampler.explore = saved
        extra = {
            "action_dist_inputs": step.logits,
            "action_logp": step.logp,
            "vf_preds": step.values,
        }
        return step.actions, [np.asarray(s) for s in step.state], extra

    def compute_single_action(
        self, obs: Any, state: list[Any] | None = None, explore: bool | None = None
    ) -> tuple[Any, list[np.ndarray], dict[str, Any]]:
        """One (filtered) observation's action, as RLlib's `Policy.compute_single_action`.

        Returns:
          (action, state out: a list of [H] arrays, extra fetches of this observation).
        """
        batch_state = None if state is None else [np.asarray(s)[None] for s in state]
        actions, state_out, extra = self.compute_actions(
            np.asarray(obs)[None], batch_state, explore
        )
        return (
            actions[0],
            [s[0] for s in state_out],
            {k: v[0] for k, v in extra.items()},
        )

    def filter(self, obs: Any) -> np.ndarray:
        """Observations [B, ...] through the policy's observation filter (not updating it)."""
        obs = np.asarray(obs, self.observation_space.dtype or np.float32)
        return self._filter()(obs, update=False)

    def __repr__(self) -> str:
        return (
            f"Policy({self.policy_id!r}, {type(self.model).__name__}, "
            f"{self.observation_space} -> {self.action_space})"
        )
