"""The loader: fragments -> fixed-size train batches -> a distributed `tf.data` pipeline.

This replaces RLlib's loader threads. `BatchBuilder` concatenates the env sequences of incoming
fragments into train batches of exactly `rows_per_batch(config)` sequences (RLlib concatenates
whole fragments until at least `train_batch_size` steps, so its batches vary in size; fixed
shapes let the train step be traced once). `make_dataset` turns a Python source of such batches
into a `tf.data.Dataset` of flat RLlib-layout columns ([B * T, ...], env-contiguous), distributed
with the learner's strategy and prefetched onto the learner devices `num_multi_gpu_tower_stacks`
batches deep. The dataset yields per-replica shards of B / num_replicas whole sequences
(`distribute_datasets_from_function` hands consecutive elements to consecutive replicas), so
per-step columns [B * T, ...] and per-sequence columns [B, ...] (RNN state) stay aligned.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import gymnasium as gym
import numpy as np
import tensorflow as tf

from impala_tf import distributions
from impala_tf.batching import BatchBuilder, rows_per_batch  # TF-free: aggregators use them
from impala_tf.config import ImpalaConfig
from impala_tf.sample_batch import SampleBatch, decompress, to_flat

__all__ = ["BatchBuilder", "rows_per_batch", "batch_signature", "make_dataset"]


def batch_signature(
    config: ImpalaConfig,
    observation_space: gym.Space,
    action_space: gym.Space,
    num_replicas: int = 1,
    state_shapes: tuple[tuple[int, ...], ...] = (),
) -> dict[str, tf.TensorSpec]:
    """The `tf.TensorSpec`s of one replica's shard of a flat train batch."""
    rows = rows_per_batch(config, num_replicas) // num_replicas
    steps = rows * config.rollout_fragment_length
    obs_dtype = tf.as_dtype(observation_space.dtype or np.float32)
    act_dtype = tf.as_dtype(distributions.action_dtype(action_space))
    spec = {
        "obs": tf.TensorSpec([steps, *observation_space.shape], obs_dtype),
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


def make_dataset(
    source: Callable[[], Iterator[SampleBatch]],
    signature: dict[str, tf.TensorSpec],
    config: ImpalaConfig,
    strategy: tf.distribute.Strategy,
):
    """Builds the distributed input pipeline over a generator of train batches.

    Args:
      source: Called once; yields `SampleBatch`es of `rows_per_batch(config)` sequences.
      signature: `batch_signature(...)` of one replica's shard.
      config: Uses `num_gpu_loader_threads` (parallel decompression and conversion) and
        `num_multi_gpu_tower_stacks` (batches prefetched onto the devices).
      strategy: The learner's distribution strategy.

    Returns:
      A distributed dataset whose elements are per-replica dicts of flat columns.
    """
    keys = list(signature)
    num_replicas = strategy.num_replicas_in_sync
    stacks = max(1, int(config.num_multi_gpu_tower_stacks))

    def flat_shards():
        for batch in source():
            rows = len(batch) // num_replicas
            for r in range(num_replicas):
                columns = to_flat(batch.slice(r * rows, (r + 1) * rows))
                yield tuple(np.asarray(columns[k], signature[k].dtype.as_numpy_dtype) for k in keys)

    def as_dict(*columns):
        return dict(zip(keys, columns))

    def dataset_fn(_: tf.distribute.InputContext) -> tf.data.Dataset:
        dataset = tf.data.Dataset.from_generator(
            flat_shards, output_signature=tuple(signature[k] for k in keys)
        ).map(as_dict, num_parallel_calls=max(1, int(config.num_gpu_loader_threads)))
        options = tf.data.Options()
        options.threading.private_threadpool_size = max(1, int(config.num_gpu_loader_threads))
        return dataset.with_options(options)

    return strategy.distribute_datasets_from_function(
        dataset_fn,
        tf.distribute.InputOptions(
            experimental_fetch_to_device=True,
            experimental_per_replica_buffer_size=stacks,
        ),
    )


def decompress_if_needed(batch: SampleBatch) -> SampleBatch:
    """Returns `batch` with observations decompressed (RLlib's `decompress_if_needed`)."""
    return decompress(batch) if batch.compressed else batch
