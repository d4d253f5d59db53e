"""The `precision` config key: which Keras dtype policy a model is built under.

`"float32"` builds every layer in float32. `"mixed_bfloat16"` builds the torso layers under
Keras' `mixed_bfloat16` dtype policy: they compute in bfloat16 and keep float32 variables, so
weights, gradients, optimizer slots, checkpoints and the weight lists broadcast to the actors stay
float32. The heads (`ActorCritic`: logits, value, `free_log_std`) and the LSTM core stay float32
whatever the policy, so logits, values, the recurrent state, V-trace and the loss are float32.

The policy is scoped to the build (`dtype_policy`): Keras layers read the default policy when they
are constructed, and Keras keeps it per thread, so nothing outside the build (another model, the
caller's own layers, another thread) sees it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import keras

from impala_tf.config.keys import PRECISIONS

__all__ = ["PRECISIONS", "dtype_policy"]


@contextlib.contextmanager
def dtype_policy(precision: str) -> Iterator[None]:
    """Sets Keras' default dtype policy to `precision` inside the block, then restores it.

    Args:
        precision: One of `PRECISIONS`.

    Raises:
        ValueError: for another value, naming the `precision` key.
    """
    if precision not in PRECISIONS:
        raise ValueError(
            f"`precision` must be one of {PRECISIONS} (the Keras dtype policy the models are "
            f"built under), got {precision!r}."
        )
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(precision)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)
