"""Environments shipped with impala_tf and the env families it wraps (Atari, classic control).

Importing this package registers the shipped envs under gymnasium ids.
"""

from __future__ import annotations

__all__: list[str] = []
