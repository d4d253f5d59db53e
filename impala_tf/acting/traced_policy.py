"""`TracedNumpyPolicy`: a custom model acting in numpy, its traced step run op by op.

B is batch. A custom model (`impala_tf.models.custom`) acts through `ActorPolicy`, one
TensorFlow call per env step of an actor's vector env; most of such a call is dispatch
(`impala_tf.acting.tf_policy`). When the model's step traces to ops numpy runs
(`impala_tf.acting.graph_numpy`: dense layers, activations, reshapes: what feed-forward Keras models
and RLlib `TFModelV2`s are made of), `numpy_acting` runs that graph with numpy instead: the same
arithmetic on the same float32 weights, without TensorFlow in the loop. It is checked once, on
two probe batches against the model's own step, and used only if they agree; otherwise (a
recurrent layer's loop, a convolution, bfloat16) the `ActorPolicy` acts as before.

`set_weights` takes the model's `get_weights()` lists, so the driver broadcasts the same
weights whichever acts. Actions are sampled by the same `ActionSampler` with the same seed.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from impala_tf.acting.action_sampler import SamplerState
from impala_tf.acting.graph_numpy import GraphProgram, UnsupportedGraph
from impala_tf.acting.policy_step import PolicyStep

__all__ = ["TracedNumpyPolicy", "numpy_acting"]

logger = logging.getLogger(__name__)

#: How close the numpy program's outputs must be to TensorFlow's on the probe batches.
_RTOL, _ATOL = 1e-4, 1e-5


class TracedNumpyPolicy(SamplerState):
    """Acts with a model's traced step run in numpy (see the module docstring).

    Args:
      actor: The model's `ActorPolicy` (its model, spaces and action sampler are used).
      program: The model's step as a `GraphProgram`: flat inputs (obs, *state), flat outputs
        (logits, values, *state).
    """

    def __init__(self, actor: Any, program: GraphProgram):
        self.observation_space = actor.observation_space
        self.action_space = actor.action_space
        self.explore = actor.explore
        self.sampler = actor.sampler
        self.model = actor.model
        self.is_recurrent = bool(actor.is_recurrent)
        self._program = program
        self._initial = [s[0] for s in actor.initial_state(1)]
        self._weights: list[np.ndarray] | None = None
        self._dtype = np.dtype(self.observation_space.dtype or np.float32)

    def set_weights(self, weights: list[np.ndarray]) -> None:
        """Loads `model.get_weights()` of the matching model."""
        weights = [np.asarray(w) for w in weights]
        self._program.set_values(weights)
        self._weights = weights

    def get_weights(self) -> list[np.ndarray]:
        if self._weights is None:
            raise RuntimeError("TracedNumpyPolicy has no weights yet: call set_weights first")
        return [w.copy() for w in self._weights]

    def initial_state(self, batch_size: int) -> tuple:
        return tuple(np.repeat(s[None], batch_size, axis=0) for s in self._initial)

    def forward(self, obs: np.ndarray, state: tuple = ()) -> tuple:
        """Returns (logits float32 [B, A], values float32 [B], next state) as numpy arrays."""
        out = self._program(np.asarray(obs, self._dtype), *state)
        return (
            np.asarray(out[0], np.float32),
            np.asarray(out[1], np.float32),
            tuple(np.asarray(s, np.float32) for s in out[2:]),
        )

    def step(self, obs: np.ndarray, state: tuple = ()) -> PolicyStep:
        """Acts on a batch of observations [B, ...] with recurrent state `state`."""
        logits, values, new_state = self.forward(obs, state)
        actions, logp = self.sampler(logits)
        return PolicyStep(actions, logits, logp, values, new_state)


def numpy_acting(actor: Any) -> Any:
    """`actor` (an `ActorPolicy` of a float32 model) as a `TracedNumpyPolicy` when its step
    runs in numpy with the same results; else `actor` itself."""
    import tensorflow as tf  # The actor's model is TensorFlow's already.

    model = actor.model
    obs_space = actor.observation_space
    obs_shape = tuple(int(d) for d in (obs_space.shape or ()))
    obs_dtype = tf.as_dtype(np.dtype(obs_space.dtype or np.float32))
    states = actor.initial_state(1)
    spec = (
        tf.TensorSpec([None, *obs_shape], obs_dtype),
        tuple(tf.TensorSpec([None, *s.shape[1:]], tf.float32) for s in states),
    )
    try:
        concrete = tf.function(model.step, autograph=False).get_concrete_function(*spec)
        program = GraphProgram(concrete, model.weights)
    except UnsupportedGraph as e:
        logger.debug("%s acts in TensorFlow: %s", type(model).__name__, e)
        return actor
    policy = TracedNumpyPolicy(actor, program)
    policy.set_weights(model.get_weights())
    rng = np.random.default_rng(0)
    for batch in (4, 1):
        obs = np.stack([obs_space.sample() for _ in range(batch)]).astype(obs_space.dtype)
        state = tuple(
            (s + rng.normal(size=(batch, *s.shape[1:]))).astype(np.float32)
            for s in actor.initial_state(batch)
        )
        expected = model.step(obs, state)
        try:
            got = policy.forward(obs, state)
        except Exception as e:  # noqa: BLE001 - any failure means: keep TensorFlow.
            logger.debug("%s acts in TensorFlow: %s", type(model).__name__, e)
            return actor
        for want, have in zip(tf.nest.flatten(expected), tf.nest.flatten(got)):
            if np.shape(want) != np.shape(have) or not np.allclose(
                np.asarray(want), have, rtol=_RTOL, atol=_ATOL
            ):
                logger.debug("%s acts in TensorFlow: numpy differs", type(model).__name__)
                return actor
    return policy
