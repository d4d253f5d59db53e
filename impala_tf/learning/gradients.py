"""How the learner applies gradients: summed once over replicas, or accumulated over microbatches.

`optimizer_groups` builds the learner's `(optimizer, variables)` pairs: one optimizer per loss,
each over every trainable variable. `all_reduce_update` sums one update's gradients and loss sums
over the replicas and clips them (replica context); `apply_if_finite` applies them, or skips the
update when it is not finite (cross-replica context, the learner's `merge_call`).

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

from collections.abc import Callable
from typing import Any, NamedTuple

import keras
import tensorflow as tf

from impala_tf.learning import losses
from impala_tf.learning.spec import LearnerSpec

__all__ = [
    "GradientAccumulators",
    "SummedUpdate",
    "all_reduce_sums",
    "all_reduce_update",
    "apply_if_finite",
    "apply_summed",
    "check_plain_optimizer",
    "optimizer_groups",
]

#: An optimizer and the variables it trains.
OptimizerGroup = tuple[keras.optimizers.Optimizer, list[keras.Variable]]


def optimizer_groups(
    spec: LearnerSpec, variables: list[keras.Variable]
) -> tuple[OptimizerGroup, ...]:
    """The learner's optimizers, built on `variables` and checked (`check_plain_optimizer`).

    The policy optimizer is RLlib's: tf1's AdamOptimizer (epsilon 1e-8) or
    RMSPropOptimizer(`lr`, `decay`, `momentum`, `epsilon`) (`opt_type`; Keras' RMSprop calls
    `decay` rho). With `_separate_vf_optimizer` a second Adam at `_lr_vf` follows it; as RLlib's
    `compute_gradients_fn`, each (optimizer, loss) pair trains ALL the variables.

    Args:
      spec: The learner's settings.
      variables: The model's trainable variables.

    Returns:
      `(policy_optimizer, variables)`, then with `_separate_vf_optimizer`
      `(value_optimizer, variables)`.
    """
    if spec.opt_type == "adam":
        policy = keras.optimizers.Adam(learning_rate=spec.lr, epsilon=1e-8, name="policy_adam")
    else:
        policy = keras.optimizers.RMSprop(
            learning_rate=spec.lr,
            rho=spec.decay,
            momentum=spec.momentum,
            epsilon=spec.epsilon,
            name="policy_rmsprop",
        )
    if not spec.separate_vf_optimizer:
        policy.build(variables)
        groups = ((policy, list(variables)),)
    else:
        value = keras.optimizers.Adam(learning_rate=spec.lr_vf, epsilon=1e-8, name="value_adam")
        variables = list(variables)
        policy.build(variables)
        value.build(variables)
        groups = ((policy, variables), (value, variables))
    for optimizer, group in groups:
        check_plain_optimizer(optimizer, group)
    return groups


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
    microbatch; `all_reduce_update` all-reduces the read values once per update. Create it
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


class SummedUpdate(NamedTuple):
    """One update's gradients and loss sums, summed over the replicas (`all_reduce_update`).

    Attributes:
      groups: For each `(optimizer, variables)` group its gradients: summed, scaled by the
        learner's `gradient_scale`, clipped by their own global norm (`grad_clip`).
      sums: The batch's loss sums (`all_reduce_sums`).
      rows: int64 scalar, the env steps of the whole batch.
      grad_gnorm_unclipped: float32 scalar, the global norm of every gradient before clipping.
      finite: bool scalar, whether that norm and every loss sum are finite.
    """

    groups: list[list[tf.Tensor]]
    sums: Any
    rows: tf.Tensor
    grad_gnorm_unclipped: tf.Tensor
    finite: tf.Tensor


def all_reduce_update(
    ctx: tf.distribute.ReplicaContext,
    grads: list[list[tf.Tensor]],
    sums: Any,
    rows: tf.Tensor,
    groups: tuple[OptimizerGroup, ...],
    grad_clip: float | None,
    gradient_scale: Callable[[Any], tf.Tensor | None],
) -> SummedUpdate:
    """Sums this replica's gradients, loss sums and env steps over the replicas, then clips.

    Call it in replica context; the gradients go in one all-reduce for every group (separate
    ones may run in a different order on each replica). The sum over the replicas is the
    gradient of the whole batch's summed loss.

    Args:
      ctx: The replica context.
      grads: For each group of `groups` this replica's gradients, one per variable.
      sums: This replica's loss sums (`losses.LossSums` or the learner's `sums_type`).
      rows: int64 scalar, this replica's env steps.
      groups: The learner's `(optimizer, variables)` pairs (`optimizer_groups`).
      grad_clip: The global norm each group is clipped to, or None.
      gradient_scale: Given the summed loss sums, what the summed gradients are multiplied by
        before clipping (None: nothing).

    Returns:
      The `SummedUpdate`, equal on every replica.
    """
    all_grads = ctx.all_reduce(tf.distribute.ReduceOp.SUM, [g for group in grads for g in group])
    sums = all_reduce_sums(ctx, sums)
    rows = ctx.all_reduce(tf.distribute.ReduceOp.SUM, rows)
    scale = gradient_scale(sums)
    if scale is not None:
        all_grads = [g * scale for g in all_grads]
    grad_gnorm_unclipped = tf.linalg.global_norm(all_grads)
    # Each optimizer clips its own group by global norm (RLlib clips each tensor alone).
    clipped_groups = []
    offset = 0
    for _, variables in groups:
        group = all_grads[offset : offset + len(variables)]
        offset += len(variables)
        if grad_clip is not None:
            group, _ = tf.clip_by_global_norm(group, grad_clip)
        clipped_groups.append(group)
    # A non-finite loss or gradient skips the whole update (weights, optimizer state,
    # counters); `update_skipped` tells the caller.
    finite = tf.logical_and(
        tf.math.is_finite(grad_gnorm_unclipped),
        tf.reduce_all(tf.math.is_finite(tf.stack(list(sums)))),
    )
    return SummedUpdate(clipped_groups, sums, rows, grad_gnorm_unclipped, finite)


def apply_if_finite(
    strategy: tf.distribute.Strategy,
    update: SummedUpdate,
    groups: tuple[OptimizerGroup, ...],
    on_applied: Callable[[Any, Any], None],
) -> None:
    """Applies a `SummedUpdate` in cross-replica context (a `merge_call`); a no-op when it is
    not `finite`.

    Args:
      strategy: The current strategy (`merge_call` passes it).
      update: The update: tensors on one device, per-replica values (equal on every replica)
        under a strategy.
      groups: The learner's `(optimizer, variables)` pairs, whose optimizers apply
        `update.groups` (`apply_summed`).
      on_applied: Called with replica 0's `rows` (int64 scalar) and `sums` after the gradients
        are applied, inside the same `tf.cond` (the learner's counters and `after_update`).
    """
    # Every replica computed `finite` and `rows` from the same all-reduced values; replica 0's
    # decide for all, so the copies of the variables cannot diverge.
    finite = strategy.experimental_local_results(update.finite)[0]
    rows = strategy.experimental_local_results(update.rows)[0]
    sums = type(update.sums)(*(strategy.experimental_local_results(v)[0] for v in update.sums))

    def apply() -> tf.Tensor:
        for (optimizer, variables), grads in zip(groups, update.groups):
            apply_summed(strategy, optimizer, grads, variables)
        on_applied(rows, sums)
        return tf.constant(True)

    # No cross-replica synchronisation runs inside: the `tf.cond` holds on every strategy.
    tf.cond(finite, apply, lambda: tf.constant(False))
