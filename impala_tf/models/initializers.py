"""Weight initializers for the actor-critic models.

Shapes follow Keras: a Dense kernel is [fan_in, units] and a column is one unit's weights.
"""

from __future__ import annotations

import random
from typing import Any

import keras

__all__ = ["NormcInitializer"]


@keras.saving.register_keras_serializable(package="impala_tf")
class NormcInitializer(keras.initializers.Initializer):
    """RLlib's `normc_initializer`: Gaussian columns rescaled to an L2 norm of `std`.

    Each unit starts with a weight vector of norm `std` whatever the fan-in, so a small `std`
    (0.01, RLlib's choice for the logits and value heads) starts the policy near uniform and the
    value near zero.
    """

    def __init__(self, std: float = 1.0, seed: int | None = None):
        self.std = float(std)
        # An int seed keeps the draw stateless (no seed variable); without one, draw it from
        # Python's RNG, which `keras.utils.set_random_seed` seeds, as Keras' own initializers do.
        self.seed = seed if seed is not None else random.randint(1, 2**31 - 1)

    def __call__(self, shape: Any, dtype: Any = None) -> Any:
        out = keras.random.normal(shape, dtype=dtype or "float32", seed=self.seed)
        norm = keras.ops.sqrt(keras.ops.sum(keras.ops.square(out), axis=0, keepdims=True))
        return out * (self.std / norm)

    def get_config(self) -> dict[str, Any]:
        return {"std": self.std, "seed": self.seed}
