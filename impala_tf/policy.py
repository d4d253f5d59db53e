"""`ActorPolicy`: the acting side of the policy, as used by actors and by evaluation.

It wraps an `impala_tf.models.ActorCritic` with one compiled `tf.function` that, for a batch of
observations [B, ...], returns the actions, the behaviour logits (RLlib's `action_dist_inputs`),
their log-probabilities (`action_logp`), the values (`vf_preds`) and the next recurrent state.
Sampling is stateless and seeded, so an actor with a fixed seed acts reproducibly.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import tensorflow as tf

from impala_tf import distributions
from impala_tf.models import build_model
from impala_tf.policy_step import PolicyStep

__all__ = ["ActorPolicy", "PolicyStep"]


class ActorPolicy:
    """A policy that acts: a model, its action distribution and a compiled step function.

    Args:
      observation_space: The env's observation space.
      action_space: The env's action space.
      model_config: RLlib model keys (see `impala_tf.models.build_model`).
      explore: Sample actions when True, take the distribution's mode when False (RLlib
        `explore`).
      seed: Seed of the stateless action sampling; None draws one at random.
    """

    def __init__(
        self,
        observation_space: gym.Space,
        action_space: gym.Space,
        model_config: dict | None = None,
        explore: bool = True,
        seed: int | None = None,
    ):
        self.observation_space = observation_space
        self.action_space = action_space
        self.explore = explore
        self.model = build_model(observation_space, action_space, model_config)
        self._seed = int(np.random.SeedSequence(seed).generate_state(1)[0] % (2**31 - 1))
        self._calls = 0
        self._step = tf.function(self._step_fn, reduce_retracing=True, autograph=False)

    @property
    def is_recurrent(self) -> bool:
        return bool(self.model.is_recurrent)

    def initial_state(self, batch_size: int) -> tuple:
        """The zero recurrent state for `batch_size` envs, as numpy arrays (() if none)."""
        return tuple(s.numpy() for s in self.model.initial_state(batch_size))

    def _step_fn(self, obs, state, seed):
        logits, values, new_state = self.model.step(obs, state)
        dist = distributions.make_distribution(self.action_space, logits)
        actions = dist.sample(seed=seed) if self.explore else dist.mode()
        return actions, logits, dist.log_prob(actions), values, new_state

    def step(self, obs: np.ndarray, state: tuple = ()) -> PolicyStep:
        """Acts on a batch of observations [B, ...] with recurrent state `state`."""
        self._calls += 1
        seed = tf.constant([self._seed, self._calls], tf.int32)
        actions, logits, logp, values, new_state = self._step(obs, tuple(state), seed)
        return PolicyStep(
            actions=actions.numpy(),
            logits=logits.numpy(),
            logp=logp.numpy(),
            values=values.numpy(),
            state=tuple(s.numpy() for s in new_state),
        )

    def get_rng_state(self) -> dict:
        """The action sampler's state (seed and call count), for checkpoints."""
        return {"seed": self._seed, "calls": self._calls}

    def set_rng_state(self, state: dict) -> None:
        """Continues the action sampler from a `get_rng_state()` value."""
        self._seed, self._calls = int(state["seed"]), int(state["calls"])

    def reseed(self, seed: int | None) -> None:
        """Restarts the action sampler as if built with `seed`."""
        self._seed = int(np.random.SeedSequence(seed).generate_state(1)[0] % (2**31 - 1))
        self._calls = 0

    def get_weights(self) -> list[np.ndarray]:
        return self.model.get_weights()

    def set_weights(self, weights: list[np.ndarray]) -> None:
        self.model.set_weights(weights)
