"""Piecewise-linear schedules (RLlib's `lr_schedule`, `entropy_coeff_schedule`), in the graph.

The learner evaluates them at its count of agent steps trained, each update.
"""

from __future__ import annotations

import tensorflow as tf

__all__ = ["piecewise_linear"]


def piecewise_linear(points: list[list[float]] | None, t: tf.Tensor, default: float) -> tf.Tensor:
    """Evaluates a piecewise-linear schedule `[[t0, v0], [t1, v1], ...]` at step `t`.

    Values are interpolated linearly between points and held constant before the first and after
    the last point (RLlib's `PiecewiseSchedule` with the last value as the outside value, except
    that before t0 we hold v0, which only differs for schedules not starting at 0).

    Args:
      points: The schedule, timesteps non-decreasing; None means the constant `default`.
      t: Scalar step count (any numeric dtype).
      default: Value used when `points` is None.

    Returns:
      float32 scalar.
    """
    if not points:
        return tf.constant(default, tf.float32)
    t = tf.cast(t, tf.float32)
    value = tf.constant(float(points[-1][1]), tf.float32)
    # Later segments first, so that each earlier one overrides the steps before its end.
    for (t0, v0), (t1, v1) in reversed(list(zip(points[:-1], points[1:]))):
        if t1 > t0:
            frac = tf.clip_by_value((t - float(t0)) / float(t1 - t0), 0.0, 1.0)
            segment = float(v0) + frac * float(v1 - v0)
        else:  # A zero-length segment is a step, taken at t1.
            segment = tf.constant(float(v1), tf.float32)
        value = tf.where(t < float(t1), segment, value)
    return value
