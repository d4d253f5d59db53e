"""The V-trace actor-critic loss of RLlib's legacy TF IMPALA policy (`VTraceLoss`), as pure tensors.

Everything here is time-major: T is time (the rollout fragment length), B is batch (the number of
env sequences). The loss holds no variables; the learner calls it inside its `train_step`.

RLlib trains on the SUMS of the per-step losses (its hyper-parameters, e.g. `grad_clip=40`, are
tuned for sums) and reports the MEANS as stats; so do we. Two details differ from RLlib, on
purpose (docs/differences.md):

* A time-limit truncation does not cut the return: the step is bootstrapped from the value of the
  episode's final observation (`values_bootstrapped`), and the trace stops there so the next
  episode's values cannot leak into it.
* Within a fragment, episode boundaries (terminated or truncated) always cut the trace.
"""

from __future__ import annotations

from typing import NamedTuple

import tensorflow as tf

from impala_tf.learning import vtrace

__all__ = [
    "LossOutputs",
    "LossSums",
    "Steps",
    "count_above",
    "explained_variance",
    "prepare_steps",
    "vtrace_loss",
    "vtrace_sums",
]


class LossSums(NamedTuple):
    """Sums over the valid steps of a (per-replica) batch: what is all-reduced across devices.

    Attributes:
      pi_loss: float32 scalar, -sum(m * log pi(a_t|x_t) * A_t) with A_t the V-trace pg advantage.
      vf_loss: float32 scalar, 0.5 * sum(m * (V(x_t) - v_t)^2).
      entropy: float32 scalar, sum(m * H[pi(.|x_t)]).
      num_valid: float32 scalar, sum(m): the number of valid steps.
      vs: float32 scalar, sum(m * v_t) (for the explained variance).
      vs_sq: float32 scalar, sum(m * v_t^2).
      err: float32 scalar, sum(m * (v_t - V(x_t))).
      err_sq: float32 scalar, sum(m * (v_t - V(x_t))^2).
      rho: float32 scalar, sum(m * rho_t), rho_t = pi(a_t|x_t) / mu(a_t|x_t) (a diagnostic).
      rho_clipped: float32 scalar, the valid steps whose rho_t exceeds `clip_rho_threshold`.
      pg_rho_clipped: float32 scalar, those whose rho_t exceeds `clip_pg_rho_threshold`.
      pg_adv: float32 scalar, sum(m * A_t) of the policy-gradient advantages.
      pg_adv_sq: float32 scalar, sum(m * A_t^2).
      logit_range: float32 scalar, sum(m * (max - min) of the logits of x_t); the caller fills
        it in (`vtrace_loss` does not see the logits).
      rho_max: float32 scalar, the largest rho_t of the valid steps (0 without one). The one
        field that is not a sum: accumulating and all-reducing take its maximum (`MAX_FIELDS`).
    """

    pi_loss: tf.Tensor
    vf_loss: tf.Tensor
    entropy: tf.Tensor
    num_valid: tf.Tensor
    vs: tf.Tensor
    vs_sq: tf.Tensor
    err: tf.Tensor
    err_sq: tf.Tensor
    rho: tf.Tensor | float = 0.0
    rho_clipped: tf.Tensor | float = 0.0
    pg_rho_clipped: tf.Tensor | float = 0.0
    pg_adv: tf.Tensor | float = 0.0
    pg_adv_sq: tf.Tensor | float = 0.0
    logit_range: tf.Tensor | float = 0.0
    rho_max: tf.Tensor | float = 0.0


#: The `LossSums` fields combined by maximum, not by sum, across microbatches and replicas.
MAX_FIELDS = ("rho_max",)


class LossOutputs(NamedTuple):
    """What `vtrace_loss` returns.

    Attributes:
      total_loss: float32 scalar, pi_loss + vf_loss_coeff * vf_loss - entropy_coeff * entropy
        (of the sums).
      sums: `LossSums` of this batch.
      vs: float32 [T, B], the V-trace value targets v_s (no gradient).
      pg_advantages: float32 [T, B], the policy-gradient advantages (no gradient).
    """

    total_loss: tf.Tensor
    sums: LossSums
    vs: tf.Tensor
    pg_advantages: tf.Tensor


def vtrace_loss(
    *,
    target_log_probs: tf.Tensor,
    behaviour_log_probs: tf.Tensor,
    entropy: tf.Tensor,
    values: tf.Tensor,
    rewards: tf.Tensor,
    terminateds: tf.Tensor,
    truncateds: tf.Tensor,
    values_bootstrapped: tf.Tensor,
    mask: tf.Tensor | None = None,
    gamma: float = 0.99,
    clip_rho_threshold: float | None = 1.0,
    clip_pg_rho_threshold: float | None = 1.0,
    vf_loss_coeff: float | tf.Tensor = 0.5,
    entropy_coeff: float | tf.Tensor = 0.01,
    drop_last_ts: bool = False,
) -> LossOutputs:
    """Computes RLlib's V-trace loss on a time-major batch.

    Args:
      target_log_probs: float32 [T, B], log pi(a_t|x_t) under the policy being trained.
      behaviour_log_probs: float32 [T, B], log mu(a_t|x_t) under the policy that acted.
      entropy: float32 [T, B], the entropy of pi(.|x_t).
      values: float32 [T, B], V(x_t) of the value function being trained.
      rewards: float32 [T, B], r_t.
      terminateds: bool [T, B], the episode ended in a terminal state at step t.
      truncateds: bool [T, B], the episode was cut (time limit) at step t.
      values_bootstrapped: float32 [T, B], the behaviour value of the observation after step t in
        the same episode (0 after a termination, V(final observation) after a truncation). Its last
        row is the bootstrap value of each sequence.
      mask: float32 or bool [T, B] of valid steps (sequence padding), or None for all valid.
      gamma: The discount factor gamma (RLlib `gamma`).
      clip_rho_threshold: rho-bar (RLlib `vtrace_clip_rho_threshold`); None for no clipping.
      clip_pg_rho_threshold: rho-bar for the pg advantage (`vtrace_clip_pg_rho_threshold`).
      vf_loss_coeff: Weight of the value loss in the total loss (`vf_loss_coeff`).
      entropy_coeff: Weight of the entropy bonus (`entropy_coeff`).
      drop_last_ts: RLlib's legacy `vtrace_drop_last_ts`: train on the first T-1 steps and
        bootstrap from the trained value function at step T-1.

    Returns:
      `LossOutputs` with the total (summed) loss, the sums for stats and the V-trace targets.
    """
    steps = prepare_steps(
        {
            "target_log_probs": target_log_probs,
            "behaviour_log_probs": behaviour_log_probs,
            "entropy": entropy,
        },
        values=values,
        rewards=rewards,
        terminateds=terminateds,
        truncateds=truncateds,
        values_bootstrapped=values_bootstrapped,
        mask=mask,
        gamma=gamma,
        drop_last_ts=drop_last_ts,
    )
    target_log_probs = steps.columns["target_log_probs"]
    behaviour_log_probs = steps.columns["behaviour_log_probs"]
    entropy = steps.columns["entropy"]
    values, mask = steps.values, steps.mask
    log_rhos = target_log_probs - behaviour_log_probs
    returns = steps.vtrace(log_rhos, clip_rho_threshold, clip_pg_rho_threshold)
    vs, pg_advantages = returns.vs, returns.pg_advantages
    sums = vtrace_sums(
        policy_loss=-target_log_probs * pg_advantages,
        entropy=entropy,
        values=values,
        mask=mask,
        log_rhos=log_rhos,
        returns=returns,
        clip_rho_threshold=clip_rho_threshold,
        clip_pg_rho_threshold=clip_pg_rho_threshold,
    )
    total = sums.pi_loss + vf_loss_coeff * sums.vf_loss - entropy_coeff * sums.entropy
    return LossOutputs(total_loss=total, sums=sums, vs=vs, pg_advantages=pg_advantages)


class Steps(NamedTuple):
    """A time-major batch made ready for V-trace (`prepare_steps`).

    Attributes:
      columns: The caller's per-step columns, trimmed as the others.
      values: float32 [T', B], V(x_t).
      rewards: float32 [T', B], r_t with a truncation's bootstrap folded in.
      discounts: float32 [T', B], gamma_t (zero where an episode ends).
      mask: float32 [T', B] of valid steps.
      bootstrap_value: float32 [B], the value after each sequence's last step (no gradient).
    """

    columns: dict[str, tf.Tensor]
    values: tf.Tensor
    rewards: tf.Tensor
    discounts: tf.Tensor
    mask: tf.Tensor
    bootstrap_value: tf.Tensor

    def vtrace(
        self,
        log_rhos: tf.Tensor,
        clip_rho_threshold: float | None,
        clip_pg_rho_threshold: float | None,
    ) -> vtrace.VTraceReturns:
        """V-trace targets and pg advantages (no gradient) for `log_rhos` [T', B]."""
        return vtrace.from_importance_weights(
            log_rhos=log_rhos,
            discounts=self.discounts,
            rewards=self.rewards,
            values=self.values,
            bootstrap_value=self.bootstrap_value,
            clip_rho_threshold=clip_rho_threshold,
            clip_pg_rho_threshold=clip_pg_rho_threshold,
        )


def prepare_steps(
    columns: dict[str, tf.Tensor],
    *,
    values: tf.Tensor,
    rewards: tf.Tensor,
    terminateds: tf.Tensor,
    truncateds: tf.Tensor,
    values_bootstrapped: tf.Tensor,
    mask: tf.Tensor | None,
    gamma: float,
    drop_last_ts: bool,
) -> Steps:
    """What every V-trace loss does first (the module docstring's two details).

    A truncated step bootstraps from V(final observation) and cuts the trace; a terminated
    step just cuts it. Folding the bootstrap into the reward keeps V-trace itself unchanged.
    With `drop_last_ts` every per-step tensor (`columns` too) loses its last step, and the
    sequence bootstraps from the trained V at that step (RLlib's `vtrace_drop_last_ts`).

    Args:
      columns: Further per-step [T, B] tensors of the loss, trimmed as the others.
      values: float32 [T, B], V(x_t) of the value function being trained.
      rewards: float32 [T, B], r_t.
      terminateds: bool [T, B].
      truncateds: bool [T, B].
      values_bootstrapped: float32 [T, B] (`vtrace_loss`).
      mask: float32 or bool [T, B] of valid steps, or None for all valid.
      gamma: The discount.
      drop_last_ts: RLlib's legacy `vtrace_drop_last_ts`.
    """
    rewards = tf.cast(rewards, tf.float32)
    values = tf.cast(values, tf.float32)
    values_bootstrapped = tf.cast(values_bootstrapped, tf.float32)
    terminateds = tf.cast(terminateds, tf.float32)
    truncateds = tf.cast(truncateds, tf.float32)
    mask = tf.ones_like(rewards) if mask is None else tf.cast(mask, tf.float32)
    discounts = gamma * (1.0 - tf.maximum(terminateds, truncateds))
    rewards = rewards + gamma * truncateds * (1.0 - terminateds) * values_bootstrapped
    if drop_last_ts:
        bootstrap_value = values[-1]
        values, rewards, discounts, mask = (x[:-1] for x in (values, rewards, discounts, mask))
        columns = {k: v[:-1] for k, v in columns.items()}
    else:
        bootstrap_value = values_bootstrapped[-1]
    return Steps(
        columns=dict(columns),
        values=values,
        rewards=rewards,
        discounts=discounts,
        mask=mask,
        bootstrap_value=tf.stop_gradient(bootstrap_value),
    )


def vtrace_sums(
    *,
    policy_loss: tf.Tensor,
    entropy: tf.Tensor,
    values: tf.Tensor,
    mask: tf.Tensor,
    log_rhos: tf.Tensor,
    returns: vtrace.VTraceReturns,
    clip_rho_threshold: float | None,
    clip_pg_rho_threshold: float | None,
) -> LossSums:
    """The `LossSums` of a V-trace actor-critic loss over the valid steps.

    Args:
      policy_loss: float32 [T', B], the per-step policy loss (IMPALA's -log pi * A; APPO's
        negated surrogate).
      entropy: float32 [T', B], H[pi(.|x_t)].
      values: float32 [T', B], V(x_t) of the value function being trained.
      mask: float32 [T', B] of valid steps.
      log_rhos: float32 [T', B], the log importance ratios V-trace ran with.
      returns: What V-trace returned for them (targets and advantages, no gradient).
      clip_rho_threshold: V-trace's rho-bar (for the clipped-fraction diagnostic).
      clip_pg_rho_threshold: The advantage's rho-bar (likewise).
    """
    vs, advantages = returns.vs, returns.pg_advantages
    err = vs - values
    rhos = tf.exp(tf.stop_gradient(log_rhos))
    return LossSums(
        pi_loss=tf.reduce_sum(mask * policy_loss),
        vf_loss=0.5 * tf.reduce_sum(mask * tf.square(err)),
        entropy=tf.reduce_sum(mask * entropy),
        num_valid=tf.reduce_sum(mask),
        vs=tf.reduce_sum(mask * vs),
        vs_sq=tf.reduce_sum(mask * tf.square(vs)),
        err=tf.stop_gradient(tf.reduce_sum(mask * err)),
        err_sq=tf.stop_gradient(tf.reduce_sum(mask * tf.square(err))),
        rho=tf.reduce_sum(mask * rhos),
        rho_clipped=count_above(rhos, mask, clip_rho_threshold),
        pg_rho_clipped=count_above(rhos, mask, clip_pg_rho_threshold),
        pg_adv=tf.reduce_sum(mask * advantages),
        pg_adv_sq=tf.reduce_sum(mask * tf.square(advantages)),
        logit_range=tf.constant(0.0),
        rho_max=tf.reduce_max(tf.where(mask > 0, rhos, tf.zeros_like(rhos))),
    )


def count_above(rhos: tf.Tensor, mask: tf.Tensor, threshold: float | None) -> tf.Tensor:
    """The valid steps whose rho exceeds `threshold` (0 without a threshold)."""
    if threshold is None:
        return tf.constant(0.0)
    return tf.reduce_sum(mask * tf.cast(rhos > threshold, tf.float32))


def explained_variance(sums: LossSums) -> tf.Tensor:
    """RLlib's `vf_explained_var`: max(-1, 1 - Var(v - V) / Var(v)) over the valid steps."""
    n = tf.maximum(sums.num_valid, 1.0)
    var_vs = sums.vs_sq / n - tf.square(sums.vs / n)
    var_err = sums.err_sq / n - tf.square(sums.err / n)
    return tf.maximum(-1.0, 1.0 - tf.math.divide_no_nan(var_err, var_vs))
