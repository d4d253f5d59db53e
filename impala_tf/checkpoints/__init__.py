"""Checkpoints: the on-disk layout (`impala_tf.checkpoints.store`) and loading a run's config.

Everything of `store` is re-exported here (`write_checkpoint`, `resolve_checkpoint_dir`,
`restore_model`, ...), plus `load_config`, which rebuilds the `ImpalaConfig` a checkpoint was
trained with. Evaluating or exporting a checkpoint's policies is `impala_tf.evaluation`'s.
"""

from __future__ import annotations

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
    learner_prefix,
    list_checkpoints,
    prune_checkpoints,
    read_config_dict,
    read_driver_state,
    read_runtime_state,
    read_state,
    resolve_checkpoint_dir,
    restore_model,
    storable_config,
    untracked_variables,
    write_checkpoint,
)
from impala_tf.config import ImpalaConfig

__all__ = [
    "CHECKPOINTS_DIR",
    "CheckpointWriteError",
    "DRIVER_STATE_FILE",
    "LEARNER_PREFIX",
    "POLICIES_DIR",
    "RUNTIME_STATE_FILE",
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


def load_config(checkpoint_dir: str) -> ImpalaConfig:
    """Rebuilds the `ImpalaConfig` a checkpoint was trained with.

    Args:
      checkpoint_dir: Anything `resolve_checkpoint_dir` accepts.

    Raises:
      FileNotFoundError: if there is no checkpoint there.
      ValueError: if the checkpoint holds no config (it was trained on an `env` callable, which
        JSON cannot store).
    """
    return ImpalaConfig.from_dict(read_config_dict(checkpoint_dir))
