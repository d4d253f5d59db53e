"""The algorithms by name: a YAML's `run:` and a checkpoint's `"algorithm"` pick a config class.

RLlib names its algorithms (`run: IMPALA`, `run: APPO`); so do we. The config class decides the
rest (its keys, its checks, the learner its `learner_spec` builds). Names are upper-cased.
"""

from __future__ import annotations

import importlib

__all__ = ["ALGORITHMS", "config_class"]

#: Algorithm name -> "module:ConfigClass".
ALGORITHMS: dict[str, str] = {
    "IMPALA": "impala_tf.config:ImpalaConfig",
    "APPO": "impala_tf.appo.config:APPOConfig",
}


def config_class(name: str) -> type:
    """The config class of algorithm `name` (`IMPALA`, `APPO`; any case).

    Raises:
      ValueError: no algorithm has that name.
    """
    path = ALGORITHMS.get(str(name).upper()) if isinstance(name, str) else None
    if path is None:
        raise ValueError(f"Unknown algorithm {name!r}: impala_tf runs {' and '.join(ALGORITHMS)}.")
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)
