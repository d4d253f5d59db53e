"""Checkpoints on disk: the one layout `Impala.save` writes, and loading a policy back from it.

A checkpoint is a directory holding

* `learner.index` / `learner.data-*`: a `tf.train.Checkpoint` with the parts `model`,
  `policy_optimizer`, `num_grad_updates`, `num_agent_steps_trained` and, with
  `_separate_vf_optimizer`, `value_optimizer` (see `learner_checkpoint`);
* `driver_state.json`: the driver's counters plus `"config": ImpalaConfig.to_dict()` (None when
  `env` is a callable, which JSON cannot hold) and `"observation_filter"`, the merged observation
  filter's state (`impala_tf.filters`);
* `runtime_state.pkl` (only when the driver has such state): a pickle of what JSON cannot hold and
  resume needs: the partial train batch waiting for more fragments and, in deterministic mode,
  the actors' envs and samplers and the replay buffer (see `Impala.save`). Like any pickle, load
  only checkpoints you trust.

Training writes one directory per save under `<logdir>/checkpoints/`, named by iteration
(`checkpoint_000010`), and keeps the newest `keep_checkpoints_num` (`checkpoint_path`,
`list_checkpoints`, `prune_checkpoints`); `resolve_checkpoint_dir` finds the newest from a logdir.

Evaluation and export only need the weights and the observation filter: they restore the
`model` part alone, into a model rebuilt from the stored config and the env's spaces.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
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
    from impala_tf.filters import Filter
    from impala_tf.learner import ImpalaLearner
    from impala_tf.policy import ActorPolicy

__all__ = [
    "CHECKPOINTS_DIR",
    "CheckpointWriteError",
    "DRIVER_STATE_FILE",
    "LEARNER_PREFIX",
    "RUNTIME_STATE_FILE",
    "checkpoint_path",
    "latest_checkpoint",
    "learner_checkpoint",
    "list_checkpoints",
    "load_config",
    "load_env_runner",
    "load_observation_filter",
    "load_policy",
    "prune_checkpoints",
    "read_driver_state",
    "read_runtime_state",
    "resolve_checkpoint_dir",
    "restore_model",
    "untracked_variables",
    "write_checkpoint",
]

#: The JSON file with the driver's state and the config.
DRIVER_STATE_FILE = "driver_state.json"
#: The `tf.train.Checkpoint` prefix inside a checkpoint directory.
LEARNER_PREFIX = "learner"
#: The pickle with the runtime state JSON cannot hold (written only when there is some).
RUNTIME_STATE_FILE = "runtime_state.pkl"
#: The subdirectory of a training logdir that holds its numbered checkpoints.
CHECKPOINTS_DIR = "checkpoints"
#: Marks the temporary directory a checkpoint is written to before it is renamed into place.
_TMP_MARK = ".tmp-"
_OLD_SUFFIX = ".old"
_NUMBER = re.compile(r"(\d+)$")


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


def _fsync_tree(directory: str) -> None:
    """Flushes every file under `directory`, and the directory entries, to disk."""
    for root, _, files in os.walk(directory):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(root)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (e.g. no space left on device); nothing was replaced.

    `errno` is the cause's (`errno.ENOSPC` for a full disk, also when TensorFlow reported it
    as `ResourceExhaustedError`); the message names the checkpoint directory and the previous
    checkpoint that stays loadable.
    """


def _no_space(error: BaseException) -> bool:
    if isinstance(error, OSError):
        return error.errno == errno.ENOSPC
    # TensorFlow maps ENOSPC to RESOURCE_EXHAUSTED in its file system layer.
    return type(error).__name__ == "ResourceExhaustedError" or "No space left" in str(error)


def _write_failed(checkpoint_dir: str, had_previous: bool, error: BaseException) -> None:
    """Raises `CheckpointWriteError` for a write of `checkpoint_dir` that failed with `error`."""
    if had_previous:
        previous = f"the previous checkpoint {checkpoint_dir} is untouched and still loadable"
    else:
        earlier = list_checkpoints(os.path.dirname(checkpoint_dir))
        previous = (
            f"the newest earlier checkpoint {earlier[-1]} is untouched and still loadable"
            if earlier
            else "there was no earlier checkpoint next to it"
        )
    if _no_space(error):
        raise CheckpointWriteError(
            errno.ENOSPC,
            f"No space left on device while writing checkpoint {checkpoint_dir}; nothing was "
            f"replaced: {previous}. Free disk space (or lower keep_checkpoints_num) and save "
            "again.",
        ) from error
    raise CheckpointWriteError(
        getattr(error, "errno", None) or errno.EIO,
        f"Writing checkpoint {checkpoint_dir} failed ({type(error).__name__}: {error}); "
        f"nothing was replaced: {previous}.",
    ) from error


def write_checkpoint(
    checkpoint_dir: str,
    learner: ImpalaLearner,
    config: ImpalaConfig,
    driver_state: Mapping[str, Any] | None = None,
    runtime_state: Mapping[str, Any] | None = None,
) -> str:
    """Writes the learner checkpoint and `driver_state.json` (with the config) to a directory.

    The write is atomic at the directory level: everything goes to a sibling temporary
    directory, which is flushed to disk and then replaces `checkpoint_dir` by two renames. A
    process killed at any point leaves either the previous checkpoint or the new one loadable
    (between the two renames the previous one waits at `<checkpoint_dir>.old`, which
    `resolve_checkpoint_dir` falls back to); the temporary directory is never taken for a
    checkpoint.

    Args:
      checkpoint_dir: The directory; created if missing, its previous checkpoint replaced.
      learner: The `ImpalaLearner` whose parts `learner_checkpoint` lists.
      config: The algorithm's config, stored under the `"config"` key (None if `env` is a
        callable).
      driver_state: Further JSON-serialisable driver state (counters, iteration, episodes).
      runtime_state: Picklable state JSON cannot hold, written to `runtime_state.pkl`; None
        writes no such file.

    Returns:
      `checkpoint_dir`.

    Raises:
      CheckpointWriteError: the write failed (a full disk: `errno.ENOSPC`, "No space left on
        device"); the previous checkpoint was kept and the message names it.
    """
    checkpoint_dir = os.path.abspath(checkpoint_dir)
    parent = os.path.dirname(checkpoint_dir)
    had_previous = _is_checkpoint(checkpoint_dir)
    old = checkpoint_dir + _OLD_SUFFIX
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=os.path.basename(checkpoint_dir) + _TMP_MARK, dir=parent)
    except OSError as e:
        _write_failed(checkpoint_dir, had_previous, e)
    try:
        learner_checkpoint(learner).write(os.path.join(tmp, LEARNER_PREFIX))
        state = dict(driver_state or {})
        state["config"] = None if callable(config.env) else config.to_dict()
        with open(os.path.join(tmp, DRIVER_STATE_FILE), "w", encoding="utf-8") as f:
            json.dump(state, f, default=_json_default)
        if runtime_state is not None:
            with open(os.path.join(tmp, RUNTIME_STATE_FILE), "wb") as f:
                pickle.dump(dict(runtime_state), f, protocol=pickle.HIGHEST_PROTOCOL)
        # Renames are atomic for a killed process; the flush makes them so for a lost machine.
        _fsync_tree(tmp)
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(checkpoint_dir):
            os.replace(checkpoint_dir, old)
        os.replace(tmp, checkpoint_dir)
        _fsync_dir(parent)
        shutil.rmtree(old, ignore_errors=True)
    except Exception as e:
        import tensorflow as tf

        if not isinstance(e, (OSError, tf.errors.OpError)):
            raise
        if had_previous and not os.path.exists(checkpoint_dir) and os.path.isdir(old):
            os.replace(old, checkpoint_dir)  # Failed between the two renames: put it back.
        _write_failed(checkpoint_dir, had_previous, e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return checkpoint_dir


def _is_checkpoint(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, DRIVER_STATE_FILE))


def _sort_key(path: str) -> tuple[int, str]:
    name = os.path.basename(path)
    match = _NUMBER.search(name)
    return (int(match.group(1)) if match else -1, name)


def checkpoint_path(root: str, iteration: int) -> str:
    """The directory of the checkpoint of iteration `iteration` under `root`.

    Args:
      root: The directory of numbered checkpoints, normally `<logdir>/checkpoints`.
      iteration: The `training_iteration` saved.

    Returns:
      `<root>/checkpoint_<iteration, 6 digits>`.
    """
    return os.path.join(root, f"checkpoint_{int(iteration):06d}")


def list_checkpoints(root: str) -> list[str]:
    """The complete checkpoints directly under `root`, oldest first.

    Ordered by the number that ends their names (the iteration, for `checkpoint_path` names),
    then by name. Temporary directories of unfinished writes are skipped; a `<name>.old` left by
    a write killed between its renames stands in for `<name>` when `<name>` is missing.

    Args:
      root: A directory of checkpoint directories (need not exist).

    Returns:
      Paths of checkpoint directories (empty if there are none).
    """
    if not os.path.isdir(root):
        return []
    found: dict[str, str] = {}
    for entry in os.scandir(root):
        if not entry.is_dir() or _TMP_MARK in entry.name or not _is_checkpoint(entry.path):
            continue
        name = entry.name
        if name.endswith(_OLD_SUFFIX):
            found.setdefault(name[: -len(_OLD_SUFFIX)], entry.path)
        else:
            found[name] = entry.path
    return sorted(found.values(), key=_sort_key)


def prune_checkpoints(root: str, keep: int | None, protect: str | None = None) -> list[str]:
    """Deletes all but the newest `keep` checkpoints under `root` (`keep_checkpoints_num`).

    Also deletes the temporary directories of writes that were killed (their names hold
    `.tmp-`); only one process should write checkpoints under `root`.

    Args:
      root: A directory of checkpoint directories.
      keep: How many to keep (>= 1); None keeps all (RLlib's default).
      protect: A checkpoint never deleted (the one just written), whatever its rank.

    Returns:
      The deleted checkpoint directories.
    """
    if not os.path.isdir(root):
        return []
    for entry in os.scandir(root):
        if entry.is_dir() and _TMP_MARK in entry.name:
            shutil.rmtree(entry.path, ignore_errors=True)
    if keep is None:
        return []
    if keep < 1:
        raise ValueError(f"keep_checkpoints_num must be >= 1 or None, got {keep}")
    existing = list_checkpoints(root)
    protected = os.path.abspath(protect) if protect else None
    doomed = [
        p for p in existing[: max(0, len(existing) - keep)] if os.path.abspath(p) != protected
    ]
    for path in doomed:
        # The twin first: a crash in between must not leave it to stand in for the deleted one.
        shutil.rmtree(path + _OLD_SUFFIX, ignore_errors=True)
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def resolve_checkpoint_dir(path: str) -> str:
    """Finds the checkpoint directory a user means by `path`.

    Accepted, in this order: a checkpoint directory itself (it holds `driver_state.json`), or
    its `.old` twin left by a write that was killed between its two renames; a training logdir
    (the newest of its `checkpoints/checkpoint_*`, or its `checkpoint/` directory as written by
    earlier versions); a directory of checkpoint directories (the newest, see
    `list_checkpoints`).

    Raises:
      FileNotFoundError: naming `path` when none of these hold a checkpoint.
    """
    found = latest_checkpoint(path)
    if found is None:
        raise FileNotFoundError(
            f"No checkpoint at {path!r}: expected a directory holding {DRIVER_STATE_FILE} (what "
            "Impala.save writes), or a training logdir with a checkpoints/ subdirectory."
        )
    return found


def latest_checkpoint(path: str) -> str | None:
    """Like `resolve_checkpoint_dir`, but returns None when there is no checkpoint at `path`."""
    for candidate in (path, path + _OLD_SUFFIX):
        if _is_checkpoint(candidate):
            return candidate
    # A logdir: its numbered checkpoints come before anything else it holds (e.g. `best/`).
    for base in (
        os.path.join(path, CHECKPOINTS_DIR),
        os.path.join(path, "checkpoint"),
        os.path.join(path, "checkpoint" + _OLD_SUFFIX),
    ):
        if _is_checkpoint(base):
            return base
        children = list_checkpoints(base)
        if children:
            return children[-1]
    children = list_checkpoints(path)
    return children[-1] if children else None


def read_driver_state(checkpoint_dir: str) -> dict[str, Any]:
    """Returns the parsed `driver_state.json` of the checkpoint at `checkpoint_dir`."""
    directory = resolve_checkpoint_dir(checkpoint_dir)
    with open(os.path.join(directory, DRIVER_STATE_FILE), encoding="utf-8") as f:
        return json.load(f)


def read_runtime_state(checkpoint_dir: str) -> dict[str, Any]:
    """Returns the unpickled `runtime_state.pkl` of a checkpoint ({} when it has none)."""
    path = os.path.join(resolve_checkpoint_dir(checkpoint_dir), RUNTIME_STATE_FILE)
    if not os.path.isfile(path):
        return {}
    with open(path, "rb") as f:
        return pickle.load(f)  # A checkpoint is trusted like code (module docstring).


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
    # One policy of a multi-agent checkpoint (impala_tf.multi_agent) stores its own spaces.
    spaces = read_runtime_state(checkpoint_dir).get("policy_spaces")
    if spaces is not None:
        observation_space, action_space = spaces
    policy = ActorPolicy(
        observation_space,
        action_space,
        config.model,
        explore=explore,
        seed=env_seed(config.seed, 0, 0),
    )
    restore_model(policy.model, checkpoint_dir)
    return config, policy


def load_observation_filter(checkpoint_dir: str) -> Filter | None:
    """The run's merged observation filter (`observation_filter`) saved in a checkpoint.

    Returns:
      The `impala_tf.filters.Filter`, or None for `NoFilter` and for checkpoints written before
      filters were saved.
    """
    from impala_tf.filters import NoFilter, filter_from_state

    state = read_driver_state(checkpoint_dir).get("observation_filter")
    if state is None:
        return None
    obs_filter = filter_from_state(state)
    return None if isinstance(obs_filter, NoFilter) else obs_filter


def load_env_runner(
    checkpoint_dir: str, explore: bool = False, config: ImpalaConfig | None = None
) -> tuple[ImpalaConfig, EnvRunner]:
    """Builds an `EnvRunner` (worker index 0, the evaluation index) acting with a checkpoint.

    Its envs are seeded from `config.seed` as RLlib seeds the driver's, so with a seed and
    `num_envs_per_env_runner=1` the episodes it runs are reproducible. The weights are restored
    into a Keras model and handed to the runner's policy, whichever kind it is (numpy or
    TensorFlow). Observations pass through the run's saved observation filter, not updated.

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
    runner = EnvRunner(config, worker_index=0, explore=explore, update_filter=False)
    try:
        model = build_model(runner.observation_space, runner.action_space, config.model)
        restore_model(model, checkpoint_dir)
        runner.set_weights(model.get_weights(), obs_filter=load_observation_filter(checkpoint_dir))
    except BaseException:
        runner.close()
        raise
    return config, runner
