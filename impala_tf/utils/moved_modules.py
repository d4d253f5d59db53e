"""Module paths from before the package was grouped into layers, still importable.

The package root once held every module (`impala_tf.learner`, `impala_tf.vtrace`, ...); they now
live in subpackages by layer (`impala_tf.learning.learner`, ...). Code written against the old
paths keeps working: `import impala_tf.learner` gives the module object of
`impala_tf.learning.learner` itself (not a copy), so classes, `isinstance` checks, pickles of
old checkpoints and `mock.patch` targets are the same under either name. New code uses the
new paths or the top-level names (`from impala_tf import ImpalaLearner`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

#: Old module path -> where the module lives now.
MOVED = {
    "impala_tf.policy": "impala_tf.acting.tf_policy",
    "impala_tf.numpy_policy": "impala_tf.acting.numpy_policy",
    "impala_tf.traced_policy": "impala_tf.acting.traced_policy",
    "impala_tf.graph_numpy": "impala_tf.acting.graph_numpy",
    "impala_tf.action_sampler": "impala_tf.acting.action_sampler",
    "impala_tf.actions": "impala_tf.acting.actions",
    "impala_tf.policy_step": "impala_tf.acting.policy_step",
    "impala_tf.filters": "impala_tf.acting.filters",
    "impala_tf.remote_policy": "impala_tf.acting.remote_policy",
    "impala_tf.inference": "impala_tf.acting.inference",
    "impala_tf.trained_policy": "impala_tf.acting.trained_policy",
    "impala_tf.sample_batch": "impala_tf.data.sample_batch",
    "impala_tf.batching": "impala_tf.data.batching",
    "impala_tf.minibatch": "impala_tf.data.train_batch",
    "impala_tf.replay": "impala_tf.data.replay",
    "impala_tf.learner": "impala_tf.learning.learner",
    "impala_tf.learner_loader": "impala_tf.learning.loader",
    "impala_tf.learner_spec": "impala_tf.learning.spec",
    "impala_tf.learner_thread": "impala_tf.learning.thread",
    "impala_tf.losses": "impala_tf.learning.losses",
    "impala_tf.vtrace": "impala_tf.learning.vtrace",
    "impala_tf.gradients": "impala_tf.learning.gradients",
    "impala_tf.schedules": "impala_tf.learning.schedules",
    "impala_tf.pipeline": "impala_tf.learning.pipeline",
    "impala_tf.nonfinite": "impala_tf.learning.nonfinite",
    "impala_tf.devices": "impala_tf.learning.devices",
    "impala_tf.stats": "impala_tf.learning.stats",
    "impala_tf.sequences": "impala_tf.learning.sequences",
    "impala_tf.distributions": "impala_tf.models.distributions",
    "impala_tf.frames": "impala_tf.models.frames",
    "impala_tf.loop": "impala_tf.training.loop",
    "impala_tf.callbacks": "impala_tf.training.callbacks",
    "impala_tf.algorithm_callbacks": "impala_tf.config.callbacks",
    "impala_tf.reporting": "impala_tf.training.reporting",
    "impala_tf.video": "impala_tf.envs.video",
    "impala_tf.algorithm": "impala_tf.driver.algorithm",
    "impala_tf.evaluation": "impala_tf.driver.evaluation",
    "impala_tf.portable": "impala_tf.config.portable",
    "impala_tf.seeds": "impala_tf.utils.seeds",
    "impala_tf.quiet": "impala_tf.utils.quiet",
    "impala_tf.shutdown": "impala_tf.utils.shutdown",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads it as the module at its new path."""

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec] = {}

    def find_spec(self, fullname: str, path: object = None, target: object = None):
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(MOVED[spec.name])
        self._specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """The module ran when it was imported at its new path. The import system has set its
        `__spec__` to the old path's: set it back, so the module keeps one identity."""
        module.__spec__ = self._specs.pop(module.__name__)


def install() -> None:
    """Makes the old paths importable (once; `import impala_tf` calls it)."""
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.append(_Alias())
