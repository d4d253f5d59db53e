"""Checkpoints on disk: the one layout for one policy or many, written atomically, found again.

A checkpoint is a directory holding

* `policies/<policy_id>/learner.index` / `learner.data-*`: one `tf.train.Checkpoint` per policy
  (`"default_policy"` for a single-agent run) with the parts `model`, `policy_optimizer`,
  `num_grad_updates`, `num_agent_steps_trained` and, with `_separate_vf_optimizer`,
  `value_optimizer` (see `learner_checkpoint`);
* `driver_state.json`: the driver's state (`"format": 2`, the iteration, counters, the episode
  window, `"policy_ids"`, `"observation_filters"`: {policy_id: the merged observation filter's
  state}) plus `"config"`, the config as `impala_tf.checkpoints.stored_config.storable_config`
  gives it (None when `env` is a callable, which JSON cannot hold);
* `runtime_state.pkl` (when the driver has such state): plain data only (dicts, lists, numpy
  arrays, bytes) that resuming needs and JSON cannot hold: the rows waiting to fill a train
  batch and, in deterministic mode, the replay buffers and the actors' runner snapshots (their
  envs pickled into bytes by the runner itself). Like any pickle, load only checkpoints you
  trust.

`write_checkpoint` writes one atomically: a process killed at any point leaves the previous
checkpoint or the new one loadable. Training writes one directory per save under
`<logdir>/checkpoints/`, named by iteration (`checkpoint_000010`), and keeps the newest
`keep_checkpoints_num` (`checkpoint_path`, `list_checkpoints`, `prune_checkpoints`);
`resolve_checkpoint_dir` finds the newest from a logdir. Reading a checkpoint back, of this
layout or of those before it, is `impala_tf.checkpoints.reading`'s.

This module imports TensorFlow only in the functions that need it, and no config class.
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
from typing import Any

import numpy as np

from impala_tf.checkpoints.stored_config import StoredConfig
from impala_tf.config.policies import DEFAULT_POLICY_ID

__all__ = [
    "CHECKPOINTS_DIR",
    "CheckpointWriteError",
    "DRIVER_STATE_FILE",
    "LEARNER_PREFIX",
    "POLICIES_DIR",
    "RUNTIME_STATE_FILE",
    "checkpoint_path",
    "json_default",
    "latest_checkpoint",
    "learner_checkpoint",
    "list_checkpoints",
    "prune_checkpoints",
    "resolve_checkpoint_dir",
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
#: The subdirectory of a checkpoint that holds one learner checkpoint per policy.
POLICIES_DIR = "policies"
#: `driver_state.json`'s `"format"` for this layout (older checkpoints have none).
FORMAT = 2
#: Marks the temporary directory a checkpoint is written to before it is renamed into place.
_TMP_MARK = ".tmp-"
_OLD_SUFFIX = ".old"
_NUMBER = re.compile(r"(\d+)$")


def learner_checkpoint(learner: Any) -> Any:
    """The `tf.train.Checkpoint` of everything the learner trains or counts.

    Args:
      learner: An `impala_tf.learning.learner.ImpalaLearner` (or an algorithm's subclass).

    Returns:
      A checkpoint of the learner's `checkpoint_parts()`: `model`, `policy_optimizer`,
      `num_grad_updates`, `num_agent_steps_trained`, `value_optimizer` when the learner has
      one, and the algorithm's own parts (APPO's target network and KL coefficient).
    """
    import tensorflow as tf

    return tf.train.Checkpoint(**learner.checkpoint_parts())


def json_default(value: Any) -> Any:
    """`json.dump`'s `default` for results and saved state: numpy scalars and arrays as
    numbers and lists, anything else as its string."""
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
    learners: Any,
    config: Any,
    driver_state: Mapping[str, Any] | None = None,
    runtime_state: Mapping[str, Any] | None = None,
) -> str:
    """Writes every policy's learner and `driver_state.json` (with the config) to a directory.

    The write is atomic at the directory level: everything goes to a sibling temporary
    directory, which is flushed to disk and then replaces `checkpoint_dir` by two renames. A
    process killed at any point leaves either the previous checkpoint or the new one loadable
    (between the two renames the previous one waits at `<checkpoint_dir>.old`, which
    `resolve_checkpoint_dir` falls back to); the temporary directory is never taken for a
    checkpoint.

    Args:
      checkpoint_dir: The directory; created if missing, its previous checkpoint replaced.
      learners: {policy_id: `ImpalaLearner`} (whose parts `learner_checkpoint` lists), or one
        learner, the single-agent `"default_policy"`.
      config: The algorithm's config (an `AlgorithmConfig`, or a `StoredConfig` resolved from
        one), stored under `"config"` (None if `env` is a callable; a module-level
        `policy_mapping_fn` is stored as its import path) with its name under `"algorithm"`.
      driver_state: Further JSON-serialisable driver state (counters, iteration, episodes).
      runtime_state: Plain data JSON cannot hold, written to `runtime_state.pkl`; None writes
        no such file.

    Returns:
      `checkpoint_dir`.

    Raises:
      CheckpointWriteError: the write failed (a full disk: `errno.ENOSPC`, "No space left on
        device"); the previous checkpoint was kept and the message names it.
    """
    if not isinstance(learners, Mapping):
        learners = {DEFAULT_POLICY_ID: learners}
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
        for pid, learner in learners.items():
            learner_checkpoint(learner).write(os.path.join(tmp, POLICIES_DIR, pid, LEARNER_PREFIX))
        state = {"format": FORMAT, "policy_ids": sorted(learners), **dict(driver_state or {})}
        stored = config if isinstance(config, StoredConfig) else StoredConfig.of(config)
        state["config"] = stored.config
        state["algorithm"] = stored.algorithm
        with open(os.path.join(tmp, DRIVER_STATE_FILE), "w", encoding="utf-8") as f:
            json.dump(state, f, default=json_default)
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
