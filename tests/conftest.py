"""Test setup shared by every test module.

Two logical CPU devices are configured before TensorFlow initialises its runtime, so that
`MirroredStrategy` code paths run on a CPU-only machine (as TF-Agents' tests do).
"""

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


@pytest.fixture(autouse=True)
def _fresh_config_warning_registry(monkeypatch):
    """Config warnings are shown once per key per process; each test starts with none shown,
    so a test that expects one does not depend on which tests ran before it in its worker."""
    from impala_tf.config import keys

    monkeypatch.setattr(keys, "WARNED", set())


def pytest_configure(config):
    """Each process that runs tests gets two logical CPU devices and starts its actors' fork
    server now, with TensorFlow loaded. xdist's controller, which runs no test, imports no
    TensorFlow (seconds of CPU).

    The fork server is one per driver process and its first build picks what it preloads; in
    a test process that first build is usually a numpy-acting one, and every later actor that
    acts in TensorFlow (custom models, LSTMs, CNNs) then imported TensorFlow itself, seconds of
    CPU each. Tests of what numpy actors load run their driver in a fresh process.
    """
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
    )

    from impala_tf.driver.plan import TENSORFLOW_PRELOAD
    from impala_tf.workers.process import prestart_fork_server

    prestart_fork_server(TENSORFLOW_PRELOAD)


#: The modules that take longest (worker-seconds in `pytest --durations=0`), run first so that
#: the two xdist workers end together instead of one finishing a long module alone.
_LONGEST_FIRST = (
    "tune_test",
    "ray_cluster_test",
    "runtime_conformance_test",
    "custom_model_binaries_test",
    "storm_test",
    "multi_agent_test",
    "ray_backend_test",
    "atari_test",
    "soak_test",
)


def pytest_collection_modifyitems(config, items):
    """Puts the tests of `_LONGEST_FIRST` first, in that order (the rest keep theirs)."""
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}

    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))
