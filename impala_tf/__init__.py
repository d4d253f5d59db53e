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

from impala_tf.utils import moved_modules

moved_modules.install()

__version__ = "0.1.0"

_EXPORTS = {
    "ImpalaConfig": "impala_tf.config",
    "APPOConfig": "impala_tf.appo",
    "AppoLearner": "impala_tf.appo",
    "normalize_stop_criteria": "impala_tf.config",
    "Impala": "impala_tf.driver.algorithm",
    "MultiAgentImpala": "impala_tf.driver.algorithm",
    "make_strategy": "impala_tf.learning.strategy",
    "ImpalaLearner": "impala_tf.learning.learner",
    "LearnerThread": "impala_tf.learning.thread",
    "MinibatchBuffer": "impala_tf.data.train_batch",
    "MixInReplayBuffer": "impala_tf.data.replay",
    "SampleBatch": "impala_tf.data.sample_batch",
    "concat_samples": "impala_tf.data.sample_batch",
    "ActorPolicy": "impala_tf.acting.tf_policy",
    "EnvRunner": "impala_tf.rollout.env_runner",
    "Fragment": "impala_tf.rollout.fragment",
    "WorkerGroup": "impala_tf.workers",
    "DefaultCallbacks": "impala_tf.config.callbacks",
    "make_multi_callbacks": "impala_tf.config.callbacks",
    "ModelCatalog": "impala_tf.models",
    "Policy": "impala_tf.acting.trained_policy",
    "build_model": "impala_tf.models",
    "fit": "impala_tf.training.loop",
    # Modules, by their historical top-level names.
    "callbacks": "impala_tf.training.callbacks",
    "vtrace": "impala_tf.learning.vtrace",
    "losses": "impala_tf.learning.losses",
    "distributions": "impala_tf.models.distributions",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'impala_tf' has no attribute {name!r}")
    module = importlib.import_module(_EXPORTS[name])
    value = module if module.__name__.rpartition(".")[2] == name else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
