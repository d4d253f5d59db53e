"""The config as a checkpoint stores it: `AlgorithmConfig.to_dict()` in the JSON it can hold.

`storable_config` gives what `impala_tf.checkpoints.store.write_checkpoint` writes under
`"config"` of `driver_state.json`: classes and module-level functions the config names (a
`policy_mapping_fn`, a `custom_model` class, a `callbacks` class) become their import paths,
`module:qualname`, which the config resolves back when it is rebuilt
(`impala_tf.checkpoints.load_config`). `impala_tf.checkpoints.reading.read_config_dict` reads it
back as a dict. `StoredConfig` is that dict and the algorithm's name (`"algorithm"`), resolved
once for a driver that saves many times (`impala_tf.driver.state.SavedState`).

This module imports no config class.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["StoredConfig", "storable_config"]


@dataclasses.dataclass(frozen=True)
class StoredConfig:
    """A config as every checkpoint of a run stores it, resolved once.

    Attributes:
      config: `storable_config(config)`, written under `"config"` (None when `env` is a
        callable); plain data, not to be changed.
      algorithm: The config's `algo_name` (`"IMPALA"`, `"APPO"`), written under `"algorithm"`.
    """

    config: dict[str, Any] | None
    algorithm: str

    @classmethod
    def of(cls, config: Any) -> StoredConfig:
        """What a checkpoint stores of `config` (an `AlgorithmConfig`)."""
        return cls(storable_config(config), str(config.algo_name))


def _import_path(obj: Any) -> str | None:
    """`module:qualname` of a module-level class or function (of an instance: its class)."""
    target = obj if isinstance(obj, type) or hasattr(obj, "__qualname__") else type(obj)
    qualname = getattr(target, "__qualname__", "")
    module = getattr(target, "__module__", None)
    return f"{module}:{qualname}" if module and qualname and "<" not in qualname else None


def _storable_model(model: Any) -> Any:
    """A `model` dict with a `custom_model` given as a class stored as its import path."""
    if not isinstance(model, Mapping):
        return model
    custom = model.get("custom_model")
    if custom is None or isinstance(custom, str):
        return model
    return {**model, "custom_model": _import_path(custom) or str(custom)}


def storable_config(config: Any) -> dict[str, Any] | None:
    """`config.to_dict()` as JSON can hold it, or None when `env` is a callable.

    A module-level `policy_mapping_fn` (function or class), a `custom_model` given as a class
    (of the config's `model` or of a policy's config) and a `callbacks` class are stored as
    `module:qualname`,
    which the config resolves back on load. Anything else that is not JSON (a lambda,
    `PolicySpec`s holding spaces) is written as text and must be passed again as `config=` when
    loading.
    """
    if callable(config.env):
        return None
    out = config.to_dict()
    fn = out.get("policy_mapping_fn")
    if fn is not None and not isinstance(fn, (str, dict)):
        path = _import_path(fn)
        if path is not None:
            out["policy_mapping_fn"] = path
    out["model"] = _storable_model(out.get("model"))
    callbacks = out.get("callbacks_class")
    if isinstance(callbacks, (list, tuple)):
        out["callbacks_class"] = [c if isinstance(c, str) else _import_path(c) for c in callbacks]
    elif callbacks is not None and not isinstance(callbacks, str):
        out["callbacks_class"] = _import_path(callbacks) or str(callbacks)
    policies = out.get("policies")
    if isinstance(policies, Mapping):
        stored = {}
        for pid, spec in policies.items():
            pconfig = spec.get("config") if isinstance(spec, Mapping) else None
            is_spec = pconfig is None and getattr(spec, "config", None) is not None
            if is_spec and spec.observation_space is None and spec.action_space is None:
                spec, pconfig = {"config": spec.config}, spec.config  # A PolicySpec.
            if isinstance(pconfig, Mapping) and "model" in pconfig:
                spec = {**spec, "config": {**pconfig, "model": _storable_model(pconfig["model"])}}
            stored[pid] = spec
        out["policies"] = stored
    return out
