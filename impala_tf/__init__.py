"""impala_tf: RLlib's IMPALA (V-trace actor-learner RL) on TensorFlow 2 / Keras 3.

The public API, importable from the top level. Names are loaded on first use, so that
`import impala_tf` (and the config alone) stay cheap: TensorFlow is imported only by the names
that need it.

    from impala_tf import ImpalaConfig
    algo = ImpalaConfig().environment("CartPole-v1").build()
    result = algo.train()
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "ImpalaConfig": "impala_tf.config",
    "APPOConfig": "impala_tf.appo",
    "AppoLearner": "impala_tf.appo",
    "normalize_stop_criteria": "impala_tf.config",
    "Impala": "impala_tf.algorithm",
    "MultiAgentImpala": "impala_tf.algorithm",
    "make_strategy": "impala_tf.algorithm",
    "ImpalaLearner": "impala_tf.learner",
    "LearnerThread": "impala_tf.learner_thread",
    "MinibatchBuffer": "impala_tf.minibatch",
    "MixInReplayBuffer": "impala_tf.replay",
    "SampleBatch": "impala_tf.sample_batch",
    "concat_samples": "impala_tf.sample_batch",
    "ActorPolicy": "impala_tf.policy",
    "EnvRunner": "impala_tf.rollout.env_runner",
    "Fragment": "impala_tf.rollout.fragment",
    "WorkerGroup": "impala_tf.workers",
    "DefaultCallbacks": "impala_tf.algorithm_callbacks",
    "make_multi_callbacks": "impala_tf.algorithm_callbacks",
    "ModelCatalog": "impala_tf.models",
    "Policy": "impala_tf.trained_policy",
    "build_model": "impala_tf.models",
    "fit": "impala_tf.loop",
    "callbacks": None,
    "vtrace": None,
    "losses": None,
    "distributions": None,
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'impala_tf' has no attribute {name!r}")
    module = _EXPORTS[name]
    if module is None:
        value = importlib.import_module(f"impala_tf.{name}")
    else:
        value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
