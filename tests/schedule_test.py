"""The asynchronous training step's waits (`impala_tf.driver.schedule`): RLlib's
`timeout_s_sampler_manager` and `timeout_s_aggregator_manager`.

The schedule's collaborators are doubles that record how long each step asked them to wait;
what the step does with fragments and batches is `tests/runtime_conformance_test.py`'s.
"""

from __future__ import annotations

import types

import pytest

from impala_tf.config import ImpalaConfig
from impala_tf.driver.metrics import Metrics
from impala_tf.driver.schedule import MIN_FETCH_WAIT_S, AsyncSchedule, make_schedule


class _Actors:
    """Records the waits of `fetch`; has no fragment ready."""

    def __init__(self):
        self.waits: list[float] = []

    def fetch(self, timeout_s: float):
        assert timeout_s >= 0, "a negative wait is refused by the worker group's poll"
        self.waits.append(timeout_s)
        return [], []

    def handle_failures(self, failures):
        assert not list(failures)
        return []

    def top_up(self):
        pass


class _Aggregation:
    """Records the waits of `fetch`; has no batch ready."""

    def __init__(self):
        self.waits: list[float] = []

    def process(self, fragment):
        raise AssertionError("no fragment arrives in these tests")

    def fetch(self, timeout_s: float = 0.0):
        assert timeout_s >= 0
        self.waits.append(timeout_s)
        return []


class _Learners:
    def check(self):
        pass

    def drain(self):
        return []


class _Broadcaster:
    def restarted(self, actor_ids):
        assert not list(actor_ids)

    def step(self, sampled):
        assert list(sampled) == []
        return False


def _schedule(**keys) -> tuple[AsyncSchedule, _Actors, _Aggregation]:
    config = ImpalaConfig(env="CartPole-v1", **keys)
    actors, aggregation = _Actors(), _Aggregation()
    plan = types.SimpleNamespace(deterministic=False)
    metrics = Metrics(100, ["default_policy"], multi_agent=False)
    schedule = make_schedule(
        plan,
        actors,
        aggregation,
        _Learners(),
        _Broadcaster(),
        metrics,
        fetch_wait_s=config.timeout_s_sampler_manager,
        aggregation_wait_s=config.timeout_s_aggregator_manager,
    )
    assert isinstance(schedule, AsyncSchedule)
    schedule.step()
    return schedule, actors, aggregation


@pytest.mark.parametrize("seconds", [0.05, 0.5])
def test_timeout_s_sampler_manager_is_how_long_a_step_waits_for_a_fragment(seconds):
    _, actors, _ = _schedule(timeout_s_sampler_manager=seconds)
    assert actors.waits == [seconds]


def test_rllibs_zero_sampler_wait_is_raised_to_the_floor_so_the_driver_does_not_spin():
    _, actors, _ = _schedule(timeout_s_sampler_manager=0.0)
    assert actors.waits == [MIN_FETCH_WAIT_S] and MIN_FETCH_WAIT_S > 0


@pytest.mark.parametrize("seconds", [0.0, 0.25])
def test_timeout_s_aggregator_manager_is_how_long_a_step_waits_for_aggregated_batches(seconds):
    _, _, aggregation = _schedule(timeout_s_aggregator_manager=seconds)
    assert aggregation.waits == [seconds]
