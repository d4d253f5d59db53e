"""Environments shipped with impala_tf and the env families it wraps (Atari, classic control).

Importing this package registers the shipped envs under gymnasium ids.
"""

from __future__ import annotations

from impala_tf.envs import classic  # noqa: F401 - registers impala_tf/StatelessCartPole-v1
from impala_tf.multi_agent.env import register_envs as _register_multi_agent

_register_multi_agent()  # impala_tf/MultiAgentCartPole and RLlib's class paths for it.

__all__: list[str] = []
