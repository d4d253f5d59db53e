"""The actor-critic Keras model shared by the actors and the learner.

T is time, B is batch, A = num_outputs (the action distribution's logits size), H the LSTM cell
size. Layout: preprocess -> torso -> [LSTM core] -> heads, where the heads are a linear logits
layer pi(.|x) and a linear value layer V(x); a non-shared MLP value tower, when present, runs
from the preprocessed observation straight to the value head.

With `free_log_std` (RLlib's model key, Box actions only) the logits head emits only the A/2
Gaussian means and the A/2 log standard deviations are one free trainable vector, the same for
every state, appended after the means (RLlib's `AppendBiasLayer`, initialised to zeros).
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import keras
import numpy as np
import tensorflow as tf

from impala_tf.models.initializers import NormcInitializer
from impala_tf.models.preprocessing import ObservationPreprocessor
from impala_tf.models.recurrent import LSTMCore

__all__ = ["ActorCritic", "FreeLogStd"]

State = tuple[tf.Tensor, ...]


class FreeLogStd(keras.layers.Layer):
    """Appends a state-independent trainable log-std vector to the Gaussian means.

    Maps means [N, D] to [N, 2D] = [means, log_std], log_std float32 [D] initialised to zeros.
    """

    def build(self, input_shape) -> None:
        self.log_std = self.add_weight(
            shape=(int(input_shape[-1]),), initializer="zeros", name="log_std"
        )

    def call(self, means: tf.Tensor) -> tf.Tensor:
        return tf.concat([means, tf.zeros_like(means) + self.log_std], axis=-1)


class ActorCritic(keras.Model):
    """Policy logits and value function over time-major sequences or single steps.

    Build one with `impala_tf.models.build_model`; the constructor takes the assembled parts.
    All variables exist once the constructor returns.

    Attributes:
        observation_space: the gymnasium observation space.
        action_space: the gymnasium action space.
        model_config: the resolved model config (RLlib keys, defaults filled in).
        num_outputs: A, the logits size.
        is_recurrent: True when an LSTM core sits between torso and heads.
    """

    def __init__(
        self,
        observation_space: gym.Space,
        action_space: gym.Space,
        model_config: dict[str, Any],
        *,
        num_outputs: int,
        torso: keras.layers.Layer,
        value_torso: keras.layers.Layer | None = None,
        core: LSTMCore | None = None,
        value_initializer: Any = None,
        name: str = "impala_model",
    ):
        """Assembles the model and creates its variables.

        Args:
            observation_space: the env's observation space.
            action_space: the env's action space.
            model_config: resolved RLlib model config, kept for reference.
            num_outputs: A, the number of logits.
            torso: maps preprocessed observations [N, ...] to features [N, F]; feeds the logits
                head, and the value head too unless `value_torso` is given.
            value_torso: optional separate value tower [N, ...] -> [N, F_v] (vf_share_layers
                False); its variables count as value variables.
            core: optional LSTM core shared by both heads (then `value_torso` must be None).
            value_initializer: kernel initializer of the value head; None is normc(0.01).
            name: the Keras model name.
        """
        # The model's own call stays float32 under any dtype policy (`precision`): a Keras call
        # casts variables read inside it to its compute dtype, which would reach the float32
        # heads and LSTM core; the torsos carry the policy they were built under.
        super().__init__(name=name, dtype="float32")
        if core is not None and value_torso is not None:
            raise ValueError("A recurrent ActorCritic shares its torso: pass no value_torso.")
        self.observation_space = observation_space
        self.action_space = action_space
        self.model_config = dict(model_config)
        self.num_outputs = int(num_outputs)
        self.is_recurrent = core is not None
        self._preprocess = ObservationPreprocessor(observation_space)
        self._obs_shape = tuple(int(d) for d in (observation_space.shape or ()))
        self._obs_dtype = tf.as_dtype(np.dtype(observation_space.dtype))
        self.torso = torso
        self.value_torso = value_torso
        self.core = core
        free_log_std = bool(model_config.get("free_log_std"))
        if free_log_std and (not isinstance(action_space, gym.spaces.Box) or self.num_outputs % 2):
            raise ValueError(
                "model_config free_log_std=True needs a Box action space (a Gaussian whose "
                f"log-stds can be free variables), got {action_space!r}."
            )
        # The heads compute in float32 under any dtype policy (`precision`): logits and values
        # feed the log-probabilities, V-trace and the loss, where bfloat16's 8-bit mantissa
        # would round importance ratios; their matmuls are a small part of the model.
        self.logits_head = keras.layers.Dense(
            self.num_outputs // 2 if free_log_std else self.num_outputs,
            # normc(0.01), as RLlib's fully connected heads: a near-uniform first policy for
            # every torso (RLlib's vision net starts its logits with Glorot; models/catalog.py).
            kernel_initializer=NormcInitializer(0.01),
            name="logits",
            dtype="float32",
        )
        self.value_head = keras.layers.Dense(
            1,
            kernel_initializer=value_initializer or NormcInitializer(0.01),
            name="value",
            dtype="float32",
        )
        # Created last, so that its variable comes last in `get_weights()`.
        self.free_log_std = (
            FreeLogStd(name="free_log_std", dtype="float32") if free_log_std else None
        )
        self._build_variables()

    # ----------------------------------------------------------------------------- building

    def _build_variables(self) -> None:
        dummy = tf.zeros((1, *self._obs_shape), self._obs_dtype)
        if self.core is not None:
            features = self.torso(self._preprocess(dummy))
            self.core.build(features.shape)
        self(dummy)

    @property
    def value_variables(self) -> list[tf.Variable]:
        """The trainable variables only V uses: the value tower (if any) and the value head."""
        layers = [self.value_head] + ([self.value_torso] if self.value_torso is not None else [])
        return [v for layer in layers for v in layer.trainable_variables]

    @property
    def policy_variables(self) -> list[tf.Variable]:
        """Every other trainable variable: torso, LSTM core and logits head."""
        value_ids = {id(v) for v in self.value_variables}
        return [v for v in self.trainable_variables if id(v) not in value_ids]

    # ------------------------------------------------------------------------------ forward

    def initial_state(self, batch_size: int | tf.Tensor) -> State:
        """Returns the state before the first step: () or zeros (h, c), float32 [B, H] each."""
        if self.core is None:
            return ()
        return self.core.initial_state(batch_size)

    def _heads(self, features: tf.Tensor, value_features: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        logits = tf.cast(self.logits_head(features), tf.float32)
        if self.free_log_std is not None:
            logits = self.free_log_std(logits)
        values = tf.cast(self.value_head(value_features)[..., 0], tf.float32)
        return logits, values

    def _feedforward(self, obs: tf.Tensor, training: bool) -> tuple[tf.Tensor, tf.Tensor]:
        x = self._preprocess(obs)
        features = self.torso(x, training=training)
        value_features = (
            features if self.value_torso is None else self.value_torso(x, training=training)
        )
        return self._heads(features, value_features)

    def call(self, obs: tf.Tensor, training: bool = False) -> tuple[tf.Tensor, tf.Tensor]:
        """One forward pass over a batch, from the zero state if recurrent.

        Args:
            obs: [B, *obs_shape] observations, in the env's dtype.
            training: Keras training flag.

        Returns:
            (logits float32 [B, A], values float32 [B]).
        """
        if self.core is None:
            return self._feedforward(obs, training)
        obs = tf.convert_to_tensor(obs)
        logits, values, _ = self.step(obs, self.initial_state(tf.shape(obs)[0]), training)
        return logits, values

    def step(
        self, obs: tf.Tensor, state: State, training: bool = False
    ) -> tuple[tf.Tensor, tf.Tensor, State]:
        """One environment step for a batch of actors.

        The caller zeroes the state rows of envs that began a new episode before calling.

        Args:
            obs: [B, *obs_shape] observations x_t.
            state: the state from `initial_state` or the previous step (() if not recurrent).
            training: Keras training flag.

        Returns:
            (logits float32 [B, A], values V(x_t) float32 [B], new state).
        """
        if self.core is None:
            logits, values = self._feedforward(obs, training)
            return logits, values, ()
        features = self.torso(self._preprocess(obs), training=training)
        out, new_state = self.core.step(features, tuple(state))
        logits, values = self._heads(out, out)
        return logits, values, new_state

    def unroll(
        self, obs: tf.Tensor, resets: tf.Tensor, state: State, training: bool = False
    ) -> tuple[tf.Tensor, tf.Tensor, State]:
        """Runs the model over time-major sequences.

        Args:
            obs: [T, B, *obs_shape] observations, in the env's dtype.
            resets: bool [T, B]; where resets[t] the LSTM state is zeroed before step t (an
                episode began there). Ignored by non-recurrent models.
            state: the state before step 0 (() if not recurrent).
            training: Keras training flag.

        Returns:
            (logits float32 [T, B, A], values float32 [T, B], final state after step T-1;
            () if not recurrent).
        """
        obs = tf.convert_to_tensor(obs)
        t, b = tf.shape(obs)[0], tf.shape(obs)[1]
        flat_obs = tf.reshape(obs, tf.concat([[t * b], tf.constant(self._obs_shape, tf.int32)], 0))
        if self.core is None:
            logits, values = self._feedforward(flat_obs, training)
            final_state = ()
        else:
            features = self.torso(self._preprocess(flat_obs), training=training)
            features = tf.reshape(features, tf.stack([t, b, features.shape[-1]]))
            out, final_state = self.core.unroll(features, resets, tuple(state))
            out = tf.reshape(out, [-1, self.core.units])
            logits, values = self._heads(out, out)
        logits = tf.reshape(logits, tf.stack([t, b, self.num_outputs]))
        values = tf.reshape(values, tf.stack([t, b]))
        return logits, values, final_state
