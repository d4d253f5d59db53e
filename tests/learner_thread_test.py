"""Tests of the learner thread's device traffic (issue 18, item 5), on logical CPU devices.

Every strategy the learner runs under: TensorFlow's default strategy, a `OneDeviceStrategy` and a
`MirroredStrategy` over the two logical CPUs of tests/conftest.py. Host reads are counted where
every eager tensor reaches numpy (`_EagerTensorBase._numpy`, behind `.numpy()`, `np.asarray`,
`int()`, `float()` and `bool()` of a tensor). The accelerator path is forced on the CPU devices.
"""

from __future__ import annotations

import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import ops

from impala_tf.data.sample_batch import SampleBatch
from impala_tf.driver.learners import LearnerGroup
from impala_tf.driver.plan import make_plan
from impala_tf.driver.specs import policy_learners
from impala_tf.learning import devices, pipeline
from impala_tf.learning.learner import ImpalaLearner
from impala_tf.learning.strategy import make_strategy
from impala_tf.learning.thread import LearnerThread, TrainBatch
from tests.support import batches as fakes
from tests.support import strategies
from tests.support.configs import small_config

OBS, ACT, T, ROWS = fakes.OBS, fakes.ACT, fakes.T, fakes.ROWS
STRATEGIES = ("default", "one_device", "mirrored")


def _strategy(name: str) -> tf.distribute.Strategy:
    if name == "default":
        return tf.distribute.get_strategy()
    if name == "one_device":
        return tf.distribute.OneDeviceStrategy("/cpu:1")
    return strategies.mirrored()


def _config(strategy: tf.distribute.Strategy, **overrides):
    n = strategy.num_replicas_in_sync
    return fakes.learner_config(num_gpus=n, _fake_gpus=n > 1, **overrides)


def _thread(strategy, config=None, callbacks=None, accelerator=None) -> LearnerThread:
    config = config or _config(strategy)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        learner = ImpalaLearner(config, OBS, ACT)
    signature = pipeline.batch_signature(config, OBS, ACT, strategy.num_replicas_in_sync)
    return LearnerThread(learner, strategy, signature, callbacks, accelerator=accelerator)


def _batch(seed: int) -> SampleBatch:
    return SampleBatch(fakes.sequence_batch(OBS, ACT, T, ROWS, seed=seed))


def _train(thread: LearnerThread, updates: int) -> list:
    thread.start()
    try:
        for seed in range(updates):
            thread.inqueue.put(TrainBatch(_batch(seed)))
        outputs = [thread.outqueue.get(timeout=120) for _ in range(updates)]
    finally:
        thread.stop()
    assert thread.error is None, thread.error
    return outputs


class _HostReads(keras.callbacks.Callback):
    """Counts the eager tensors read back to the host, per thread, from the first update on
    (building the iterator and tracing read constants once, before it); a learner callback."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.by_thread: dict[threading.Thread, int] = {}
        self.counting = False
        original = ops._EagerTensorBase._numpy

        def counted(tensor):
            thread = threading.current_thread()
            if self.counting:
                self.by_thread[thread] = self.by_thread.get(thread, 0) + 1
            return original(tensor)

        monkeypatch.setattr(ops._EagerTensorBase, "_numpy", counted)

    def on_train_batch_begin(self, batch, logs=None):
        self.counting = True

    def of(self, thread: threading.Thread) -> int:
        return self.by_thread.get(thread, 0)


# Every pair of values of the three settings, in 6 runs of the 12 combinations (a mirrored run
# traces for seconds): each strategy with and without microbatches and the accelerator path.
_HOST_READ_CASES = [
    ("default", 1, False),
    ("default", 2, True),
    ("one_device", 1, True),
    ("one_device", 2, False),
    ("mirrored", 1, True),
    ("mirrored", 2, False),
]


@pytest.mark.parametrize(
    "name, microbatches, accelerator",
    _HOST_READ_CASES,
    ids=[
        f"{name}-{'microbatches' if micro == 2 else 'batch'}-{'accelerator' if acc else 'cpu'}"
        for name, micro, acc in _HOST_READ_CASES
    ],
)
def test_an_update_reads_one_value_back_to_the_host(monkeypatch, name, microbatches, accelerator):
    strategy = _strategy(name)
    micro = {} if microbatches == 1 else {"microbatch_size": ROWS * T // microbatches}
    reads = _HostReads(monkeypatch)
    thread = _thread(
        strategy, _config(strategy, **micro), callbacks=[reads], accelerator=accelerator
    )
    assert thread.num_microbatches == microbatches
    updates = 3
    outputs = _train(thread, updates)
    # The stats of each update, stacked into one tensor: 14 reads per update before issue 18.
    assert reads.of(thread) == updates
    assert [o[2]["num_grad_updates_lifetime"] for o in outputs] == [1, 2, 3]
    assert isinstance(outputs[-1][2]["num_agent_steps_trained"], int)
    assert all(np.isfinite(o[2]["total_loss"]) for o in outputs)
    # The host-side version is the variable's value, and reading it reads nothing.
    before = reads.of(threading.current_thread())
    assert thread.version == updates
    assert reads.of(threading.current_thread()) == before
    assert int(thread.learner.num_grad_updates.numpy()) == updates


def test_the_driver_reads_no_device_value_for_the_versions(monkeypatch):
    # Two policies, one trained: the trained one's version is its thread's; the other's is read
    # once, and again after a flush (a restore loads the counters after flushing).
    config = small_config(policies=2, policies_to_train=["p0"])
    config.validate(require_env=True)
    plan = make_plan(config)
    group = LearnerGroup(policy_learners(config, plan.models), plan, tf.distribute.get_strategy())
    try:
        assert sorted(group.threads) == ["p0"]
        assert group.versions() == {"p0": 0, "p1": 0}
        reads = _HostReads(monkeypatch)
        reads.counting = True
        for _ in range(5):
            assert group.versions() == {"p0": 0, "p1": 0}
        assert reads.of(threading.current_thread()) == 0
        with group.locked():
            group.flush()
            for learner in group.learners.values():  # What a checkpoint read does.
                learner.num_grad_updates.assign(7)
        assert group.versions() == {"p0": 7, "p1": 7}
        assert group.snapshot("p0")[1] == 7 and group.snapshot("p1")[1] == 7
    finally:
        group.stop()


@pytest.mark.parametrize("name", ["default", "mirrored"])
@pytest.mark.parametrize("accelerator", [False, True], ids=["cpu", "accelerator"])
def test_on_an_accelerator_the_loader_loads_the_next_unit_during_an_update(name, accelerator):
    strategy = _strategy(name)
    gate = fakes.Gate()
    thread = _thread(strategy, callbacks=[gate], accelerator=accelerator)
    slots = 2 if accelerator else 1
    assert thread.num_slots == slots
    if accelerator:  # Units go through the strategy's device copy, also on one device.
        assert isinstance(thread._dataset, tf.distribute.DistributedDataset)
    thread.start()
    try:
        for seed in range(4):
            thread.inqueue.put(TrainBatch(_batch(seed)))
        assert gate.entered.wait(60)
        # The first unit trains; the loader has loaded the next `slots - 1` and waits.
        assert thread.loader_waiting.wait(60)
        assert thread.load_timer.count == slots and thread.inqueue.qsize() == 4 - slots
        gate.release.set()
        outputs = [thread.outqueue.get(timeout=120) for _ in range(4)]
    finally:
        gate.release.set()
        thread.stop()
    assert thread.error is None, thread.error
    assert [o[2]["num_grad_updates_lifetime"] for o in outputs] == [1, 2, 3, 4]


class _Events:
    """Records, in order, each update queued ("q") and each update's stats read ("r")."""

    def __init__(self, thread: LearnerThread):
        self.events: list[str] = []
        queue_update, unpack = thread._queue, thread.reports.unpack

        def queued(*args):
            self.events.append("q")
            return queue_update(*args)

        def read(packed):
            self.events.append("r")
            return unpack(packed)

        thread._queue, thread.reports.unpack = queued, read


class _NextUnitLoaded(keras.callbacks.Callback):
    """Begins the first `first` updates only once the loader has handed the next unit to the
    dataset, so that it is at hand when the update is queued (the loader is not made to wait)."""

    def __init__(self, first: int):
        super().__init__()
        self.first = first
        self.begun = 0
        self.thread: LearnerThread | None = None

    def on_train_batch_begin(self, batch, logs=None):
        deadline = time.monotonic() + 60
        while self.begun < self.first and not self.thread.loader.units:
            assert time.monotonic() < deadline, "the loader never handed over the next unit"
            time.sleep(0.002)
        self.begun += 1


@pytest.mark.parametrize("name", ["default", "mirrored"])
@pytest.mark.parametrize("accelerator", [False, True], ids=["cpu", "accelerator"])
def test_on_an_accelerator_the_next_update_is_queued_before_the_last_is_read(name, accelerator):
    strategy = _strategy(name)
    updates = 4
    # With one loader slot (a CPU) the next unit is never loaded during an update.
    loaded = _NextUnitLoaded(first=updates - 1 if accelerator else 0)
    thread = _thread(strategy, callbacks=[loaded], accelerator=accelerator)
    loaded.thread = thread
    assert thread.queues_updates is accelerator
    events = _Events(thread)
    outputs = _train(thread, updates)
    assert [o[2]["num_grad_updates_lifetime"] for o in outputs] == [1, 2, 3, 4]
    if accelerator:  # Update k's stats are read after update k+1 is queued; the last at once.
        assert events.events == ["q", "q", "r", "q", "r", "q", "r", "r"]
    else:
        assert events.events == ["q", "r"] * updates
    # Same updates either way: the stats and the weights of a run that reads at once.
    reference = _thread(strategy, accelerator=False)
    expected = _train(reference, updates)
    for got, want in zip(outputs, expected):
        for key in ("total_loss", "grad_gnorm", "num_agent_steps_trained"):
            assert got[2][key] == pytest.approx(want[2][key], rel=1e-5, abs=1e-7), key
        assert got[2]["diff_num_grad_updates_vs_sampler_policy"] == pytest.approx(
            want[2]["diff_num_grad_updates_vs_sampler_policy"]
        )
    for a, b in zip(reference.learner.get_policy_weights(), thread.learner.get_policy_weights()):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)
    assert thread.version == updates
    assert thread.policy_snapshot()[1] == updates


def test_a_queued_update_is_read_before_the_learner_waits_for_data():
    # Lockstep, as a deterministic run trains: each batch's output is awaited before the next
    # batch is put. A queued update whose successor never comes must still be read; with two
    # passes per batch the first pass's update is queued while the second pass runs.
    strategy = tf.distribute.get_strategy()
    config = _config(strategy, num_sgd_iter=2, minibatch_buffer_size=1)
    thread = _thread(strategy, config, accelerator=True)
    events = _Events(thread)
    thread.start()
    try:
        for seed in range(2):
            thread.inqueue.put(TrainBatch(_batch(seed)))
            outputs = [thread.outqueue.get(timeout=60) for _ in range(2)]
            assert [o[2]["num_grad_updates_lifetime"] for o in outputs] == [
                2 * seed + 1,
                2 * seed + 2,
            ]
    finally:
        thread.stop()
    assert thread.error is None, thread.error
    # The second pass was at hand when the first was queued; the next batch was not.
    assert events.events == ["q", "q", "r", "r"] * 2


def test_a_flush_drops_the_queued_update_and_the_version_is_read_again():
    # A restore flushes while update 0 is queued and update 1 about to be: neither is reported
    # (update 0 has trained; the restore loads the weights and counters next), and the next
    # update's version starts from the counter as the restore left it.
    strategy = tf.distribute.get_strategy()
    thread = None

    class _RestoreAtSecondUpdate(_NextUnitLoaded):
        def on_train_batch_begin(self, batch, logs=None):
            super().on_train_batch_begin(batch, logs)
            if batch == 1:
                assert thread._pending is not None  # Update 0 is queued, not read.
                with thread.lock:  # What `Impala.restore` does, from the driver.
                    thread.flush()
                    thread.learner.num_grad_updates.assign(10)

    loaded = _RestoreAtSecondUpdate(first=1)
    thread = _thread(strategy, callbacks=[loaded], accelerator=True)
    loaded.thread = thread
    events = _Events(thread)
    thread.start()
    try:
        for seed in range(2):
            thread.inqueue.put(TrainBatch(_batch(seed)))
        deadline = time.monotonic() + 60
        while thread.num_units_dropped < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert thread.num_units_dropped == 1 and thread.outqueue.empty()
        thread.inqueue.put(TrainBatch(_batch(2)))
        _, _, stats = thread.outqueue.get(timeout=60)
    finally:
        thread.stop()
    assert thread.error is None, thread.error
    assert events.events == ["q", "q", "r"]  # Update 1 never queued; update 0 never read.
    assert stats["num_grad_updates_lifetime"] == 11 and thread.version == 11
    assert thread.outqueue.empty()


@pytest.mark.parametrize("name", ["default", "mirrored"])
def test_num_gpu_loader_threads_sizes_the_pool_of_the_device_loader(name):
    strategy = _strategy(name)
    thread = _thread(strategy, _config(strategy, num_gpu_loader_threads=3), accelerator=True)
    # TensorFlow keeps the per-worker datasets of a distributed dataset in `_datasets`.
    (dataset,) = thread._dataset._datasets
    assert dataset.options().threading.private_threadpool_size == 3


class _FakeGpus:
    """Two visible physical GPUs as TensorFlow's device configuration calls see them."""

    def __init__(self, monkeypatch, initialised: bool = False):
        self.gpus = [tf.config.PhysicalDevice(f"/physical_device:GPU:{i}", "GPU") for i in (0, 1)]
        self.hidden: list = []
        self.growth: list = []
        real_list = tf.config.list_physical_devices

        def list_physical_devices(kind=None):
            return list(self.gpus) if kind == "GPU" else real_list(kind)

        def set_visible_devices(devices_, kind=None):
            if initialised:
                raise RuntimeError("Visible devices cannot be modified after being initialized")
            self.hidden.append((list(devices_), kind))

        def set_memory_growth(device, enable):
            if initialised:
                raise RuntimeError("Physical devices cannot be modified after being initialized")
            self.growth.append((device, enable))

        monkeypatch.setattr(tf.config, "list_physical_devices", list_physical_devices)
        monkeypatch.setattr(tf.config, "set_visible_devices", set_visible_devices)
        monkeypatch.setattr(tf.config.experimental, "set_memory_growth", set_memory_growth)
        monkeypatch.setattr(tf.config.experimental, "get_memory_growth", lambda device: False)


def test_num_gpus_0_hides_the_gpus_before_tensorflow_initialises(monkeypatch):
    gpus = _FakeGpus(monkeypatch)
    strategy = make_strategy(small_config(num_gpus=0))
    assert gpus.hidden == [([], "GPU")] and gpus.growth == []
    assert strategy is tf.distribute.get_strategy()


def test_num_gpus_0_places_the_learner_on_the_cpu_when_the_gpus_stay_visible(monkeypatch):
    _FakeGpus(monkeypatch, initialised=True)
    strategy = make_strategy(small_config(num_gpus=0))
    assert isinstance(strategy, tf.distribute.OneDeviceStrategy)
    assert strategy.extended.worker_devices == ("/job:localhost/replica:0/task:0/device:CPU:0",)
    monkeypatch.undo()
    outputs = _train(_thread(strategy, _config(strategy)), updates=2)
    assert [o[2]["num_grad_updates_lifetime"] for o in outputs] == [1, 2]


@pytest.mark.parametrize("num_gpus", [1, 2])
def test_a_learner_on_gpus_turns_on_memory_growth_for_every_gpu(monkeypatch, num_gpus):
    gpus = _FakeGpus(monkeypatch)
    with strategies.own_collective_keys():
        make_strategy(small_config(num_gpus=num_gpus, _fake_gpus=True))
    assert gpus.growth == [(gpu, True) for gpu in gpus.gpus] and gpus.hidden == []


def test_accelerator_detection():
    assert not devices.on_accelerator(tf.distribute.get_strategy())
    assert not devices.on_accelerator(strategies.mirrored())
    assert devices.on_accelerator(tf.distribute.OneDeviceStrategy("/gpu:0"))


@pytest.mark.parametrize("name", ["default", "mirrored"])
def test_jit_compile_update_compiles_the_gradients_and_gives_the_same_update(name):
    strategy = _strategy(name)
    stats, weights = {}, {}
    for jit in (False, True):
        thread = _thread(strategy, _config(strategy, jit_compile_update=jit))
        assert thread.learner.jit_compile_update is jit
        outputs = _train(thread, updates=2)
        stats[jit] = outputs[-1][2]
        weights[jit] = thread.learner.get_policy_weights()
    # Compiled: XLA's HLO of the gradient part exists (a plain function has none).
    batch = {k: tf.constant(v) for k, v in fakes.time_major(dict(_batch(0))).items()}
    hlo = thread.learner._gradients_fn.experimental_get_compiler_ir(batch, tf.constant(0.01))
    assert "HloModule" in hlo(stage="hlo")
    for key in ("total_loss", "grad_gnorm", "vf_explained_var"):
        assert stats[True][key] == pytest.approx(stats[False][key], rel=1e-4, abs=1e-6), key
    for a, b in zip(weights[False], weights[True]):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)


def test_jit_compile_update_auto_is_off_on_a_cpu_and_bad_values_name_the_key():
    thread = _thread(tf.distribute.get_strategy())
    assert thread.learner.spec.jit_compile_update == "auto"
    assert thread.learner.jit_compile_update is False
    for value in ("yes", 1, None, "on"):
        with pytest.raises(ValueError, match="jit_compile_update"):
            fakes.learner_config(jit_compile_update=value).validate()
