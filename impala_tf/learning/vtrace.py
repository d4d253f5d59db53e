"""V-trace off-policy value targets and policy-gradient advantages, as pure tensor ops.

Implements section 4 of Espeholt et al., 2018, "IMPALA: Scalable Distributed Deep-RL with
Importance Weighted Actor-Learner Architectures", with the public API of RLlib's `vtrace_tf`
(itself from DeepMind's scalable_agent): tensors in, namedtuples out; no variables, no state.

Shapes: T is time, B is batch. Per-step inputs are time-major `[T, B, ...]`: any number of
trailing dimensions is allowed, as long as `log_rhos`, `discounts`, `rewards` and `values` share
one rank r >= 2 and `bootstrap_value` has rank r - 1 (`[B, ...]`). Their shapes broadcast, as in
DeepMind's scalable_agent and trfl: `log_rhos` and `discounts` [T, B, 1] with `rewards` and
`values` [T, B, k] give targets [T, B, k]. A wrong rank raises a `ValueError` whose message holds
the peers' "must have rank r". Logits are `[T, B, A]` (A is the
number of actions of one categorical component) with `[T, B]` integer actions; any rank >= 2 for
logits works, with actions one rank less.

With rho_t = pi(a_t|x_t) / mu(a_t|x_t), rho-bar = `clip_rho_threshold`, c-bar = 1 and gamma_t the
per-step discount (gamma * (1 - terminated_t), already applied by the caller):

    delta_t = min(rho-bar, rho_t) * (r_t + gamma_t V(x_{t+1}) - V(x_t))
    v_s - V(x_s) = delta_s + gamma_s c_s (v_{s+1} - V(x_{s+1})),  c_s = min(1, rho_s)
    pg_advantage_s = min(rho-bar_pg, rho_s) * (r_s + gamma_s v_{s+1} - V(x_s))

where V(x_T) = v_T = `bootstrap_value`. As in RLlib, c_s clips the unclipped rho_s.

The reverse recursion acc_t = delta_t + a_t acc_{t+1} (acc_t = v_t - V(x_t), a_t = gamma_t c_t)
is the only sequential part; `impala_tf.learning.recursion` computes it (a log-depth doubling
scan, or under XLA a sequential loop; `scan_vtrace_baseline` uses RLlib's `tf.scan`).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import tensorflow as tf

from impala_tf.learning.recursion import reverse_recursion, scan_recursion

__all__ = [
    "VTraceFromLogitsReturns",
    "VTraceReturns",
    "from_importance_weights",
    "from_logits",
    "log_probs_from_logits_and_actions",
    "multi_from_logits",
    "multi_log_probs_from_logits_and_actions",
    "scan_vtrace_baseline",
]

VTraceReturns = collections.namedtuple("VTraceReturns", ["vs", "pg_advantages"])
VTraceReturns.__doc__ = """V-trace targets.

Attributes:
    vs: float [T, B, ...], the V-trace value targets v_s (no gradient).
    pg_advantages: float [T, B, ...], the policy-gradient advantages
        rho_pg_s * (r_s + gamma_s v_{s+1} - V(x_s)) (no gradient).
"""

VTraceFromLogitsReturns = collections.namedtuple(
    "VTraceFromLogitsReturns",
    ["vs", "pg_advantages", "log_rhos", "behaviour_action_log_probs", "target_action_log_probs"],
)
VTraceFromLogitsReturns.__doc__ = """V-trace targets computed from policy logits.

Attributes:
    vs: float [T, B], the V-trace value targets v_s (no gradient).
    pg_advantages: float [T, B], the policy-gradient advantages (no gradient).
    log_rhos: float [T, B], log pi(a_t|x_t) - log mu(a_t|x_t) summed over action components.
    behaviour_action_log_probs: log mu(a_t|x_t): a float [T, B] tensor from `from_logits`; a list
        of per-component [T, B] tensors from `multi_from_logits`.
    target_action_log_probs: log pi(a_t|x_t), in the same form as `behaviour_action_log_probs`.
"""


def log_probs_from_logits_and_actions(policy_logits: tf.Tensor, actions: tf.Tensor) -> tf.Tensor:
    """Returns the categorical log-probabilities of `actions` under `policy_logits`.

    Args:
        policy_logits: float [T, B, A], unnormalised log-probabilities of each of A actions
            (any rank >= 2).
        actions: int [T, B], the actions taken a_t (rank of `policy_logits` minus one).

    Returns:
        float [T, B] (the shape of `actions`): log pi(a_t|x_t).

    Raises:
        ValueError: if the ranks of `policy_logits` and `actions` do not match.
    """
    return multi_log_probs_from_logits_and_actions([policy_logits], [actions])[0]


def multi_log_probs_from_logits_and_actions(
    policy_logits: Sequence[tf.Tensor], actions: Sequence[tf.Tensor]
) -> list[tf.Tensor]:
    """Returns per-component log-probabilities of a MultiDiscrete action.

    Args:
        policy_logits: list of float [T, B, A_i], the logits of each action component i
            (any rank >= 2).
        actions: list of int [T, B], the action a_t^i taken in each component.

    Returns:
        List of float [T, B]: log pi_i(a_t^i|x_t) for each component i.

    Raises:
        ValueError: if the lists are empty or differ in length, or a component's ranks disagree.
    """
    policy_logits, actions = list(policy_logits), list(actions)
    if not policy_logits or len(policy_logits) != len(actions):
        raise ValueError(
            "policy_logits and actions must be non-empty lists of equal length (one entry per "
            f"action component); got {len(policy_logits)} logits and {len(actions)} actions."
        )
    log_probs = []
    for i, (logits, action) in enumerate(zip(policy_logits, actions, strict=True)):
        logits = _as_float(logits, _float_dtype_of(logits))
        action = tf.convert_to_tensor(action)
        if action.dtype not in (tf.int32, tf.int64):
            action = tf.cast(action, tf.int32)
        if logits.shape.rank is None or action.shape.rank is None:
            raise ValueError(f"Component {i}: logits and actions need a known rank.")
        if logits.shape.rank < 2 or action.shape.rank != logits.shape.rank - 1:
            raise ValueError(
                f"Component {i}: policy_logits must have rank >= 2 ([T, B, num_actions]) and "
                f"actions one rank less ([T, B]); got logits {logits.shape} and actions "
                f"{action.shape}."
            )
        log_probs.append(
            -tf.nn.sparse_softmax_cross_entropy_with_logits(labels=action, logits=logits)
        )
    return log_probs


def from_logits(
    behaviour_policy_logits: tf.Tensor,
    target_policy_logits: tf.Tensor,
    actions: tf.Tensor,
    discounts: tf.Tensor,
    rewards: tf.Tensor,
    values: tf.Tensor,
    bootstrap_value: tf.Tensor,
    clip_rho_threshold: float | tf.Tensor | None = 1.0,
    clip_pg_rho_threshold: float | tf.Tensor | None = 1.0,
) -> VTraceFromLogitsReturns:
    """Computes V-trace for a categorical policy from behaviour and target logits.

    Args:
        behaviour_policy_logits: float [T, B, A], logits of the behaviour policy mu.
        target_policy_logits: float [T, B, A], logits of the target policy pi.
        actions: int [T, B], actions a_t sampled from mu.
        discounts: float [T, B], gamma_t = gamma * (1 - terminated_t).
        rewards: float [T, B], rewards r_t.
        values: float [T, B], value estimates V(x_t) under pi.
        bootstrap_value: float [B], V(x_T).
        clip_rho_threshold: scalar rho-bar, or None for no clipping.
        clip_pg_rho_threshold: scalar rho-bar_pg for the advantages, or None for no clipping.

    Returns:
        A `VTraceFromLogitsReturns` whose log-probabilities are [T, B] tensors.

    Raises:
        ValueError: on inconsistent ranks or static shapes.
    """
    returns = multi_from_logits(
        [behaviour_policy_logits],
        [target_policy_logits],
        [actions],
        discounts,
        rewards,
        values,
        bootstrap_value,
        clip_rho_threshold=clip_rho_threshold,
        clip_pg_rho_threshold=clip_pg_rho_threshold,
    )
    return returns._replace(
        behaviour_action_log_probs=returns.behaviour_action_log_probs[0],
        target_action_log_probs=returns.target_action_log_probs[0],
    )


def multi_from_logits(
    behaviour_policy_logits: Sequence[tf.Tensor],
    target_policy_logits: Sequence[tf.Tensor],
    actions: Sequence[tf.Tensor],
    discounts: tf.Tensor,
    rewards: tf.Tensor,
    values: tf.Tensor,
    bootstrap_value: tf.Tensor,
    behaviour_action_log_probs: tf.Tensor | None = None,
    clip_rho_threshold: float | tf.Tensor | None = 1.0,
    clip_pg_rho_threshold: float | tf.Tensor | None = 1.0,
) -> VTraceFromLogitsReturns:
    """Computes V-trace for a MultiDiscrete policy from per-component logits.

    log_rhos is the sum over components of log pi_i(a_t^i) - log mu_i(a_t^i). Unlike RLlib, which
    uses `behaviour_action_log_probs` only for a single component, a given
    `behaviour_action_log_probs` is always used as the joint log mu(a_t|x_t) and the behaviour
    logits are then not read.

    Args:
        behaviour_policy_logits: list of float [T, B, A_i], logits of mu per component.
        target_policy_logits: list of float [T, B, A_i], logits of pi per component.
        actions: list of int [T, B], the action component a_t^i taken.
        discounts: float [T, B], gamma_t = gamma * (1 - terminated_t).
        rewards: float [T, B], rewards r_t.
        values: float [T, B], value estimates V(x_t) under pi.
        bootstrap_value: float [B], V(x_T).
        behaviour_action_log_probs: optional float [T, B], log mu(a_t|x_t) recorded by the actor
            (RLlib's `action_logp`).
        clip_rho_threshold: scalar rho-bar, or None for no clipping.
        clip_pg_rho_threshold: scalar rho-bar_pg for the advantages, or None for no clipping.

    Returns:
        A `VTraceFromLogitsReturns` whose log-probabilities are lists of per-component [T, B]
        tensors (a single-entry list holding the given joint `behaviour_action_log_probs`).

    Raises:
        ValueError: on empty or mismatched lists, inconsistent ranks or static shapes.
    """
    target_action_log_probs = multi_log_probs_from_logits_and_actions(target_policy_logits, actions)
    if behaviour_action_log_probs is None:
        if len(list(behaviour_policy_logits)) != len(target_action_log_probs):
            raise ValueError(
                "behaviour_policy_logits and target_policy_logits must have one entry per action "
                f"component; got {len(list(behaviour_policy_logits))} and "
                f"{len(target_action_log_probs)}."
            )
        behaviour_log_probs = multi_log_probs_from_logits_and_actions(
            behaviour_policy_logits, actions
        )
    else:
        behaviour_log_probs = [
            _as_float(behaviour_action_log_probs, target_action_log_probs[0].dtype)
        ]
    log_rhos = tf.math.add_n(target_action_log_probs) - tf.math.add_n(behaviour_log_probs)
    returns = from_importance_weights(
        log_rhos,
        discounts,
        rewards,
        values,
        bootstrap_value,
        clip_rho_threshold=clip_rho_threshold,
        clip_pg_rho_threshold=clip_pg_rho_threshold,
    )
    return VTraceFromLogitsReturns(
        vs=returns.vs,
        pg_advantages=returns.pg_advantages,
        log_rhos=log_rhos,
        behaviour_action_log_probs=behaviour_log_probs,
        target_action_log_probs=target_action_log_probs,
    )


def from_importance_weights(
    log_rhos: tf.Tensor,
    discounts: tf.Tensor,
    rewards: tf.Tensor,
    values: tf.Tensor,
    bootstrap_value: tf.Tensor,
    clip_rho_threshold: float | tf.Tensor | None = 1.0,
    clip_pg_rho_threshold: float | tf.Tensor | None = 1.0,
) -> VTraceReturns:
    """Computes V-trace targets and advantages from log importance weights.

    Computation runs in the dtype of `log_rhos` when it is a floating `tf.Tensor` (e.g. float64),
    else in float32; the other inputs are cast to it.

    Args:
        log_rhos: float [T, B, ...], log(pi(a_t|x_t) / mu(a_t|x_t)), i.e. log rho_t.
        discounts: float [T, B, ...], gamma_t: the discount with the termination cut applied.
        rewards: float [T, B, ...], r_t.
        values: float [T, B, ...], V(x_t) under the target policy.
        bootstrap_value: float [B, ...], V(x_T).
        clip_rho_threshold: scalar rho-bar clipping the weights of the value targets, or None.
        clip_pg_rho_threshold: scalar rho-bar_pg clipping the advantages' weights, or None.

    Returns:
        `VTraceReturns(vs, pg_advantages)`, both float [T, B, ...] wrapped in `tf.stop_gradient`.

    Raises:
        ValueError: on inconsistent ranks or static shapes, or non-scalar thresholds.
    """
    inputs = _prepare(
        log_rhos, discounts, rewards, values, bootstrap_value, clip_rho_threshold,
        clip_pg_rho_threshold,
    )  # fmt: skip
    return _vtrace(*inputs, recursion=reverse_recursion)


def scan_vtrace_baseline(
    log_rhos: tf.Tensor,
    discounts: tf.Tensor,
    rewards: tf.Tensor,
    values: tf.Tensor,
    bootstrap_value: tf.Tensor,
    clip_rho_threshold: float | tf.Tensor | None = 1.0,
    clip_pg_rho_threshold: float | tf.Tensor | None = 1.0,
) -> VTraceReturns:
    """`from_importance_weights` as RLlib computes it: `tf.scan` with `parallel_iterations=1`.

    Kept as the reference formulation for tests and `tools/bench_vtrace.py`; same arguments and
    returns as `from_importance_weights`.
    """
    inputs = _prepare(
        log_rhos, discounts, rewards, values, bootstrap_value, clip_rho_threshold,
        clip_pg_rho_threshold,
    )  # fmt: skip
    return _vtrace(*inputs, recursion=scan_recursion)


def _vtrace(
    log_rhos, discounts, rewards, values, bootstrap_value, rho_bar, pg_rho_bar, recursion
) -> VTraceReturns:
    # No gradient flows through the targets, so none is traced through the recursion either
    # (which also keeps XLA's while loop free of gradient accumulators).
    log_rhos, discounts, rewards, values, bootstrap_value = (
        tf.stop_gradient(x) for x in (log_rhos, discounts, rewards, values, bootstrap_value)
    )
    # Broadcast inputs (e.g. [T, B, 1] rhos against [T, B, k] values) meet in one full shape.
    full_shape = tf.shape(log_rhos)
    for x in (discounts, rewards, values, tf.expand_dims(bootstrap_value, 0)):
        full_shape = tf.broadcast_dynamic_shape(full_shape, tf.shape(x))
    values = tf.broadcast_to(values, full_shape)
    bootstrap_value = tf.broadcast_to(bootstrap_value, full_shape[1:])
    rhos = tf.exp(log_rhos)
    clipped_rhos = rhos if rho_bar is None else tf.minimum(rho_bar, rhos)
    cs = tf.minimum(tf.ones([], rhos.dtype), rhos)
    bootstrap_row = tf.expand_dims(bootstrap_value, 0)
    values_tp1 = tf.concat([values[1:], bootstrap_row], axis=0)
    deltas = clipped_rhos * (rewards + discounts * values_tp1 - values)
    trace = tf.broadcast_to(discounts * cs, full_shape)
    vs = values + recursion(trace, tf.broadcast_to(deltas, full_shape))
    vs_tp1 = tf.concat([vs[1:], bootstrap_row], axis=0)
    pg_rhos = rhos if pg_rho_bar is None else tf.minimum(pg_rho_bar, rhos)
    pg_advantages = pg_rhos * (rewards + discounts * vs_tp1 - values)
    return VTraceReturns(vs=tf.stop_gradient(vs), pg_advantages=tf.stop_gradient(pg_advantages))


def _float_dtype_of(x) -> tf.DType:
    if isinstance(x, (tf.Tensor, tf.Variable)) and x.dtype.is_floating:
        return x.dtype
    return tf.float32


def _as_float(x, dtype: tf.DType) -> tf.Tensor:
    x = tf.convert_to_tensor(x)
    return x if x.dtype == dtype else tf.cast(x, dtype)


def _prepare(
    log_rhos, discounts, rewards, values, bootstrap_value, clip_rho_threshold, clip_pg_rho_threshold
):
    """Converts the inputs to one float dtype and checks their ranks and static shapes."""
    dtype = _float_dtype_of(log_rhos)
    log_rhos, discounts, rewards, values, bootstrap_value = (
        _as_float(x, dtype) for x in (log_rhos, discounts, rewards, values, bootstrap_value)
    )
    rank = log_rhos.shape.rank
    if rank is None or rank < 2:
        raise ValueError(
            f"log_rhos must have a known rank >= 2 ([T, B, ...]); got {log_rhos.shape}."
        )
    # The peers' messages ("Shape ... must have rank r", TensorShape.assert_has_rank's wording),
    # which their tests match.
    for name, x in (("values", values), ("discounts", discounts), ("rewards", rewards)):
        if x.shape.rank != rank:
            raise ValueError(
                f"{name}: Shape {x.shape} must have rank {rank} (the rank of log_rhos, "
                "[T, B, ...])."
            )
    if bootstrap_value.shape.rank != rank - 1:
        raise ValueError(
            f"bootstrap_value: Shape {bootstrap_value.shape} must have rank {rank - 1} (that of "
            "values minus the time axis)."
        )
    # Trailing dimensions broadcast, as in scalable_agent and trfl: e.g. log_rhos and discounts
    # [T, B, 1] with rewards and values [T, B, k].
    full = log_rhos.shape
    for name, x in (("discounts", discounts), ("rewards", rewards), ("values", values)):
        try:
            full = tf.broadcast_static_shape(full, x.shape)
        except ValueError:
            raise ValueError(
                f"{name} shape {x.shape} does not broadcast with log_rhos' and the other "
                f"per-step inputs' shape {full}."
            ) from None
    try:
        tf.broadcast_static_shape(full[1:], bootstrap_value.shape)
    except ValueError:
        raise ValueError(
            f"bootstrap_value shape {bootstrap_value.shape} does not broadcast with the per-step "
            f"shape without the time axis, {full[1:]}."
        ) from None
    thresholds = []
    for name, threshold in (
        ("clip_rho_threshold", clip_rho_threshold),
        ("clip_pg_rho_threshold", clip_pg_rho_threshold),
    ):
        if threshold is not None:
            threshold = _as_float(threshold, dtype)
            if threshold.shape.rank != 0:
                raise ValueError(f"{name} must be a scalar or None; got shape {threshold.shape}.")
        thresholds.append(threshold)
    return (log_rhos, discounts, rewards, values, bootstrap_value, *thresholds)
