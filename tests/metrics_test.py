"""The driver's metrics: every update of an iteration summarised beside RLlib's last-update
learner stats (`update_stats`), and what TensorBoard gets of it."""

from __future__ import annotations

import math

from impala_tf.driver.counters import Counters
from impala_tf.driver.metrics import Metrics
from impala_tf.training.reporting import tensorboard_scalars

RUNTIME = {"num_healthy_workers": 1, "num_in_flight_async_sample_reqs": 0, "node_ip": "127.0.0.1"}


def _update(entropy: float, gnorm: float, updates: int) -> dict:
    return {
        "entropy": entropy,
        "grad_gnorm_unclipped": gnorm,
        "diff_num_grad_updates_vs_sampler_policy": 2.0,
        "num_grad_updates_lifetime": updates,
        "num_agent_steps_trained": 100 * updates,
    }


def test_update_stats_summarise_every_update_of_an_iteration_then_start_again():
    metrics = Metrics(10, ["default_policy"], False)
    metrics.record_learner_output("default_policy", 100, _update(0.6, 10.0, 1))
    metrics.record_learner_output("default_policy", 100, _update(0.01, 400.0, 2))
    metrics.record_learner_output("default_policy", 100, _update(0.5, math.nan, 3))
    result = metrics.result(Counters(), 1.0, 1, 1.0, RUNTIME)
    info = result["info"]["learner"]["default_policy"]
    assert info["learner_stats"]["entropy"] == 0.5  # RLlib's: the last update's.
    summary = info["update_stats"]
    assert summary["num_updates"] == 3
    assert summary["entropy_min"] == 0.01 and summary["entropy_max"] == 0.6
    assert math.isclose(summary["entropy_mean"], (0.6 + 0.01 + 0.5) / 3)
    assert summary["grad_gnorm_unclipped_max"] == 400.0  # The NaN left out.
    assert summary["diff_num_grad_updates_vs_sampler_policy_mean"] == 2.0
    assert "num_grad_updates_lifetime_mean" not in summary  # A counter, not a measurement.
    scalars = tensorboard_scalars(result, raw=False)
    assert scalars["learner/updates/entropy_min"] == 0.01
    metrics.record_learner_output("default_policy", 100, _update(0.4, 5.0, 4))
    again = metrics.result(Counters(), 1.0, 2, 2.0, RUNTIME)["info"]["learner"]["default_policy"]
    assert again["update_stats"]["entropy_min"] == 0.4 and again["update_stats"]["num_updates"] == 1


def test_each_policy_has_its_own_update_stats_and_tags():
    metrics = Metrics(10, ["p0", "p1"], True)
    metrics.record_learner_output("p0", 50, _update(0.3, 1.0, 1))
    result = metrics.result(Counters(), 1.0, 1, 1.0, RUNTIME)
    assert result["info"]["learner"]["p0"]["update_stats"]["entropy_min"] == 0.3
    assert result["info"]["learner"]["p1"]["update_stats"] == {"num_updates": 0}
    assert tensorboard_scalars(result, raw=False)["learner/p0/updates/entropy_min"] == 0.3
