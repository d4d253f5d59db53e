"""Convolutional torsos for image observations.

Input float32 [N, H, W, C] (channels last; N rows: T*B in the learner, B in the actors); output
float32 [N, F] features for the heads or the LSTM core.

- `NatureCNN`: Mnih et al. 2015, conv 32x8x8/4, 64x4x4/2, 64x3x3/1 (valid padding), dense 512
  relu; F = 512. It and `ImpalaResNet` multiply their input by `input_scale` first (the catalog
  passes 1/255 for uint8 images, as DeepMind's agents scale pixels).
- `ImpalaResNet`: Espeholt et al. 2018 ("deep" network), three sections of 16, 32, 32 channels,
  each conv3x3 + maxpool3x3/2 + two residual blocks (relu-conv-relu-conv + skip), then relu,
  flatten, dense 256 relu; F = 256.
- `ConvStack`: RLlib's VisionNetwork torso, on pixels as they come (0..255 for uint8, as
  RLlib casts them without scaling), or shifted by `input_shift` (-128..127 for uint8 with the
  `center_pixels` model key). The `conv_filters` list [[out_channels, kernel,
  stride], ...] ("same" padding for all but the last layer, "valid" for the last), then, with
  `post_fcnet_hiddens` [h0, h1, ...], a 1x1 conv of h0 channels and dense layers h1, ...
  (`post_fcnet_activation`), flattened; F = the flattened size of what comes last. Without
  `conv_filters`, `get_filter_config` gives RLlib's default filters for the image size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from impala_tf.models.initializers import NormcInitializer
from impala_tf.models.mlp import get_activation, track_layers

__all__ = [
    "DEFAULT_FILTERS",
    "ConvStack",
    "CoveringConv2D",
    "ImpalaResNet",
    "NatureCNN",
    "get_filter_config",
    "parse_conv_filters",
]

# RLlib's `get_filter_config` (rllib/models/utils.py): default `conv_filters` per (H, W).
DEFAULT_FILTERS: dict[tuple[int, int], list[list[Any]]] = {
    (96, 96): [[16, [8, 8], 4], [32, [4, 4], 2], [256, [11, 11], 2]],
    (84, 84): [[16, [8, 8], 4], [32, [4, 4], 2], [256, [11, 11], 1]],
    (64, 64): [[32, [4, 4], 2], [64, [4, 4], 2], [128, [4, 4], 2], [256, [4, 4], 2]],
    (42, 42): [[16, [4, 4], 2], [32, [4, 4], 2], [256, [11, 11], 1]],
    (10, 10): [[16, [5, 5], 2], [32, [5, 5], 2]],
}


def get_filter_config(shape: Sequence[int]) -> list[list[Any]]:
    """Returns RLlib's default `conv_filters` for an image of shape (H, W, C).

    Args:
        shape: the observation shape, channels last.

    Returns:
        A fresh copy of the filter list for (H, W) from `DEFAULT_FILTERS`.

    Raises:
        ValueError: naming `conv_filters`, for sizes RLlib has no default for.
    """
    key = tuple(int(d) for d in shape[:2])
    if len(shape) != 3 or key not in DEFAULT_FILTERS:
        sizes = ", ".join(f"[{h}, {w}, K]" for h, w in DEFAULT_FILTERS)
        raise ValueError(
            f"No default conv filters for observations of shape {tuple(shape)}: set "
            f"`model.conv_filters` (a list of [out_channels, kernel, stride]), or "
            f"`model.custom_model` (nature_cnn, impala_resnet). RLlib's defaults exist for "
            f"{sizes} only."
        )
    return [[out, list(kernel), stride] for out, kernel, stride in DEFAULT_FILTERS[key]]


def _pair(value: Any, what: str, entry: Any) -> tuple[int, int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value, value)
    if (
        isinstance(value, Sequence)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        return (int(value[0]), int(value[1]))
    raise ValueError(
        f"conv_filters entry {entry!r}: {what} must be an int or a pair [h, w], got {value!r}."
    )


def parse_conv_filters(
    conv_filters: Sequence[Any],
) -> list[tuple[int, tuple[int, int], tuple[int, int]]]:
    """Normalises RLlib's `conv_filters` to [(out_channels, (kh, kw), (sh, sw)), ...].

    Args:
        conv_filters: a non-empty list of [out_channels, kernel, stride], kernel and stride each
            an int or an [h, w] pair.

    Raises:
        ValueError: naming `conv_filters` and the bad entry.
    """
    if not isinstance(conv_filters, Sequence) or isinstance(conv_filters, str) or not conv_filters:
        raise ValueError(
            f"conv_filters must be a non-empty list of [out_channels, kernel, stride], "
            f"got {conv_filters!r}."
        )
    parsed = []
    for entry in conv_filters:
        if not isinstance(entry, Sequence) or isinstance(entry, str) or len(entry) != 3:
            raise ValueError(
                f"conv_filters entry {entry!r} must be [out_channels, kernel, stride]."
            )
        out, kernel, stride = entry
        if not isinstance(out, int) or isinstance(out, bool) or out <= 0:
            raise ValueError(f"conv_filters entry {entry!r}: out_channels must be a positive int.")
        parsed.append((int(out), _pair(kernel, "kernel", entry), _pair(stride, "stride", entry)))
    return parsed


class NatureCNN(keras.layers.Layer):
    """The DQN Nature torso (Mnih et al. 2015) with a 512-unit relu layer on top."""

    def __init__(self, activation: str | None = "relu", input_scale: float = 1.0, **kwargs):
        super().__init__(**kwargs)
        self.input_scale = float(input_scale)
        act = get_activation(activation, "conv_activation")
        self.convs = [
            keras.layers.Conv2D(32, 8, strides=4, activation=act, name="conv1"),
            keras.layers.Conv2D(64, 4, strides=2, activation=act, name="conv2"),
            keras.layers.Conv2D(64, 3, strides=1, activation=act, name="conv3"),
        ]
        track_layers(self, self.convs)
        self.flatten = keras.layers.Flatten()
        self.fc = keras.layers.Dense(
            512, activation="relu", kernel_initializer=NormcInitializer(1.0), name="fc"
        )

    def call(self, x: tf.Tensor) -> tf.Tensor:
        x = x * self.input_scale
        for conv in self.convs:
            x = conv(x)
        return self.fc(self.flatten(x))


class _ResidualBlock(keras.layers.Layer):
    """relu -> conv3x3 -> relu -> conv3x3, added to the input."""

    def __init__(self, channels: int, **kwargs):
        super().__init__(**kwargs)
        self.conv_a = keras.layers.Conv2D(channels, 3, padding="same", name="conv_a")
        self.conv_b = keras.layers.Conv2D(channels, 3, padding="same", name="conv_b")

    def call(self, x: tf.Tensor) -> tf.Tensor:
        y = self.conv_a(tf.nn.relu(x))
        y = self.conv_b(tf.nn.relu(y))
        return x + y


class _ResNetSection(keras.layers.Layer):
    """conv3x3 -> maxpool3x3 stride 2 -> two residual blocks."""

    def __init__(self, channels: int, **kwargs):
        super().__init__(**kwargs)
        self.conv = keras.layers.Conv2D(channels, 3, padding="same", name="conv")
        self.pool = keras.layers.MaxPooling2D(3, strides=2, padding="same")
        self.res0 = _ResidualBlock(channels, name="res0")
        self.res1 = _ResidualBlock(channels, name="res1")

    def call(self, x: tf.Tensor) -> tf.Tensor:
        return self.res1(self.res0(self.pool(self.conv(x))))


class ImpalaResNet(keras.layers.Layer):
    """The IMPALA "deep" torso (Espeholt et al. 2018, figure 3, right)."""

    def __init__(
        self,
        channels: Sequence[int] = (16, 32, 32),
        hidden: int = 256,
        input_scale: float = 1.0,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.input_scale = float(input_scale)
        self.sections = [
            _ResNetSection(int(ch), name=f"section{i}") for i, ch in enumerate(channels)
        ]
        track_layers(self, self.sections)
        self.flatten = keras.layers.Flatten()
        self.fc = keras.layers.Dense(
            hidden, activation="relu", kernel_initializer=NormcInitializer(1.0), name="fc"
        )

    def call(self, x: tf.Tensor) -> tf.Tensor:
        x = x * self.input_scale
        for section in self.sections:
            x = section(x)
        return self.fc(self.flatten(tf.nn.relu(x)))


class CoveringConv2D(keras.layers.Conv2D):
    """`keras.layers.Conv2D` that runs as one matmul when its kernel covers its whole input.

    With "valid" padding and a kernel as large as its input, a convolution has a 1x1 output and
    is a dense layer on the flattened input: RLlib's last vision layer is one (11x11 filters on
    the 11x11 maps of 42x42 and 84x84 frames), and so is the 1x1 `post_fcnet_hiddens` conv that
    follows it. On a CPU, TensorFlow's convolution of that shape is slower than the matmul and
    its time varies more: 1.3x-2.4x at an actor's batch of 16 on one thread, 1.1x-1.4x forward
    and backward at batch 500 (`tools.bench_learner --parts conv`, BENCHMARKS.md). The
    variables, their shapes and the results (up to float rounding) are the convolution's; any
    other input takes the convolution.
    """

    def convolution_op(self, inputs, kernel):
        kh, kw, cin, cout = kernel.shape
        covers_input = (
            self.padding == "valid"
            and self.data_format == "channels_last"
            and self.groups == 1
            and tuple(self.dilation_rate) == (1, 1)
            and tuple(inputs.shape[1:3]) == (kh, kw)
        )
        if not covers_input:
            return super().convolution_op(inputs, kernel)
        flat = tf.reshape(inputs, [-1, kh * kw * cin])
        out = tf.matmul(flat, tf.reshape(kernel, [kh * kw * cin, cout]))
        return tf.reshape(out, [-1, 1, 1, cout])


class ConvStack(keras.layers.Layer):
    """RLlib's VisionNetwork torso: `conv_filters`, then the `post_fcnet_hiddens` stack.

    As RLlib's (old stack) VisionNetwork builds it with `no_final_linear=False`: every conv but
    the last pads "same", the last "valid"; with `post_fcnet_hiddens` [h0, h1, ...] a 1x1 conv
    of h0 channels follows (so a last conv with a 1x1 output acts as a dense layer), then the
    output is flattened and dense layers h1, ... follow, all with `post_fcnet_activation`.
    RLlib's logits layer (a 1x1 conv or dense of `num_outputs`) is the model's logits head.

    Args:
        conv_filters: RLlib's `conv_filters`.
        activation: `conv_activation`.
        post_fcnet_hiddens: `post_fcnet_hiddens` (empty: the flattened convs are the features).
        post_fcnet_activation: `post_fcnet_activation`.
        post_conv_1x1: build h0 as a 1x1 conv before flattening (RLlib's feed-forward vision
            net); False flattens first and makes h0 a dense layer (RLlib's vision net inside its
            LSTM wrapper, built with `num_outputs=None`). The two differ only when the last
            conv's output is wider than 1x1.
        input_shift: subtracted from the input before the first conv (the catalog passes 128
            for uint8 images with the `center_pixels` model key; 0, RLlib's, leaves the input
            as it comes).
    """

    def __init__(
        self,
        conv_filters: Sequence[Any],
        activation: str | None = "relu",
        post_fcnet_hiddens: Sequence[int] = (),
        post_fcnet_activation: str | None = "relu",
        *,
        post_conv_1x1: bool = True,
        input_shift: float = 0.0,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.input_shift = float(input_shift)
        act = get_activation(activation, "conv_activation")
        post_act = get_activation(post_fcnet_activation, "post_fcnet_activation")
        filters = parse_conv_filters(conv_filters)
        self.convs = [
            CoveringConv2D(
                out,
                kernel,
                strides=stride,
                padding="valid" if i == len(filters) - 1 else "same",
                activation=act,
                name=f"conv{i + 1}",
            )
            for i, (out, kernel, stride) in enumerate(filters)
        ]
        hiddens = [int(h) for h in post_fcnet_hiddens]
        if hiddens and post_conv_1x1:
            self.convs.append(CoveringConv2D(hiddens[0], 1, activation=post_act, name="conv_out"))
            hiddens = hiddens[1:]
        track_layers(self, self.convs)
        self.flatten = keras.layers.Flatten()
        self.post_fc = [
            keras.layers.Dense(
                h, activation=post_act, kernel_initializer=NormcInitializer(1.0), name=f"post_fc{i}"
            )
            for i, h in enumerate(hiddens)
        ]
        track_layers(self, self.post_fc)

    def call(self, x: tf.Tensor) -> tf.Tensor:
        if self.input_shift:
            x = x - self.input_shift
        for conv in self.convs:
            x = conv(x)
        x = self.flatten(x)
        for dense in self.post_fc:
            x = dense(x)
        return x
