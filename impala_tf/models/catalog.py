"""Builds an ActorCritic from gymnasium spaces and RLlib's model config keys.

Torso choice (RLlib's ModelCatalog, with the IMPALA paper's networks added):

- Image observations (rank-3 Box, H x W x C), as RLlib's VisionNetwork: the `conv_filters`
  stack, or without `conv_filters` (None or []) RLlib's default filters for the image size
  (`get_filter_config`: 96x96, 84x84, 64x64, 42x42, 10x10; other sizes are an error naming
  `conv_filters`), with `conv_activation`, then `post_fcnet_hiddens` / `post_fcnet_activation`.
  `vf_share_layers=True` (RLlib's default) puts the value head on the same torso;
  `vf_share_layers=False` builds a second conv stack for the value head, as RLlib does (its value
  tower ignores `post_fcnet_hiddens`). As RLlib's, this network takes uint8 pixels as 0..255
  and a shared value head starts with normc(0.01); unlike RLlib's (a Glorot 1x1 conv), its
  logits head starts with normc(0.01) too, so that no seed starts nearly deterministic.
  With `center_pixels=True` (ours; off by default, as in RLlib) uint8 pixels enter both conv
  stacks as x - 128 (-128..127) instead: the same layers and variables, but Pong's policy
  leaves its uniform start sooner (docs/models.md).
  By name: `custom_model="nature_cnn"` (Mnih et al. 2015) and `custom_model="impala_resnet"`
  (Espeholt et al. 2018); these always share their torso with the value head, scale uint8
  pixels to [0, 1] as DeepMind's agents do, and have normc(0.01) heads.
- Other observations: an MLP of `fcnet_hiddens` / `fcnet_activation`, shared with the value
  head (`vf_share_layers=True`, RLlib's default); with `vf_share_layers=False` a second MLP of the
  same shape feeds the value head.
- `use_lstm=True`: an LSTM core of `lstm_cell_size` between the torso and both heads, shared by
  policy and value (as RLlib's LSTM wrapper), so no separate value tower is built.

Any other `custom_model` (a registered name, an import path or a class: `impala_tf.models.spec`)
is the user's model, built and checked by `impala_tf.models.custom.CustomActorCritic`.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from impala_tf.config.keys import MODEL_DEFAULTS as RLLIB_MODEL_DEFAULTS
from impala_tf.models.actor_critic import ActorCritic
from impala_tf.models.distributions import logits_size
from impala_tf.models.mlp import MLP, get_activation
from impala_tf.models.precision import dtype_policy
from impala_tf.models.preprocessing import ObservationPreprocessor, is_image_space
from impala_tf.models.recurrent import LSTMCore
from impala_tf.models.spec import BUILTIN_MODELS, ModelSpec, model_spec, resolve_custom_model
from impala_tf.models.vision import (
    ConvStack,
    ImpalaResNet,
    NatureCNN,
    get_filter_config,
    parse_conv_filters,
)

__all__ = ["CUSTOM_MODELS", "MODEL_DEFAULTS", "build_model", "resolve_model_config"]

# RLlib's model defaults live in the (TensorFlow-free) config keys; one copy.
MODEL_DEFAULTS: dict[str, Any] = {**RLLIB_MODEL_DEFAULTS, "use_attention": False}

CUSTOM_MODELS = BUILTIN_MODELS


def resolve_model_config(model_config: dict[str, Any] | None) -> dict[str, Any]:
    """Fills RLlib's defaults into `model_config` and rejects what the models cannot do.

    Unknown keys are kept and ignored here (the config module validates key names).

    Raises:
        ValueError: naming the key, for use_attention=True,
            lstm_use_prev_action/lstm_use_prev_reward with use_lstm, a custom_model that names
            nothing (`impala_tf.models.spec.resolve_custom_model`), a non-positive
            lstm_cell_size, bad activations, a malformed conv_filters or post_fcnet_hiddens.
    """
    config = dict(MODEL_DEFAULTS)
    config.update(model_config or {})
    if config["use_attention"]:
        raise ValueError("model_config use_attention=True is not supported by impala_tf.")
    if config["use_lstm"] and (config["lstm_use_prev_action"] or config["lstm_use_prev_reward"]):
        raise ValueError(
            "model_config lstm_use_prev_action / lstm_use_prev_reward are not supported yet: "
            "the models do not take previous actions or rewards as inputs."
        )
    resolve_custom_model(config["custom_model"])
    if int(config["lstm_cell_size"]) <= 0:
        raise ValueError(
            f"model_config lstm_cell_size must be > 0, got {config['lstm_cell_size']}."
        )
    hiddens = config["fcnet_hiddens"]
    if not isinstance(hiddens, list | tuple) or not all(
        isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in hiddens
    ):
        raise ValueError(
            f"model_config fcnet_hiddens must be a list of positive ints, got {hiddens!r}."
        )
    post = config["post_fcnet_hiddens"]
    if not isinstance(post, list | tuple) or not all(
        isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in post
    ):
        raise ValueError(
            f"model_config post_fcnet_hiddens must be a list of positive ints, got {post!r}."
        )
    get_activation(config["fcnet_activation"], "fcnet_activation")
    get_activation(config["conv_activation"], "conv_activation")
    get_activation(config["post_fcnet_activation"], "post_fcnet_activation")
    if config["conv_filters"]:  # RLlib reads an empty list as "use the default CNN".
        parse_conv_filters(config["conv_filters"])
    return config


def build_model(
    observation_space: gym.Space,
    action_space: gym.Space,
    model_config: dict[str, Any] | ModelSpec | None = None,
    name: str = "impala_model",
    precision: str = "float32",
) -> Any:
    """Builds the actor-critic for the given spaces from RLlib-style model config keys.

    Args:
        observation_space: Box (vector or H x W x C image), Discrete, MultiDiscrete or MultiBinary.
        action_space: Discrete, MultiDiscrete or Box (see `impala_tf.models.distributions`).
        model_config: RLlib model keys, or a policy's resolved `ModelSpec`; missing keys take
            RLlib's defaults (`MODEL_DEFAULTS`).
            `lstm_use_prev_action` / `lstm_use_prev_reward` with `use_lstm` raise "not supported
            yet"; `max_seq_len` and `dim` are informational here. `post_fcnet_hiddens` and
            `post_fcnet_activation` apply to the vision network only (as RLlib).
        name: the Keras model name.
        precision: the `precision` config key: "float32", or "mixed_bfloat16" for torso layers
            that compute in bfloat16 (variables, heads, LSTM core and outputs stay float32;
            `impala_tf.models.precision`).

    Returns:
        An `ActorCritic` with all variables created; for a user's `custom_model`, a
        `impala_tf.models.custom.CustomActorCritic` (the same interface).

    Raises:
        ValueError: for unsupported spaces or config values, an image size with no default
            filters (naming `conv_filters`), or an image too small for the torso;
            `impala_tf.models.spec.ModelError` (a ValueError) for a custom model that does not
            fit, naming it.
    """
    spec = model_spec(model_config)
    if spec.custom is not None:
        from impala_tf.models.custom import CustomActorCritic

        with dtype_policy(precision):
            return CustomActorCritic(
                observation_space,
                action_space,
                spec,
                num_outputs=logits_size(action_space),
                name=name,
            )
    config = resolve_model_config(dict(spec.config))
    with dtype_policy(precision):
        return _assemble(observation_space, action_space, config, name)


def _assemble(
    observation_space: gym.Space, action_space: gym.Space, config: dict[str, Any], name: str
) -> ActorCritic:
    """`build_model` on a resolved model config, under the dtype policy the caller set."""
    num_outputs = logits_size(action_space)
    ObservationPreprocessor(observation_space)  # Rejects unsupported observation spaces early.
    custom = config["custom_model"]
    if config["center_pixels"] and custom is not None:
        raise ValueError(
            f"model_config center_pixels=True applies to RLlib's vision network; custom_model="
            f"{custom!r} scales uint8 pixels to [0, 1] itself."
        )
    value_torso = None
    value_init = None  # normc(0.01), RLlib's fully connected heads (the logits head's too).
    if is_image_space(observation_space):
        # DeepMind's torsos scale uint8 pixels to [0, 1]; RLlib's vision net takes 0..255.
        uint8 = observation_space.dtype == np.uint8
        scale = 1.0 / 255.0 if uint8 else 1.0
        if custom == "impala_resnet":
            torso = ImpalaResNet(input_scale=scale, name="impala_resnet")
        elif custom == "nature_cnn":
            torso = NatureCNN(config["conv_activation"], input_scale=scale, name="nature_cnn")
        else:
            # RLlib's VisionNetwork, but for one departure: its logits are a 1x1 conv with
            # Keras' default Glorot init, which on 0..255 pixels starts some seeds with a
            # near-deterministic policy (Pong's frames: entropy from 1e-6 to 0.65 of ln 6 = 1.79
            # over eight seeds) whose policy gradient vanishes, so it never learns (Pong seed
            # 100: -21 and entropy ~1e-8 for 420k env steps). Ours starts the logits like
            # RLlib's fully connected heads, normc(0.01): a uniform policy on every seed. A
            # separate value tower's output keeps Glorot, a shared value head normc(0.01).
            # `center_pixels` (ours, off as in RLlib) shifts uint8 pixels to -128..127 first.
            shift = 128.0 if config["center_pixels"] and uint8 else 0.0
            filters = config["conv_filters"] or get_filter_config(observation_space.shape)
            torso = ConvStack(
                filters,
                config["conv_activation"],
                config["post_fcnet_hiddens"],
                config["post_fcnet_activation"],
                post_conv_1x1=not config["use_lstm"],
                input_shift=shift,
                name="conv_stack",
            )
            if not config["vf_share_layers"] and not config["use_lstm"]:
                value_torso = ConvStack(
                    filters, config["conv_activation"], input_shift=shift, name="conv_value"
                )
                value_init = "glorot_uniform"
    else:
        if custom is not None:
            raise ValueError(
                f"model_config custom_model={custom!r} needs image observations (a rank-3 Box), "
                f"got {observation_space!r}."
            )
        torso = MLP(config["fcnet_hiddens"], config["fcnet_activation"], name="fc_torso")
        if not config["vf_share_layers"] and not config["use_lstm"]:
            value_torso = MLP(
                config["fcnet_hiddens"], config["fcnet_activation"], name="fc_value_torso"
            )
    core = None
    if config["use_lstm"]:
        core = LSTMCore(int(config["lstm_cell_size"]), name="lstm", dtype="float32")
    try:
        return ActorCritic(
            observation_space,
            action_space,
            config,
            num_outputs=num_outputs,
            torso=torso,
            value_torso=value_torso,
            core=core,
            value_initializer=value_init,
            name=name,
        )
    except ValueError as e:
        if not is_image_space(observation_space):
            raise
        raise ValueError(
            f"Could not build the {torso.name} torso for observations of shape "
            f"{observation_space.shape} (too small for its kernels and strides?): {e}"
        ) from e
