"""`GraphProgram`: a traced TensorFlow function run with numpy, op by op.

An actor calls its policy once per env step of its vector env, at a batch of a few dozen, where
a TensorFlow call costs hundreds of microseconds of dispatch for a few microseconds of
arithmetic (`impala_tf.acting.tf_policy`). For the catalog's MLPs the actors run a hand-written
numpy program (`impala_tf.acting.numpy_policy`); a user's model is arbitrary code, so instead its
step is traced once into a graph and that graph is run here: each op becomes one numpy call, the
variables' reads and everything computed from constants and variables alone are evaluated
once per `set_weights`, and only the rest runs per call.

Only graphs made of the ops in `_OPS` (dense layers, elementwise activations, reshapes, slices,
concatenations, one-hot encodings: what feed-forward Keras models and RLlib `TFModelV2`s trace
to) can run; any other op (a `While` loop of a recurrent layer, a convolution) raises
`UnsupportedGraph` when the program is built, and the caller keeps TensorFlow.
`impala_tf.acting.traced_policy` builds the program and checks it against TensorFlow before using
it.

This module imports numpy only; `GraphProgram` reads a `ConcreteFunction` it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["GraphProgram", "UnsupportedGraph"]


class UnsupportedGraph(ValueError):
    """The traced graph holds an op (or attribute) this interpreter does not run."""


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # No overflow for large |x|.


def _static(tensor: Any) -> Any:
    """The value of a tensor known when the graph was traced (a constant), else None."""
    import tensorflow as tf  # The caller traced with it: already imported.

    return tf.get_static_value(tensor)


def _strided_slice(op: Any) -> Callable[..., np.ndarray]:
    masks = {k: int(op.get_attr(k)) for k in ("begin_mask", "end_mask", "ellipsis_mask",
                                              "new_axis_mask", "shrink_axis_mask")}  # fmt: skip

    def index(begin: Any, end: Any, strides: Any) -> tuple:
        out: list[Any] = []
        for i, (b, e, s) in enumerate(zip(begin, end, strides)):
            bit = 1 << i
            if masks["ellipsis_mask"] & bit:
                out.append(Ellipsis)
            elif masks["new_axis_mask"] & bit:
                out.append(np.newaxis)
            elif masks["shrink_axis_mask"] & bit:
                out.append(int(b))
            else:
                start = None if masks["begin_mask"] & bit else int(b)
                stop = None if masks["end_mask"] & bit else int(e)
                out.append(slice(start, stop, int(s)))
        return tuple(out)

    parts = [_static(t) for t in op.inputs[1:]]
    if all(p is not None for p in parts):
        fixed = index(*parts)  # The usual case: constant bounds, one index for every call.
        return lambda x, *_: np.asarray(x[fixed])
    return lambda x, begin, end, strides: np.asarray(x[index(begin, end, strides)])


def _one_hot(op: Any) -> Callable[..., np.ndarray]:
    if int(op.get_attr("axis")) != -1:
        raise UnsupportedGraph("OneHot with an axis other than -1")

    def run(indices: Any, depth: Any, on: Any, off: Any) -> np.ndarray:
        indices = np.asarray(indices)
        depth = int(depth)
        out = np.full((*indices.shape, depth), off, dtype=np.asarray(on).dtype)
        rows = np.nonzero((indices >= 0) & (indices < depth))
        out[(*rows, indices[rows])] = on
        return out

    return run


def _reduce(fn: Callable) -> Callable[[Any], Callable[..., np.ndarray]]:
    def make(op: Any) -> Callable[..., np.ndarray]:
        keep = bool(op.get_attr("keep_dims"))
        return lambda x, axis: np.asarray(
            fn(x, axis=tuple(np.atleast_1d(axis).tolist()), keepdims=keep)
        )

    return make


def _transposed_matmul(ta: bool, tb: bool) -> Callable[..., np.ndarray]:
    if not (ta or tb):
        return np.matmul

    def run(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return (np.swapaxes(a, -1, -2) if ta else a) @ (np.swapaxes(b, -1, -2) if tb else b)

    return run


def _matmul(op: Any) -> Callable[..., np.ndarray]:
    return _transposed_matmul(bool(op.get_attr("transpose_a")), bool(op.get_attr("transpose_b")))


def _batch_matmul(op: Any) -> Callable[..., np.ndarray]:
    return _transposed_matmul(bool(op.get_attr("adj_x")), bool(op.get_attr("adj_y")))


def _cast(op: Any) -> Callable[..., np.ndarray]:
    dtype = op.get_attr("DstT").as_numpy_dtype
    return lambda x: np.asarray(x).astype(dtype)


def _squeeze(op: Any) -> Callable[..., np.ndarray]:
    axes = tuple(op.get_attr("squeeze_dims")) or None
    return lambda x: np.squeeze(x, axis=axes)


def _pack(op: Any) -> Callable[..., np.ndarray]:
    axis = int(op.get_attr("axis"))
    return lambda *xs: np.stack(xs, axis=axis)


def _shape(op: Any) -> Callable[..., np.ndarray]:
    dtype = op.get_attr("out_type").as_numpy_dtype
    return lambda x: np.asarray(np.shape(x), dtype)


def _split(op: Any) -> Callable[..., list]:
    n = int(op.get_attr("num_split"))
    return lambda axis, x: np.split(x, n, axis=int(axis))


def _softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x - x.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    z = x - x.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def _plain(fn: Callable[..., Any]) -> Callable[[Any], Callable[..., Any]]:
    """An op whose numpy function needs none of its attributes."""
    return lambda op: fn


def _selu(x: np.ndarray) -> np.ndarray:
    return 1.0507009873554805 * np.where(x > 0, x, 1.6732632423543772 * np.expm1(np.minimum(x, 0)))


#: op type -> make(op): the numpy function of the op's inputs (its attributes read once).
_OPS: dict[str, Callable[[Any], Callable[..., Any]]] = {
    "Identity": _plain(lambda x: x),
    "StopGradient": _plain(lambda x: x),
    "Snapshot": _plain(lambda x: x),
    "IdentityN": _plain(lambda *xs: list(xs)),
    "MatMul": _matmul,
    "BatchMatMulV2": _batch_matmul,
    "BiasAdd": _plain(np.add),
    "AddV2": _plain(np.add),
    "Add": _plain(np.add),
    "AddN": _plain(lambda *xs: np.sum(xs, axis=0)),
    "Sub": _plain(np.subtract),
    "Mul": _plain(np.multiply),
    "RealDiv": _plain(np.divide),
    "FloorDiv": _plain(np.floor_divide),
    "Maximum": _plain(np.maximum),
    "Minimum": _plain(np.minimum),
    "SquaredDifference": _plain(lambda a, b: np.square(a - b)),
    "Neg": _plain(np.negative),
    "Square": _plain(np.square),
    "Sqrt": _plain(np.sqrt),
    "Rsqrt": _plain(lambda x: 1.0 / np.sqrt(x)),
    "Exp": _plain(np.exp),
    "Log": _plain(np.log),
    "Abs": _plain(np.abs),
    "Tanh": _plain(np.tanh),
    "Sigmoid": _plain(_sigmoid),
    "Relu": _plain(lambda x: np.maximum(x, 0)),
    "Relu6": _plain(lambda x: np.clip(x, 0, 6)),
    "Elu": _plain(lambda x: np.where(x > 0, x, np.expm1(np.minimum(x, 0)))),
    "Selu": _plain(_selu),
    "Softplus": _plain(lambda x: np.logaddexp(0, x)),
    "Softmax": _plain(_softmax),
    "LogSoftmax": _plain(_log_softmax),
    "Cast": _cast,
    "Reshape": _plain(lambda x, shape: np.reshape(x, np.asarray(shape).tolist())),
    "Squeeze": _squeeze,
    "ExpandDims": _plain(lambda x, axis: np.expand_dims(x, int(axis))),
    "ConcatV2": _plain(lambda *xs: np.concatenate(xs[:-1], axis=int(xs[-1]))),
    "Pack": _pack,
    "Shape": _shape,
    "StridedSlice": _strided_slice,
    "Fill": _plain(lambda dims, value: np.full(np.asarray(dims).tolist(), value)),
    "ZerosLike": _plain(np.zeros_like),
    "OnesLike": _plain(np.ones_like),
    "OneHot": _one_hot,
    "Transpose": _plain(lambda x, perm: np.transpose(x, np.asarray(perm).tolist())),
    "GatherV2": _plain(lambda x, idx, axis: np.take(x, idx, axis=int(axis))),
    "Tile": _plain(lambda x, reps: np.tile(x, np.asarray(reps).tolist())),
    "Select": _plain(np.where),
    "SelectV2": _plain(np.where),
    "Split": _split,
    "Sum": _reduce(np.sum),
    "Mean": _reduce(np.mean),
    "Prod": _reduce(np.prod),
    "Max": _reduce(np.max),
    "Min": _reduce(np.min),
    "Range": _plain(np.arange),
    "Equal": _plain(np.equal),
    "NotEqual": _plain(np.not_equal),
    "Less": _plain(np.less),
    "Greater": _plain(np.greater),
    "LogicalNot": _plain(np.logical_not),
    "LogicalAnd": _plain(np.logical_and),
    "LogicalOr": _plain(np.logical_or),
}
#: Ops whose attributes change semantics in ways not handled above.
_ATTR_CHECKS: dict[str, Callable[[Any], bool]] = {
    "BiasAdd": lambda op: op.get_attr("data_format") in (b"NHWC", "NHWC"),
    "GatherV2": lambda op: int(op.get_attr("batch_dims")) == 0,
}


class GraphProgram:
    """A `ConcreteFunction`'s graph, run with numpy (see the module docstring).

    Args:
      concrete: The traced function: its own inputs are arrays, its captures variables.
      variables: The variables it may capture, in the order `set_values` receives their
        values (a Keras model's `weights`).

    Raises:
      UnsupportedGraph: an op outside `_OPS`, a capture that is no variable of `variables`,
        or an attribute value not handled.
    """

    def __init__(self, concrete: Any, variables: Sequence[Any]):
        graph = concrete.graph
        captures = list(graph.captures)
        captured = {internal.name for _, internal in captures}
        self._inputs = [t.name for t in graph.inputs if t.name not in captured]
        handles = {}
        for i, v in enumerate(variables):
            tf_variable = getattr(v, "value", v)  # A Keras variable wraps a tf.Variable.
            handles[id(getattr(tf_variable, "handle", None))] = i
        self._captures: dict[str, int] = {}
        for external, internal in captures:
            index = handles.get(id(external))
            if index is None:
                raise UnsupportedGraph(f"the graph captures {external!r}, not a model variable")
            self._captures[internal.name] = index
        self._outputs = [t.name for t in concrete.outputs]
        static = set(self._captures)
        self._static_steps: list[tuple] = []
        self._steps: list[tuple] = []
        self._consts: dict[str, Any] = {}
        for op in graph.get_operations():
            kind = op.type
            if kind in ("Placeholder", "NoOp"):
                continue
            if kind == "Const":
                import tensorflow as tf  # The caller traced with it: already imported.

                self._consts[op.outputs[0].name] = tf.make_ndarray(op.get_attr("value"))
                static.add(op.outputs[0].name)
                continue
            if kind == "ReadVariableOp":
                source = op.inputs[0].name
                if source not in self._captures:
                    raise UnsupportedGraph("ReadVariableOp of something not captured")
                self._static_steps.append((lambda x: x, (source,), self._names(op)))
                static.add(op.outputs[0].name)
                continue
            make = _OPS.get(kind)
            if make is None:
                raise UnsupportedGraph(f"op {kind} ({op.name})")
            check = _ATTR_CHECKS.get(kind)
            if check is not None and not check(op):
                raise UnsupportedGraph(f"op {kind} ({op.name}) with these attributes")
            inputs = tuple(t.name for t in op.inputs)
            step = (make(op), inputs, self._names(op))
            if all(name in static for name in inputs):
                self._static_steps.append(step)
                static.update(step[2])
            else:
                self._steps.append(step)
        self._values: dict[str, Any] | None = None

    @staticmethod
    def _names(op: Any) -> tuple[str, ...]:
        return tuple(t.name for t in op.outputs)

    @staticmethod
    def _run(step: tuple, env: dict[str, Any]) -> None:
        fn, inputs, outputs = step
        result = fn(*[env[name] for name in inputs])
        if len(outputs) == 1:
            env[outputs[0]] = result
        else:
            for name, value in zip(outputs, result):
                env[name] = value

    def set_values(self, values: Sequence[np.ndarray]) -> None:
        """Loads the variables' values (in `variables` order) and folds what they determine."""
        env: dict[str, Any] = dict(self._consts)
        for name, index in self._captures.items():
            env[name] = np.asarray(values[index])
        for step in self._static_steps:
            self._run(step, env)
        self._values = env

    def __call__(self, *inputs: np.ndarray) -> list[np.ndarray]:
        """The function's flat outputs for its flat inputs (numpy arrays)."""
        if self._values is None:
            raise RuntimeError("GraphProgram has no variable values yet: call set_values")
        env = dict(self._values)
        for name, value in zip(self._inputs, inputs):
            env[name] = value
        for step in self._steps:
            self._run(step, env)
        return [env[name] for name in self._outputs]
