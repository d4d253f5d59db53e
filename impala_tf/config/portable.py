"""`Portable`: a user's class or function, resolved once in the driver, sent to every worker.

What a user plugs in (a custom model, a callbacks class) is named in the config by the object
itself, an import path or a registered name; the driver resolves it once. Workers receive the
resolved object pickled by its import path when that path finds it again in a fresh process (a
module-level object of an importable module), and by value with cloudpickle otherwise (an
object defined in the main script, a notebook or a function), so that they never re-resolve
the config. `check_sendable` tells at build time when neither works.

This module imports neither TensorFlow nor Keras.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable
from typing import Any

from impala_tf.config.policies import import_object

__all__ = ["Portable", "import_path", "portable", "resolve_path"]


def import_path(obj: Any) -> str | None:
    """`module:qualname` of a module-level class or function, else None."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not module or not qualname or "<" in qualname:
        return None
    return f"{module}:{qualname}"


def resolve_path(path: str) -> Any:
    """The object at `package.module:Qual.name` (or `package.module.name`).

    Raises:
      ValueError: naming the path when it does not import.
    """
    module, sep, qualname = path.partition(":")
    if not sep:
        return import_object(path)
    obj = import_object(f"{module}:{qualname.split('.')[0]}")
    for part in qualname.split(".")[1:]:
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"Cannot import {path!r}: {obj!r} has no {part!r}.") from None
    return obj


def _finds(path: str, obj: Any) -> bool:
    """Whether importing `path` in a fresh process gives `obj` back."""
    if path.startswith("__main__:"):
        return False  # The main script is another module in a worker process.
    try:
        return resolve_path(path) is obj
    except ValueError:
        return False


def _by_path(label: str, path: str, error: type[Exception]) -> Portable:
    try:
        return Portable(label, resolve_path(path), path)
    except ValueError as e:
        raise error(
            f"{label}: cannot import {path!r} in this process ({e}). Its module must be "
            "importable wherever the run builds it (install it, or run from its directory)."
        ) from e


def _by_value(label: str, path: str | None, payload: bytes) -> Portable:
    return Portable(label, pickle.loads(payload), path)


@dataclasses.dataclass(frozen=True)
class Portable:
    """A resolved user object (see the module docstring).

    Attributes:
      label: How messages name it: the setting as configured, with the object's path.
      obj: The class or function.
      path: Its `module:qualname` (what checkpoints store), None for one without a name.
      error: The exception class a failed import in a worker raises.
    """

    label: str
    obj: Callable[..., Any]
    path: str | None
    error: type[Exception] = dataclasses.field(default=ValueError, compare=False)

    def __reduce__(self) -> tuple:
        if self.path is not None and _finds(self.path, self.obj):
            return (_by_path, (self.label, self.path, self.error))
        import cloudpickle

        return (_by_value, (self.label, self.path, cloudpickle.dumps(self.obj)))

    def check_sendable(self, what: str) -> None:
        """Raises `error` when this object cannot be sent to a worker process (pickled).

        Args:
          what: Names the object's use in the message ("custom_model ... of policy 'p0'").
        """
        try:
            pickle.loads(pickle.dumps(self))
        except Exception as e:  # noqa: BLE001 - whatever the pickler says is the reason.
            raise self.error(
                f"{what} cannot be sent to the worker processes: {type(e).__name__}: {e}. "
                "Define it at module level in an importable module and keep unpicklable "
                "objects (locks, open files, sessions) out of it."
            ) from e


def portable(
    value: Any, key: str, error: type[Exception] = ValueError, registry: dict | None = None
) -> Portable:
    """`value` (an object, an import path or a name in `registry`) as a `Portable`.

    Args:
      value: The setting.
      key: The config key it comes from, named in messages.
      error: The exception class to raise (and to raise in workers).
      registry: {name: object} of registered names, looked up first for a string.

    Raises:
      `error`: a string that is neither a registered name nor an import path that resolves,
        or a value that is not callable.
    """
    if isinstance(value, str):
        if registry is not None and value in registry:
            obj = registry[value]
            path = import_path(obj)
            return Portable(f"{value!r} ({path or obj!r})", obj, path, error)
        if ":" not in value and "." not in value:
            names = "" if registry is None else f" nor a registered name ({sorted(registry)})"
            raise error(f"`{key}={value!r}` is not an import path `package.module:Name`{names}.")
        try:
            obj = resolve_path(value)
        except ValueError as e:
            raise error(f"`{key}={value!r}`: the import path does not resolve: {e}") from e
        if not callable(obj):
            raise error(f"`{key}={value!r}` names {obj!r}, which is not a class or function.")
        path = value if ":" in value else import_path(obj) or value
        return Portable(repr(value), obj, path, error)
    if callable(value):
        path = import_path(value)
        return Portable(path or repr(value), value, path, error)
    raise error(f"`{key}` must be a class, a function or an import path, got {value!r}.")
