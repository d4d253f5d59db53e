"""Reading a checkpoint back: its driver state, config, runtime state and policies' learners.

Every reader takes anything `impala_tf.checkpoints.store.resolve_checkpoint_dir` accepts (a
checkpoint directory, a training logdir, a directory of checkpoints) and returns this layout's
data (see `impala_tf.checkpoints.store` for the files): `read_state` the driver state in this
layout's keys, `read_config_dict` the stored config, `learner_prefix` the `tf.train.Checkpoint`
prefix of one policy's learner, `read_runtime_state` the plain data of `runtime_state.pkl` (a
pickle: like any pickle, load only checkpoints you trust).

Checkpoints written before this layout still load (`impala_tf.checkpoints.legacy`): a
single-agent one keeps its learner at the top (`learner.*`) and its filter under
`"observation_filter"`; a multi-agent one has the same `policies/<policy_id>/learner.*` (each a
complete single-policy checkpoint then); its `runtime_state.pkl` may pickle the driver's
aggregator object, read back as plain data.

Evaluation and export need a policy's weights and observation filter only: `restore_model`
loads one policy's `model` part into a model rebuilt from the config and the env's spaces.

This module imports TensorFlow only in the functions that need it, and no config class.
"""

from __future__ import annotations

import json
import os
from typing import Any

from impala_tf.checkpoints.legacy import load_runtime_state, normalize_state
from impala_tf.checkpoints.store import (
    DRIVER_STATE_FILE,
    LEARNER_PREFIX,
    POLICIES_DIR,
    RUNTIME_STATE_FILE,
    resolve_checkpoint_dir,
)
from impala_tf.config.policies import DEFAULT_POLICY_ID
from impala_tf.models.tracking import untracked_variables

__all__ = [
    "learner_prefix",
    "read_config_dict",
    "read_driver_state",
    "read_runtime_state",
    "read_state",
    "restore_model",
]


def read_driver_state(checkpoint_dir: str) -> dict[str, Any]:
    """Returns the parsed `driver_state.json` of the checkpoint at `checkpoint_dir`."""
    directory = resolve_checkpoint_dir(checkpoint_dir)
    with open(os.path.join(directory, DRIVER_STATE_FILE), encoding="utf-8") as f:
        return json.load(f)


def read_state(checkpoint_dir: str) -> dict[str, Any]:
    """`driver_state.json` of any layout, in this layout's keys.

    Always present in the result: `"policy_ids"` and `"observation_filters"` ({policy_id:
    filter state or None}); the rest as saved (`"iteration"`, `"counters"`, `"episodes"`, ...).
    """
    return normalize_state(read_driver_state(checkpoint_dir))


def read_config_dict(checkpoint_dir: str) -> dict[str, Any]:
    """The stored config as a dict (`AlgorithmConfig.to_dict()`).

    Raises:
      ValueError: if the checkpoint holds no config (it was trained on an `env` callable, which
        JSON cannot store).
    """
    config = read_driver_state(checkpoint_dir).get("config")
    if config is None:
        raise ValueError(
            f"The checkpoint at {checkpoint_dir!r} holds no config: it was trained on an "
            "env_creator callable, which cannot be stored. Rebuild the ImpalaConfig in Python "
            "and pass it as `config=`."
        )
    return config


def learner_prefix(checkpoint_dir: str, policy_id: str = DEFAULT_POLICY_ID) -> str:
    """The `tf.train.Checkpoint` prefix of one policy's learner in a checkpoint of any layout.

    Raises:
      ValueError: naming the policies the checkpoint has, when it has no `policy_id`.
    """
    directory = resolve_checkpoint_dir(checkpoint_dir)
    prefix = os.path.join(directory, POLICIES_DIR, policy_id, LEARNER_PREFIX)
    if os.path.isfile(prefix + ".index"):
        return prefix
    state = read_state(directory)
    if policy_id in state["policy_ids"] and os.path.isfile(
        os.path.join(directory, LEARNER_PREFIX + ".index")
    ):
        return os.path.join(directory, LEARNER_PREFIX)  # The single-agent layout before 2.
    raise ValueError(
        f"No policy {policy_id!r} in the checkpoint {directory}; it has {state['policy_ids']}."
    )


def read_runtime_state(checkpoint_dir: str) -> dict[str, Any]:
    """The plain data of `runtime_state.pkl` ({} when there is none).

    Keys: `"aggregator"` ({policy_id: {"pending": ..., "replay": ...}}, see
    `impala_tf.driver.aggregation.Aggregator.get_state`) and `"actors"` ({actor id: runner
    snapshot}); older checkpoints' pickled objects are read back as that data.
    """
    path = os.path.join(resolve_checkpoint_dir(checkpoint_dir), RUNTIME_STATE_FILE)
    if not os.path.isfile(path):
        return {}
    with open(path, "rb") as f:
        return load_runtime_state(f)  # A checkpoint is trusted like code (docstring).


def restore_model(model: Any, checkpoint_dir: str, policy_id: str = DEFAULT_POLICY_ID) -> None:
    """Loads one policy's `model` part into `model`, ignoring optimizers and counters.

    Args:
      model: An `ActorCritic` built from the checkpoint's (policy) config and the env's spaces.
      checkpoint_dir: Anything `resolve_checkpoint_dir` accepts.
      policy_id: The policy (`"default_policy"` for a single-agent run).

    Raises:
      ValueError: if some variables of `model` cannot be in a checkpoint's `model` part (see
        `untracked_variables`), rather than leave them at their initial values; or if the
        checkpoint has no such policy.
      AssertionError: if a variable of `model` has no value in the checkpoint (a different
        architecture); a variable of another shape raises while reading.
    """
    import tensorflow as tf

    missing = untracked_variables(model)
    if missing:
        raise ValueError(
            f"{len(missing)} of the model's {len(model.variables)} variables "
            f"({', '.join(v.path for v in missing[:4])}{', ...' if len(missing) > 4 else ''}) "
            "are not tracked by tf.train.Checkpoint, so no checkpoint holds them under `model`: "
            "a layer keeps sublayers in a Python list, which Keras 3 does not track for "
            "TensorFlow checkpoints. Assign each sublayer to an attribute as well."
        )
    status = tf.train.Checkpoint(model=model).read(learner_prefix(checkpoint_dir, policy_id))
    # The optimizers and counters stay unread on purpose; every model variable must be matched.
    status.expect_partial().assert_existing_objects_matched()
