"""APPO, as RLlib builds it on IMPALA: `APPOConfig(ImpalaConfig)` and APPO's learner.

    from impala_tf.appo import APPOConfig

    algo = APPOConfig().environment("CartPole-v1").build()

The package holds everything APPO adds and nothing else: its config keys (`config`), the
learner settings that carry them to the learner (`spec`), its loss (`losses`), its learner
(`learner`: the target network and KL coefficient) and its learner queue (`buffer`: the circular
buffer). The actors, driver, learner thread and checkpoints are IMPALA's; the config's
`learner_class` and `learner_spec` are where the runtime takes the APPO parts from.
`docs/appo.md` is the guide.
"""

from __future__ import annotations

import importlib
from typing import Any

from impala_tf.appo.buffer import CircularBuffer
from impala_tf.appo.config import APPOConfig

__all__ = ["APPOConfig", "AppoLearner", "CircularBuffer", "appo_loss"]

# TensorFlow parts, imported on first use (the config stays light to import).
_LAZY = {"AppoLearner": "impala_tf.appo.learner", "appo_loss": "impala_tf.appo.losses"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
