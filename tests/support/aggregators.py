"""Aggregation-worker hosts of the tests (`tests/aggregation_test.py`), in a module that imports
no TensorFlow: an aggregation worker imports its factory's module by path, and a worker forked
from a fork server that preloaded only numpy modules imported TensorFlow (seconds of CPU) when
that module was the test module."""

from __future__ import annotations

import os
import time

from impala_tf.driver.aggregation import AggregatorHost

#: The file whose creation lets a gated aggregator answer.
GATE_ENV = "IMPALA_TF_TEST_GATE"


class _GatedAggregator(AggregatorHost):
    def process_parts(self, batches, versions):
        while not os.path.exists(os.environ[GATE_ENV]):  # Until the test opens it.
            time.sleep(0.01)
        return super().process_parts(batches, versions)


def make_gated_aggregator(index, spec):
    """An aggregation worker that answers once the test creates the file named by GATE_ENV."""
    return _GatedAggregator(index, spec)


class _StuckAggregator(AggregatorHost):
    def process_parts(self, batches, versions):
        time.sleep(600)  # Until killed.


def make_stuck_aggregator(index, spec):
    """An aggregation worker that never answers."""
    return _StuckAggregator(index, spec)
