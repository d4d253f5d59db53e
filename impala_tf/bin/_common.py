"""Flags every binary shares (impala-train, impala-evaluate, impala-export), defined once.

absl refuses a flag defined by two modules, and a process (a test, a notebook) may import
several binaries.
"""

from __future__ import annotations

from absl import flags

__all__ = ["FLAGS"]

FLAGS = flags.FLAGS

flags.DEFINE_bool(
    "verbose",
    False,
    "Show TensorFlow's C++ start-up log; impala-train also prints the full result dict "
    "each iteration.",
)
