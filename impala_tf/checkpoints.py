"""Checkpoints on disk: the one layout `Impala.save` writes, and loading a policy back from it.

A checkpoint is a directory holding

* `learner.index` / `learner.data-*`: a `tf.train.Checkpoint` with the parts `model`,
  `policy_optimizer`, `num_grad_updates`, `num_agent_steps_trained` and, with
  `_separate_vf_optimizer`, `value_optimizer` (see `learner_checkpoint`);
* `driver_state.json`: the driver's counters plus `"config": ImpalaConfig.to_dict()` (None when
  `env` is a callable, which JSON cannot hold).

Evaluation and export only need the weights: they restore the `model` part alone, into a model
rebuilt from the stored config and the env's spaces.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from impala_tf.config import ImpalaConfig

if TYPE_CHECKING:  # TensorFlow is imported by the functions that need it.
    import keras
    import tensorflow as tf

    from impala_tf.actors.env_runner import EnvRunner
    from impala_tf.learner import ImpalaLearner
    from impala_tf.policy import ActorPolicy

__all__ = [
    "DRIVER_STATE_FILE",
    "LEARNER_PREFIX",
    "learner_checkpoint",
    "load_config",
    "load_env_runner",
    "load_policy",
    "read_driver_state",
    "resolve_checkpoint_dir",
    "restore_model",
    "untracked_variables",
    "write_checkpoint",
]

#: The JSON file with the driver's state and the config.
DRIVER_STATE_FILE = "driver_state.json"
#: The `tf.train.Checkpoint` prefix inside a checkpoint directory.
LEARNER_PREFIX = "learner"


def learner_checkpoint(learner: ImpalaLearner) -> tf.train.Checkpoint:
    """The `tf.train.Checkpoint` of everything the learner trains or counts.

    Args:
      learner: An `impala_tf.learner.ImpalaLearner`.

    Returns:
      A checkpoint with parts `model`, `policy_optimizer`, `num_grad_updates`,
      `num_agent_steps_trained` and, when the learner has one, `value_optimizer`.
    """
    import tensorflow as tf

    parts = {
        "model": learner.model,
        "policy_optimizer": learner.policy_optimizer,
        "num_grad_updates": learner.num_grad_updates,
        "num_agent_steps_trained": learner.num_agent_steps_trained,
    }
    if learner.value_optimizer is not None:
        parts["value_optimizer"] = learner.value_optimizer
    return tf.train.Checkpoint(**parts)


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


def write_checkpoint(
    checkpoint_dir: str,
    learner: ImpalaLearner,
    config: ImpalaConfig,
    driver_state: Mapping[str, Any] | None = None,
) -> str:
    """Writes the learner checkpoint and `driver_state.json` (with the config) to a directory.

    The write is atomic at the directory level: everything goes to a sibling temporary
    directory, which then replaces `checkpoint_dir` by two renames. A process killed at any point
    leaves either the previous checkpoint or the new one loadable (between the two renames the
    previous one waits at `<checkpoint_dir>.old`, which `resolve_checkpoint_dir` falls back to).

    Args:
      checkpoint_dir: The directory; created if missing, its previous checkpoint replaced.
      learner: The `ImpalaLearner` whose parts `learner_checkpoint` lists.
      config: The algorithm's config, stored under the `"config"` key (None if `env` is a
        callable).
      driver_state: Further JSON-serialisable driver state (counters, iteration, episodes).

    Returns:
      `checkpoint_dir`.
    """
    checkpoint_dir = os.path.abspath(checkpoint_dir)
    parent = os.path.dirname(checkpoint_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(checkpoint_dir) + ".tmp-", dir=parent)
    try:
        learner_checkpoint(learner).write(os.path.join(tmp, LEARNER_PREFIX))
        state = dict(driver_state or {})
        state["config"] = None if callable(config.env) else config.to_dict()
        with open(os.path.join(tmp, DRIVER_STATE_FILE), "w", encoding="utf-8") as f:
            json.dump(state, f, default=_json_default)
        old = checkpoint_dir + ".old"
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(checkpoint_dir):
            os.replace(checkpoint_dir, old)
        os.replace(tmp, checkpoint_dir)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return checkpoint_dir


def resolve_checkpoint_dir(path: str) -> str:
    """Finds the checkpoint directory a user means by `path`.

    Accepted, in this order: a checkpoint directory itself (it holds `driver_state.json`), or
    its `.old` twin left by a write that was killed between its two renames; a training logdir
    (its `checkpoint/` subdirectory); a directory of checkpoint directories (the last one by
    name).

    Raises:
      FileNotFoundError: naming `path` when none of these hold a checkpoint.
    """
    bases = (
        path,
        path + ".old",
        os.path.join(path, "checkpoint"),
        os.path.join(path, "checkpoint.old"),
    )
    for base in bases:
        if os.path.isfile(os.path.join(base, DRIVER_STATE_FILE)):
            return base
        if os.path.isdir(base):
            children = sorted(
                entry.path
                for entry in os.scandir(base)
                if entry.is_dir() and os.path.isfile(os.path.join(entry.path, DRIVER_STATE_FILE))
            )
            if children:
                return children[-1]
    raise FileNotFoundError(
        f"No checkpoint at {path!r}: expected a directory holding {DRIVER_STATE_FILE} (what "
        "Impala.save writes), or a training logdir with a checkpoint/ subdirectory."
    )


def read_driver_state(checkpoint_dir: str) -> dict[str, Any]:
    """Returns the parsed `driver_state.json` of the checkpoint at `checkpoint_dir`."""
    directory = resolve_checkpoint_dir(checkpoint_dir)
    with open(os.path.join(directory, DRIVER_STATE_FILE), encoding="utf-8") as f:
        return json.load(f)


def load_config(checkpoint_dir: str) -> ImpalaConfig:
    """Rebuilds the `ImpalaConfig` a checkpoint was trained with.

    Args:
      checkpoint_dir: Anything `resolve_checkpoint_dir` accepts.

    Raises:
      FileNotFoundError: if there is no checkpoint there.
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
    return ImpalaConfig.from_dict(config)


def untracked_variables(model: keras.Model) -> list:
    """The variables of `model` that a `tf.train.Checkpoint` of it would not hold.

    Keras 3 does not track layers kept in Python lists for TensorFlow checkpoints (only
    attributes), so a torso that keeps its layers in a list saves none of their weights under
    the `model` part. A model whose list is empty checkpoints completely.
    """
    import tensorflow as tf

    root = tf.train.Checkpoint(model=model)
    reachable = {id(obj) for obj in tf.train.TrackableView(root).descendants()}
    return [v for v in model.variables if id(v) not in reachable]


def restore_model(model: keras.Model, checkpoint_dir: str) -> None:
    """Loads the `model` part of a checkpoint into `model`, ignoring optimizers and counters.

    Args:
      model: An `ActorCritic` built from the checkpoint's config and the env's spaces.
      checkpoint_dir: Anything `resolve_checkpoint_dir` accepts.

    Raises:
      ValueError: if some variables of `model` cannot be in a checkpoint's `model` part (see
        `untracked_variables`), rather than leave them at their initial values.
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
    prefix = os.path.join(resolve_checkpoint_dir(checkpoint_dir), LEARNER_PREFIX)
    status = tf.train.Checkpoint(model=model).read(prefix)
    # The optimizers and counters stay unread on purpose; every model variable must be matched.
    status.expect_partial().assert_existing_objects_matched()


def load_policy(
    checkpoint_dir: str, explore: bool = False, config: ImpalaConfig | None = None
) -> tuple[ImpalaConfig, ActorPolicy]:
    """Rebuilds the acting policy of a checkpoint, weights restored (no envs kept open).

    Args:
      checkpoint_dir: Anything `resolve_checkpoint_dir` accepts.
      explore: Sample actions (True) or take the distribution's mode (False).
      config: The config to build the model from; default: the checkpoint's own.

    Returns:
      `(config, policy)`: the config used and an `impala_tf.policy.ActorPolicy`.
    """
    from impala_tf.actors.env_runner import env_seed, make_env
    from impala_tf.policy import ActorPolicy

    config = load_config(checkpoint_dir) if config is None else config
    env = make_env(config, 0, 0)
    try:
        observation_space, action_space = env.observation_space, env.action_space
    finally:
        env.close()
    policy = ActorPolicy(
        observation_space,
        action_space,
        config.model,
        explore=explore,
        seed=env_seed(config.seed, 0, 0),
    )
    restore_model(policy.model, checkpoint_dir)
    return config, policy


def load_env_runner(
    checkpoint_dir: str, explore: bool = False, config: ImpalaConfig | None = None
) -> tuple[ImpalaConfig, EnvRunner]:
    """Builds an `EnvRunner` (worker index 0, the evaluation index) acting with a checkpoint.

    Its envs are seeded from `config.seed` as RLlib seeds the driver's, so with a seed and
    `num_envs_per_env_runner=1` the episodes it runs are reproducible. The weights are restored
    into a Keras model and handed to the runner's policy, whichever kind it is (numpy or
    TensorFlow).

    Args:
      checkpoint_dir: Anything `resolve_checkpoint_dir` accepts.
      explore: Sample actions (True) or take the distribution's mode (False).
      config: The config for the runner (env, env_config, model, seed, envs per runner);
        default: the checkpoint's own.

    Returns:
      `(config, runner)`: the config used and the runner, weights restored.
    """
    from impala_tf.actors.env_runner import EnvRunner
    from impala_tf.models import build_model

    config = load_config(checkpoint_dir) if config is None else config
    runner = EnvRunner(config, worker_index=0, explore=explore)
    try:
        model = build_model(runner.observation_space, runner.action_space, config.model)
        restore_model(model, checkpoint_dir)
        runner.set_weights(model.get_weights())
    except BaseException:
        runner.close()
        raise
    return config, runner
