"""Custom models for impala_tf, each way you can write one (see docs/custom-models.md).

Every model here is built from the same arguments, `(obs_space, action_space, num_outputs,
model_config, name, **custom_model_config)`, and configs name it by import path (run from the
repository root, where `examples` is importable):

    model:
        custom_model: examples.custom_models:keras_mlp
        custom_model_config: {hiddens: [256, 256]}

* `keras_mlp`: a function that builds a functional `keras.Model`, `obs -> (logits, value)`:
  the same network as the catalog's MLP (normc initialisers, tanh, a shared torso);
* `KerasMLP`: the same as a subclassed `keras.Model`;
* `RLlibStyleMLP`: an RLlib `TFModelV2`, written as RLlib's TF users write one;
* `KerasLSTM`: an RLlib `RecurrentNetwork` around a Keras LSTM layer (its own state).
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from impala_tf.models import RecurrentNetwork, TFModelV2, normc_initializer

__all__ = ["KerasLSTM", "KerasMLP", "RLlibStyleMLP", "keras_mlp"]


# --8<-- [start:keras_mlp]
def keras_mlp(obs_space, action_space, num_outputs, model_config, name, hiddens=(256, 256)):
    """A functional Keras model: logits [B, num_outputs] and value [B, 1] from one torso.

    With `use_lstm: true` impala_tf builds it with `num_outputs=None` (as RLlib's LSTM wrapper
    does): its first output is then the torso's features, which the LSTM takes.
    """
    obs = keras.Input(obs_space.shape, name="obs")
    x = keras.layers.Flatten()(obs)
    for i, units in enumerate(hiddens):
        x = keras.layers.Dense(
            units, activation="tanh", kernel_initializer=normc_initializer(1.0), name=f"fc_{i}"
        )(x)
    head = normc_initializer(0.01)
    logits = keras.layers.Dense(num_outputs, kernel_initializer=head, name="logits")(x)
    value = keras.layers.Dense(1, kernel_initializer=head, name="value")(x)
    return keras.Model(obs, [logits if num_outputs else x, value], name=name)


# --8<-- [end:keras_mlp]


# --8<-- [start:keras_subclassed]
class KerasMLP(keras.Model):
    """The same network as a subclassed Keras model: `call(obs)` returns (logits, values)."""

    def __init__(
        self, obs_space, action_space, num_outputs, model_config, name, hiddens=(256, 256)
    ):
        super().__init__(name=name)
        self.torso = [
            keras.layers.Dense(h, activation="tanh", kernel_initializer=normc_initializer(1.0))
            for h in hiddens
        ]
        self.logits = keras.layers.Dense(num_outputs, kernel_initializer=normc_initializer(0.01))
        self.value = keras.layers.Dense(1, kernel_initializer=normc_initializer(0.01))

    def call(self, obs):
        x = obs
        for layer in self.torso:
            x = layer(x)
        return self.logits(x), self.value(x)[:, 0]


# --8<-- [end:keras_subclassed]


# --8<-- [start:tfmodelv2]
class RLlibStyleMLP(TFModelV2):
    """An RLlib TFModelV2: a Keras model built in the constructor, called in `forward`, whose
    value output is kept for `value_function` (RLlib's TF custom-model pattern)."""

    def __init__(self, obs_space, action_space, num_outputs, model_config, name, hiddens=(64,)):
        super().__init__(obs_space, action_space, num_outputs, model_config, name)
        obs = tf.keras.layers.Input(shape=obs_space.shape, name="obs")
        x = obs
        for units in hiddens:
            x = tf.keras.layers.Dense(
                units, activation=tf.nn.relu, kernel_initializer=normc_initializer(1.0)
            )(x)
        logits = tf.keras.layers.Dense(num_outputs, kernel_initializer=normc_initializer(0.01))(x)
        value = tf.keras.layers.Dense(1, kernel_initializer=normc_initializer(0.01))(x)
        self.base_model = tf.keras.Model(obs, [logits, value])

    def forward(self, input_dict, state, seq_lens):
        logits, self._value = self.base_model(input_dict["obs"])
        return logits, state

    def value_function(self):
        return tf.reshape(self._value, [-1])


# --8<-- [end:tfmodelv2]


# --8<-- [start:recurrent]
class KerasLSTM(RecurrentNetwork):
    """An RLlib RecurrentNetwork: a Dense layer, then a Keras LSTM whose (h, c) state the
    policy carries; `forward_rnn` sees [B, T, F] inputs (impala_tf steps it with T = 1 and
    restarts an env's state from `get_initial_state()` when its episode ends)."""

    def __init__(
        self, obs_space, action_space, num_outputs, model_config, name, hidden=64, cell_size=64
    ):
        super().__init__(obs_space, action_space, num_outputs, model_config, name)
        self.cell_size = cell_size
        inputs = tf.keras.layers.Input(shape=(None, int(np.prod(obs_space.shape))))
        h_in = tf.keras.layers.Input(shape=(cell_size,))
        c_in = tf.keras.layers.Input(shape=(cell_size,))
        x = tf.keras.layers.Dense(
            hidden, activation="tanh", kernel_initializer=normc_initializer(1.0)
        )(inputs)
        out, h, c = tf.keras.layers.LSTM(cell_size, return_sequences=True, return_state=True)(
            x, initial_state=[h_in, c_in]
        )
        logits = tf.keras.layers.Dense(num_outputs, kernel_initializer=normc_initializer(0.01))(out)
        value = tf.keras.layers.Dense(1, kernel_initializer=normc_initializer(0.01))(out)
        self.rnn = tf.keras.Model([inputs, h_in, c_in], [logits, value, h, c])

    def forward_rnn(self, inputs, state, seq_lens):
        logits, self._value, h, c = self.rnn([inputs, *state])
        return logits, [h, c]

    def get_initial_state(self):
        return [np.zeros(self.cell_size, np.float32), np.zeros(self.cell_size, np.float32)]

    def value_function(self):
        return tf.reshape(self._value, [-1])


# --8<-- [end:recurrent]
