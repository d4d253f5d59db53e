"""Test setup shared by every test module.

Two logical CPU devices are configured before TensorFlow initialises its runtime, so that
`MirroredStrategy` code paths run on a CPU-only machine (as TF-Agents' tests do).
"""

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    _cpus[0], [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
)


@pytest.fixture(autouse=True)
def _fresh_config_warning_registry(monkeypatch):
    """Config warnings are shown once per key per process; each test starts with none shown,
    so a test that expects one does not depend on which tests ran before it in its worker."""
    from impala_tf.config import keys

    monkeypatch.setattr(keys, "WARNED", set())
