"""LSTM core with per-step state resets, for recurrent actor-critics.

Time-major: T is time, B is batch, F the feature size of the torso, H = lstm_cell_size.
The state is the pair (h, c), each float32 [B, H]. Gates follow Keras' LSTM (i, f, g, o order,
forget bias initialised to 1). The core computes in float32 under any dtype policy (`precision`):
it casts the torso's features (bfloat16 under "mixed_bfloat16") to float32, so the recurrent state
the actors carry and the learner unrolls is float32.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

__all__ = ["LSTMCore"]

LSTMState = tuple[tf.Tensor, tf.Tensor]


class LSTMCore(keras.layers.Layer):
    """An LSTM cell with an unroll that zeroes the state where an episode starts.

    The weights are created by `build((None, F))`; `step` and `unroll` are plain methods (not
    Keras calls) so the caller decides when to trace them.
    """

    def __init__(self, units: int, **kwargs):
        super().__init__(**kwargs)
        self.units = int(units)

    def build(self, input_shape: Any) -> None:
        in_dim = int(input_shape[-1])
        units = self.units

        def unit_forget_bias(shape: Any, dtype: Any = None) -> tf.Tensor:
            return tf.concat([tf.zeros([units]), tf.ones([units]), tf.zeros([2 * units])], axis=0)

        self.kernel = self.add_weight(
            shape=(in_dim, 4 * units), initializer="glorot_uniform", name="kernel"
        )
        self.recurrent_kernel = self.add_weight(
            shape=(units, 4 * units), initializer="orthogonal", name="recurrent_kernel"
        )
        self.bias = self.add_weight(shape=(4 * units,), initializer=unit_forget_bias, name="bias")
        self.built = True

    def initial_state(self, batch_size: int | tf.Tensor) -> LSTMState:
        """Returns zeros (h, c), each float32 [batch_size, H]."""
        zeros = tf.zeros(tf.stack([batch_size, self.units]), tf.float32)
        return (zeros, zeros)

    def _cell(self, z_x: tf.Tensor, h: tf.Tensor, c: tf.Tensor, w_h: tf.Tensor) -> LSTMState:
        z = z_x + tf.matmul(h, w_h)
        i, f, g, o = tf.split(z, 4, axis=-1)
        c = tf.sigmoid(f) * c + tf.sigmoid(i) * tf.tanh(g)
        h = tf.sigmoid(o) * tf.tanh(c)
        return h, c

    def step(self, x: tf.Tensor, state: LSTMState) -> tuple[tf.Tensor, LSTMState]:
        """Applies the cell once.

        Args:
            x: float [B, F] features (cast to float32).
            state: (h, c), float32 [B, H] each.

        Returns:
            (h_new [B, H], (h_new, c_new)).
        """
        z_x = tf.matmul(tf.cast(x, tf.float32), self.kernel) + self.bias
        h, c = self._cell(z_x, state[0], state[1], tf.convert_to_tensor(self.recurrent_kernel))
        return h, (h, c)

    def call(self, x: tf.Tensor, state: LSTMState) -> tuple[tf.Tensor, LSTMState]:
        return self.step(x, state)

    def unroll(
        self, x: tf.Tensor, resets: tf.Tensor, state: LSTMState
    ) -> tuple[tf.Tensor, LSTMState]:
        """Runs the cell over T steps, zeroing the state before step t where resets[t].

        Args:
            x: float [T, B, F] features (cast to float32).
            resets: bool [T, B]; True where an episode starts at step t.
            state: (h, c) before step 0, float32 [B, H] each.

        Returns:
            (outputs h_t float32 [T, B, H], final state (h_{T-1}, c_{T-1})).
        """
        t, b = tf.shape(x)[0], tf.shape(x)[1]
        in_dim = x.shape[-1]
        # The input projection does not depend on the state: one big matmul outside the loop.
        z_x = tf.matmul(tf.reshape(tf.cast(x, tf.float32), [-1, in_dim]), self.kernel) + self.bias
        z_x = tf.reshape(z_x, tf.stack([t, b, 4 * self.units]))
        keep = 1.0 - tf.cast(resets, tf.float32)[..., None]
        w_h = tf.convert_to_tensor(self.recurrent_kernel)

        def body(carry: LSTMState, inputs: tuple[tf.Tensor, tf.Tensor]) -> LSTMState:
            z_t, keep_t = inputs
            return self._cell(z_t, carry[0] * keep_t, carry[1] * keep_t, w_h)

        h0 = tf.convert_to_tensor(state[0], tf.float32)
        c0 = tf.convert_to_tensor(state[1], tf.float32)
        hs, cs = tf.scan(body, (z_x, keep), initializer=(h0, c0))
        return hs, (hs[-1], cs[-1])
