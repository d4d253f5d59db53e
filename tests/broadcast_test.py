"""Tests for impala_tf.driver.broadcast: broadcast_interval and the time floor bound it."""

from __future__ import annotations

import numpy as np
import pytest

from impala_tf.config import ImpalaConfig
from impala_tf.driver.broadcast import AUTO_BYTES_PER_S, Broadcaster
from impala_tf.driver.counters import Counters


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Learners:
    """A learner at `rate` updates per second of `clock` (never waits, never dies), whose
    weights are `nbytes` bytes."""

    trained = ["default_policy"]

    def __init__(self, clock: Clock, rate: float, nbytes: int = 1000):
        self.clock, self.rate = clock, rate
        self.arrays = [np.zeros(nbytes // 4, np.float32)]

    def versions(self) -> dict[str, int]:
        return {"default_policy": int(self.clock() * self.rate)}

    def snapshot(self, pid: str, wait: bool = True):
        return self.arrays, self.versions()[pid]

    def weights(self):
        return {p: self.snapshot(p) for p in self.trained}


class Actors:
    def __init__(self, n: int):
        self.n = n
        self.sends: list[tuple[int, list[int]]] = []

    def healthy_ids(self) -> list[int]:
        return list(range(self.n))

    def broadcast(self, weights, actor_ids) -> None:
        self.sends.append((weights["default_policy"][1], list(actor_ids)))


def run(
    min_time_s: float | str,
    interval: int = 1,
    seconds: float = 10.0,
    step_s: float = 0.001,
    nbytes: int = 1000,
):
    """A driver loop of `step_s` steps for `seconds`, 128 actors each finishing a fragment every
    50 steps, a learner at 1,000 updates/s with `nbytes` of weights; returns (broadcasts,
    actors' sends)."""
    clock = Clock()
    actors = Actors(128)
    counters = Counters()
    broadcaster = Broadcaster(
        Learners(clock, 1000.0, nbytes),
        actors,
        interval,
        counters,
        min_time_s=min_time_s,
        clock=clock,
    )
    broadcaster.send(actors.healthy_ids())
    for step in range(int(seconds / step_s)):
        clock.now = step * step_s
        broadcaster.step([a for a in range(128) if (step + a) % 50 == 0])
    return counters.num_weight_broadcasts, actors.sends[1:]


def test_the_time_floor_bounds_broadcasts_per_second_whatever_the_learner_does():
    broadcasts, sends = run(min_time_s=0.1)
    assert 95 <= broadcasts <= 100  # 10 per second over 10 s.
    # Each broadcast goes to every actor that sampled since its last weights, newest weights.
    assert all(len(ids) == 128 for _, ids in sends[1:])
    assert [v for v, _ in sends] == sorted(v for v, _ in sends)


def test_without_the_floor_every_training_step_with_an_update_broadcasts():
    broadcasts, _ = run(min_time_s=0.0, seconds=1.0)
    assert broadcasts == 999  # RLlib's behaviour: one per step that had a new update.


def test_broadcast_interval_keeps_its_meaning_under_the_floor():
    # Few steps per second: the interval (steps), not the floor, is what binds.
    broadcasts, _ = run(min_time_s=0.1, interval=20, seconds=10.0, step_s=0.05)
    assert broadcasts == pytest.approx(200 / 20, abs=1)


def test_the_auto_floor_follows_the_weights_size():
    # The Pong CNN (4 MB): 0.1 s, at most 10 broadcasts per second.
    broadcasts, _ = run(min_time_s="auto", nbytes=4_000_000)
    assert 95 <= broadcasts <= 100
    # The CartPole MLP (0.27 MB): 6.8 ms, about 147 per second.
    broadcasts, _ = run(min_time_s="auto", nbytes=272_000)
    assert 1200 <= broadcasts <= 1430
    assert AUTO_BYTES_PER_S == 40e6


def test_the_floor_is_a_validated_config_key():
    assert ImpalaConfig().min_time_s_per_broadcast == "auto"
    ImpalaConfig(env="CartPole-v1").training(min_time_s_per_broadcast=0.5).validate()
    config = ImpalaConfig(env="CartPole-v1").training(min_time_s_per_broadcast=-1)
    with pytest.raises(ValueError, match="min_time_s_per_broadcast"):
        config.validate()


def test_restarted_actors_get_the_newest_weights_and_the_others_the_next_broadcast():
    clock = Clock()
    actors = Actors(3)
    broadcaster = Broadcaster(Learners(clock, 10.0), actors, 1, Counters())
    broadcaster.send(actors.healthy_ids())  # Version 0 to everyone.
    clock.now = 1.0  # Version 10 now.
    broadcaster.restarted([2])
    assert actors.sends[-1] == (10, [2])
    assert broadcaster.sent["default_policy"][1] == 0  # The others still hold version 0...
    assert broadcaster.step([0, 1])
    assert actors.sends[-1] == (10, [0, 1])  # ...so the next broadcast sends them version 10.
    broadcaster.restarted([])
    assert len(actors.sends) == 3


def test_broadcast_state_round_trips_and_a_restore_resumes_from_what_actors_hold():
    clock = Clock()
    actors = Actors(2)
    broadcaster = Broadcaster(Learners(clock, 10.0), actors, 3, Counters())
    broadcaster.send(actors.healthy_ids())
    broadcaster.step([0])
    state = broadcaster.get_state()
    assert state == {"steps_since_broadcast": 1}
    other = Broadcaster(Learners(clock, 10.0), actors, 3, Counters())
    other.set_state(state)
    assert other.get_state() == state
    clock.now = 2.0
    held = {"default_policy": ([np.ones(2, np.float32)], 7)}
    other.resume({0: held, 1: None})  # Actor 1's snapshot has no weights: it gets version 20.
    assert actors.sends[-1] == (20, [1])
    assert other.sent["default_policy"][1] == 20
    other.resume({0: held, 1: held})  # Every actor holds its own: broadcasts go on from those.
    assert other.sent["default_policy"][1] == 7
