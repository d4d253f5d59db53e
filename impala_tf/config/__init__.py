"""`ImpalaConfig`: RLlib's IMPALA config, and `build()`, which makes the algorithm from it.

    from impala_tf.config import ImpalaConfig

    config = ImpalaConfig().environment("CartPole-v1").training(lr=1e-3)
    algo = config.build()

The package's parts, bottom up: `keys` (the key tables, model defaults, stop criteria, warnings),
`validation` (pure checks), `policies` (RLlib's multi-agent keys: `PolicySpec`, the policy mapping
function, per-policy configs), `experiments` (tuned-example YAML files), `resolution` (how a
setting finds its key) and `base` (`AlgorithmConfig`: the keys as attributes, builders, YAML).
The runtime reads configs through `AlgorithmConfig` and never imports this module, whose
`build()` reaches up to it (`impala_tf.driver.factory.build_algorithm`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from impala_tf.config.base import AlgorithmConfig
from impala_tf.config.keys import (
    MODEL_DEFAULTS,
    ConfigWarning,
    DeprecatedKeyWarning,
    normalize_stop_criteria,
)

__all__ = [
    "MODEL_DEFAULTS",
    "AlgorithmConfig",
    "ConfigWarning",
    "DeprecatedKeyWarning",
    "ImpalaConfig",
    "normalize_stop_criteria",
]


class ImpalaConfig(AlgorithmConfig):
    """RLlib's IMPALA config (`AlgorithmConfig`'s keys, builders and checks) with `build()`.

    Construct with defaults (`ImpalaConfig()`), or with settings
    (`ImpalaConfig(env="CartPole-v1", lr=1e-3)`, the same as `update_from_dict`), then chain
    builders: `ImpalaConfig().environment("CartPole-v1").training(lr=1e-3)`. Values are not
    checked until `validate()` (called by `build()`). Every key, its default and its RLlib name:
    `docs/configs.md`.
    """

    def build(
        self,
        env: Any = None,
        logger_creator: Callable | None = None,
        *,
        callbacks: list | None = None,
        deterministic: bool = False,
        logdir: str | None = None,
    ) -> Any:
        """Validates this config and returns the algorithm built from it (an `Impala`).

        The same factory as `impala-train` (`impala_tf.driver.factory.build_algorithm`).

        Args:
          env: If given, sets `env` first (gymnasium id or `env_creator(env_config)`), as RLlib.
          logger_creator: RLlib's `logger_creator(config) -> logger`: called once; the
            logger's `logdir`, when it has one, becomes the run's directory. Anything else
            it returns is ignored with a warning (results go through callbacks here).
          callbacks: Keras callbacks for the learner threads (called around each update).
          deterministic: Sample and train in lockstep, so that a seeded run is reproducible.
          logdir: The run's directory (batches of skipped non-finite updates go there).

        Returns:
          An `impala_tf.driver.algorithm.Impala`.
        """
        if env is not None:
            self.environment(env)
        from impala_tf.driver.factory import build_algorithm  # Lazy: it imports TensorFlow.

        return build_algorithm(
            self,
            callbacks=callbacks,
            deterministic=deterministic,
            logdir=logdir,
            logger_creator=logger_creator,
        )
