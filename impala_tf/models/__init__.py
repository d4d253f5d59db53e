"""Keras actor-critic models for impala_tf, built from spaces and RLlib's model config keys."""

from impala_tf.models.actor_critic import ActorCritic
from impala_tf.models.catalog import (
    CUSTOM_MODELS,
    MODEL_DEFAULTS,
    build_model,
    resolve_model_config,
)
from impala_tf.models.initializers import NormcInitializer
from impala_tf.models.mlp import MLP
from impala_tf.models.preprocessing import ObservationPreprocessor, is_image_space
from impala_tf.models.recurrent import LSTMCore
from impala_tf.models.vision import (
    ConvStack,
    CoveringConv2D,
    ImpalaResNet,
    NatureCNN,
    get_filter_config,
)

__all__ = [
    "CUSTOM_MODELS",
    "MODEL_DEFAULTS",
    "MLP",
    "ActorCritic",
    "ConvStack",
    "CoveringConv2D",
    "ImpalaResNet",
    "LSTMCore",
    "NatureCNN",
    "NormcInitializer",
    "ObservationPreprocessor",
    "build_model",
    "get_filter_config",
    "is_image_space",
    "resolve_model_config",
]
