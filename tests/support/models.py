"""Custom models of the tests, in an importable module (actor processes and Ray workers build
them by import path): RLlib's example `TFModelV2`, Keras-native models (functional and
subclassed), a `RecurrentNetwork`, a callbacks class, and broken models for the error tests."""

from __future__ import annotations

import threading

import keras
import numpy as np

from impala_tf.algorithm_callbacks import DefaultCallbacks
from impala_tf.models import RecurrentNetwork, TFModelV2, normc_initializer, try_import_tf

tf1, tf, tfv = try_import_tf()


class MyKerasModel(TFModelV2):
    """RLlib's `rllib/examples/custom_keras_model.py` model, its imports changed."""

    def __init__(self, obs_space, action_space, num_outputs, model_config, name):
        super().__init__(obs_space, action_space, num_outputs, model_config, name)
        self.inputs = tf.keras.layers.Input(shape=obs_space.shape, name="observations")
        layer_1 = tf.keras.layers.Dense(
            128, name="my_layer1", activation=tf.nn.relu, kernel_initializer=normc_initializer(1.0)
        )(self.inputs)
        layer_out = tf.keras.layers.Dense(
            num_outputs, name="my_out", activation=None, kernel_initializer=normc_initializer(0.01)
        )(layer_1)
        value_out = tf.keras.layers.Dense(
            1, name="value_out", activation=None, kernel_initializer=normc_initializer(0.01)
        )(layer_1)
        self.base_model = tf.keras.Model(self.inputs, [layer_out, value_out])

    def forward(self, input_dict, state, seq_lens):
        model_out, self._value_out = self.base_model(input_dict["obs"])
        return model_out, state

    def value_function(self):
        return tf.reshape(self._value_out, [-1])


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


class RNNModel(RecurrentNetwork):
    """RLlib's example `RNNModel` (rllib/examples/models/rnn_model.py), in Keras 3 (Keras 3
    refuses TensorFlow ops on symbolic inputs, so its `tf.sequence_mask` is left out: the steps
    it masked are never fed here)."""

    def __init__(
        self, obs_space, action_space, num_outputs, model_config, name, hiddens_size=32,
        cell_size=16,
    ):  # fmt: skip
        super().__init__(obs_space, action_space, num_outputs, model_config, name)
        self.cell_size = cell_size
        input_layer = tf.keras.layers.Input(shape=(None, obs_space.shape[0]), name="inputs")
        state_in_h = tf.keras.layers.Input(shape=(cell_size,), name="h")
        state_in_c = tf.keras.layers.Input(shape=(cell_size,), name="c")
        seq_in = tf.keras.layers.Input(shape=(), name="seq_in", dtype=tf.int32)
        dense1 = tf.keras.layers.Dense(hiddens_size, activation=tf.nn.relu, name="dense1")(
            input_layer
        )
        lstm_out, state_h, state_c = tf.keras.layers.LSTM(
            cell_size, return_sequences=True, return_state=True, name="lstm"
        )(dense1, initial_state=[state_in_h, state_in_c])
        logits = tf.keras.layers.Dense(self.num_outputs, name="logits")(lstm_out)
        values = tf.keras.layers.Dense(1, name="values")(lstm_out)
        self.rnn_model = tf.keras.Model(
            inputs=[input_layer, seq_in, state_in_h, state_in_c],
            outputs=[logits, values, state_h, state_c],
        )

    def forward_rnn(self, inputs, state, seq_lens):
        model_out, self._value_out, h, c = self.rnn_model([inputs, seq_lens] + state)
        return model_out, [h, c]

    def get_initial_state(self):
        return [np.zeros(self.cell_size, np.float32), np.zeros(self.cell_size, np.float32)]

    def value_function(self):
        return tf.reshape(self._value_out, [-1])


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


class WithCustomLoss(MyKerasModel):
    def custom_loss(self, policy_loss, loss_inputs):
        return policy_loss * 2


class NotAModel:
    def __init__(self, *args, **kwargs):
        pass


class Unpicklable(MyKerasModel):
    """Holds a lock in its class: it cannot be sent to a worker by value."""

    lock = threading.Lock()


# Callbacks ---------------------------------------------------------------------------------


class EpisodeStats(DefaultCallbacks):
    """RLlib's custom-metrics example, generalised: per episode, the mean |first observation
    component| as `obs0`, the episode's length as `steps`, the observations as hist data."""

    def on_episode_start(self, *, worker, base_env, policies, episode, env_index, **kwargs):
        assert episode.length == 0
        episode.user_data["obs0"] = [abs(float(np.ravel(self._obs(episode))[0]))]

    def on_episode_step(self, *, worker, base_env, episode, env_index, **kwargs):
        episode.user_data["obs0"].append(abs(float(np.ravel(self._obs(episode))[0])))

    def on_episode_end(self, *, worker, base_env, policies, episode, env_index, **kwargs):
        episode.custom_metrics["obs0"] = float(np.mean(episode.user_data["obs0"]))
        episode.custom_metrics["steps"] = episode.length
        episode.hist_data["obs0"] = episode.user_data["obs0"]

    def on_train_result(self, *, algorithm, result, **kwargs):
        result["callback_ok"] = True

    @staticmethod
    def _obs(episode):
        agents = episode.get_agents()
        return episode.last_raw_obs_for(agents[0])


class FailingEpisodeEnd(DefaultCallbacks):
    def on_episode_end(self, **kwargs):
        raise KeyError("no such metric")
