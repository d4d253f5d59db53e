"""`ModelSpec`: a policy's model, resolved once from the config, as every part builds it.

The driver resolves each policy's `model` config once (`model_spec`, called by the run's plan):
RLlib's defaults filled in, and `custom_model` resolved to what builds the model. The spec then
travels, as data, to every place that builds a model: the actors (local processes or Ray
workers), the central inference server, the learners, evaluation, `impala-evaluate` and
`impala-export`. No part looks at `model` again.

`custom_model` is one of:

* None: the catalog's network for the observations (an MLP, RLlib's vision network, with
  `use_lstm` an LSTM), or `"nature_cnn"` / `"impala_resnet"` (`impala_tf.models.catalog`);
* a name registered with `ModelCatalog.register_custom_model(name, cls)` (RLlib's call);
* an import path, `"package.module:Name"` (or `"package.module.Name"`);
* the class (or a function returning a model) itself.

What it names is an RLlib `TFModelV2` subclass (`impala_tf.models.modelv2`) or a callable
returning a `keras.Model` (a `keras.Model` subclass, or a function that builds a functional
model); either is called with `(obs_space, action_space, num_outputs, model_config, name,
**custom_model_config)` and adapted by `impala_tf.models.custom`.

A spec pickles its custom model by import path when the path finds it again (a module-level
class of an importable module), else by value with cloudpickle (a class defined in the main
script, a notebook or a function; `impala_tf.config.portable`); `check_transport` tells at build
time when neither works.
A registered name is looked up here, in the driver: worker processes never need the registry.

This module imports neither TensorFlow nor Keras; `impala_tf.models.build_model(obs_space,
action_space, spec)` builds a spec's model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from impala_tf.config.keys import MODEL_DEFAULTS
from impala_tf.config.portable import Portable, portable, resolve_path

#: A resolved `custom_model`: `.obj` builds the model, `.label` names it, `.path` is stored.
CustomModel = Portable

__all__ = [
    "BUILTIN_MODELS",
    "CustomModel",
    "ModelCatalog",
    "ModelError",
    "ModelSpec",
    "check_transport",
    "model_spec",
    "register_stored_models",
    "registered_paths",
    "resolve_custom_model",
]

#: `custom_model` names of the catalog's own networks (not user models).
BUILTIN_MODELS = ("nature_cnn", "impala_resnet")


class ModelError(ValueError):
    """A custom model that cannot be used: the message names the model and the mismatch."""


class ModelCatalog:
    """RLlib's `ModelCatalog`, for custom models: `register_custom_model(name, cls)`.

    Registered names are resolved in the process that builds the algorithm; the class itself
    then travels with the run's model specs, so actor processes need no registration.
    """

    _custom_models: dict[str, Any] = {}

    @staticmethod
    def register_custom_model(model_name: str, model_class: Any) -> None:
        """Makes `model.custom_model: model_name` build `model_class`.

        Args:
          model_name: The name configs use.
          model_class: A `TFModelV2` subclass, or a callable returning a `keras.Model`.

        Raises:
          ValueError: the name is a built-in model's, or `model_class` is not callable.
        """
        if not isinstance(model_name, str) or not model_name:
            raise ValueError(
                f"register_custom_model: the name must be a string, got {model_name!r}."
            )
        if model_name in BUILTIN_MODELS:
            raise ValueError(
                f"register_custom_model: {model_name!r} is the name of a built-in model "
                f"({', '.join(BUILTIN_MODELS)}); choose another."
            )
        if not callable(model_class):
            raise ValueError(
                f"register_custom_model({model_name!r}, ...): expected a TFModelV2 subclass or "
                f"a callable returning a keras.Model, got {model_class!r}."
            )
        ModelCatalog._custom_models[model_name] = model_class

    @staticmethod
    def get_custom_model(model_name: str) -> Any:
        """The class registered as `model_name`; KeyError if there is none."""
        return ModelCatalog._custom_models[model_name]

    @staticmethod
    def registered() -> dict[str, Any]:
        """{name: class} of every registered custom model."""
        return dict(ModelCatalog._custom_models)


def resolve_custom_model(value: Any, where: str = "model.custom_model") -> CustomModel | None:
    """What a `custom_model` setting names (None: a built-in network).

    Raises:
      ModelError: an unknown name, an import path that does not resolve, or a value that is
        neither a string nor callable; the message names `where`.
    """
    if value is None or (isinstance(value, str) and value in BUILTIN_MODELS):
        return None
    bare_name = isinstance(value, str) and ":" not in value and "." not in value
    if bare_name and value not in ModelCatalog._custom_models:
        known = sorted(ModelCatalog._custom_models) + list(BUILTIN_MODELS)
        raise ModelError(
            f"`{where}={value!r}` is not a registered custom model (registered and "
            f"built-in: {known}) nor an import path `package.module:Name`. Register it "
            "with impala_tf.models.ModelCatalog.register_custom_model before building."
        )
    return portable(value, where, ModelError, ModelCatalog._custom_models)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One policy's model, resolved (see the module docstring).

    Attributes:
      config: The model config with RLlib's defaults filled in (what a custom model receives
        as `model_config`; plain data: a `custom_model` given as a class is named here by its
        import path).
      custom: The custom model, or None for the catalog's networks.
    """

    config: Mapping[str, Any]
    custom: CustomModel | None = None

    @property
    def max_seq_len(self) -> int:
        return int(self.config["max_seq_len"])

    @property
    def use_lstm(self) -> bool:
        return bool(self.config["use_lstm"])

    @property
    def custom_model_config(self) -> dict[str, Any]:
        return dict(self.config.get("custom_model_config") or {})

    @property
    def label(self) -> str:
        """How messages name the model."""
        if self.custom is not None:
            return f"custom_model {self.custom.label}"
        name = self.config.get("custom_model")
        return f"model {name!r}" if name else "the catalog's model"


def model_spec(
    model_config: Mapping[str, Any] | ModelSpec | None, where: str = "model"
) -> ModelSpec:
    """Resolves a `model` config into a `ModelSpec` (a spec is returned as it is).

    Raises:
      ModelError: `custom_model` names nothing that builds a model (`resolve_custom_model`).
    """
    if isinstance(model_config, ModelSpec):
        return model_config
    config = {**MODEL_DEFAULTS, **dict(model_config or {})}
    config["custom_model_config"] = dict(config.get("custom_model_config") or {})
    custom = resolve_custom_model(config.get("custom_model"), f"{where}.custom_model")
    if custom is not None and not isinstance(config["custom_model"], str):
        # The spec carries the class; its config holds plain data (it is sent to workers).
        config["custom_model"] = custom.path or custom.label
    return ModelSpec(config, custom)


def registered_paths(specs: Mapping[str, ModelSpec]) -> dict[str, str]:
    """{registered name: import path} of the custom models `specs` name by a registered name
    (what a checkpoint keeps, so that another process can register them again)."""
    out = {}
    for spec in specs.values():
        name = spec.config.get("custom_model")
        custom = spec.custom
        registered = isinstance(name, str) and ModelCatalog._custom_models.get(name)
        if custom is not None and custom.path and registered is custom.obj:
            out[name] = custom.path
    return out


def register_stored_models(paths: Mapping[str, str]) -> None:
    """Registers each {name: import path} of a checkpoint that this process has not registered.

    Raises:
      ModelError: a path that does not import here (the message says how to register it).
    """
    for name, path in paths.items():
        if name in ModelCatalog._custom_models:
            continue
        try:
            factory = resolve_path(path)
        except ValueError as e:
            raise ModelError(
                f"The checkpoint's custom_model {name!r} was registered as {path!r}, which does "
                f"not import here ({e}). Register it with "
                f"ModelCatalog.register_custom_model({name!r}, ...) before loading."
            ) from e
        ModelCatalog.register_custom_model(name, factory)


def check_transport(spec: ModelSpec, policy_id: str) -> None:
    """Raises ModelError when `spec` cannot be sent to a worker process (pickled).

    Args:
      spec: The policy's spec.
      policy_id: Named in the message.
    """
    if spec.custom is not None:
        spec.custom.check_sendable(f"{spec.label} of policy {policy_id!r}")
