"""RLlib's default networks as `TFModelV2`s: `FullyConnectedNetwork` and `VisionNetwork`.

B is batch. RLlib's TF models are often written around its own networks (a custom model that
holds a `FullyConnectedNetwork`, or registers `VisionNetwork` under a name, as RLlib's
`custom_keras_model.py` example does with `--use-vision-network`). These two are the catalog's
networks (`impala_tf.models.catalog`) behind the `TFModelV2` interface, built from the same
model keys:

* `FullyConnectedNetwork`: an MLP of `fcnet_hiddens` / `fcnet_activation`; the value head on
  the same torso (`vf_share_layers: true`) or on a second MLP;
* `VisionNetwork`: RLlib's conv stack (`conv_filters`, or RLlib's default filters for the image
  size; `conv_activation`, `post_fcnet_hiddens`) with the value head on the same torso.

Both take `obs` as the model receives it (`impala_tf.models.custom`: float32, uint8 pixels as
0..255, as RLlib's vision network takes them). With `num_outputs=None` (wrapped by `use_lstm`)
they return their features, as RLlib's do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import keras
import tensorflow as tf

from impala_tf.models.initializers import NormcInitializer
from impala_tf.models.mlp import MLP
from impala_tf.models.modelv2 import TFModelV2
from impala_tf.models.vision import ConvStack, get_filter_config

__all__ = ["FullyConnectedNetwork", "VisionNetwork"]


class _Heads(TFModelV2):
    """A torso and RLlib's heads: logits (normc(0.01), none when num_outputs is None), value."""

    def _heads(self, num_outputs: int | None) -> None:
        normc = NormcInitializer(0.01)
        self.logits_layer = (
            keras.layers.Dense(num_outputs, kernel_initializer=normc, name="fc_out")
            if num_outputs
            else None
        )
        self.value_layer = keras.layers.Dense(
            1, kernel_initializer=NormcInitializer(0.01), name="value_out"
        )

    def _outputs(self, features: tf.Tensor, value_features: tf.Tensor) -> tf.Tensor:
        self._value_out = self.value_layer(value_features)
        return features if self.logits_layer is None else self.logits_layer(features)

    def value_function(self) -> tf.Tensor:
        return tf.reshape(self._value_out, [-1])


class FullyConnectedNetwork(_Heads):
    """RLlib's `FullyConnectedNetwork` (TF) as a `TFModelV2` (see the module docstring)."""

    def __init__(
        self,
        obs_space: Any,
        action_space: Any,
        num_outputs: int | None,
        model_config: Mapping[str, Any],
        name: str,
    ):
        super().__init__(obs_space, action_space, num_outputs, model_config, name)
        hiddens = list(model_config.get("fcnet_hiddens", [256, 256]))
        activation = model_config.get("fcnet_activation", "tanh")
        self.torso = MLP(hiddens, activation, name="fc_torso")
        self.value_torso = (
            None
            if model_config.get("vf_share_layers", True)
            else MLP(hiddens, activation, name="fc_value_torso")
        )
        self._heads(num_outputs)
        if num_outputs is None:
            self.num_outputs = hiddens[-1] if hiddens else None

    def forward(
        self, input_dict: dict[str, Any], state: list[Any], seq_lens: Any
    ) -> tuple[tf.Tensor, list[Any]]:
        x = input_dict["obs_flat"]
        features = self.torso(x)
        value_features = features if self.value_torso is None else self.value_torso(x)
        return self._outputs(features, value_features), state


class VisionNetwork(_Heads):
    """RLlib's `VisionNetwork` (TF) as a `TFModelV2` (see the module docstring)."""

    def __init__(
        self,
        obs_space: Any,
        action_space: Any,
        num_outputs: int | None,
        model_config: Mapping[str, Any],
        name: str,
    ):
        super().__init__(obs_space, action_space, num_outputs, model_config, name)
        filters = model_config.get("conv_filters") or get_filter_config(obs_space.shape)
        self.torso = ConvStack(
            filters,
            model_config.get("conv_activation", "relu"),
            model_config.get("post_fcnet_hiddens", []),
            model_config.get("post_fcnet_activation", "relu"),
            post_conv_1x1=num_outputs is not None,
            name="conv_stack",
        )
        self._heads(num_outputs)

    def forward(
        self, input_dict: dict[str, Any], state: list[Any], seq_lens: Any
    ) -> tuple[tf.Tensor, list[Any]]:
        features = self.torso(tf.cast(input_dict["obs"], tf.float32))
        return self._outputs(features, features), state
