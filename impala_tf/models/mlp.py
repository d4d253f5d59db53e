"""Fully connected torso (RLlib's FullyConnectedNetwork hidden stack).

Input float32 [N, D] (N rows: T*B in the learner, B in the actors); output float32 [N, F] with
F = fcnet_hiddens[-1], or D when there are no hidden layers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from impala_tf.models.initializers import NormcInitializer

__all__ = ["MLP", "get_activation", "track_layers"]

_ACTIVATIONS: dict[str, Callable[[Any], Any] | None] = {
    "linear": None,
    "tanh": keras.activations.tanh,
    "relu": keras.activations.relu,
    "elu": keras.activations.elu,
    "swish": keras.activations.silu,
    "silu": keras.activations.silu,
}


def get_activation(name: str | None, key: str) -> Callable[[Any], Any] | None:
    """Maps an RLlib activation name to a Keras activation (None or "linear" -> identity).

    Args:
        name: "tanh", "relu", "elu", "swish", "silu", "linear" or None.
        key: the config key the name came from, for the error message.

    Raises:
        ValueError: for an unknown name, naming `key`.
    """
    if name is None:
        return None
    try:
        return _ACTIVATIONS[str(name).lower()]
    except KeyError:
        raise ValueError(
            f"{key}={name!r} is not a supported activation; use one of "
            f"{sorted(_ACTIVATIONS)} or None."
        ) from None


def track_layers(owner: keras.layers.Layer, layers: Sequence[keras.layers.Layer]) -> None:
    """Makes a list of sublayers visible to `tf.train.Checkpoint`.

    Keras 3 tracks a list of layers for its own weights, but `tf.train.Checkpoint` only sees
    layers held in attributes: without this a checkpoint's `model` part misses their variables.
    Setting the attributes does not change the order of `owner.weights`.
    """
    for layer in layers:
        setattr(owner, layer.name, layer)


class MLP(keras.layers.Layer):
    """A stack of Dense layers with RLlib's normc(1.0) kernel init and zero biases."""

    def __init__(
        self, hiddens: Sequence[int], activation: str | None = "tanh", *, key: str = "", **kwargs
    ):
        super().__init__(**kwargs)
        act = get_activation(activation, key or "fcnet_activation")
        self.hiddens = [int(h) for h in hiddens]
        self.dense_layers = [
            keras.layers.Dense(
                h, activation=act, kernel_initializer=NormcInitializer(1.0), name=f"fc_{i + 1}"
            )
            for i, h in enumerate(self.hiddens)
        ]
        track_layers(self, self.dense_layers)

    def call(self, x: tf.Tensor) -> tf.Tensor:
        for layer in self.dense_layers:
            x = layer(x)
        return x
