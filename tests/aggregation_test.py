"""Aggregation (`impala_tf.driver.aggregation`): the `Aggregator` and the aggregation stage.

`Aggregator` decompresses, mixes in replay and cuts train batches per trained policy;
`AggregationStage` runs it in the driver or in aggregation worker processes, which get the
fragments' batches by reference (here the test plays the actors: it writes each fragment's
batches into shared memory as an actor's worker process does) and send train batches back the
same way, left there until the learner's loader fetches them (`BatchRef`). Replay in the
running algorithm, in the driver and in a worker, is
`tests/replay_runtime_test.py`'s; a killed aggregation worker in a running algorithm is
`tests/runtime_conformance_test.py`'s.

The aggregation workers' gated and stuck hosts are `tests.support.aggregators`' (no TensorFlow in
those worker processes).
"""

from __future__ import annotations

import collections
import os
import signal

import gymnasium as gym
import numpy as np
import pytest

from impala_tf.config import ImpalaConfig
from impala_tf.data.sample_batch import SampleBatch, compress
from impala_tf.data.train_batch import BatchLost, TrainBatch
from impala_tf.driver import aggregation
from impala_tf.driver.aggregation import AggregationStage, Aggregator, BatchRef
from impala_tf.driver.counters import Counters
from impala_tf.driver.specs import aggregator_spec
from impala_tf.rollout.fragment import DEFAULT_POLICY_ID, Fragment
from impala_tf.workers import ProcessBackend, StoredValue
from impala_tf.workers import shared_values as sv
from impala_tf.workers.shared_arrays import SEGMENT_PREFIX
from tests.support import aggregators
from tests.support.batches import sequence_batch
from tests.support.processes import wait_until

PID = DEFAULT_POLICY_ID


def _fragment(rows: int, horizon: int = 5, seed: int = 0) -> SampleBatch:
    rng = np.random.default_rng(seed)
    return SampleBatch(
        {
            "obs": rng.normal(size=(rows, horizon, 4)).astype(np.float32),
            "rewards": np.ones((rows, horizon), np.float32),
        }
    )


def test_aggregator_decompresses_and_cuts_fixed_size_batches():
    config = ImpalaConfig(env="CartPole-v1")
    aggregator = Aggregator(aggregator_spec(config, {PID: 3}))
    fragment = _fragment(4)
    out = aggregator.process({PID: compress(fragment)}, {PID: 7.0})
    assert len(out) == 1
    pid, batch, version = out[0]
    assert pid == PID and len(batch) == 3 and version == 7.0
    np.testing.assert_array_equal(batch["obs"], fragment["obs"][:3])
    ((_, batch2, version2),) = aggregator.process({PID: _fragment(2, seed=1)}, {PID: 9.0})
    assert len(batch2) == 3
    assert version2 == (7.0 + 9.0 + 9.0) / 3  # one leftover row of version 7, two of 9
    np.testing.assert_array_equal(batch2["obs"][0], fragment["obs"][3])


def test_aggregator_drops_the_batches_of_policies_it_does_not_train():
    config = ImpalaConfig(env="CartPole-v1").multi_agent(
        policies=["p0", "p1"], policies_to_train=["p0"]
    )
    aggregator = Aggregator(aggregator_spec(config, {"p0": 1}))
    out = aggregator.process({"p0": _fragment(1), "p1": _fragment(1, seed=1)}, {})
    assert [pid for pid, _, _ in out] == ["p0"]


def test_aggregator_replays_p_old_batches_per_new_one():
    config = ImpalaConfig(env="CartPole-v1", replay_proportion=1.0, replay_buffer_num_slots=4)
    config.debugging(seed=0)
    aggregator = Aggregator(aggregator_spec(config, {PID: 1}))
    arrived = []  # Fragment i's one row, to tell where each train batch came from.
    replayed, older = 0, 0
    for i in range(200):
        fragment = _fragment(1, seed=i)
        arrived.append(fragment["obs"][0])
        out = aggregator.process({PID: fragment}, {})
        origins = [
            next(j for j, row in enumerate(arrived) if np.array_equal(row, batch["obs"][0]))
            for _, batch, _ in out
        ]
        assert origins[0] == i  # The new fragment trains at once ...
        assert all(i - 4 < j <= i for j in origins[1:])  # ... then rows from the 4 slots.
        replayed += len(origins) - 1
        older += sum(j < i for j in origins[1:])
    # p = 1 replayed batch per new one (exactly: one draw per new batch below a whole p) ...
    assert replayed == 200
    # ... drawn from the 4 slots, the new batch among them: mostly older ones.
    assert older > 0.6 * replayed


def _stage(**overrides) -> AggregationStage:
    config = ImpalaConfig(env="CartPole-v1", num_aggregation_workers=1, **overrides)
    config.debugging(seed=0)
    return AggregationStage(aggregator_spec(config, {PID: 2}), Counters(), ProcessBackend())


def _sequences(seed: int) -> Fragment:
    space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
    batch = SampleBatch(sequence_batch(space, gym.spaces.Discrete(2), 5, 2, seed=seed))
    return Fragment({PID: batch}, env_steps=10, agent_steps=10, policy_versions={PID: seed})


def _got(out: list) -> list:
    """The stage's outputs with each train batch fetched here, as the learner's loader does."""
    return [(pid, TrainBatch(batch).batch, version) for pid, batch, version in out]


def _fetch_one(stage: AggregationStage) -> list:
    out: list = []
    assert wait_until(lambda: out.extend(stage.fetch(0.5)) or out, timeout_s=60)
    return _got(out)


@pytest.fixture(scope="module")
def stage():
    stage = _stage()
    yield stage
    stage.stop()


def test_a_worker_cuts_the_train_batches_and_the_driver_fetches_them(stage):
    fragment = _sequences(1)
    assert stage.process(fragment) == []  # Sent to the worker, not aggregated here.
    ((pid, batch, version),) = _fetch_one(stage)
    assert pid == PID and version == 1.0
    np.testing.assert_array_equal(batch["obs"], fragment.batches[PID]["obs"])
    assert stage.counters.num_times_no_aggregation_worker_available == 0


def test_a_reset_drops_what_workers_were_sent_before_it(stage):
    stage.process(_sequences(2))  # Answered before the next fragment: the worker runs in order.
    stage.reset(seed=5)
    after = _sequences(3)
    stage.process(after)
    ((_, batch, version),) = _fetch_one(stage)
    assert version == 3.0
    np.testing.assert_array_equal(batch["obs"], after.batches[PID]["obs"])


@pytest.fixture
def gated(monkeypatch, tmp_path):
    """Aggregation workers that hold every fragment until `open_gate()`; yields `open_gate`."""
    gate = tmp_path / "gate"
    monkeypatch.setenv(aggregators.GATE_ENV, str(gate))
    monkeypatch.setattr(aggregation, "make_aggregator_host", aggregators.make_gated_aggregator)
    yield gate.touch


def test_a_worker_at_max_requests_in_flight_gets_no_more_fragments_the_driver_aggregates_them(
    gated,
):
    stage = _stage(max_requests_in_flight_per_aggregator_worker=1)
    try:
        assert stage.process(_sequences(1)) == []  # Sent: the worker's one call in flight.
        # The worker has not answered, so it is at its limit: aggregated here.
        ((_, batch, version),) = stage.process(_sequences(2))
        assert version == 2.0
        assert stage.counters.num_times_no_aggregation_worker_available == 1
        gated()
        ((_, _, version),) = _fetch_one(stage)
        assert version == 1.0  # The worker's reply to the first fragment.
        assert stage.process(_sequences(3)) == []  # Room again: sent to the worker.
        assert stage.counters.num_times_no_aggregation_worker_available == 1
    finally:
        stage.stop()


def test_a_reply_that_came_back_frees_its_worker_before_the_next_fetch(gated):
    """A worker at its limit whose reply has arrived takes the next fragment: `process` takes
    the reply itself (kept for `fetch`) instead of aggregating the fragment in the driver."""
    stage = _stage(max_requests_in_flight_per_aggregator_worker=1)
    try:
        assert stage.process(_sequences(1)) == []
        gated()
        # No fetch in between: only `process` itself can see the reply and free the worker.
        assert wait_until(lambda: stage.process(_sequences(2)) == [], timeout_s=30)
        out: list = []
        assert wait_until(lambda: out.extend(stage.fetch(0.5)) or len(out) >= 2, timeout_s=60)
        assert sorted(version for _, _, version in out)[0] == 1.0  # The first reply, kept.
    finally:
        stage.stop()


def test_two_fragments_in_flight_per_worker_by_default(gated):
    stage = _stage()
    try:
        assert stage.process(_sequences(1)) == [] and stage.process(_sequences(2)) == []
        assert len(stage.process(_sequences(3))) == 1  # The third waits for no one: here.
        assert stage.counters.num_times_no_aggregation_worker_available == 1
    finally:
        stage.stop()


# Fragments by reference (local processes) -------------------------------------------------------


class _Actors:
    """The test as the actors' side: each fragment's batches written into shared memory, as an
    actor's worker process writes them, held in a `SegmentStore` as the driver holds them."""

    def __init__(self):
        self.store = sv.SegmentStore()
        self.calls = 0

    def fragment(self, seed: int) -> Fragment:
        self.calls += 1
        name = self.store.expect(0, self.calls)
        fragment = _sequences(seed)
        handle = self.store.received(0, self.calls, sv.write_value(name, fragment.batches))
        return Fragment(handle, fragment.env_steps, fragment.agent_steps, {PID: seed})

    def segments(self) -> list[str]:
        """Those of its segments still in /dev/shm."""
        return [n for n in self.store.names() if os.path.exists(f"/dev/shm/{n}")]


def _read_in_driver(monkeypatch) -> list[str]:
    """Records the name of every segment the driver reads."""
    names: list[str] = []
    get = sv.SharedValue.get
    monkeypatch.setattr(sv.SharedValue, "get", lambda self: names.append(self.name) or get(self))
    return names


def test_workers_get_fragments_by_reference_and_cut_the_train_batches_the_driver_would(
    monkeypatch,
):
    read_here = _read_in_driver(monkeypatch)
    actors = _Actors()
    stage = _stage(max_requests_in_flight_per_aggregator_worker=100)
    handed = []
    call = stage.workers.call
    monkeypatch.setattr(
        stage.workers, "call", lambda *a, **k: handed.append(type(a[2])) or call(*a, **k)
    )
    driver = Aggregator(stage.spec)
    try:
        expected, out = [], []
        for seed in range(6):  # 2 rows each, a train batch of 2 rows: one per fragment.
            expected += driver.process(_sequences(seed).batches, {PID: seed})
            assert stage.process(actors.fragment(seed)) == []
        assert wait_until(lambda: out.extend(stage.fetch(0.5)) or len(out) == 6, timeout_s=60)
        assert not read_here  # Handles: nothing read in the driver yet.
        out = _got(out)  # As the learners' loaders fetch them.
        assert stage.counters.num_times_no_aggregation_worker_available == 0
        assert handed == [sv.SharedValue] * 6  # Names, not batches.
        # The driver read the train batches only, never a fragment's batches, and removed each
        # fragment once its worker answered.
        assert read_here and not set(read_here) & set(actors.store.names())
        assert actors.segments() == [] and actors.store.names() == []
    finally:
        stage.stop()
    assert [(p, v) for p, _, v in out] == [(p, v) for p, _, v in expected]
    for (_, got, _), (_, want, _) in zip(out, expected):
        assert sorted(got) == sorted(want)
        for column in want:
            assert got[column].tobytes() == want[column].tobytes(), column


def test_at_the_in_flight_limit_the_driver_reads_the_fragment_from_shared_memory(
    monkeypatch, gated
):
    read_here = _read_in_driver(monkeypatch)
    actors = _Actors()
    stage = _stage(max_requests_in_flight_per_aggregator_worker=1)
    try:
        first, second = actors.fragment(1), actors.fragment(2)
        assert stage.process(first) == []
        ((_, batch, version),) = stage.process(second)  # Aggregated here, from the segment.
        assert version == 2.0 and read_here == [second.batches.name]
        np.testing.assert_array_equal(batch["obs"], _sequences(2).batches[PID]["obs"])
        assert stage.counters.num_times_no_aggregation_worker_available == 1
        assert actors.segments() == [first.batches.name]  # Read and removed; the first waits.
        gated()
        _fetch_one(stage)
        assert actors.segments() == []
    finally:
        stage.stop()


def test_a_killed_worker_loses_its_fragments_and_the_driver_removes_them(monkeypatch):
    monkeypatch.setattr(aggregation, "make_aggregator_host", aggregators.make_stuck_aggregator)
    actors = _Actors()
    stage = _stage()
    try:
        fragment = actors.fragment(1)
        assert stage.process(fragment) == []
        assert actors.segments() == [fragment.batches.name]
        os.kill(stage.pids()[0], signal.SIGKILL)
        assert wait_until(
            lambda: stage.fetch(0.5) == [] and stage.counters.num_aggregation_worker_restarts
        )
        assert stage.counters.num_env_steps_lost_in_aggregation == fragment.env_steps
        assert actors.segments() == []  # Removed on the failure, not on stop.
    finally:
        stage.stop()
    assert not [
        n for n in os.listdir("/dev/shm") if n.startswith(f"{SEGMENT_PREFIX}{os.getpid()}_")
    ]


def _train_batch_segments(stage: AggregationStage) -> list[str]:
    """The aggregation workers' segments in /dev/shm (the train batches they sent back)."""
    names = stage.workers._impl._segments.names()  # noqa: SLF001 - the driver's book of them.
    return [n for n in names if os.path.exists(f"/dev/shm/{n}")]


def test_train_batches_stay_in_shared_memory_until_the_loader_fetches_or_drops_them(stage):
    for seed in (4, 5):
        stage.process(_sequences(seed))
    out: list = []
    assert wait_until(lambda: out.extend(stage.fetch(0.5)) or len(out) == 2, timeout_s=60)
    (_, kept, _), (_, dropped, _) = out
    assert isinstance(kept, BatchRef) and kept.env_steps == 10
    assert len(_train_batch_segments(stage)) == 2
    batch = TrainBatch(kept).batch  # Fetched: a private copy here, the segment removed.
    np.testing.assert_array_equal(batch["obs"], _sequences(4).batches[PID]["obs"])
    assert len(_train_batch_segments(stage)) == 1
    with pytest.raises(BatchLost):
        kept.get()  # Each batch is fetched once.
    TrainBatch(dropped).release()  # Dropped unread (a full learner queue, a restore).
    assert _train_batch_segments(stage) == []


def test_a_train_batch_lost_from_the_store_is_skipped_and_counted(stage):
    stage.process(_sequences(6))
    out: list = []
    assert wait_until(lambda: out.extend(stage.fetch(0.5)) or out, timeout_s=60)
    ((_, ref, _),) = out
    for name in _train_batch_segments(stage):  # As a node's store goes with the node.
        os.unlink(f"/dev/shm/{name}")
    with pytest.raises(BatchLost, match="lost before the learner read it"):
        TrainBatch(ref).batch  # noqa: B018
    lost = stage.counters.num_env_steps_lost_in_aggregation
    stage.fetch(0.0)
    assert stage.counters.num_env_steps_lost_in_aggregation == lost + 10


def test_stop_removes_the_train_batches_never_fetched():
    stage = _stage()
    try:
        stage.process(_sequences(7))
        out: list = []
        assert wait_until(lambda: out.extend(stage.fetch(0.5)) or out, timeout_s=60)
        assert len(_train_batch_segments(stage)) == 1
    finally:
        stage.stop()
    assert not [
        n for n in os.listdir("/dev/shm") if n.startswith(f"{SEGMENT_PREFIX}{os.getpid()}_")
    ]


class _GoneValue(StoredValue):
    def get(self):
        raise FileNotFoundError("gone with its node")


def test_a_reply_lost_from_the_store_counts_the_env_steps_of_every_batch_not_dropped():
    lost: collections.deque = collections.deque()
    reply = aggregation._StoredReply(_GoneValue(), [10, 20, 30], lost)
    refs = [BatchRef(reply, i, steps) for i, steps in enumerate([10, 20, 30])]
    refs[2].release()  # Dropped unread first (a full learner queue): not lost.
    for ref in refs[:2]:
        with pytest.raises(BatchLost, match="gone with its node"):
            ref.get()
    assert list(lost) == [30]  # 10 + 20, counted once.
