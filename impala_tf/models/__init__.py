"""Keras actor-critic models, built from spaces and RLlib's model config keys, and custom models.

The catalog's networks (`build_model`: MLPs, RLlib's vision network, the IMPALA paper's
ResNet, LSTM cores) and what users bring: RLlib's `ModelCatalog.register_custom_model`,
`TFModelV2` and `RecurrentNetwork` (`impala_tf.models.modelv2`; RLlib's
`FullyConnectedNetwork` and `VisionNetwork` as such, `impala_tf.models.rllib_networks`), or any
`keras.Model`
(`impala_tf.models.custom`). A policy's model is resolved once into a `ModelSpec`
(`impala_tf.models.spec`) that every part builds from.

Names load on first use: `ModelCatalog`, `ModelSpec` and `model_spec` import no TensorFlow.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ActorCritic": "impala_tf.models.actor_critic",
    "CUSTOM_MODELS": "impala_tf.models.catalog",
    "MODEL_DEFAULTS": "impala_tf.models.catalog",
    "build_model": "impala_tf.models.catalog",
    "resolve_model_config": "impala_tf.models.catalog",
    "CustomActorCritic": "impala_tf.models.custom",
    "model_input_space": "impala_tf.models.custom",
    "NormcInitializer": "impala_tf.models.initializers",
    "MLP": "impala_tf.models.mlp",
    "ModelV2": "impala_tf.models.modelv2",
    "RecurrentNetwork": "impala_tf.models.modelv2",
    "TFModelV2": "impala_tf.models.modelv2",
    "normc_initializer": "impala_tf.models.modelv2",
    "try_import_tf": "impala_tf.models.modelv2",
    "ObservationPreprocessor": "impala_tf.models.preprocessing",
    "is_image_space": "impala_tf.models.preprocessing",
    "LSTMCore": "impala_tf.models.recurrent",
    "FullyConnectedNetwork": "impala_tf.models.rllib_networks",
    "VisionNetwork": "impala_tf.models.rllib_networks",
    "ModelCatalog": "impala_tf.models.spec",
    "ModelError": "impala_tf.models.spec",
    "ModelSpec": "impala_tf.models.spec",
    "model_spec": "impala_tf.models.spec",
    "ConvStack": "impala_tf.models.vision",
    "CoveringConv2D": "impala_tf.models.vision",
    "ImpalaResNet": "impala_tf.models.vision",
    "NatureCNN": "impala_tf.models.vision",
    "get_filter_config": "impala_tf.models.vision",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'impala_tf.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
