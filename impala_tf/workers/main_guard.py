"""Scripts without `if __name__ == "__main__":` that build an algorithm at module level.

`multiprocessing` prepares each new actor or aggregation process (forked from the fork server,
or spawned) by re-running the parent's main script as `__mp_main__`, so that objects defined in
it can be unpickled. A script that builds and trains at module level would train again in every
child, which failed with a bare `BrokenPipeError`. Ray, which RLlib runs on, never re-runs the
driver script: its workers receive functions and classes defined there by value.

We do the same for such scripts only: `unguarded_main_call()` tells, from the call stack and the
script's syntax tree, whether the algorithm is being built by module-level code of the main script
outside an `if __name__ == "__main__":` block. Then the worker processes
(`impala_tf.workers.process`) are started inside `without_main_preparation()` (the children do
not re-run the script), and what they receive (the hosted object's factory and arguments, each
call's arguments) goes `by_value` (cloudpickle pickles the script's env classes and functions by
value). Scripts with the guard keep `multiprocessing`'s usual preparation.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import functools
import inspect
import io
import pickle
import sys
from collections.abc import Iterator
from multiprocessing import spawn
from multiprocessing.reduction import ForkingPickler
from typing import Any

__all__ = ["by_value", "unguarded_main_call", "without_main_preparation"]

_MAIN_KEYS = ("init_main_from_path", "init_main_from_name")


@functools.lru_cache(maxsize=8)
def _guarded_lines(path: str) -> tuple[tuple[int, int], ...]:
    """The line ranges of the `if __name__ == "__main__":` bodies of the script at `path`."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    ranges = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_test(node.test):
            ranges.append((node.body[0].lineno, node.body[-1].end_lineno or node.body[-1].lineno))
    return tuple(ranges)


def _is_main_test(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return False
    if not isinstance(test.ops[0], ast.Eq):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    consts = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return len(names) == 1 and len(consts) == 1


def unguarded_main_call() -> bool:
    """Whether the caller runs, somewhere up the stack, from the main script's module-level code
    outside an `if __name__ == "__main__":` block (so a child re-running it would train again)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path:
        return False
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code.co_name == "<module>" and frame.f_globals is vars(main):
                try:
                    ranges = _guarded_lines(path)
                except (OSError, SyntaxError, ValueError):
                    return False
                line = frame.f_lineno
                return not any(start <= line <= end for start, end in ranges)
            frame = frame.f_back
        return False
    finally:
        del frame


@contextlib.contextmanager
def without_main_preparation(active: bool = True) -> Iterator[None]:
    """Processes started inside do not re-run the parent's main script (if `active`)."""
    if not active:
        yield
        return
    original = spawn.get_preparation_data

    def preparation_data(name: str) -> dict[str, Any]:
        data = original(name)
        for key in _MAIN_KEYS:
            data.pop(key, None)
        return data

    spawn.get_preparation_data = preparation_data
    try:
        yield
    finally:
        spawn.get_preparation_data = original


class _ByValue:
    """Pickles its object with cloudpickle: classes and functions of `__main__` by value.

    What only `multiprocessing` knows how to pickle (pipe ends, shared arrays, locks) keeps its
    `multiprocessing` reduction, so such objects may travel inside (to a child being started).
    """

    def __init__(self, obj: Any):
        self.obj = obj

    def __reduce__(self):
        import cloudpickle

        class Pickler(cloudpickle.Pickler):
            dispatch_table = collections.ChainMap(
                ForkingPickler._extra_reducers, cloudpickle.Pickler.dispatch_table
            )

        with io.BytesIO() as buffer:
            Pickler(buffer).dump(self.obj)
            return pickle.loads, (buffer.getvalue(),)


def by_value(obj: Any) -> Any:
    """`obj`, to be pickled into a child with whatever it references in `__main__` by value."""
    return _ByValue(obj)
