"""`ReplicaSteps`: the learner's steps as graph functions that run on every replica of a strategy.

The learner thread runs the learner through these: each calls `strategy.run` on one distributed
unit (an element of `impala_tf.learning.pipeline.make_dataset`: on each replica its shard of
whole sequences in RLlib's flat layout, per-step columns [B * T, ...], B sequences of T steps)
and returns what the host reads back: an update's stats stacked into one float64 vector
(`impala_tf.learning.reports.UpdateReports.pack`; every replica returns the same all-reduced
stats, replica 0's are taken), or a microbatch's env steps. Autograph is off: the graph code is
explicit, and autograph costs seconds of tracing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from impala_tf.learning.learner import ImpalaLearner

__all__ = ["ReplicaSteps"]


class ReplicaSteps:
    """`ImpalaLearner`'s steps under `strategy`, each a `tf.function`.

    Args:
      learner: The learner (built inside `strategy.scope()`).
      strategy: The learner's distribution strategy.
      pack: Stacks an update's stats dict into the one tensor the host reads.

    Attributes:
      train: `train(data)`: one update on a unit (`ImpalaLearner.train_step`); its packed stats.
      accumulate: `accumulate(data)`: adds a microbatch's gradients
        (`ImpalaLearner.accumulate_step`); int64, replica 0's env steps of it.
      apply: `apply()`: applies the accumulated gradients as one update
        (`ImpalaLearner.apply_accumulated`); its packed stats.
      reset: `reset()`: zeroes the accumulators (`ImpalaLearner.reset_accumulators`).
    """

    def __init__(
        self,
        learner: ImpalaLearner,
        strategy: tf.distribute.Strategy,
        pack: Callable[[dict[str, tf.Tensor]], tf.Tensor],
    ):
        self.learner = learner
        self.strategy = strategy
        self._pack = pack
        self.train = tf.function(self._train, autograph=False)
        self.accumulate = tf.function(self._accumulate, autograph=False)
        self.apply = tf.function(self._apply, autograph=False)
        self.reset = tf.function(self._reset, autograph=False)

    def trace(self, element_spec: Any, microbatching: bool) -> None:
        """Traces the steps a thread will run on units of `element_spec` (the dataset's), so
        that they are ready before the first unit (while the actors start)."""
        if microbatching:
            self.accumulate.get_concrete_function(element_spec)
            self.apply.get_concrete_function()
        else:
            self.train.get_concrete_function(element_spec)

    def _first(self, values: Any) -> Any:
        return self.strategy.experimental_local_results(values)[0]

    def _train(self, data):
        return self._pack(self._first(self.strategy.run(self.learner.train_step, args=(data,))))

    def _accumulate(self, data):
        return self._first(self.strategy.run(self.learner.accumulate_step, args=(data,)))

    def _apply(self):
        return self._pack(self._first(self.strategy.run(self.learner.apply_accumulated)))

    def _reset(self):
        self.strategy.run(self.learner.reset_accumulators)
