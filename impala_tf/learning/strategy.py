"""The learner's `tf.distribute` strategy: which devices it splits each train batch over.

`make_strategy(config)` turns `num_gpus` and `_fake_gpus` into a strategy, before the first
TensorFlow op of a run (`Impala` calls it first): the default strategy for one device (on the GPU
when there is one), a `MirroredStrategy` over N GPUs, or over N logical CPU devices with
`_fake_gpus=True`, which is how multi-device code is tested without a GPU. It makes the GPU
settings that must precede TensorFlow's initialisation first (`impala_tf.learning.devices`).
"""

from __future__ import annotations

import contextlib
import logging

import tensorflow as tf

from impala_tf.config.base import AlgorithmConfig
from impala_tf.learning.devices import configure_gpus

__all__ = ["make_strategy"]

logger = logging.getLogger(__name__)


def make_strategy(config: AlgorithmConfig) -> tf.distribute.Strategy:
    """The learner's `tf.distribute` strategy for `num_gpus` / `_fake_gpus`.

    Call it before any TensorFlow op: it first makes the GPU settings that must precede
    TensorFlow's initialisation (`impala_tf.learning.devices.configure_gpus`: memory growth on,
    or with `num_gpus: 0` the GPUs hidden).

    One device: the default strategy (TensorFlow places ops on the GPU if there is one and
    `num_gpus > 0`); with `num_gpus: 0` and GPUs that could no longer be hidden, a
    `OneDeviceStrategy` on the CPU. N > 1: `MirroredStrategy` over N GPUs, or over N logical
    CPU devices with `_fake_gpus=True` (these must be configured before TensorFlow initialises;
    we do that here when we can).
    """
    pin_to_cpu = configure_gpus(config.num_gpus)
    n = config.num_learner_devices
    if pin_to_cpu:
        return tf.distribute.OneDeviceStrategy("/cpu:0")
    if n <= 1:
        return tf.distribute.get_strategy()
    if config._fake_gpus:
        cpus = tf.config.list_physical_devices("CPU")
        # `list_logical_devices` initialises the runtime, after which logical devices can no
        # longer be configured: look at the (uninitialised) configuration first.
        if tf.config.get_logical_device_configuration(cpus[0]) is None:
            # If TF is already initialised this fails; the check below explains.
            with contextlib.suppress(RuntimeError):
                tf.config.set_logical_device_configuration(
                    cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(n)]
                )
        logical = tf.config.list_logical_devices("CPU")
        if len(logical) < n:
            raise RuntimeError(
                f"num_gpus={n} with _fake_gpus=True needs {n} logical CPU devices, but "
                f"TensorFlow was initialised with {len(logical)}: build the algorithm before "
                "running any TensorFlow op, or configure the logical devices yourself."
            )
        return _mirrored([d.name for d in logical[:n]])
    gpus = tf.config.list_logical_devices("GPU")
    if not gpus:
        logger.warning(
            "num_gpus=%d but no GPU is visible: training on the CPU (set _fake_gpus=True to "
            "simulate %d devices).",
            n,
            n,
        )
        return tf.distribute.get_strategy()
    if len(gpus) < n:
        raise ValueError(f"num_gpus={n} but only {len(gpus)} GPU(s) are visible")
    return _mirrored([d.name for d in gpus[:n]])


_MIRRORED: dict[tuple[str, ...], tf.distribute.MirroredStrategy] = {}


def _mirrored(devices: list[str]) -> tf.distribute.MirroredStrategy:
    """One `MirroredStrategy` per set of devices and process.

    TensorFlow numbers each new strategy's collective all-reduces from the same start, so two
    strategies over the same devices in one process (two algorithms built one after the other,
    as in tests) reuse instance keys, and the runtime aborts on the first two that differ in
    shape ("Shape mismatch in the collective instance ..."). Sharing the strategy keeps the
    numbering unique.
    """
    key = tuple(devices)
    if key not in _MIRRORED:
        _MIRRORED[key] = tf.distribute.MirroredStrategy(list(devices))
    return _MIRRORED[key]
