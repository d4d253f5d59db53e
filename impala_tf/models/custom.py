"""`CustomActorCritic`: a user's model behind the interface the runtime calls.

T is time, B is batch, A = num_outputs (the action distribution's inputs), H a recurrent
state's size. The runtime (actors, the inference server, the learner, evaluation, export) calls
every model through `ActorCritic`'s methods: `step(obs, state)` for one env step, `unroll(obs,
resets, state)` over time-major sequences, `initial_state(B)` and `call(obs)`. This class gives
a custom model (`impala_tf.models.spec`: an RLlib `TFModelV2` or a callable returning a
`keras.Model`) those methods:

* Inputs: observations [B, *obs_shape] as the env gives them become `obs`, float32
  [B, *obs_shape] (Discrete and MultiDiscrete one-hot encoded, as RLlib's preprocessors; the
  space the model is built for, `model_input_space`, says the shape). A `TFModelV2` gets them
  as `input_dict["obs"]` (and `input_dict["obs_flat"]`, [B, F]); a Keras model as its call's
  argument.
* Outputs: a `TFModelV2` returns its logits from `forward` and its values from
  `value_function()`; a Keras model returns `(logits, values)` from `call(obs)`. Logits must be
  [B, A], values [B] (or [B, 1]); both are cast to float32.
* Recurrent `TFModelV2`s (a `RecurrentNetwork`, or any whose `get_initial_state()` is not
  empty) are stepped one step at a time with `seq_lens` of ones: the learner's `unroll` scans
  the T steps, setting an env's state back to the initial state where an episode starts
  (`resets`), so no sequence ever holds two episodes (RLlib cuts sequences at episode ends).
* `use_lstm: true` wraps the custom model as RLlib's `LSTMWrapper` does: the model is built
  with `num_outputs=None` and its outputs [B, F] (a Keras model: its first output) feed an
  LSTM of `lstm_cell_size` units, whose output feeds new logits and value heads (normc(0.01),
  as RLlib's); the model's own values are not used.

Every check runs once, when the model is built (on the driver before any training step): the
constructor's arguments, the output shapes, the recurrent state, and that every variable is one
Keras tracks (so checkpoints and the weights sent to the actors hold it). A failure raises
`ModelError` naming the model.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import keras
import numpy as np
import tensorflow as tf

from impala_tf.models.initializers import NormcInitializer
from impala_tf.models.modelv2 import ModelV2
from impala_tf.models.recurrent import LSTMCore
from impala_tf.models.spec import ModelError, ModelSpec
from impala_tf.models.tracking import untracked_variables

__all__ = ["CustomActorCritic", "model_input_space"]

State = tuple[tf.Tensor, ...]

#: The batch size of the probe call that builds and checks a model.
_PROBE_BATCH = 2
#: A recurrent TFModelV2's unroll lays out at most this many steps in the graph (else scans).
_MAX_LAID_OUT_STEPS = 64


def model_input_space(observation_space: gym.Space) -> gym.Space:
    """The space of the `obs` a custom model receives for env observations of this space.

    Discrete(n) -> Box(0, 1, (n,)); MultiDiscrete(nvec) -> Box(0, 1, (sum(nvec),));
    MultiBinary(shape) -> Box(0, 1, shape); a Box is given as it is (its values as float32).

    Raises:
      ModelError: a Dict, Tuple or other space.
    """
    space = observation_space
    if isinstance(space, gym.spaces.Discrete):
        return gym.spaces.Box(0.0, 1.0, (int(space.n),), np.float32)
    if isinstance(space, gym.spaces.MultiDiscrete):
        return gym.spaces.Box(0.0, 1.0, (int(np.sum(space.nvec)),), np.float32)
    if isinstance(space, gym.spaces.MultiBinary):
        return gym.spaces.Box(0.0, 1.0, tuple(np.atleast_1d(space.shape)), np.float32)
    if isinstance(space, gym.spaces.Box):
        return space
    raise ModelError(
        f"Unsupported observation space {space!r}: custom models take Box, Discrete, "
        "MultiDiscrete and MultiBinary observations (no Dict or Tuple)."
    )


class _Inputs:
    """Env observations [N, *obs_shape] -> the model's `obs`, float32 (see `model_input_space`)."""

    def __init__(self, observation_space: gym.Space):
        self.space = observation_space
        self.shape = tuple(int(d) for d in model_input_space(observation_space).shape)
        if isinstance(observation_space, gym.spaces.MultiDiscrete):
            self._nvec = [int(n) for n in np.asarray(observation_space.nvec).reshape(-1)]

    def __call__(self, obs: tf.Tensor) -> tf.Tensor:
        space = self.space
        if isinstance(space, gym.spaces.Discrete):
            return tf.one_hot(tf.cast(obs, tf.int32) - int(space.start), int(space.n))
        if isinstance(space, gym.spaces.MultiDiscrete):
            idx = tf.reshape(tf.cast(obs, tf.int32), [-1, len(self._nvec)])
            hots = [tf.one_hot(idx[:, i], n) for i, n in enumerate(self._nvec)]
            return tf.concat(hots, axis=-1)
        x = tf.cast(obs, tf.float32)
        return tf.reshape(x, tf.concat([[-1], self.shape], 0)) if self.shape else x


def _layers_in(struct: Any, depth: int = 0) -> list[Any]:
    """The Keras layers and variables a `TFModelV2` holds, in attribute order."""
    if isinstance(struct, (keras.layers.Layer, keras.Variable)):
        return [struct]
    if depth > 4:
        return []
    if isinstance(struct, ModelV2):
        return _layers_in(vars(struct), depth + 1)
    out: list[Any] = []
    if isinstance(struct, (list, tuple)):
        for value in struct:
            out.extend(_layers_in(value, depth + 1))
    elif isinstance(struct, dict):
        for key, value in struct.items():
            if not str(key).startswith("__"):
                out.extend(_layers_in(value, depth + 1))
    return out


class CustomActorCritic(keras.Model):
    """A custom model with `ActorCritic`'s interface (see the module docstring).

    Build one with `impala_tf.models.build_model` (or `ModelSpec.build`); all variables exist
    and every check has run once the constructor returns.

    Args:
      observation_space: The env's observation space.
      action_space: The env's action space.
      spec: The policy's resolved model (`spec.custom` is not None).
      num_outputs: A, the action distribution's inputs.
      name: The Keras name of this wrapper; the user's model is built with it too.

    Attributes:
      net: The user's model: the `TFModelV2` instance or the `keras.Model`.
      model_config: The resolved model config.
      num_outputs: A.
      is_recurrent: The model carries a recurrent state (its own, or `use_lstm`'s).

    Raises:
      ModelError: naming the model and what does not fit.
    """

    def __init__(
        self,
        observation_space: gym.Space,
        action_space: gym.Space,
        spec: ModelSpec,
        *,
        num_outputs: int,
        name: str = "impala_model",
    ):
        super().__init__(name=name, dtype="float32")
        if spec.custom is None:
            raise ValueError("CustomActorCritic builds custom models; this spec has none.")
        self.observation_space = observation_space
        self.action_space = action_space
        self.model_config = dict(spec.config)
        self.num_outputs = int(num_outputs)
        self._label = spec.label
        self._inputs = _Inputs(observation_space)
        self._obs_shape = tuple(int(d) for d in (observation_space.shape or ()))
        self._obs_dtype = tf.as_dtype(np.dtype(observation_space.dtype or np.float32))
        wrapped = spec.use_lstm
        self.net = self._construct(spec, None if wrapped else self.num_outputs)
        self._is_v2 = isinstance(self.net, ModelV2)
        if self._is_v2:
            self._check_overrides()
            # Keras tracks what a Keras model's attributes hold; a TFModelV2 is a plain object.
            for i, part in enumerate(_layers_in(vars(self.net))):
                setattr(self, f"net_part_{i}", part)
        self._state_template: list[np.ndarray] = []
        if self._is_v2 and not wrapped:
            self._state_template = self._initial_state_template()
        self.core: LSTMCore | None = None
        self.logits_head = self.value_head = None
        if wrapped:
            self.core = LSTMCore(int(spec.config["lstm_cell_size"]), name="lstm", dtype="float32")
            self.logits_head = keras.layers.Dense(
                self.num_outputs, kernel_initializer=NormcInitializer(0.01), name="logits"
            )
            self.value_head = keras.layers.Dense(
                1, kernel_initializer=NormcInitializer(0.01), name="value"
            )
        self.is_recurrent = wrapped or bool(self._state_template)
        self._build_and_check()
        self._track_listed_layers()
        self.built = True

    # ----------------------------------------------------------------------------- building

    def _construct(self, spec: ModelSpec, num_outputs: int | None) -> Any:
        factory = spec.custom.obj
        input_space = model_input_space(self.observation_space)
        kwargs = spec.custom_model_config
        try:
            net = factory(
                input_space, self.action_space, num_outputs, dict(spec.config), self.name, **kwargs
            )
        except Exception as e:  # noqa: BLE001 - any failure is the model's; say which call.
            hint = (
                " With `use_lstm: true` the model is built with num_outputs=None, as RLlib's "
                "LSTMWrapper builds it: its outputs feed the LSTM."
                if num_outputs is None
                else ""
            )
            raise ModelError(
                f"{self._label}: building it failed: {type(e).__name__}: {e}. It was called "
                f"with (obs_space={input_space}, action_space={self.action_space}, "
                f"num_outputs={num_outputs}, model_config, name={self.name!r}"
                f"{''.join(f', {k}={v!r}' for k, v in kwargs.items())}).{hint}"
            ) from e
        if not isinstance(net, (ModelV2, keras.layers.Layer)):
            raise ModelError(
                f"{self._label} built {type(net).__name__}, which is neither a TFModelV2 "
                "(impala_tf.models.TFModelV2) nor a keras.Model."
            )
        return net

    def _check_overrides(self) -> None:
        if type(self.net).custom_loss is not ModelV2.custom_loss:
            raise ModelError(
                f"{self._label} overrides custom_loss(), which impala_tf does not call: the "
                "learner would train on the V-trace loss alone. Remove it, or add the term to "
                "the model's outputs."
            )

    def _initial_state_template(self) -> list[np.ndarray]:
        try:
            state = self.net.get_initial_state()
        except NotImplementedError as e:
            raise ModelError(f"{self._label}: {e}") from e
        out = []
        for i, s in enumerate(state or []):
            s = np.asarray(s, np.float32)
            if s.ndim != 1:
                raise ModelError(
                    f"{self._label}: get_initial_state()[{i}] has shape {s.shape}; each state "
                    "must be one env's vector [H] (the batch dimension is added)."
                )
            out.append(s)
        return out

    def _build_and_check(self) -> None:
        b = _PROBE_BATCH
        dummy = tf.zeros((b, *self._obs_shape), self._obs_dtype)
        state = self.initial_state(b)
        if self.core is not None:
            features = self._features(self._inputs(dummy), False)
            self._check_shape("outputs", features, None, "feed the LSTM (use_lstm)")
            self.core.build(features.shape)
        logits, values, new_state = self._raw_step(dummy, state, False)
        self._check_shape("logits", logits, (b, self.num_outputs), "[B, num_outputs]")
        if tuple(values.shape) not in ((b,), (b, 1)):
            raise ModelError(
                f"{self._label}: its values have shape {tuple(values.shape)} for a batch of {b}; "
                "expected [B] (or [B, 1])."
            )
        if len(new_state) != len(state) or any(
            tuple(n.shape) != tuple(s.shape) for n, s in zip(new_state, state)
        ):
            raise ModelError(
                f"{self._label}: forward() returned a state of shapes "
                f"{[tuple(s.shape) for s in new_state]}, but get_initial_state() gives "
                f"{[tuple(s.shape) for s in state]} for a batch of {b}."
            )
        self._check_variables()

    def _check_shape(self, what: str, x: Any, expected: tuple | None, want: str) -> None:
        shape = tuple(x.shape)
        ok = shape == expected if expected else len(shape) == 2 and shape[0] == _PROBE_BATCH
        if not ok:
            raise ModelError(
                f"{self._label}: its {what} have shape {shape} for a batch of {_PROBE_BATCH}; "
                f"expected {want}"
                + (f" = {expected} for the action space {self.action_space}." if expected else ".")
            )

    def _track_listed_layers(self) -> None:
        """Makes TensorFlow checkpoints hold the layers a Keras model keeps in Python lists.

        Keras 3 tracks such layers for its weights but not for `tf.train.Checkpoint`, so a
        checkpoint would silently leave them out (a resumed run would restart them from
        scratch). Each layer of the user's model is then also held by an attribute here (the
        weights and their order do not change); a weight still out of reach is an error.
        """
        if not untracked_variables(self):
            return
        parts = [self.net] if isinstance(self.net, keras.layers.Layer) else []
        parts += [getattr(self, n) for n in sorted(vars(self)) if n.startswith("net_part_")]
        layers = []
        for part in parts:
            if isinstance(part, keras.layers.Layer):
                layers.extend(part._flatten_layers(include_self=False))  # Keras 3 API.
        order = [id(v) for v in self.weights]
        for i, layer in enumerate(layers):
            setattr(self, f"checkpointed_layer_{i}", layer)
        if [id(v) for v in self.weights] != order:
            raise ModelError(f"{self._label}: its weights changed order when tracked.")
        missing = untracked_variables(self)
        if missing:
            raise ModelError(
                f"{self._label} holds weights no checkpoint would save "
                f"({', '.join(v.path for v in missing[:4])}): keep its layers in attributes."
            )

    def _check_variables(self) -> None:
        if not self._is_v2:
            return
        tracked = {id(v) for v in self.variables}
        missing = [v for v in self.net.variables() if id(v) not in tracked]
        if missing:
            names = ", ".join(str(getattr(v, "name", v)) for v in missing[:4])
            raise ModelError(
                f"{self._label} holds variables Keras does not track ({names}): create them "
                "with Keras layers (or keras.Variable) kept in the model's attributes, so that "
                "checkpoints and the actors' weights include them."
            )

    # ------------------------------------------------------------------------------ forward

    def initial_state(self, batch_size: int | tf.Tensor) -> State:
        """The state before the first step, float32 [B, H] each (() if not recurrent)."""
        if self.core is not None:
            return self.core.initial_state(batch_size)
        return tuple(
            tf.tile(tf.constant(s)[None], tf.stack([batch_size, 1])) for s in self._state_template
        )

    def _v2_forward(self, x: tf.Tensor, state: State, training: bool) -> tuple[Any, list]:
        seq_lens = tf.ones(tf.shape(x)[:1], tf.int32) if state else None
        state = [tf.convert_to_tensor(s, tf.float32) for s in state]
        return self.net({"obs": x, "is_training": training}, state, seq_lens)

    def _features(self, x: tf.Tensor, training: bool) -> tf.Tensor:
        """The wrapped model's outputs [N, F] (use_lstm)."""
        if self._is_v2:
            out, _ = self._v2_forward(x, (), training)
        else:
            out = self.net(x, training=training)
            if isinstance(out, (list, tuple)):
                out = out[0]
        return tf.cast(out, tf.float32)

    def _raw_step(
        self, obs: tf.Tensor, state: State, training: bool
    ) -> tuple[tf.Tensor, tf.Tensor, State]:
        """One step, outputs as the model gives them (cast to float32)."""
        x = self._inputs(obs)
        if self.core is not None:
            out, new_state = self.core.step(self._features(x, training), tuple(state))
            logits = self.logits_head(out)
            values = self.value_head(out)
        elif self._is_v2:
            logits, new_state = self._v2_forward(x, state, training)
            values = self.net.value_function()
            new_state = tuple(tf.cast(s, tf.float32) for s in new_state) if state else ()
        else:
            out = self.net(x, training=training)
            if not isinstance(out, (list, tuple)) or len(out) != 2:
                what = type(out).__name__
                if isinstance(out, (list, tuple)):
                    what += f" of {len(out)}"
                raise ModelError(
                    f"{self._label}: call(obs) must return (logits, values), got {what}."
                )
            logits, values = out
            new_state = ()
        return tf.cast(logits, tf.float32), tf.cast(values, tf.float32), tuple(new_state)

    def step(
        self, obs: tf.Tensor, state: State, training: bool = False
    ) -> tuple[tf.Tensor, tf.Tensor, State]:
        """One env step: (logits float32 [B, A], values float32 [B], new state)."""
        logits, values, new_state = self._raw_step(tf.convert_to_tensor(obs), state, training)
        return logits, tf.reshape(values, [-1]), new_state

    def call(self, obs: tf.Tensor, training: bool = False) -> tuple[tf.Tensor, tf.Tensor]:
        """(logits [B, A], values [B]) from the initial state."""
        obs = tf.convert_to_tensor(obs)
        logits, values, _ = self.step(obs, self.initial_state(tf.shape(obs)[0]), training)
        return logits, values

    def unroll(
        self, obs: tf.Tensor, resets: tf.Tensor, state: State, training: bool = False
    ) -> tuple[tf.Tensor, tf.Tensor, State]:
        """The model over time-major sequences (see `ActorCritic.unroll`).

        Args:
          obs: [T, B, *obs_shape] observations.
          resets: bool [T, B]: an episode starts at step t (the state is set back first).
          state: The state before step 0 (() if not recurrent).
          training: Keras training flag.

        Returns:
          (logits float32 [T, B, A], values float32 [T, B], final state).
        """
        obs = tf.convert_to_tensor(obs)
        t, b = tf.shape(obs)[0], tf.shape(obs)[1]
        flat = tf.reshape(obs, tf.concat([[t * b], tf.constant(self._obs_shape, tf.int32)], 0))
        if not self.is_recurrent:
            logits, values, _ = self.step(flat, (), training)
            final = ()
        elif self.core is not None:
            features = self._features(self._inputs(flat), training)
            features = tf.reshape(features, tf.stack([t, b, features.shape[-1]]))
            out, final = self.core.unroll(features, resets, tuple(state))
            out = tf.reshape(out, [-1, self.core.units])
            logits = self.logits_head(out)
            values = tf.reshape(self.value_head(out), [-1])
        else:
            logits, values, final = self._unroll_steps(obs, resets, state, training)
        logits = tf.reshape(logits, tf.stack([t, b, self.num_outputs]))
        values = tf.reshape(values, tf.stack([t, b]))
        return logits, values, final

    def _unroll_steps(
        self, obs: tf.Tensor, resets: tf.Tensor, state: State, training: bool
    ) -> tuple[tf.Tensor, tf.Tensor, State]:
        """A recurrent `TFModelV2` over [T, B] steps, one `step` per time step.

        Where an episode starts (`resets[t]`) the state goes back to the initial state first.
        With T known when traced (the learner's `max_seq_len` sequences) the steps are laid
        out one after another in the graph, which runs faster than a `tf.scan` of the same
        steps; otherwise they are scanned.
        """
        b = tf.shape(obs)[1]
        initial = self.initial_state(b)
        resets = tf.cast(resets, tf.bool)

        def advance(carry: State, obs_t: tf.Tensor, reset_t: tf.Tensor):
            keep = tf.logical_not(reset_t)[:, None]
            carry = tuple(tf.where(keep, c, i) for c, i in zip(carry, initial))
            logits_t, values_t, new = self.step(obs_t, carry, training)
            return logits_t, values_t, tuple(new)

        carry = tuple(tf.convert_to_tensor(s, tf.float32) for s in state)
        steps = obs.shape[0]
        if steps is not None and steps <= _MAX_LAID_OUT_STEPS:
            all_logits, all_values = [], []
            for t in range(steps):
                logits_t, values_t, carry = advance(carry, obs[t], resets[t])
                all_logits.append(logits_t)
                all_values.append(values_t)
            return tf.stack(all_logits), tf.stack(all_values), carry

        def body(previous, inputs):
            return advance(previous[2], *inputs)

        probe = (
            tf.zeros(tf.stack([b, self.num_outputs])),
            tf.zeros(tf.stack([b])),
            carry,
        )
        logits, values, states = tf.scan(body, (obs, resets), initializer=probe)
        return logits, values, tuple(s[-1] for s in states)

    @property
    def value_variables(self) -> list[tf.Variable]:
        """The value head's variables (use_lstm); a user's model keeps its own split."""
        return list(self.value_head.trainable_variables) if self.value_head is not None else []

    @property
    def policy_variables(self) -> list[tf.Variable]:
        value_ids = {id(v) for v in self.value_variables}
        return [v for v in self.trainable_variables if id(v) not in value_ids]
