"""The reverse linear recursion acc_t = b_t + a_t acc_{t+1} (acc_T = 0), computed four ways.

This is the only sequential part of V-trace (`impala_tf.learning.vtrace`: a_t = gamma_t c_t,
b_t = delta_t, acc_t = v_t - V(x_t)). Shapes: T is time; `a` and `b` are `[T, ...]` of one
shape, and so is the result.

`reverse_recursion`, what V-trace uses, picks one of two implementations when the graph is built:

* outside XLA (eagerly and in `tf.function`): `doubling_recursion`, a log-depth doubling scan
  (Hillis-Steele on the affine maps x -> b_t + a_t x), ceil(log2 T) vectorised steps. It is exact
  (products of the a_t, no division), so a zero a_t gives exactly zero weight. Python-unrolled
  when T is static; with unknown T, six steps (T <= 64) are unrolled and a `tf.while_loop` does
  the rest.
* inside `tf.function(jit_compile=True)` (`in_xla_context`): `sequential_recursion`, a plain
  `tf.while_loop` over T, which XLA compiles into a tight loop, whereas it fuses the doubling
  steps by recomputing their products.

`scan_recursion` is RLlib's formulation (`tf.scan`), the reference `vtrace.scan_vtrace_baseline`
uses. `python -m tools.bench_vtrace` times the V-trace functions built on these.
"""

from __future__ import annotations

import tensorflow as tf

try:  # Not public API; only used to pick the faster recursion under XLA.
    from tensorflow.python.ops import control_flow_util as _control_flow_util
except ImportError:  # pragma: no cover
    _control_flow_util = None

__all__ = [
    "doubling_recursion",
    "in_xla_context",
    "reverse_recursion",
    "scan_recursion",
    "sequential_recursion",
]

# Unrolled doubling steps when T is unknown: enough for T <= 64 (RLlib's T is 50 by default).
_UNROLLED_MAX_OFFSET = 32


def reverse_recursion(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    """Returns acc [T, ...] with acc_t = b_t + a_t acc_{t+1} and acc_T = 0 (module docstring:
    sequential under XLA, doubling otherwise)."""
    if in_xla_context():
        return sequential_recursion(a, b)
    return doubling_recursion(a, b)


def doubling_recursion(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    """Log-depth scan: after the step with offset k, (a_t, b_t) compose the maps t..t+2k-1.

    Rows past the end compose with the zero map, which is exact because acc_T = 0; for the same
    reason a step with offset k >= T leaves b unchanged, so when T is unknown the steps up to
    offset _UNROLLED_MAX_OFFSET are unrolled and a `tf.while_loop` does any further ones.
    """
    rank = b.shape.rank
    num_steps = b.shape[0]
    k = 1
    if num_steps is not None:
        while k < num_steps:
            a, b = _doubling_step(a, b, k, k, rank, update_a=2 * k < num_steps)
            k *= 2
        return b

    t_len = tf.shape(b)[0]
    while k <= _UNROLLED_MAX_OFFSET:
        a, b = _doubling_step(a, b, k, tf.minimum(k, t_len), rank, update_a=True)
        k *= 2

    def body(k, a, b):
        a, b = _doubling_step(a, b, k, k, rank, update_a=True)
        return k * 2, a, b

    _, _, b = tf.while_loop(
        lambda k, a, b: k < tf.shape(b)[0], body, (tf.constant(k), a, b), parallel_iterations=1
    )
    return b


def _doubling_step(a, b, k, pad, rank, update_a):
    """Composes each row's map with the one k rows later; `pad` = min(k, T) rows of zero maps."""
    paddings = [[0, pad]] + [[0, 0]] * (rank - 1)
    b = b + a * tf.pad(b[k:], paddings)
    if update_a:
        a = a * tf.pad(a[k:], paddings)
    return a, b


def sequential_recursion(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    """One step per time index in a `tf.while_loop`; fastest once compiled by XLA."""
    num_steps = tf.shape(b)[0]
    acc0 = tf.zeros(tf.shape(b)[1:], b.dtype)
    outputs = tf.TensorArray(b.dtype, size=num_steps, element_shape=b.shape[1:])

    def body(t, acc, outputs):
        acc = b[t] + a[t] * acc
        return t - 1, acc, outputs.write(t, acc)

    _, _, outputs = tf.while_loop(
        lambda t, acc, outputs: t >= 0,
        body,
        (num_steps - 1, acc0, outputs),
        parallel_iterations=1,
        maximum_iterations=num_steps,
    )
    return tf.ensure_shape(outputs.stack(), b.shape)


def scan_recursion(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    """RLlib's formulation: `tf.scan` over the reversed sequences."""
    acc = tf.scan(
        lambda acc, item: item[1] + item[0] * acc,
        (tf.reverse(a, [0]), tf.reverse(b, [0])),
        initializer=tf.zeros(tf.shape(b)[1:], b.dtype),
        parallel_iterations=1,
    )
    return tf.reverse(acc, [0])


def in_xla_context() -> bool:
    """True while tracing a function (or its callee) compiled with `jit_compile=True`."""
    if tf.executing_eagerly() or _control_flow_util is None:
        return False
    return bool(_control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))
