"""The loader: train batches -> per-replica shards -> a `tf.data` pipeline onto the learner devices.

This replaces RLlib's loader threads. Train batches (`SampleBatch`es of `rows_per_batch(config)`
sequences, cut by `impala_tf.data.batching.BatchBuilder`; B is sequences, T is time) reach the
learner thread, which cuts them into *units*: the whole batch, or with `microbatch_size` its
microbatches of `microbatch_rows(config)` sequences. `replica_shards` splits a unit into one shard
of whole sequences per learner device, in RLlib's flat layout (per-step columns [B * T, ...],
env-contiguous; per-sequence columns such as RNN state [B, ...]), checked against
`batch_signature`. `make_dataset` turns a Python source of shards into a `tf.data.Dataset`
distributed with the learner's strategy and copied onto the learner devices ahead of use
(`experimental_fetch_to_device`; with one GPU and the default strategy, through a
`OneDeviceStrategy`), so the host->device copy of the next unit overlaps training on the current
one; with one CPU device it is a plain prefetching dataset. `num_gpu_loader_threads` sizes the
private thread pool of the pipeline that copies onto devices. `distribute_datasets_from_function`
hands consecutive elements to consecutive replicas, so per-step and per-sequence columns stay
aligned.

How many units are loaded ahead is bounded by the learner thread (its tower-stack slots), not by
the dataset: the prefetch buffers are sized to that bound and the source blocks when it is
reached.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import gymnasium as gym
import numpy as np
import tensorflow as tf

from impala_tf.data.batching import BatchBuilder, BatchShape, rows_per_batch  # TF-free
from impala_tf.data.layouts import to_flat
from impala_tf.data.sample_batch import (
    OBS_FRAMES,
    OBS_RESTARTS,
    SampleBatch,
    decompress,
    is_per_sequence_column,
)
from impala_tf.models import distributions

__all__ = [
    "BatchBuilder",
    "batch_signature",
    "make_dataset",
    "microbatch_rows",
    "microbatches_per_batch",
    "replica_shards",
    "rows_per_batch",
    "unit_rows",
]


def microbatch_rows(config: BatchShape, num_replicas: int = 1) -> int | None:
    """Sequences per microbatch, `microbatch_size / rollout_fragment_length`; None without one.

    Raises:
      ValueError: `microbatch_size` is not a whole number of sequences, or its sequences do not
        divide evenly over the `num_replicas` learner devices (the message names the keys).
    """
    size = config.microbatch_size
    if size is None:
        return None
    horizon = int(config.rollout_fragment_length)
    if size % horizon:
        raise ValueError(
            f"`microbatch_size` ({size}) must be a multiple of `rollout_fragment_length` "
            f"({horizon}): microbatches are whole env sequences, so the recurrent state and the "
            "V-trace targets of a sequence are never split."
        )
    rows = size // horizon
    if rows % num_replicas:
        raise ValueError(
            f"`microbatch_size` ({size}) is {rows} sequences of {horizon} steps, which do not "
            f"divide evenly over the {num_replicas} learner devices (`num_gpus`): use a "
            f"multiple of {num_replicas * horizon}."
        )
    return rows


def microbatches_per_batch(config: BatchShape, num_replicas: int = 1) -> int:
    """Microbatches in one train batch (one update); 1 without `microbatch_size`.

    Raises:
      ValueError: the train batch is not a whole number of microbatches.
    """
    micro = microbatch_rows(config, num_replicas)
    if micro is None:
        return 1
    rows = rows_per_batch(config, num_replicas)
    if rows % micro:
        raise ValueError(
            f"`train_batch_size` ({config.train_batch_size}) must be a multiple of "
            f"`microbatch_size` ({config.microbatch_size}): a train batch of {rows} sequences "
            f"cannot be cut into microbatches of {micro}."
        )
    return rows // micro


def unit_rows(config: BatchShape, num_replicas: int = 1) -> int:
    """Sequences per unit the device receives: a microbatch, or else the whole train batch."""
    micro = microbatch_rows(config, num_replicas)
    return micro if micro is not None else rows_per_batch(config, num_replicas)


def batch_signature(
    config: BatchShape,
    observation_space: gym.Space,
    action_space: gym.Space,
    num_replicas: int = 1,
    state_shapes: tuple[tuple[int, ...], ...] = (),
    frame_stack: tuple[int, int] | None = None,
) -> dict[str, tf.TensorSpec]:
    """The `tf.TensorSpec`s of one replica's shard of a unit (train batch or microbatch).

    Args:
      config: Uses `train_batch_size`, `microbatch_size`, `rollout_fragment_length`.
      observation_space: The env's observation space (obs dtype and shape).
      action_space: The env's action space.
      num_replicas: Learner devices.
      state_shapes: Shapes (without the batch dimension) of the model's recurrent state.
      frame_stack: (k, s) when the observations travel as frames (`impala_tf.models.frames`):
        `obs_frames` [B, T + k - 1, H, W, s] and `obs_restarts` [B * T] replace `obs`.

    Returns:
      Column name -> spec, flat layout: per-step columns [B * T, ...], per-sequence columns
      (state, `obs_frames`) [B, ...], with B = `unit_rows(config, num_replicas) / num_replicas`.
    """
    rows = unit_rows(config, num_replicas) // num_replicas
    steps = rows * config.rollout_fragment_length
    obs_dtype = tf.as_dtype(observation_space.dtype or np.float32)
    act_dtype = tf.as_dtype(distributions.action_dtype(action_space))
    if frame_stack is None:
        obs_spec = {"obs": tf.TensorSpec([steps, *observation_space.shape], obs_dtype)}
    else:
        k, channels = frame_stack
        height, width = observation_space.shape[:2]
        horizon = config.rollout_fragment_length + k - 1
        obs_spec = {
            OBS_FRAMES: tf.TensorSpec([rows, horizon, height, width, channels], obs_dtype),
            OBS_RESTARTS: tf.TensorSpec([steps], tf.bool),
        }
    spec = {
        **obs_spec,
        "actions": tf.TensorSpec([steps, *distributions.action_shape(action_space)], act_dtype),
        "rewards": tf.TensorSpec([steps], tf.float32),
        "terminateds": tf.TensorSpec([steps], tf.bool),
        "truncateds": tf.TensorSpec([steps], tf.bool),
        "action_dist_inputs": tf.TensorSpec(
            [steps, distributions.logits_size(action_space)], tf.float32
        ),
        "action_logp": tf.TensorSpec([steps], tf.float32),
        "vf_preds": tf.TensorSpec([steps], tf.float32),
        "values_bootstrapped": tf.TensorSpec([steps], tf.float32),
    }
    for i, shape in enumerate(state_shapes):
        spec[f"state_in_{i}"] = tf.TensorSpec([rows, *shape], tf.float32)
    return spec


def replica_shards(
    batch: SampleBatch, signature: dict[str, tf.TensorSpec], num_replicas: int
) -> list[dict[str, np.ndarray]]:
    """Splits a unit into `num_replicas` flat shards of whole sequences, checked and cast.

    Args:
      batch: A unit in sequence layout (per-step columns [B, T, ...]), B divisible by
        `num_replicas`; compressed observations are decompressed.
      signature: `batch_signature(...)`: the columns, dtypes and shapes of one shard.
      num_replicas: Learner devices.

    Returns:
      One dict of numpy columns per replica, in replica order.

    Raises:
      ValueError: a column is missing, cannot be cast, or has the wrong shape; the message names
        the column, its shape and the expected one.
    """
    batch = decompress(batch)
    missing = [k for k in signature if k not in batch]
    if missing:
        raise ValueError(
            f"The train batch lacks column(s) {missing} that the learner needs (it has "
            f"{sorted(batch)})."
        )
    rows = len(batch) // num_replicas
    shards = []
    for r in range(num_replicas):
        columns = to_flat(batch.slice(r * rows, (r + 1) * rows))
        shard = {}
        for key, spec in signature.items():
            column = columns[key]
            try:
                value = np.asarray(column, spec.dtype.as_numpy_dtype)
            except (TypeError, ValueError) as e:
                raise ValueError(
                    f"Train batch column `{key}` (dtype {column.dtype}) cannot be cast to "
                    f"{spec.dtype.name}: {e}"
                ) from e
            if tuple(value.shape) != tuple(spec.shape):
                layout = "[B, ...]" if is_per_sequence_column(key) else "[B, T, ...]"
                raise ValueError(
                    f"Train batch column `{key}` has shape {tuple(value.shape)} per device shard "
                    f"(after flattening {layout} to RLlib's layout), but the learner expects "
                    f"{tuple(spec.shape)}: check the column's shape against the env's spaces, "
                    "`rollout_fragment_length` and `train_batch_size`."
                )
            shard[key] = value
        shards.append(shard)
    return shards


def make_dataset(
    source: Callable[[], Iterator[dict[str, np.ndarray]]],
    signature: dict[str, tf.TensorSpec],
    strategy: tf.distribute.Strategy,
    buffer_size: int = 1,
    accelerator: bool = False,
    threads: int | None = None,
):
    """Builds the distributed input pipeline over a generator of replica shards.

    Args:
      source: Called once; yields `replica_shards(...)` dicts, the shards of each unit
        consecutively in replica order.
      signature: `batch_signature(...)` of one replica's shard.
      strategy: The learner's distribution strategy.
      buffer_size: Units copied onto each device ahead of use (the learner's tower-stack slots).
      accelerator: The learner runs on an accelerator (`devices.on_accelerator`): copy units
        onto its device ahead of use, also with one device.
      threads: Size of the pipeline's private thread pool when it copies onto devices
        (`num_gpu_loader_threads`); None: tf.data's shared pool.

    Returns:
      A distributed dataset whose elements are per-replica dicts of flat columns; on one device,
      a dataset of plain dicts of tensors.
    """
    output_signature = dict(signature)
    buffer_size = max(1, int(buffer_size))

    def dataset_fn(_: tf.distribute.InputContext | None = None) -> tf.data.Dataset:
        dataset = tf.data.Dataset.from_generator(source, output_signature=output_signature)
        # The buffers are sized here (the slots), so tf.data's autotuning has nothing to tune;
        # its model thread also held each iterator's deletion, at the end of every run, for
        # about 2 s (the iterator waits for the thread's next wake-up).
        options = tf.data.Options()
        options.autotune.enabled = False
        return dataset.with_options(options)

    if strategy.num_replicas_in_sync == 1 and not accelerator:
        # One CPU device: the host is the device. A multi-device iterator would only add its
        # hand-off, about a millisecond per unit on a 2-core machine (measured).
        return dataset_fn().prefetch(buffer_size)

    def device_dataset_fn(context: tf.distribute.InputContext | None = None) -> tf.data.Dataset:
        dataset = dataset_fn(context)
        if threads is not None:
            options = tf.data.Options()
            options.threading.private_threadpool_size = int(threads)
            dataset = dataset.with_options(options)
        return dataset

    return _input_strategy(strategy).distribute_datasets_from_function(
        device_dataset_fn,
        tf.distribute.InputOptions(
            experimental_fetch_to_device=True,
            experimental_per_replica_buffer_size=buffer_size,
        ),
    )


def _input_strategy(strategy: tf.distribute.Strategy) -> tf.distribute.Strategy:
    """The strategy that copies input onto the learner devices ahead of use.

    TensorFlow's default strategy does not (its datasets are plain datasets, copied to the GPU
    inside the step); a `OneDeviceStrategy` on the device the update runs on (the first GPU;
    the CPU when the accelerator path is forced on a CPU-only machine, as tests do) does, and
    yields plain tensors that the default strategy's step accepts.
    """
    # Outside any scope `get_strategy()` is the default strategy; inside one we keep `strategy`.
    if tf.distribute.has_strategy() or strategy is not tf.distribute.get_strategy():
        return strategy
    device = "/gpu:0" if tf.config.list_logical_devices("GPU") else "/cpu:0"
    return tf.distribute.OneDeviceStrategy(device)
