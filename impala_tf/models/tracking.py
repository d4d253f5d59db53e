"""Which of a model's weights a TensorFlow checkpoint of it would miss (no TensorFlow at import).

Checkpoints (`impala_tf.checkpoints`) save a policy's model as a `tf.train.Checkpoint` part, and
custom models (`impala_tf.models.custom`) are checked against it when they are built, so that a
model whose weights a checkpoint cannot hold fails at build time rather than at a restore.
"""

from __future__ import annotations

from typing import Any

__all__ = ["untracked_variables"]


def untracked_variables(model: Any) -> list:
    """The weights of `model` that a `tf.train.Checkpoint` of it would not hold.

    Keras 3 does not track layers kept in Python lists for TensorFlow checkpoints (only
    attributes), so a torso that keeps its layers in a list saves none of their weights under
    the `model` part. A model whose list is empty checkpoints completely. Only weights count:
    a Keras layer's random-seed state (a recurrent layer's dropout seeds) is not a weight, and
    no checkpoint needs it.
    """
    import tensorflow as tf

    root = tf.train.Checkpoint(model=model)
    reachable = {id(obj) for obj in tf.train.TrackableView(root).descendants()}
    return [v for v in model.weights if id(v) not in reachable]
