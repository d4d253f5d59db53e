"""Custom models of the tests, in an importable module (actor processes and Ray workers build
them by import path): RLlib-style `TFModelV2`s, Keras-native models (functional and
subclassed), `RecurrentNetwork`s, and broken models for the error tests. Callbacks classes are in
`tests.support.callbacks`, which imports no TensorFlow: actors that load them stay numpy."""

from __future__ import annotations

import threading

import keras
import numpy as np

from impala_tf.models import RecurrentNetwork, TFModelV2, normc_initializer, try_import_tf

tf1, tf, tfv = try_import_tf()


class TwoHeadedModel(TFModelV2):
    """An RLlib-style `TFModelV2`: a functional Keras model with a policy and a value output,
    built in the constructor, called in `forward`, its value kept for `value_function`."""

    def __init__(self, obs_space, action_space, num_outputs, model_config, name):
        super().__init__(obs_space, action_space, num_outputs, model_config, name)
        obs = tf.keras.layers.Input(shape=obs_space.shape, name="obs")
        hidden = tf.keras.layers.Dense(
            64, activation=tf.nn.relu, kernel_initializer=normc_initializer(1.0), name="hidden"
        )(obs)
        logits = tf.keras.layers.Dense(
            num_outputs, kernel_initializer=normc_initializer(0.01), name="policy_head"
        )(hidden)
        value = tf.keras.layers.Dense(
            1, kernel_initializer=normc_initializer(0.01), name="value_head"
        )(hidden)
        self.net = tf.keras.Model(obs, [logits, value])

    def forward(self, input_dict, state, seq_lens):
        logits, self._value = self.net(input_dict["obs"])
        return logits, state

    def value_function(self):
        return tf.reshape(self._value, [-1])


def functional_model(obs_space, action_space, num_outputs, model_config, name, hidden=16):
    """A Keras functional model built by a function; `hidden` from `custom_model_config`.

    With `num_outputs=None` (`use_lstm`) its first output is the features the LSTM takes.
    """
    inputs = keras.Input(obs_space.shape)
    x = keras.layers.Dense(hidden, activation="tanh")(inputs)
    logits = keras.layers.Dense(num_outputs)(x) if num_outputs else x
    return keras.Model(inputs, [logits, keras.layers.Dense(1)(x)], name=name)


class WrappableModel(TFModelV2):
    """A `TFModelV2` that `use_lstm` can wrap: with `num_outputs=None` it outputs its features,
    as RLlib's own fully connected network does."""

    def __init__(self, obs_space, action_space, num_outputs, model_config, name, hidden=16):
        super().__init__(obs_space, action_space, num_outputs, model_config, name)
        self.hidden = keras.layers.Dense(hidden, activation="tanh")
        self.out = keras.layers.Dense(num_outputs) if num_outputs else None
        self.value = keras.layers.Dense(1)

    def forward(self, input_dict, state, seq_lens):
        x = self.hidden(input_dict["obs_flat"])
        self._value_out = self.value(x)
        return (x if self.out is None else self.out(x)), state

    def value_function(self):
        return tf.reshape(self._value_out, [-1])


class SubclassedModel(keras.Model):
    """A subclassed Keras model: `call(obs)` returns (logits [B, A], values [B])."""

    def __init__(self, obs_space, action_space, num_outputs, model_config, name, hidden=16):
        super().__init__(name=name)
        self.hidden = keras.layers.Dense(hidden, activation="tanh")
        self.pi = keras.layers.Dense(num_outputs)
        self.v = keras.layers.Dense(1)

    def call(self, obs):
        x = self.hidden(obs)
        return self.pi(x), self.v(x)[:, 0]


class ListedLayersModel(keras.Model):
    """Keeps its hidden layers in a Python list, which Keras 3 tracks for its weights but not
    for TensorFlow checkpoints (impala_tf makes them checkpointed)."""

    def __init__(self, obs_space, action_space, num_outputs, model_config, name):
        super().__init__(name=name)
        self.hidden = [keras.layers.Dense(8, activation="tanh") for _ in range(2)]
        self.pi = keras.layers.Dense(num_outputs)
        self.v = keras.layers.Dense(1)

    def call(self, obs):
        x = obs
        for layer in self.hidden:
            x = layer(x)
        return self.pi(x), self.v(x)


class KerasLSTMModel(RecurrentNetwork):
    """A `RecurrentNetwork` around a Keras LSTM layer: `forward_rnn` takes [B, T, F] inputs
    and the (h, c) state, returns [B, T, num_outputs] logits and the new state."""

    def __init__(
        self, obs_space, action_space, num_outputs, model_config, name, units=16
    ):  # fmt: skip
        super().__init__(obs_space, action_space, num_outputs, model_config, name)
        self.units = units
        inputs = tf.keras.layers.Input(shape=(None, obs_space.shape[0]))
        h_in = tf.keras.layers.Input(shape=(units,))
        c_in = tf.keras.layers.Input(shape=(units,))
        x = tf.keras.layers.Dense(32, activation="relu")(inputs)
        out, h, c = tf.keras.layers.LSTM(units, return_sequences=True, return_state=True)(
            x, initial_state=[h_in, c_in]
        )
        logits = tf.keras.layers.Dense(self.num_outputs)(out)
        value = tf.keras.layers.Dense(1)(out)
        self.net = tf.keras.Model([inputs, h_in, c_in], [logits, value, h, c])

    def forward_rnn(self, inputs, state, seq_lens):
        logits, self._value, h, c = self.net([inputs, *state])
        return logits, [h, c]

    def get_initial_state(self):
        return [np.zeros(self.units, np.float32), np.zeros(self.units, np.float32)]

    def value_function(self):
        return tf.reshape(self._value, [-1])


class Counter(RecurrentNetwork):
    """A recurrent model whose state counts the steps of its episode from 1 (a non-zero initial
    state): its first logit is the state, so a test can read it."""

    def __init__(self, obs_space, action_space, num_outputs, model_config, name):
        super().__init__(obs_space, action_space, num_outputs, model_config, name)
        self.head = keras.layers.Dense(num_outputs - 1)
        self.value = keras.layers.Dense(1)

    def forward_rnn(self, inputs, state, seq_lens):
        count = state[0] + 1.0  # [B, 1]
        x = inputs[:, 0]
        self._value_out = self.value(x)
        logits = tf.concat([count, self.head(x)], axis=-1)
        return logits[:, None], [count]

    def get_initial_state(self):
        return [np.ones(1, np.float32)]

    def value_function(self):
        return tf.reshape(self._value_out, [-1])


# Broken models ---------------------------------------------------------------------------


def wrong_logits(obs_space, action_space, num_outputs, model_config, name):
    inputs = keras.Input(obs_space.shape)
    return keras.Model(
        inputs, [keras.layers.Dense(num_outputs + 1)(inputs), keras.layers.Dense(1)(inputs)]
    )


def wrong_values(obs_space, action_space, num_outputs, model_config, name):
    inputs = keras.Input(obs_space.shape)
    return keras.Model(
        inputs, [keras.layers.Dense(num_outputs)(inputs), keras.layers.Dense(3)(inputs)]
    )


def one_output(obs_space, action_space, num_outputs, model_config, name):
    inputs = keras.Input(obs_space.shape)
    return keras.Model(inputs, keras.layers.Dense(num_outputs)(inputs))


class NoKwargs(TFModelV2):
    """Takes no `custom_model_config` options: `hidden` in it fails the constructor."""

    def __init__(self, obs_space, action_space, num_outputs, model_config, name):
        super().__init__(obs_space, action_space, num_outputs, model_config, name)


class WithCustomLoss(TwoHeadedModel):
    def custom_loss(self, policy_loss, loss_inputs):
        return policy_loss * 2


class NotAModel:
    def __init__(self, *args, **kwargs):
        pass


class Unpicklable(TwoHeadedModel):
    """Holds a lock in its class: it cannot be sent to a worker by value."""

    lock = threading.Lock()
