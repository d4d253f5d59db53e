"""Imported by the fork server before the policy: TensorFlow without its C++ start-up lines.

Only when `TF_CPP_MIN_LOG_LEVEL` is 3 or more (see `impala_tf.utils.quiet`); else a plain import.
"""

from __future__ import annotations

from impala_tf.utils.quiet import import_tensorflow

__all__: list[str] = []

import_tensorflow()
