"""APPO's loss: PPO's clipped surrogate on V-trace advantages taken against a target network.

Time-major tensors, T time by B batch, as `impala_tf.learning.losses`. With pi the policy
being trained, pi_t the target network (a lagged copy of pi, no gradient), mu the policy that
acted, epsilon = `clip_param` and m the valid steps (RLlib's APPO learner and old-stack TF policy):

    V-trace with pi_t as its target policy: log rho = log pi_t(a|x) - log mu(a|x)
        -> value targets v_s and advantages A_s (no gradient)
    w_t     = clip(mu(a|x) / pi_t(a|x), 0, `target_worker_clipping`)
    ratio_t = w_t * pi(a|x) / mu(a|x)            (pi / pi_t when w_t is not clipped)
    policy  = -mean_m min(A_t ratio_t, A_t clip(ratio_t, 1 - epsilon, 1 + epsilon))
    value   = 0.5 mean_m (V(x_t) - v_t)^2
    entropy = mean_m H[pi(.|x_t)]
    kl      = mean_m KL(pi_t(.|x_t) || pi(.|x_t))
    total   = policy + vf_loss_coeff value - entropy_coeff entropy [+ kl_coeff kl]

The terms are means over the valid steps, as in RLlib's APPO (IMPALA's are sums). This module
returns the sums (`AppoSums`), which the learner all-reduces across devices and accumulates
across microbatches as IMPALA's; the learner then divides the summed gradient by the batch's
valid steps (`AppoLearner.gradient_scale`), which gives the gradient of the means. The
truncation and sequence-end handling is IMPALA's (`impala_tf.learning.losses.prepare_steps`).
"""

from __future__ import annotations

import collections

import tensorflow as tf

from impala_tf.learning import losses

__all__ = ["AppoSums", "appo_loss"]

#: `impala_tf.learning.losses.LossSums`' fields plus APPO's: `kl` (sum of KL(pi_t || pi)),
#: `kl_penalty` (kl_coeff x kl when `use_kl_loss`, else 0), `is_ratio` and `is_ratio_sq`
#: (of the clipped weight w_t) and `ratio_clipped` (the steps whose ratio fell outside
#: [1 - epsilon, 1 + epsilon]). `pi_loss` is the negated surrogate's sum.
AppoSums = collections.namedtuple(
    "AppoSums",
    [*losses.LossSums._fields, "kl", "kl_penalty", "is_ratio", "is_ratio_sq", "ratio_clipped"],
)


def appo_loss(
    *,
    target_log_probs: tf.Tensor,
    old_log_probs: tf.Tensor,
    behaviour_log_probs: tf.Tensor,
    entropy: tf.Tensor,
    kl: tf.Tensor,
    values: tf.Tensor,
    rewards: tf.Tensor,
    terminateds: tf.Tensor,
    truncateds: tf.Tensor,
    values_bootstrapped: tf.Tensor,
    mask: tf.Tensor | None = None,
    gamma: float = 0.99,
    clip_param: float = 0.4,
    target_worker_clipping: float = 2.0,
    clip_rho_threshold: float | None = 1.0,
    clip_pg_rho_threshold: float | None = 1.0,
    vf_loss_coeff: float | tf.Tensor = 0.5,
    entropy_coeff: float | tf.Tensor = 0.01,
    kl_coeff: float | tf.Tensor | None = None,
    drop_last_ts: bool = False,
) -> tuple[tf.Tensor, AppoSums]:
    """Computes APPO's loss, summed over the valid steps (module docstring).

    Args:
      target_log_probs: float32 [T, B], log pi(a_t|x_t) of the policy being trained.
      old_log_probs: float32 [T, B], log pi_t(a_t|x_t) of the target network (no gradient
        flows into it).
      behaviour_log_probs: float32 [T, B], log mu(a_t|x_t) of the policy that acted.
      entropy: float32 [T, B], H[pi(.|x_t)].
      kl: float32 [T, B], KL(pi_t(.|x_t) || pi(.|x_t)).
      values: float32 [T, B], V(x_t) of the value function being trained.
      rewards: float32 [T, B].
      terminateds: bool [T, B].
      truncateds: bool [T, B].
      values_bootstrapped: float32 [T, B] (`impala_tf.learning.losses.vtrace_loss`).
      mask: float32 or bool [T, B] of valid steps, or None for all valid.
      gamma: The discount (`gamma`).
      clip_param: epsilon (`clip_param`).
      target_worker_clipping: The bound of w_t (`target_worker_clipping`).
      clip_rho_threshold: V-trace's rho-bar (`vtrace_clip_rho_threshold`).
      clip_pg_rho_threshold: Its advantage's rho-bar (`vtrace_clip_pg_rho_threshold`).
      vf_loss_coeff: The value loss's weight (`vf_loss_coeff`).
      entropy_coeff: The entropy bonus's weight (`entropy_coeff`).
      kl_coeff: The KL penalty's weight, or None for no penalty (`use_kl_loss=False`).
      drop_last_ts: RLlib's legacy `vtrace_drop_last_ts`.

    Returns:
      (total, sums): the summed total loss (divide by `sums.num_valid` for the mean) and the
      `AppoSums`.
    """
    steps = losses.prepare_steps(
        {
            "target": target_log_probs,
            "old": tf.stop_gradient(old_log_probs),
            "behaviour": behaviour_log_probs,
            "entropy": entropy,
            "kl": kl,
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
    c, mask, values = steps.columns, steps.mask, steps.values
    behaviour = tf.stop_gradient(c["behaviour"])
    log_rhos = c["old"] - behaviour
    returns = steps.vtrace(log_rhos, clip_rho_threshold, clip_pg_rho_threshold)
    advantages = returns.pg_advantages
    is_ratio = tf.clip_by_value(tf.exp(behaviour - c["old"]), 0.0, target_worker_clipping)
    ratio = is_ratio * tf.exp(c["target"] - behaviour)
    clipped_ratio = tf.clip_by_value(ratio, 1.0 - clip_param, 1.0 + clip_param)
    surrogate = tf.minimum(advantages * ratio, advantages * clipped_ratio)
    kl_sum = tf.reduce_sum(mask * c["kl"])
    kl_penalty = tf.constant(0.0) if kl_coeff is None else kl_coeff * kl_sum
    common = losses.vtrace_sums(
        policy_loss=-surrogate,
        entropy=c["entropy"],
        values=values,
        mask=mask,
        log_rhos=log_rhos,
        returns=returns,
        clip_rho_threshold=clip_rho_threshold,
        clip_pg_rho_threshold=clip_pg_rho_threshold,
    )
    sums = AppoSums(
        **common._asdict(),
        kl=kl_sum,
        kl_penalty=kl_penalty,
        is_ratio=tf.stop_gradient(tf.reduce_sum(mask * is_ratio)),
        is_ratio_sq=tf.stop_gradient(tf.reduce_sum(mask * tf.square(is_ratio))),
        ratio_clipped=tf.stop_gradient(
            tf.reduce_sum(mask * tf.cast(tf.abs(ratio - 1.0) > clip_param, tf.float32))
        ),
    )
    total = sums.pi_loss + vf_loss_coeff * sums.vf_loss - entropy_coeff * sums.entropy + kl_penalty
    return total, sums
