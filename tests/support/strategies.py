"""`MirroredStrategy`s for tests that build several in one process.

TensorFlow numbers a `MirroredStrategy`'s collective operations (group and instance keys) from the
same start in every instance. Two strategies over the same devices in one process therefore
reuse keys, and when two of their all-reduces with equal keys differ in shape the runtime aborts
("Shape mismatch in the collective instance ..."). Tests (and pytest-xdist workers running many
test files) build many strategies, so each one here gets its own key range through
`MirroredStrategy._collective_key_base`, the attribute TensorFlow provides for its own tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import tensorflow as tf

__all__ = ["mirrored", "own_collective_keys"]

_KEY_RANGE = 10_000


def _next_key_range() -> None:
    tf.distribute.MirroredStrategy._collective_key_base += _KEY_RANGE


@contextlib.contextmanager
def own_collective_keys() -> Iterator[None]:
    """Strategies created inside the block (e.g. by `Impala`) use keys no other strategy uses."""
    _next_key_range()
    try:
        yield
    finally:
        _next_key_range()


def mirrored(num_devices: int = 2) -> tf.distribute.MirroredStrategy:
    """A new `MirroredStrategy` over the first `num_devices` logical CPUs, with its own keys."""
    devices = [d.name for d in tf.config.list_logical_devices("CPU")[:num_devices]]
    assert len(devices) == num_devices, "tests/conftest.py configures two logical CPUs"
    with own_collective_keys():
        return tf.distribute.MirroredStrategy(devices)
