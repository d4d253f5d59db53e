"""Test setup shared by every test module.

Two logical CPU devices are configured before TensorFlow initialises its runtime, so that
`MirroredStrategy` code paths run on a CPU-only machine (as TF-Agents' tests do).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    _cpus[0], [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
)
