"""`ActorPolicy`: the acting side of the policy, as used by actors and by evaluation.

It wraps an `impala_tf.models.ActorCritic` with one compiled `tf.function` that, for a batch of
observations [B, ...], returns the behaviour logits (RLlib's `action_dist_inputs`), the values
(`vf_preds`) and the next recurrent state; `impala_tf.acting.action_sampler.ActionSampler` then
draws the actions and their log-probabilities (`action_logp`) in numpy, seeded, as every acting
policy does, so an actor with a fixed seed acts reproducibly and takes the same actions whether it
runs the model itself or the driver runs it for it (central inference,
`impala_tf.acting.inference`).

An actor calls the model once per env step of its vector env, so the cost of a call matters: a
`tf.function` call first binds its arguments and looks up its trace, Python work that took about
0.3 ms per call on this project's 2-core machine, a fifth of a Pong actor's batch-16 forward pass
and a third of a stateless-CartPole LSTM's (`tools.bench_learner --parts call`). `TracedCall`
does that lookup once per input signature and then calls the traced graph directly.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import tensorflow as tf

from impala_tf.acting.action_sampler import ActionSampler, SamplerState
from impala_tf.acting.policy_step import PolicyStep
from impala_tf.models import build_model

__all__ = ["ActorPolicy", "PolicyStep", "TracedCall"]


class TracedCall:
    """Calls a `tf.function` on numpy arrays through its traced graph, one trace per signature.

    `tf.function.__call__` builds a trace type from every argument, binds them to the function's
    signature and looks the trace up, on every call. Here that lookup runs once per distinct
    (shape, dtype) of the flattened numpy arguments: the concrete function found then is called
    with the arrays as its flat tensor inputs and the variables it captured. The results are the
    function's own, as structured as `fn` returns them.

    The direct call uses `ConcreteFunction._call_flat`, TensorFlow's entry below the argument
    binding (the one its SavedModel loader calls). It is not public API: if a TensorFlow release
    drops it, or an argument is not a numpy array, the call goes through `fn` as usual, with the
    same results (tests/policy_test.py checks both paths and that the direct one is taken).

    Args:
      fn: The `tf.function`.
    """

    def __init__(self, fn: tf.types.experimental.PolymorphicFunction):
        self.fn = fn
        self._traces: dict[tuple, tuple[Any, list]] = {}
        self.direct = True

    def __call__(self, *args: Any) -> Any:
        flat = tf.nest.flatten(args)
        if not self.direct or not all(type(a) is np.ndarray for a in flat):
            return self.fn(*args)
        key = tuple((a.shape, a.dtype.str) for a in flat)
        trace = self._traces.get(key)
        if trace is None:
            concrete = self.fn.get_concrete_function(*args)
            if not hasattr(concrete, "_call_flat"):  # A TensorFlow without it.
                self.direct = False
                return self.fn(*args)
            trace = self._traces[key] = (concrete, concrete.captured_inputs)
        concrete, captured = trace
        tensors = [tf.constant(a) for a in flat]
        return concrete._call_flat(tensors, captured)  # Private: class docstring.


class ActorPolicy(SamplerState):
    """A policy that acts: a model, its action distribution and a compiled step function.

    Args:
      observation_space: The env's observation space.
      action_space: The env's action space.
      model_config: RLlib model keys, or the policy's `ModelSpec` (see
        `impala_tf.models.build_model`).
      explore: Sample actions when True, take the distribution's mode when False (RLlib
        `explore`).
      seed: Seed of the stateless action sampling; None draws one at random.
      precision: The `precision` config key: the Keras dtype policy the model is built under
        (`impala_tf.models.precision`); logits, values and weights are float32 either way.
    """

    def __init__(
        self,
        observation_space: gym.Space,
        action_space: gym.Space,
        model_config: Any = None,
        explore: bool = True,
        seed: int | None = None,
        precision: str = "float32",
    ):
        self.observation_space = observation_space
        self.action_space = action_space
        self.explore = explore
        self.model = build_model(observation_space, action_space, model_config, precision=precision)
        self.sampler = ActionSampler(action_space, explore, seed)
        self._forward = TracedCall(
            tf.function(self.model.step, reduce_retracing=True, autograph=False)
        )

    @property
    def is_recurrent(self) -> bool:
        return bool(self.model.is_recurrent)

    def initial_state(self, batch_size: int) -> tuple:
        """The zero recurrent state for `batch_size` envs, as numpy arrays (() if none)."""
        return tuple(s.numpy() for s in self.model.initial_state(batch_size))

    def forward(self, obs: np.ndarray, state: tuple = ()) -> tuple:
        """Returns (logits float32 [B, L], values float32 [B], next state) as numpy arrays."""
        logits, values, new_state = self._forward(obs, tuple(state))
        return logits.numpy(), values.numpy(), tuple(s.numpy() for s in new_state)

    def step(self, obs: np.ndarray, state: tuple = ()) -> PolicyStep:
        """Acts on a batch of observations [B, ...] with recurrent state `state`."""
        logits, values, new_state = self.forward(obs, state)
        actions, logp = self.sampler(logits)
        return PolicyStep(actions, logits, logp, values, new_state)

    def get_weights(self) -> list[np.ndarray]:
        return self.model.get_weights()

    def set_weights(self, weights: list[np.ndarray]) -> None:
        self.model.set_weights(weights)
