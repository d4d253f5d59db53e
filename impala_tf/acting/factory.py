"""`make_policy`: how a policy acts, chosen once from its spaces and model.

In order of speed: `NumpyPolicy` (the catalog's MLPs in numpy), a custom model's traced step run
in numpy (`impala_tf.acting.traced_policy`), else `ActorPolicy` (TensorFlow, imported only then).
Env runners, evaluation and `impala_tf.acting.trained_policy.Policy` all build their policy here.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym

from impala_tf.acting.numpy_policy import NumpyPolicy, supports
from impala_tf.models.spec import ModelSpec

__all__ = ["make_policy"]


def make_policy(
    observation_space: gym.Space,
    action_space: gym.Space,
    model_config: Any = None,
    explore: bool = True,
    seed: int | None = None,
    precision: str = "float32",
):
    """The acting policy for these spaces: `NumpyPolicy` for the catalog's MLPs; for a custom
    model whose step numpy can run, its traced step in numpy (`impala_tf.acting.traced_policy`);
    else `ActorPolicy` (TensorFlow). `model_config` is RLlib model keys or the policy's
    `ModelSpec`.

    `precision` (the config key) applies to `ActorPolicy`'s Keras model; `NumpyPolicy` computes
    in float32 numpy whatever it says, and a custom model acts in numpy only in float32.
    """
    if supports(observation_space, action_space, model_config):
        return NumpyPolicy(observation_space, action_space, model_config, explore, seed)
    from impala_tf.acting.tf_policy import ActorPolicy  # imports TensorFlow

    actor = ActorPolicy(observation_space, action_space, model_config, explore, seed, precision)
    custom = isinstance(model_config, ModelSpec) and model_config.custom is not None
    if custom and precision == "float32":
        from impala_tf.acting.traced_policy import numpy_acting

        return numpy_acting(actor)
    return actor
