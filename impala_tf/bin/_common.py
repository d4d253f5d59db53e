"""What every binary shares (impala-train, impala-evaluate, impala-export): flags defined once,
and the current directory on the import path.

absl refuses a flag defined by two modules, and a process (a test, a notebook) may import
several binaries.
"""

from __future__ import annotations

import os
import sys

from absl import flags

__all__ = ["FLAGS", "import_from_cwd"]


def import_from_cwd() -> None:
    """Makes the current directory importable, as `python -m` would: a config's import paths
    (custom models, callbacks, env creators, policy mapping functions) may name the user's
    own modules. Call it before the run's plan resolves them (worker processes started later
    inherit the path)."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


FLAGS = flags.FLAGS

flags.DEFINE_bool(
    "verbose",
    False,
    "Show TensorFlow's C++ start-up log; impala-train also prints the full result dict "
    "each iteration.",
)
