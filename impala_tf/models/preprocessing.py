"""Observation preprocessing inside the model: env observations in, float32 features out.

Observations arrive as the environment gives them, with N leading rows (N = T*B in the learner,
B in the actors):

- `Discrete(n)`: int [N] -> one-hot float32 [N, n].
- `MultiDiscrete(nvec)`: int [N, k] -> concatenated one-hots float32 [N, sum(nvec)].
- `MultiBinary(shape)`: int [N, *shape] -> float32 [N, prod(shape)].
- `Box` of rank 3 (an image, H x W x C): float32 [N, H, W, C], only cast, as RLlib's
  VisionNetwork takes them (uint8 pixels arrive as 0..255). The DeepMind torsos (`NatureCNN`,
  `ImpalaResNet`) divide uint8 images by 255 themselves, as DeepMind's IMPALA does.
- Any other `Box`: float32, flattened to [N, prod(shape)] (no scaling, as RLlib).
"""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import tensorflow as tf

__all__ = ["ObservationPreprocessor", "is_image_space"]


def is_image_space(space: gym.Space) -> bool:
    """True for a rank-3 Box (H, W, C), the observations the convolutional torsos take."""
    return isinstance(space, gym.spaces.Box) and len(space.shape) == 3


class ObservationPreprocessor:
    """Maps raw observations [N, *obs_shape] to float32 model inputs (no variables).

    A plain callable rather than a Keras layer: it holds no weights, and actors call it on
    every environment step, where a layer's call overhead would show.

    Attributes:
        output_shape: the per-row shape of the result, e.g. (n,) or (H, W, C).
    """

    def __init__(self, observation_space: gym.Space):
        self.observation_space = observation_space
        space = observation_space
        if isinstance(space, gym.spaces.Discrete):
            self.output_shape: tuple[int, ...] = (int(space.n),)
        elif isinstance(space, gym.spaces.MultiDiscrete):
            self._nvec = [int(n) for n in np.asarray(space.nvec).reshape(-1)]
            self.output_shape = (sum(self._nvec),)
        elif is_image_space(space):
            self.output_shape = tuple(int(d) for d in space.shape)
        elif isinstance(space, gym.spaces.Box | gym.spaces.MultiBinary):
            self.output_shape = (int(math.prod(space.shape)),)
        else:
            raise ValueError(
                f"Unsupported observation space {space!r}: impala_tf models take Box, "
                "Discrete, MultiDiscrete and MultiBinary observations (no Dict or Tuple)."
            )

    def __call__(self, obs: tf.Tensor) -> tf.Tensor:
        """Returns float32 [N, *output_shape] for observations [N, *obs_shape]."""
        space = self.observation_space
        obs = tf.convert_to_tensor(obs)
        if isinstance(space, gym.spaces.Discrete):
            idx = tf.cast(obs, tf.int32) - int(space.start)
            return tf.one_hot(idx, int(space.n), dtype=tf.float32)
        if isinstance(space, gym.spaces.MultiDiscrete):
            idx = tf.reshape(tf.cast(obs, tf.int32), [-1, len(self._nvec)])
            hots = [tf.one_hot(idx[:, i], n, dtype=tf.float32) for i, n in enumerate(self._nvec)]
            return tf.concat(hots, axis=-1)
        x = tf.cast(obs, tf.float32)
        if is_image_space(space):
            return x
        return tf.reshape(x, [-1, self.output_shape[0]])
