"""Tests of the pure-logic parts of tools.bench_scaling and tools.bench_cartpole."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from tools import bench_cartpole, bench_scaling


def test_pickled_size_counts_out_of_band_buffers():
    array = np.zeros((1000, 100), np.uint8)
    size = bench_scaling.pickled_size({"obs": array})
    assert array.nbytes <= size < array.nbytes + 1000
    # The in-band pickle is the same size: protocol 5 only moves the bytes out of band.
    assert abs(size - len(pickle.dumps({"obs": array}, protocol=5))) < 100


def _actor(**overrides) -> dict:
    actor = {
        "env_steps_per_fragment": 800,
        "steps_per_cpu_s": 2000.0,
        "pickled_bytes": 1_600_000.0,
    }
    actor.update(overrides)
    return actor


def test_estimate_arithmetic():
    intake = {"local": 200_000.0, "ray": 100_000.0}
    est = bench_scaling.estimate(_actor(), learner_per_s=10_000.0, intake=intake)
    assert est["actors_at_cpu_learner_limit"] == pytest.approx(5.0)
    assert est["bytes_per_env_step"] == pytest.approx(2000.0)
    assert est["actors_per_driver_core"] == {"local": 100.0, "ray": 50.0}
    # 15 cores shared so that c actors' fragments take c * 2,000 / 200,000 driver cores.
    assert est["machine_actors"] == pytest.approx(15 / 1.01)
    assert est["machine_driver_cores"] == pytest.approx(15 / 1.01 * 0.01)
    assert est["link_steps_per_s"] == pytest.approx(1.25e9 / 2000.0)


def test_estimate_follows_the_actor_rate():
    intake = {"local": 200_000.0, "ray": 100_000.0}
    slow = bench_scaling.estimate(_actor(steps_per_cpu_s=1000.0), 10_000.0, intake)
    assert slow["actors_at_cpu_learner_limit"] == pytest.approx(10.0)
    assert slow["actors_per_driver_core"]["ray"] == pytest.approx(100.0)


def test_cartpole_steady_rate_excludes_the_first_iteration():
    results = [
        {"time_total_s": 10.0, "timesteps_total": 1000},
        {"time_total_s": 12.0, "timesteps_total": 5000},
        {"time_total_s": 14.0, "timesteps_total": 9000},
    ]
    assert bench_cartpole.steady_rate(results) == pytest.approx(2000.0)
    assert bench_cartpole.steady_rate(results[:1]) == pytest.approx(100.0)
    assert bench_cartpole.steady_rate([]) == 0.0
