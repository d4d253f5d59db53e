"""Checkpoints: the on-disk layout, written and found (`impala_tf.checkpoints.store`), the config
as stored (`impala_tf.checkpoints.stored_config`), reading back (`impala_tf.checkpoints.reading`)
and loading a run's config.

The public names of those modules are re-exported here (`write_checkpoint`,
`resolve_checkpoint_dir`, `read_state`, `restore_model`, ...), plus `load_config`, which rebuilds
the config a checkpoint was trained with. Evaluating or exporting a checkpoint's policies is
`impala_tf.driver.evaluation`'s.
"""

from __future__ import annotations

from impala_tf.checkpoints.reading import (
    learner_prefix,
    read_config_dict,
    read_driver_state,
    read_runtime_state,
    read_state,
    restore_model,
)
from impala_tf.checkpoints.store import (
    CHECKPOINTS_DIR,
    DRIVER_STATE_FILE,
    LEARNER_PREFIX,
    POLICIES_DIR,
    RUNTIME_STATE_FILE,
    CheckpointWriteError,
    checkpoint_path,
    latest_checkpoint,
    learner_checkpoint,
    list_checkpoints,
    prune_checkpoints,
    resolve_checkpoint_dir,
    write_checkpoint,
)
from impala_tf.checkpoints.stored_config import StoredConfig, storable_config
from impala_tf.config.base import AlgorithmConfig
from impala_tf.config.registry import config_class
from impala_tf.models.spec import register_stored_models
from impala_tf.models.tracking import untracked_variables

__all__ = [
    "CHECKPOINTS_DIR",
    "CheckpointWriteError",
    "DRIVER_STATE_FILE",
    "LEARNER_PREFIX",
    "POLICIES_DIR",
    "RUNTIME_STATE_FILE",
    "StoredConfig",
    "checkpoint_path",
    "latest_checkpoint",
    "learner_checkpoint",
    "learner_prefix",
    "list_checkpoints",
    "load_config",
    "prune_checkpoints",
    "read_config_dict",
    "read_driver_state",
    "read_runtime_state",
    "read_state",
    "resolve_checkpoint_dir",
    "restore_model",
    "storable_config",
    "untracked_variables",
    "write_checkpoint",
]


def load_config(checkpoint_dir: str) -> AlgorithmConfig:
    """Rebuilds the config a checkpoint was trained with: an `ImpalaConfig`, or the config
    class of the algorithm the checkpoint names (`"algorithm"`, e.g. an `APPOConfig`).

    Custom models the run named by a registered name (`ModelCatalog.register_custom_model`)
    are registered again here from the import paths the checkpoint keeps
    (`"custom_models"` of `driver_state.json`), unless this process registered the name.

    Args:
      checkpoint_dir: Anything `resolve_checkpoint_dir` accepts.

    Raises:
      FileNotFoundError: if there is no checkpoint there.
      ValueError: if the checkpoint holds no config (it was trained on an `env` callable, which
        JSON cannot store), or a registered custom model's path does not import here.
    """
    config = read_config_dict(checkpoint_dir)
    state = read_driver_state(checkpoint_dir)
    register_stored_models(state.get("custom_models") or {})
    # Checkpoints written before APPO existed name no algorithm: they are IMPALA's.
    return config_class(state.get("algorithm", "IMPALA")).from_dict(config)
