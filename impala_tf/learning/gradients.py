"""How the learner applies gradients: summed once over replicas, or accumulated over microbatches.

`apply_summed` applies gradients that the learner has already summed over the replicas (its one
all-reduce per update) with a stock Keras optimizer, through public API only: Keras' TF optimizer
all-reduces the gradients it is given in replica context, and its `apply_gradients` refuses
cross-replica context under `MirroredStrategy`, so the learner hands the summed gradients over
with `ReplicaContext.merge_call` and this function runs the optimizer's `update_step` (Keras'
public hook for an optimizer's rule) on each device's copy of each variable.
`check_plain_optimizer` refuses the optimizer options that `apply_gradients` would honour and
`apply_summed` does not (clipping options, weight decay, EMA, loss scaling, constraints).

`GradientAccumulators` holds the per-replica sums of microbatch gradients (`microbatch_size`);
`all_reduce_sums` reduces the loss sums across replicas.

The learner's update (`impala_tf.learning.learner.ImpalaLearner`), in full:

Multiple devices: build the learner inside `strategy.scope()` (`tf.distribute.MirroredStrategy`).
Each replica computes the gradient of the summed loss on its shard of sequences; the gradients
are summed across replicas (so the update equals the single-device update on the whole batch),
then clipped by global norm, then applied; stats are reduced across replicas the same way.
That sum is the update's only all-reduce of gradients. A Keras optimizer's `apply_gradients`
would all-reduce them a second time (in replica context, Keras' TF optimizer sums whatever each
replica gives it), so the summed gradients leave replica context through the public
`ReplicaContext.merge_call` and are applied in cross-replica context, each variable's copy on
each device by `StrategyExtended.update` with the optimizer's own `update_step`
(`impala_tf.learning.gradients.apply_summed`), as `apply_gradients` does after its all-reduce for a
plain optimizer (no `clipnorm`, weight decay, EMA or variable constraints: `check_plain_optimizer`
rejects them). The optimizers are stock Keras Adam / RMSprop: same variables and checkpoints as
before.
RLlib's multi-GPU towers *average* the replica gradients; their per-tower loss is the same summed
V-trace loss, so with n towers of B/n sequences our sum equals their average of n x the shard
losses: averaging gradients of n * L_shard and summing gradients of L_shard are the same number.

Gradient accumulation (`microbatch_size`, RLlib's `MicrobatchOptimizer`): `accumulate_step` adds
the gradients and loss sums of one microbatch (whole sequences) to accumulator variables, and
`apply_accumulated` applies their sum as one update and zeroes them. The losses are sums, so the
accumulated gradient of a train batch's microbatches is the gradient of the whole batch: the
update (clipping, optimizer state, schedules, counters, stats) equals `train_step` on the whole
batch, while the device only ever holds one microbatch's activations. The accumulators are
per-replica (`ON_READ`) variables, all-reduced once per update. `train_step` is the same two
parts (gradients, then the update) without the variables in between.

Non-finite updates: when the all-reduced loss sums or the gradient's global norm are not finite,
the update is skipped (no variable, optimizer slot or counter changes) and the stats report
`update_skipped` = 1.0 (`impala_tf.learning.nonfinite` counts and saves them). The skip is a
`tf.cond` around the cross-replica update, the same on one device, under any `tf.distribute`
strategy, in `fit` and in the learner thread: it runs no cross-replica synchronisation, which a
`tf.cond` in replica context could not hold.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from impala_tf.learning import losses

__all__ = ["GradientAccumulators", "all_reduce_sums", "apply_summed", "check_plain_optimizer"]


def check_plain_optimizer(
    optimizer: keras.optimizers.Optimizer, variables: list[keras.Variable]
) -> None:
    """Raises if `optimizer.apply_gradients` would do more than `apply_summed` does.

    Args:
      optimizer: A Keras optimizer.
      variables: The variables it trains.

    Raises:
      ValueError: naming the optimizer options or the variables `apply_summed` would ignore.
    """
    options = ("clipnorm", "clipvalue", "global_clipnorm", "weight_decay", "use_ema")
    options += ("loss_scale_factor", "gradient_accumulation_steps")
    used = [name for name in options if getattr(optimizer, name)]
    constrained = [
        v.path for v in variables if v.constraint is not None or v.overwrite_with_gradient
    ]
    if used or constrained:
        raise ValueError(
            f"The learner applies gradients itself (one all-reduce per update) and supports "
            f"neither optimizer options {used} of {optimizer.name} nor constrained or "
            f"overwrite-with-gradient variables {constrained}."
        )


def apply_summed(
    strategy: tf.distribute.Strategy,
    optimizer: keras.optimizers.Optimizer,
    grads: list[Any],
    variables: list[keras.Variable],
) -> None:
    """Applies gradients already summed over the replicas; call it in cross-replica context.

    In replica context Keras' TF optimizer all-reduces the gradients it is given, and in
    cross-replica context its `apply_gradients` fails under `MirroredStrategy` (it asks for a
    replica context). This is what `apply_gradients` runs after its all-reduce for an optimizer
    that `check_plain_optimizer` accepts: `update_step` (Keras' public hook for an optimizer's
    rule) on each device's copy of each variable, then `iterations` + 1.

    Args:
      strategy: The strategy of the cross-replica context (`merge_call`'s first argument).
      optimizer: The Keras optimizer whose slots and step count the update uses.
      grads: float gradients, one per variable: tensors (one device) or per-replica values
        that are equal on every replica (the all-reduced sum).
      variables: The Keras variables `optimizer` was built on.
    """
    learning_rate = optimizer.learning_rate

    def update(variable: tf.Variable, grad: tf.Tensor) -> None:
        optimizer.update_step(grad, variable, learning_rate)

    for grad, variable in zip(grads, variables):
        strategy.extended.update(variable.value, update, args=(grad,), group=False)
    optimizer.iterations.assign_add(1)


class GradientAccumulators:
    """Per-replica sums of microbatch gradients, loss sums and env steps (gradient accumulation).

    The variables are `ON_READ`: each replica adds to its own copy, with no communication per
    microbatch; `ImpalaLearner._apply` all-reduces the read values once per update. Create it
    inside the learner's `strategy.scope()`.

    Args:
      groups: The learner's `(optimizer, variables)` pairs; one accumulator per variable.
      sums_type: The loss's sums (a NamedTuple of float32 scalars, `losses.LossSums` by
        default); its `losses.MAX_FIELDS` accumulate by maximum, the others by sum.
    """

    def __init__(self, groups: list[tuple[Any, list[Any]]], sums_type: type = losses.LossSums):
        self.sums_type = sums_type
        # Which entries of the stacked sums accumulate by maximum.
        self._max_mask = [name in losses.MAX_FIELDS for name in sums_type._fields]
        local = dict(
            trainable=False,
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.SUM,
        )
        self.grads = [
            [
                tf.Variable(tf.zeros(v.shape, v.dtype), name=f"grad_accumulator_{i}", **local)
                for i, v in enumerate(variables)
            ]
            for _, variables in groups
        ]
        self.sums = tf.Variable(tf.zeros([len(sums_type._fields)]), name="sums", **local)
        self.rows = tf.Variable(tf.constant(0, tf.int64), name="rows", **local)

    def add(self, grads: list[list[tf.Tensor]], sums: losses.LossSums, rows: tf.Tensor) -> None:
        for accumulators, group in zip(self.grads, grads):
            for accumulator, grad in zip(accumulators, group):
                accumulator.assign_add(grad)
        current, new = self.sums.read_value(), tf.stack(list(sums))
        self.sums.assign(tf.where(self._max_mask, tf.maximum(current, new), current + new))
        self.rows.assign_add(rows)

    def read(self) -> tuple[list[list[tf.Tensor]], losses.LossSums, tf.Tensor]:
        grads = [[a.read_value() for a in accumulators] for accumulators in self.grads]
        return grads, self.sums_type(*tf.unstack(self.sums.read_value())), self.rows.read_value()

    def reset(self) -> None:
        for accumulators in self.grads:
            for accumulator in accumulators:
                accumulator.assign(tf.zeros_like(accumulator))
        self.sums.assign(tf.zeros_like(self.sums))
        self.rows.assign(tf.zeros_like(self.rows))


def all_reduce_sums(ctx: tf.distribute.ReplicaContext, sums: Any) -> Any:
    """The batch's loss sums (`losses.LossSums`, or an algorithm's `sums_type`) from every
    replica's, in one all-reduce: summed, and the
    `losses.MAX_FIELDS` by maximum. `ReduceOp` has no MAX, so each replica puts its value in its
    own slot of a vector of one slot per replica (zeros elsewhere; the values are >= 0), and
    the max of the summed vector is the batch's."""
    kind = type(sums)
    summed = [name for name in kind._fields if name not in losses.MAX_FIELDS]
    slot = tf.one_hot(ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync)
    parts = [getattr(sums, name) for name in summed]
    parts += [slot * getattr(sums, name) for name in losses.MAX_FIELDS]
    reduced = ctx.all_reduce(tf.distribute.ReduceOp.SUM, parts)
    values = dict(zip(summed, reduced[: len(summed)]))
    values.update(
        (name, tf.reduce_max(v)) for name, v in zip(losses.MAX_FIELDS, reduced[len(summed) :])
    )
    return kind(**values)
