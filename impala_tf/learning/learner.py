"""`ImpalaLearner`: the V-trace learner as a `keras.Model` whose `train_step` is one IMPALA update.

It reproduces RLlib's legacy TF IMPALA policy (`VTraceTFPolicy`): the summed V-trace loss of
`impala_tf.learning.losses`, Adam or RMSProp (`opt_type`), piecewise-linear `lr_schedule` and
`entropy_coeff_schedule` driven by the number of agent steps trained, and `_separate_vf_optimizer`:
a second Adam (`impala_tf.learning.gradients.optimizer_groups`); as in RLlib's TF policy, the policy
optimizer's loss `pi_loss - entropy_coeff * entropy` and the value loss are each differentiated
over ALL the trainable variables, so layers shared by the policy and V (a CNN torso, an LSTM core,
`vf_share_layers`) get both updates. Each optimizer's gradients are clipped by their own global
norm (`grad_clip`).

Stats: `grad_gnorm` is the global norm of the gradients after clipping (RLlib computes it in
`grad_stats_fn`, which receives the clipped gradients); `grad_gnorm_unclipped` is the norm before.
With two optimizers both norms are taken over the gradients of both losses together.

Input batches (what `train_step` receives, e.g. from a `tf.data.Dataset` given to `fit`) are dicts
with RLlib's column names, in one of two layouts:

* time-major: per-step columns shaped [T, B, ...] (T is time, B is batch);
* flat, as RLlib's `SampleBatch`: per-step columns shaped [B * T, ...] with each env's T steps
  contiguous; the learner reshapes them as RLlib's `make_time_major` does, with
  T = `rollout_fragment_length`.

Per-sequence columns (`state_in_0`, `state_in_1` of recurrent models) are [B, C, H] in both: the
recurrent state at the start of each of the C = ceil(T / `max_seq_len`) sequences of a fragment
(`impala_tf.learning.sequences`); [B, H] is accepted when T <= `max_seq_len`. Recurrent models train
on those sequences (RLlib's `max_seq_len`), each bootstrapped at its end, padding masked.
The layout is told apart by the rank of `rewards` (2 is time-major, 1 is flat).

Multiple devices (build the learner inside `strategy.scope()`), gradient accumulation
(`microbatch_size`: `accumulate_step`, then `apply_accumulated`) and the skip of non-finite
updates: `impala_tf.learning.gradients` says how the update is applied in each case.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import gymnasium as gym
import keras
import numpy as np
import tensorflow as tf

from impala_tf.learning import devices, losses, sequences
from impala_tf.learning.gradients import (
    GradientAccumulators,
    all_reduce_update,
    apply_if_finite,
    optimizer_groups,
)
from impala_tf.learning.schedules import piecewise_linear
from impala_tf.learning.spec import LearnerSpec
from impala_tf.models import distributions
from impala_tf.models.catalog import build_model
from impala_tf.models.spec import ModelSpec

__all__ = ["DIAGNOSTIC_KEYS", "ImpalaLearner", "LossInputs", "piecewise_linear", "STATS_KEYS"]

#: Diagnostics of each update `train_step` also returns (ours; over the valid steps): the
#: importance ratio rho = pi/mu (mean, max, and the fractions above `vtrace_clip_rho_threshold`
#: and `vtrace_clip_pg_rho_threshold`), the policy-gradient advantage (mean and standard
#: deviation), the value error v_s - V(x_s) (mean: negative when V overestimates) and the logit
#: range (max - min logit per step: how far the policy is from uniform, Discrete actions).
DIAGNOSTIC_KEYS = (
    "mean_rho",
    "max_rho",
    "rho_clipped_frac",
    "pg_rho_clipped_frac",
    "pg_advantage_mean",
    "pg_advantage_std",
    "vf_error_mean",
    "logit_range_mean",
)

#: Keys of the stats dict `train_step` returns (RLlib's `learner_stats` names).
STATS_KEYS = (
    "cur_lr",
    "policy_loss",
    "entropy",
    "entropy_coeff",
    "var_gnorm",
    "vf_loss",
    "vf_explained_var",
    "grad_gnorm",
    "grad_gnorm_unclipped",
    "total_loss",
    "num_agent_steps_trained",
    "num_grad_updates_lifetime",
)


class LossInputs(NamedTuple):
    """What `ImpalaLearner.compute_loss` receives: one replica's time-major batch and the
    trained model's outputs on it.

    Attributes:
      batch: The time-major columns ([T, B, ...]; recurrent batches cut into sequences).
      logits: float32 [T, B, ...], the trained policy's action-distribution inputs.
      values: float32 [T, B], the trained value function's V(x_t).
      resets: bool [T, B], where the model's recurrent state restarts (after an episode end).
      state: The recurrent state at each sequence's start (empty for feed-forward models).
      terminateds: bool [T, B].
      truncateds: bool [T, B]; a sequence's end counts as one (it bootstraps there).
      mask: float32 [T, B] of valid steps, or None when every step is valid.
    """

    batch: dict[str, tf.Tensor]
    logits: tf.Tensor
    values: tf.Tensor
    resets: tf.Tensor
    state: tuple[tf.Tensor, ...]
    terminateds: tf.Tensor
    truncateds: tf.Tensor
    mask: tf.Tensor | None


class ImpalaLearner(keras.Model):
    """The IMPALA learner: an actor-critic Keras model trained with the V-trace loss.

    Construct it inside `strategy.scope()` to train on several devices. `train_step` performs one
    update and returns the stats in `STATS_KEYS`, so `learner.fit(dataset, callbacks=[...])` works
    on a `tf.data.Dataset` of batches (see the module docstring for the layouts).

    Args:
      spec: The policy's learner settings (`impala_tf.learning.spec.LearnerSpec`), or a config
        (an `ImpalaConfig`: its settings are read once, `config.learner_spec()`; the learner
        keeps no config).
      observation_space: The policy's observation space.
      action_space: The policy's action space.
      model: The actor-critic to train (a built `keras.Model`), or a `ModelSpec` to build it
        from; None builds the spec's model.
      name: The Keras name.

    Attributes:
      spec: The `LearnerSpec` it was built from.
      model: The `impala_tf.models.ActorCritic` being trained.
      policy_optimizer: The optimizer of the total loss (or of the policy loss when
        `_separate_vf_optimizer`).
      value_optimizer: The value-function Adam when `_separate_vf_optimizer`, else None.
      num_grad_updates: int64 variable, updates applied so far (RLlib `num_grad_updates_lifetime`).
      num_agent_steps_trained: int64 variable, steps trained so far; drives the schedules.
    """

    #: The loss's sums (`compute_loss`): what is all-reduced and accumulated.
    sums_type: type = losses.LossSums
    #: Stats that are counts (the learner thread reports them as ints, as RLlib does).
    count_keys: tuple[str, ...] = ("num_agent_steps_trained", "num_grad_updates_lifetime")

    def __init__(
        self,
        spec: LearnerSpec | Any,
        observation_space: gym.Space,
        action_space: gym.Space,
        model: keras.Model | ModelSpec | None = None,
        name: str = "impala_learner",
    ):
        super().__init__(name=name)
        if not isinstance(spec, LearnerSpec):
            spec = spec.learner_spec(model if isinstance(model, ModelSpec) else None)
        elif isinstance(model, ModelSpec):
            spec = dataclasses.replace(spec, model=model)
        self.spec = spec
        self.observation_space = observation_space
        self.action_space = action_space
        if model is None or isinstance(model, ModelSpec):
            model = build_model(
                observation_space, action_space, spec.model, precision=spec.precision
            )
        self.model = model
        self._separate_vf = spec.separate_vf_optimizer

        groups = optimizer_groups(spec, self.model.trainable_variables)
        self.policy_optimizer = groups[0][0]
        self.value_optimizer = groups[1][0] if self._separate_vf else None
        self._groups = groups
        counter = dict(
            dtype=tf.int64,
            trainable=False,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )
        self.num_grad_updates = tf.Variable(0, name="num_grad_updates", **counter)
        self.num_agent_steps_trained = tf.Variable(0, name="num_agent_steps_trained", **counter)
        self._accumulators: GradientAccumulators | None = (
            GradientAccumulators(self._groups, self.sums_type)
            if spec.microbatch_size is not None
            else None
        )
        # `jit_compile_update`: XLA compiles the part of the update that is one device's own
        # work (forward, V-trace, backward). The rest (all-reduce, clipping, the optimizers in
        # a `merge_call`) cannot be compiled: `merge_call` leaves the replica function, which
        # an XLA cluster cannot do, so Keras' `compile(jit_compile=True)` (which compiles the
        # whole `train_step`) is never used.
        self.jit_compile_update = devices.resolve_jit_compile(
            spec.jit_compile_update, devices.on_accelerator(tf.distribute.get_strategy())
        )
        self._gradients_fn = (
            tf.function(self._gradients, jit_compile=True, autograph=False)
            if self.jit_compile_update
            else self._gradients
        )
        self.compile(optimizer=self.policy_optimizer, jit_compile=False)
        # Every variable exists now; telling Keras so stops `fit` from calling the model on a
        # batch to build it.
        self.built = True

    # Keras plumbing -------------------------------------------------------------------------

    def call(self, inputs, training=False):
        """Runs the model on a batch of observations [B, ...]; returns (logits, values)."""
        return self.model(inputs, training=training)

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name}

    # The update -----------------------------------------------------------------------------

    def time_major(self, batch: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        """Returns `batch` with per-step columns time-major [T, B, ...] and frame stacks rebuilt
        (`impala_tf.learning.sequences.to_time_major`; the layouts are in the module docstring)."""
        return sequences.to_time_major(batch, self.spec.rollout_fragment_length)

    def _schedules(self) -> tuple[tf.Tensor, tf.Tensor]:
        steps = self.num_agent_steps_trained
        spec = self.spec
        cur_lr = piecewise_linear(spec.lr_schedule, steps, spec.lr)
        entropy_coeff = piecewise_linear(spec.entropy_coeff_schedule, steps, spec.entropy_coeff)
        return cur_lr, entropy_coeff

    def train_step(self, data):
        """Applies one V-trace update to a batch and returns RLlib's learner stats."""
        batch, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        cur_lr, entropy_coeff = self._schedules()
        grads, sums, rows = self._gradients_fn(self.time_major(batch), entropy_coeff)
        return self._apply(grads, sums, rows, cur_lr, entropy_coeff)

    def accumulate_step(self, data) -> tf.Tensor:
        """Adds one microbatch's gradients and loss sums to the accumulators; no update.

        Call it in replica context (`strategy.run`), once per microbatch of a train batch, then
        `apply_accumulated` once. Needs `microbatch_size` in the config.

        Returns:
          int64 scalar, the env steps of this replica's shard of the microbatch.
        """
        if self._accumulators is None:
            raise ValueError("accumulate_step needs `microbatch_size` set in the config")
        batch, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        # The step count only moves in `apply_accumulated`: every microbatch of a train batch
        # sees the entropy coefficient the whole batch would.
        _, entropy_coeff = self._schedules()
        grads, sums, rows = self._gradients_fn(self.time_major(batch), entropy_coeff)
        self._accumulators.add(grads, sums, rows)
        return rows

    def apply_accumulated(self) -> dict[str, tf.Tensor]:
        """Applies the accumulated gradients as one update, zeroes them, returns the stats.

        Call it in replica context after the `accumulate_step`s of one train batch; the update
        and stats are those `train_step` gives on the whole batch.
        """
        if self._accumulators is None:
            raise ValueError("apply_accumulated needs `microbatch_size` set in the config")
        cur_lr, entropy_coeff = self._schedules()
        grads, sums, rows = self._accumulators.read()
        stats = self._apply(grads, sums, rows, cur_lr, entropy_coeff)
        # Automatic control dependencies order these writes after the reads above.
        self._accumulators.reset()
        return stats

    def reset_accumulators(self) -> None:
        """Zeroes the microbatch accumulators (a no-op without `microbatch_size`)."""
        if self._accumulators is not None:
            self._accumulators.reset()

    def _gradients(
        self, batch: dict[str, tf.Tensor], entropy_coeff: tf.Tensor
    ) -> tuple[list[list[tf.Tensor]], losses.LossSums, tf.Tensor]:
        """This replica's loss sums and the gradients of its summed loss, per optimizer group.

        Args:
          batch: Time-major columns ([T, B, ...]) of this replica's sequences.
          entropy_coeff: float32 scalar, the entropy coefficient.

        Returns:
          (grads, sums, rows): for each `(optimizer, variables)` of `self._groups` the list of
          float gradients (zeros where a variable has none); the `LossSums`; int64 env steps.
        """
        spec = self.spec
        rows = tf.cast(tf.size(batch["rewards"]), tf.int64)
        mask, sequence_ends = None, None
        if any(k.startswith(sequences.STATE_PREFIX) for k in batch):
            # RLlib's `max_seq_len`: sequences of at most L steps from their recorded start states.
            batch, mask, sequence_ends = sequences.chunk_time_major(batch, spec.max_seq_len)
        terminateds = tf.cast(batch["terminateds"], tf.bool)
        truncateds = tf.cast(batch["truncateds"], tf.bool)
        dones = tf.logical_or(terminateds, truncateds)
        # The stored initial state already starts each sequence; reset after each episode end.
        resets = tf.concat([tf.zeros_like(dones[:1]), dones[:-1]], axis=0)
        state = tuple(
            batch[k] for k in sorted(k for k in batch if k.startswith(sequences.STATE_PREFIX))
        )

        with tf.GradientTape(persistent=len(self._groups) > 1) as tape:
            logits, values, _ = self.model.unroll(batch["obs"], resets, state, training=True)
            inputs = LossInputs(
                batch=batch,
                logits=logits,
                values=values,
                resets=resets,
                state=state,
                terminateds=terminateds,
                # A sequence's end bootstraps from the next value as a truncation does.
                truncateds=(
                    truncateds
                    if sequence_ends is None
                    else tf.logical_or(truncateds, sequence_ends)
                ),
                mask=mask,
            )
            group_losses, sums = self.compute_loss(inputs, entropy_coeff)

        grads = []
        for loss, (_, variables) in zip(group_losses, self._groups):
            group = tape.gradient(loss, variables)
            grads.append([tf.zeros_like(v) if g is None else g for g, v in zip(group, variables)])
        del tape
        # The diagnostic's steps are the loss's (`vtrace_drop_last_ts` leaves out the last).
        step_mask = tf.ones_like(logits[..., 0]) if mask is None else tf.cast(mask, tf.float32)
        logit_range = tf.reduce_max(logits, axis=-1) - tf.reduce_min(logits, axis=-1)
        if spec.vtrace_drop_last_ts:
            step_mask, logit_range = step_mask[:-1], logit_range[:-1]
        sums = sums._replace(logit_range=tf.stop_gradient(tf.reduce_sum(step_mask * logit_range)))
        return grads, sums, rows

    def compute_loss(
        self, inputs: LossInputs, entropy_coeff: tf.Tensor
    ) -> tuple[list[tf.Tensor], losses.LossSums]:
        """The loss of one replica's batch: RLlib's summed V-trace loss (`losses.vtrace_loss`).

        Called inside the gradient tape; a subclass (APPO) replaces the loss here.

        Args:
          inputs: The batch and the trained model's outputs on it.
          entropy_coeff: float32 scalar, the entropy coefficient.

        Returns:
          (losses, sums): one scalar loss per `(optimizer, variables)` group (the total loss;
          with `_separate_vf_optimizer` the policy loss and the value loss) and the loss's
          `sums_type` sums.
        """
        actions = inputs.batch["actions"]
        target = distributions.make_distribution(self.action_space, inputs.logits)
        behaviour = self.behaviour_distribution(inputs)
        out = losses.vtrace_loss(
            target_log_probs=target.log_prob(actions),
            behaviour_log_probs=behaviour.log_prob(actions),
            entropy=target.entropy(),
            **self.vtrace_arguments(inputs, entropy_coeff),
        )
        if self._separate_vf:
            return [out.sums.pi_loss - entropy_coeff * out.sums.entropy, out.sums.vf_loss], out.sums
        return [out.total_loss], out.sums

    def behaviour_distribution(self, inputs: LossInputs) -> Any:
        """mu(.|x_t), the distribution of the policy that acted (`action_dist_inputs`)."""
        logits = tf.cast(inputs.batch["action_dist_inputs"], tf.float32)
        return distributions.make_distribution(self.action_space, logits)

    def vtrace_arguments(self, inputs: LossInputs, entropy_coeff: tf.Tensor) -> dict[str, Any]:
        """The arguments every V-trace loss of this learner takes from the batch and the
        settings: values, rewards, episode ends, bootstrap values, mask, discount, rho-bars,
        coefficients and `vtrace_drop_last_ts`."""
        spec, batch = self.spec, inputs.batch
        return dict(
            values=inputs.values,
            rewards=batch["rewards"],
            terminateds=inputs.terminateds,
            truncateds=inputs.truncateds,
            values_bootstrapped=batch["values_bootstrapped"],
            mask=inputs.mask,
            gamma=spec.gamma,
            clip_rho_threshold=spec.vtrace_clip_rho_threshold,
            clip_pg_rho_threshold=spec.vtrace_clip_pg_rho_threshold,
            vf_loss_coeff=spec.vf_loss_coeff,
            entropy_coeff=entropy_coeff,
            drop_last_ts=spec.vtrace_drop_last_ts,
        )

    def gradient_scale(self, sums: Any) -> tf.Tensor | None:
        """What the batch's all-reduced gradient is multiplied by before clipping: None (RLlib's
        IMPALA trains on the sums of its per-step losses). A subclass whose loss is a mean over
        the batch's valid steps returns 1 / `sums.num_valid`."""
        del sums
        return None

    def update_stats(self, sums: Any, entropy_coeff: tf.Tensor) -> dict[str, tf.Tensor]:
        """The stats of one update that the loss decides (`total_loss`; a subclass adds its
        own), from the batch's all-reduced sums. Read after the update is applied."""
        num_valid = tf.maximum(sums.num_valid, 1.0)
        spec = self.spec
        return {
            "total_loss": (
                sums.pi_loss + spec.vf_loss_coeff * sums.vf_loss - entropy_coeff * sums.entropy
            )
            / num_valid
        }

    def after_update(self, sums: Any) -> None:
        """Runs in cross-replica context after each applied update (not after a skipped one),
        with the batch's all-reduced sums. Nothing for IMPALA; APPO updates its target network
        and KL coefficient here."""
        del sums

    def _apply(
        self,
        grads: list[list[tf.Tensor]],
        sums: losses.LossSums,
        rows: tf.Tensor,
        cur_lr: tf.Tensor,
        entropy_coeff: tf.Tensor,
    ) -> dict[str, tf.Tensor]:
        """All-reduces this replica's gradients and sums, clips, applies; returns the stats
        (`impala_tf.learning.gradients`: `all_reduce_update`, then `apply_if_finite`)."""
        ctx = tf.distribute.get_replica_context()
        self.policy_optimizer.learning_rate.assign(cur_lr)
        update = all_reduce_update(
            ctx, grads, sums, rows, self._groups, self.spec.grad_clip, self.gradient_scale
        )
        # Out of replica context, so that the optimizers apply the summed gradients as they are.
        apply = functools.partial(apply_if_finite, groups=self._groups, on_applied=self._count)
        ctx.merge_call(apply, args=(update,))
        sums = update.sums
        num_valid = tf.maximum(sums.num_valid, 1.0)
        return {
            "cur_lr": cur_lr,
            "policy_loss": sums.pi_loss / num_valid,
            "entropy": sums.entropy / num_valid,
            "entropy_coeff": entropy_coeff,
            "var_gnorm": tf.linalg.global_norm(self.model.trainable_variables),
            "vf_loss": sums.vf_loss / num_valid,
            "vf_explained_var": losses.explained_variance(sums),
            "grad_gnorm": tf.linalg.global_norm([g for group in update.groups for g in group]),
            "grad_gnorm_unclipped": update.grad_gnorm_unclipped,
            **self.update_stats(sums, entropy_coeff),
            "num_agent_steps_trained": self.num_agent_steps_trained.read_value(),
            "num_grad_updates_lifetime": self.num_grad_updates.read_value(),
            # DIAGNOSTIC_KEYS (ours).
            "mean_rho": sums.rho / num_valid,
            "max_rho": sums.rho_max,
            "rho_clipped_frac": sums.rho_clipped / num_valid,
            "pg_rho_clipped_frac": sums.pg_rho_clipped / num_valid,
            "pg_advantage_mean": sums.pg_adv / num_valid,
            "pg_advantage_std": tf.sqrt(
                tf.maximum(sums.pg_adv_sq / num_valid - tf.square(sums.pg_adv / num_valid), 0.0)
            ),
            "vf_error_mean": sums.err / num_valid,
            "logit_range_mean": sums.logit_range / num_valid,
            # float32 (1.0: skipped), as Keras' `fit` averages every stat over replicas.
            "update_skipped": 1.0 - tf.cast(update.finite, tf.float32),
        }

    def checkpoint_parts(self) -> dict[str, Any]:
        """What a checkpoint holds of this learner, by part name (`tf.train.Checkpoint` keys):
        the model, the optimizers and the step counters."""
        parts = {
            "model": self.model,
            "policy_optimizer": self.policy_optimizer,
            "num_grad_updates": self.num_grad_updates,
            "num_agent_steps_trained": self.num_agent_steps_trained,
        }
        if self.value_optimizer is not None:
            parts["value_optimizer"] = self.value_optimizer
        return parts

    def state_variables(self) -> list[tf.Variable]:
        """The variables one update changes: model, optimizer state, step counters."""
        variables = list(self.model.variables)
        for optimizer, _ in self._groups:
            variables.extend(optimizer.variables)
        return [*variables, self.num_grad_updates, self.num_agent_steps_trained]

    def _count(self, rows: tf.Tensor, sums: Any) -> None:
        """After an applied update (cross-replica context): counts it and its `rows` env steps,
        then `after_update` with the batch's all-reduced `sums`."""
        self.num_grad_updates.assign_add(1)
        self.num_agent_steps_trained.assign_add(rows)
        self.after_update(sums)

    # Convenience for non-Keras callers ------------------------------------------------------

    def get_policy_weights(self) -> list[np.ndarray]:
        """The model's weights as numpy arrays (what the actors receive)."""
        return self.model.get_weights()

    def set_policy_weights(self, weights: list[np.ndarray]) -> None:
        """Sets the model's weights from `get_policy_weights()` output."""
        self.model.set_weights(weights)
