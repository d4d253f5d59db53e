"""RLlib's custom-model base classes: `ModelV2`, `TFModelV2`, `RecurrentNetwork`.

A model written for RLlib's TF policies runs here with its imports changed: subclass `TFModelV2`
(or `RecurrentNetwork` for a model with its own recurrent state), build Keras models in the
constructor, and implement the same methods as in RLlib.

* The constructor takes `(obs_space, action_space, num_outputs, model_config, name,
  **custom_model_config)`: the keys of the model's `custom_model_config` arrive as keyword
  arguments, as in RLlib. `obs_space` is the space of what the model receives (below).
* `forward(input_dict, state, seq_lens) -> (outputs, state)`: `input_dict["obs"]` holds the
  observations, float32 [B, *obs_shape] (Discrete and MultiDiscrete observations one-hot
  encoded, as RLlib's preprocessors do), `input_dict["obs_flat"]` the same flattened to [B, F];
  `outputs` are the action distribution's inputs, float32 [B, num_outputs].
* `value_function() -> [B]`: V of the observations of the last `forward` call.
* `get_initial_state() -> list of arrays [H]`: the recurrent state of one env before its first
  step (`[]`, the default, for a feed-forward model).

`RecurrentNetwork` implements `forward` by adding the time dimension and calling
`forward_rnn(inputs [B, T, F], state, seq_lens) -> (outputs [B, T, num_outputs], new_state)`.
impala_tf calls a recurrent model one step at a time (T = 1, `seq_lens` all ones), in the actors
and in the learner, where the state of an env whose episode ended is set back to
`get_initial_state()` before its next step; so a model sees exactly the sequences RLlib feeds it,
never the steps of two episodes in one sequence.

Variables: as RLlib's `TFModelV2`, every Keras model, layer or variable held in the instance's
attributes (or in lists, tuples and dicts of them, or in another `ModelV2`) belongs to the model;
`register_variables` is accepted and not needed.

RLlib's `custom_loss`, `metrics` and `update_ops` are not called here: a model that overrides
`custom_loss` is refused when it is built (`impala_tf.models.custom`), since the learner would
train another loss than the model's author meant; `metrics()` may stay (it is not reported).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import tensorflow as tf

from impala_tf.models.initializers import NormcInitializer

__all__ = [
    "ModelV2",
    "RecurrentNetwork",
    "TFModelV2",
    "add_time_dimension",
    "normc_initializer",
    "try_import_tf",
]


def normc_initializer(std: float = 1.0) -> NormcInitializer:
    """RLlib's `normc_initializer(std)`: columns of norm `std` (a Keras initializer)."""
    return NormcInitializer(std)


def try_import_tf(error: bool = False) -> tuple[Any, Any, int]:
    """RLlib's `try_import_tf()`: `(tf.compat.v1, tf, 2)`, so ported modules keep their line
    `tf1, tf, tfv = try_import_tf()`."""
    del error
    return tf.compat.v1, tf, 2


def add_time_dimension(padded_inputs: Any, seq_lens: Any, **_: Any) -> tf.Tensor:
    """[B * T, ...] -> [B, T, ...] for B sequences of `seq_lens` (RLlib's helper, batch-major).

    T is `len(padded_inputs) // len(seq_lens)`: the inputs hold B sequences padded to T steps.
    """
    padded_inputs = tf.convert_to_tensor(padded_inputs)
    rows = tf.shape(padded_inputs)[0]
    sequences = tf.shape(seq_lens)[0]
    steps = rows // sequences
    shape = tf.concat([[sequences, steps], tf.shape(padded_inputs)[1:]], axis=0)
    return tf.reshape(padded_inputs, shape)


class ModelV2:
    """RLlib's `ModelV2`: the interface of a custom model (see the module docstring).

    Args:
      obs_space: The space of the observations the model receives.
      action_space: The env's action space.
      num_outputs: The size of the action distribution's inputs (`outputs` of `forward`); None
        when the model is wrapped by `use_lstm` (its outputs feed the LSTM).
      model_config: The resolved model config (RLlib's keys).
      name: The model's name.
      framework: Always "tf" here.
    """

    def __init__(
        self,
        obs_space: Any,
        action_space: Any,
        num_outputs: int | None,
        model_config: Mapping[str, Any],
        name: str,
        framework: str = "tf",
    ):
        self.obs_space = obs_space
        self.action_space = action_space
        self.num_outputs = num_outputs
        self.model_config = model_config
        self.name = name or "default_model"
        self.framework = framework
        self.time_major = bool(model_config.get("_time_major", False))
        self._last_output = None

    def get_initial_state(self) -> list[np.ndarray]:
        """The recurrent state of one env before its first step ([] for feed-forward models)."""
        return []

    def forward(
        self, input_dict: dict[str, Any], state: list[Any], seq_lens: Any
    ) -> tuple[Any, list[Any]]:
        """Returns (outputs float32 [B, num_outputs], new state); see the module docstring."""
        raise NotImplementedError(f"{type(self).__name__} must implement forward().")

    def value_function(self) -> Any:
        """V of the observations of the last `forward` call, float32 [B]."""
        raise NotImplementedError(f"{type(self).__name__} must implement value_function().")

    def custom_loss(self, policy_loss: Any, loss_inputs: Any) -> Any:
        """RLlib's hook to change the loss; impala_tf refuses models that override it."""
        return policy_loss

    def metrics(self) -> dict[str, Any]:
        """RLlib's model metrics; impala_tf does not report them."""
        return {}

    def __call__(
        self, input_dict: Mapping[str, Any], state: list[Any] | None = None, seq_lens: Any = None
    ) -> tuple[Any, list[Any]]:
        """Adds `obs_flat` to `input_dict` and calls `forward`, checking what it returns."""
        restored = dict(input_dict)
        obs = tf.convert_to_tensor(restored["obs"])
        restored["obs"] = obs
        if "obs_flat" not in restored:
            restored["obs_flat"] = (
                tf.reshape(obs, [tf.shape(obs)[0], -1]) if obs.shape.rank != 2 else obs
            )
        with self.context():
            res = self.forward(restored, list(state or []), seq_lens)
        if not isinstance(res, (list, tuple)) or len(res) != 2:
            raise ValueError(
                f"{type(self).__name__}.forward() must return (outputs, state), got {res!r}."
            )
        outputs, state_out = res
        if not isinstance(state_out, (list, tuple)):
            raise ValueError(
                f"{type(self).__name__}.forward() returned a state that is not a list: "
                f"{state_out!r}."
            )
        self._last_output = outputs
        return outputs, list(state_out) if len(state_out) > 0 else list(state or [])

    def last_output(self) -> Any:
        """The outputs of the last `forward` call."""
        return self._last_output

    def context(self) -> contextlib.AbstractContextManager:
        """The context `forward` runs in (none)."""
        return contextlib.nullcontext()

    def is_time_major(self) -> bool:
        return self.time_major


class TFModelV2(ModelV2):
    """RLlib's `TFModelV2`: a `ModelV2` whose layers are Keras models (module docstring).

    Subclasses call `super().__init__(obs_space, action_space, num_outputs, model_config,
    name)` and keep their Keras models in attributes.
    """

    def __init__(
        self,
        obs_space: Any,
        action_space: Any,
        num_outputs: int | None,
        model_config: Mapping[str, Any],
        name: str,
    ):
        super().__init__(obs_space, action_space, num_outputs, model_config, name, "tf")
        self.var_list: list[tf.Variable] = []

    def register_variables(self, variables: Any) -> None:
        """Accepted for old RLlib models; the variables are found without it."""
        self.var_list.extend(variables)

    def update_ops(self) -> list:
        return []

    def variables(self, as_dict: bool = False) -> list[tf.Variable] | dict[str, tf.Variable]:
        """The model's variables: those of every Keras model, layer, `tf.Module` or variable in
        its attributes (and in lists, tuples and dicts of them, and other `ModelV2`s)."""
        found = _find_variables(self.name, vars(self))
        for v in self.var_list:
            found.setdefault(_variable_path(v), v)
        return found if as_dict else list(found.values())

    def trainable_variables(
        self, as_dict: bool = False
    ) -> list[tf.Variable] | dict[str, tf.Variable]:
        """`variables` that are trainable."""
        found = {k: v for k, v in self.variables(as_dict=True).items() if v.trainable}
        return found if as_dict else list(found.values())


class RecurrentNetwork(TFModelV2):
    """RLlib's `RecurrentNetwork`: implement `forward_rnn` and `get_initial_state`.

    `forward` adds the time dimension to `obs_flat` ([B * T, F] -> [B, T, F], T from
    `seq_lens`), calls `forward_rnn` and flattens its outputs back to [B * T, num_outputs].
    """

    def forward(
        self, input_dict: dict[str, Any], state: list[Any], seq_lens: Any
    ) -> tuple[Any, list[Any]]:
        if seq_lens is None:
            raise ValueError(f"{type(self).__name__} is recurrent: forward() needs seq_lens.")
        inputs = add_time_dimension(input_dict["obs_flat"], seq_lens)
        output, new_state = self.forward_rnn(inputs, state, seq_lens)
        return tf.reshape(output, [-1, int(self.num_outputs)]), list(new_state)

    def forward_rnn(self, inputs: Any, state: list[Any], seq_lens: Any) -> tuple[Any, list[Any]]:
        """Returns (outputs [B, T, num_outputs], new state) for inputs [B, T, F]."""
        raise NotImplementedError(f"{type(self).__name__} must implement forward_rnn().")

    def get_initial_state(self) -> list[np.ndarray]:
        raise NotImplementedError(f"{type(self).__name__} must implement get_initial_state().")


def _variable_path(v: Any) -> str:
    return str(getattr(v, "path", None) or getattr(v, "name", "variable"))


def _find_variables(key: str, struct: Any) -> dict[str, Any]:
    """{key: variable} of everything `TFModelV2.variables` counts in `struct`."""
    import keras

    if isinstance(struct, (keras.layers.Layer, tf.Module)):
        return {f"{key}.{re.sub('/', '.', _variable_path(v))}": v for v in struct.variables}
    if isinstance(struct, TFModelV2):
        return {f"{key}.{k}": v for k, v in struct.variables(as_dict=True).items()}
    if isinstance(struct, (tf.Variable, keras.Variable)):
        return {key: struct}
    out: dict[str, Any] = {}
    if isinstance(struct, (list, tuple)):
        for i, value in enumerate(struct):
            out.update(_find_variables(f"{key}_{i}", value))
    elif isinstance(struct, dict):
        for k, value in struct.items():
            if not str(k).startswith("__"):
                out.update(_find_variables(f"{key}_{k}", value))
    return out
