"""Environments shipped with impala_tf and the env families it wraps (Atari, classic control).

Importing this package registers the shipped envs under gymnasium ids.
"""

from __future__ import annotations

from impala_tf.envs import classic  # noqa: F401 - registers impala_tf/StatelessCartPole-v1

__all__: list[str] = []
