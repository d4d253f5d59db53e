"""Tests of ImpalaLearner: the update, input layouts, options, schedules, strategies and fit."""

from __future__ import annotations

import json
import os
import re

import gymnasium as gym
import keras
import numpy as np
import pytest
import tensorflow as tf

from impala_tf.config import ImpalaConfig
from impala_tf.config.base import AlgorithmConfig
from impala_tf.learning import gradients, losses
from impala_tf.learning.learner import DIAGNOSTIC_KEYS, STATS_KEYS, ImpalaLearner, piecewise_linear
from impala_tf.learning.spec import learner_spec
from impala_tf.models import build_model, distributions
from tests.support import batches as fakes
from tests.support import strategies

OBS = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
ACT = gym.spaces.Discrete(3)
T, ROWS = 5, 4


def _config(**overrides) -> ImpalaConfig:
    config = ImpalaConfig().environment("CartPole-v1")
    config.training(model={"fcnet_hiddens": [16, 16]})
    config.env_runners(rollout_fragment_length=T)
    return config.update_from_dict(overrides)


def _learner(config: ImpalaConfig, weights=None, strategy=None) -> ImpalaLearner:
    keras.utils.set_random_seed(0)
    strategy = strategy or tf.distribute.get_strategy()
    with strategy.scope():
        learner = ImpalaLearner(config, OBS, ACT)
    if weights is not None:
        learner.model.set_weights(weights)
    return learner


def _step(learner: ImpalaLearner, batch) -> dict[str, float]:
    batch = {k: tf.constant(v) for k, v in batch.items()}
    out = tf.function(learner.train_step)(batch)
    return {k: float(v) for k, v in out.items()}


def _weights(learner):
    return [w.copy() for w in learner.model.get_weights()]


def test_train_step_returns_rllib_stats_matching_the_loss():
    config = _config()
    learner = _learner(config)
    batch = fakes.time_major(fakes.sequence_batch(OBS, ACT, T, ROWS))
    logits, values, _ = learner.model.unroll(
        tf.constant(batch["obs"]), tf.zeros((T, ROWS), tf.bool), ()
    )
    target = distributions.make_distribution(ACT, logits)
    behaviour = distributions.make_distribution(ACT, tf.constant(batch["action_dist_inputs"]))
    expected = losses.vtrace_loss(
        target_log_probs=target.log_prob(batch["actions"]),
        behaviour_log_probs=behaviour.log_prob(batch["actions"]),
        entropy=target.entropy(),
        values=values,
        rewards=batch["rewards"],
        terminateds=batch["terminateds"],
        truncateds=batch["truncateds"],
        values_bootstrapped=batch["values_bootstrapped"],
        gamma=config.gamma,
    )
    # The loss must see the resets the learner derives from episode ends; without resets a
    # feed-forward model gives the same values, so the loss above is the reference.
    before = _weights(learner)
    stats = _step(learner, batch)
    assert set(STATS_KEYS) <= set(stats)
    n = T * ROWS
    np.testing.assert_allclose(stats["policy_loss"], expected.sums.pi_loss / n, rtol=1e-4)
    np.testing.assert_allclose(stats["vf_loss"], expected.sums.vf_loss / n, rtol=1e-4)
    np.testing.assert_allclose(stats["entropy"], expected.sums.entropy / n, rtol=1e-4)
    assert stats["cur_lr"] == pytest.approx(config.lr)
    assert stats["entropy_coeff"] == pytest.approx(config.entropy_coeff)
    assert stats["num_agent_steps_trained"] == n
    assert stats["num_grad_updates_lifetime"] == 1
    assert stats["grad_gnorm"] > 0
    assert not all(np.allclose(a, b) for a, b in zip(before, _weights(learner)))
    # The diagnostics (ours), from the same loss and logits.
    assert set(DIAGNOSTIC_KEYS) <= set(stats)
    sums = expected.sums
    np.testing.assert_allclose(stats["mean_rho"], sums.rho / n, rtol=1e-4)
    np.testing.assert_allclose(stats["max_rho"], sums.rho_max, rtol=1e-6)
    assert stats["max_rho"] >= stats["mean_rho"] > 0
    np.testing.assert_allclose(stats["rho_clipped_frac"], sums.rho_clipped / n, rtol=1e-6)
    np.testing.assert_allclose(stats["pg_advantage_mean"], sums.pg_adv / n, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(stats["vf_error_mean"], sums.err / n, rtol=1e-4, atol=1e-6)
    spread = np.ptp(logits.numpy(), axis=-1).mean()
    np.testing.assert_allclose(stats["logit_range_mean"], spread, rtol=1e-4)


def test_flat_and_time_major_layouts_give_the_same_update():
    config = _config()
    seq = fakes.sequence_batch(OBS, ACT, T, ROWS, seed=1)
    a = _learner(config)
    init = _weights(a)
    b = _learner(config, weights=init)
    stats_a = _step(a, fakes.time_major(seq))
    stats_b = _step(b, fakes.flat(seq))
    for key in ("policy_loss", "vf_loss", "entropy", "grad_gnorm"):
        assert stats_a[key] == pytest.approx(stats_b[key], rel=1e-5)
    for wa, wb in zip(_weights(a), _weights(b)):
        np.testing.assert_allclose(wa, wb, rtol=1e-5, atol=1e-7)


def test_bad_layout_is_a_clear_error():
    learner = _learner(_config())
    batch = fakes.time_major(fakes.sequence_batch(OBS, ACT, T, ROWS))
    batch["rewards"] = batch["rewards"][..., None]
    with pytest.raises(ValueError, match="rewards"):
        _step(learner, batch)


@pytest.mark.parametrize("train_value", [True, False])
def test_separate_value_optimizer_moves_only_its_variables(train_value):
    # lr=0 freezes the policy optimizer; _lr_vf=0 freezes the value optimizer.
    config = _config(
        _separate_vf_optimizer=True,
        lr=0.0 if train_value else 0.01,
        _lr_vf=0.01 if train_value else 0.0,
    )
    config.model["vf_share_layers"] = False  # Shared layers would take both updates.
    learner = _learner(config)
    value_ids = {id(v) for v in learner.model.value_variables}
    before = {id(v): v.numpy().copy() for v in learner.model.trainable_variables}
    _step(learner, fakes.time_major(fakes.sequence_batch(OBS, ACT, T, ROWS, seed=2)))
    moved_value = moved_policy = False
    for v in learner.model.trainable_variables:
        moved = not np.allclose(before[id(v)], v.numpy())
        if id(v) in value_ids:
            moved_value |= moved
        else:
            moved_policy |= moved
    assert moved_value == train_value
    assert moved_policy == (not train_value)


def test_separate_value_optimizer_ignores_vf_loss_coeff():
    seq = fakes.time_major(fakes.sequence_batch(OBS, ACT, T, ROWS, seed=3))
    results = []
    for coeff in (0.5, 0.01):
        learner = _learner(_config(_separate_vf_optimizer=True, vf_loss_coeff=coeff))
        _step(learner, seq)
        results.append(_weights(learner))
    for wa, wb in zip(*results):
        np.testing.assert_allclose(wa, wb, rtol=1e-6)


def test_vf_loss_coeff_changes_the_update_without_separate_optimizer():
    seq = fakes.time_major(fakes.sequence_batch(OBS, ACT, T, ROWS, seed=3))
    results = []
    for coeff in (0.5, 0.01):
        learner = _learner(_config(vf_loss_coeff=coeff, opt_type="rmsprop"))
        _step(learner, seq)
        results.append(_weights(learner))
    assert not all(np.allclose(a, b) for a, b in zip(*results))


def test_grad_clip_bounds_the_update():
    # RMSProp with RLlib's epsilon=0.1 makes the first step roughly proportional to the gradient.
    seq = fakes.time_major(fakes.sequence_batch(OBS, ACT, T, ROWS, seed=4))
    deltas = {}
    for clip in (None, 1e-3):
        learner = _learner(_config(opt_type="rmsprop", grad_clip=clip, lr=0.01))
        before = _weights(learner)
        stats = _step(learner, seq)
        deltas[clip] = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(before, _weights(learner))))
        assert stats["grad_gnorm_unclipped"] > 1e-3
        if clip is not None:  # RLlib reports the norm after clipping
            assert stats["grad_gnorm"] == pytest.approx(clip, rel=1e-4)
    assert deltas[1e-3] < 0.05 * deltas[None]


def test_piecewise_linear_schedule_values():
    points = [[0, 1.0], [100, 0.5], [100, 0.2], [300, 0.0]]
    for t, expected in [(0, 1.0), (50, 0.75), (99, 0.505), (100, 0.2), (200, 0.1), (999, 0.0)]:
        assert float(piecewise_linear(points, tf.constant(t), 9.0)) == pytest.approx(expected)
    assert float(piecewise_linear(None, tf.constant(5), 9.0)) == 9.0


def test_schedules_are_driven_by_steps_trained():
    n = T * ROWS
    config = _config(
        lr_schedule=[[0, 0.01], [4 * n, 0.001]],
        entropy_coeff_schedule=[[0, 0.1], [2 * n, 0.0]],
    )
    learner = _learner(config)
    seen = []
    for i in range(4):
        stats = _step(learner, fakes.time_major(fakes.sequence_batch(OBS, ACT, T, ROWS, seed=i)))
        seen.append((stats["cur_lr"], stats["entropy_coeff"]))
    # The schedule is read before each update, at the steps trained so far (0, n, 2n, 3n).
    expected_lr = [0.01, 0.01 - 0.009 / 4, 0.01 - 0.009 / 2, 0.01 - 0.009 * 3 / 4]
    expected_ent = [0.1, 0.05, 0.0, 0.0]
    np.testing.assert_allclose([s[0] for s in seen], expected_lr, rtol=1e-5)
    np.testing.assert_allclose([s[1] for s in seen], expected_ent, atol=1e-7)
    assert float(learner.policy_optimizer.learning_rate.numpy()) == pytest.approx(
        expected_lr[-1], rel=1e-5
    )


def test_fit_on_a_dataset_with_callbacks():
    config = _config()
    learner = _learner(config)
    batches = [fakes.flat(fakes.sequence_batch(OBS, ACT, T, ROWS, seed=s)) for s in range(3)]
    dataset = tf.data.Dataset.from_tensor_slices(
        {k: np.stack([b[k] for b in batches]) for k in batches[0]}
    )

    class Recorder(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.logs = []

        def on_train_batch_end(self, batch, logs=None):
            self.logs.append(dict(logs))

    recorder = Recorder()
    history = learner.fit(dataset, epochs=1, verbose=0, callbacks=[recorder])
    assert len(recorder.logs) == 3
    assert "vf_explained_var" in history.history
    assert int(learner.num_grad_updates.numpy()) == 3
    assert int(learner.num_agent_steps_trained.numpy()) == 3 * T * ROWS


# The ops by which a `tf.distribute` strategy moves values between its devices: TF's collectives
# (`CollectiveReduceV2`, `CollectiveGatherV2`, ...) and NCCL's.
_COLLECTIVE = re.compile(r"^(Collective(Reduce|Gather|AllToAll)|Nccl)")


def _device(name: str) -> str:
    """'CPU:1' for any spelling of that device; '' for an op the graph leaves unplaced."""
    if not name:
        return ""
    spec = tf.DeviceSpec.from_string(name)
    return f"{spec.device_type}:{spec.device_index}"


def _cross_device_elements(graph, first_device: str, placed=None) -> int:
    """The number of elements `graph` reduces or gathers across devices, once per reduction.

    Whatever Python route asked for it (`ReplicaContext.all_reduce` or `all_gather`, a
    `merge_call`, `StrategyExtended.reduce_to` or `batch_reduce_to`, `Strategy.reduce`, reading
    a SUM variable), a reduction is either collective ops, one per device (those on
    `first_device` are counted), or one op combining tensors from several devices
    (`ReductionToOneDevice`, what cross-replica reductions to CPUs use). Functions the graph calls
    (`tf.cond` branches, ...) are walked too, their inputs placed where the caller's are.

    Args:
      graph: A traced `tf.function` graph.
      first_device: The device whose collective ops are counted, as `_device` spells it.
      placed: For a called function, the device of each of its inputs (by `Tensor.ref()`).

    Returns:
      int, the elements reduced.
    """
    placed = placed or {}

    def device_of(tensor) -> str:
        return placed.get(tensor.ref()) or _device(tensor.op.device)

    def size(tensor) -> int:
        elements = tensor.shape.num_elements()
        # (An all-gather pads to a shape it learns at run time.)
        assert elements is not None, f"{tensor.op.name} moves a tensor of unknown size"
        return elements

    total = 0
    for op in graph.get_operations():
        attrs = op.node_def.attr
        functions = [attrs[a].func.name for a in attrs if attrs[a].WhichOneof("value") == "func"]
        if functions:
            for name in functions:
                # A lookup TensorFlow could rename: the test then fails, it cannot pass blind.
                called = graph._get_function(name).graph
                outer = op.inputs[len(op.inputs) - len(called.inputs) :]
                devices = {inner.ref(): device_of(t) for inner, t in zip(called.inputs, outer)}
                total += _cross_device_elements(called, first_device, devices)
        elif _COLLECTIVE.match(op.type):
            if _device(op.device) == first_device:  # What this device sends.
                total += size(op.inputs[0])
        elif op.outputs and len({device_of(t) for t in op.inputs} - {""}) > 1:
            total += size(op.outputs[0])
    return total


@pytest.mark.parametrize("separate_vf", [False, True])
@pytest.mark.parametrize("microbatches", [False, True])
def test_one_gradient_all_reduce_per_update_under_mirrored_strategy(separate_vf, microbatches):
    # The learner sums the replicas' gradients once (to clip by the whole batch's norm); nothing
    # may reduce them again, as a stock Keras optimizer's `apply_gradients` would.
    config = _config(
        num_gpus=2,
        _fake_gpus=True,
        _separate_vf_optimizer=separate_vf,
        microbatch_size=2 * T if microbatches else None,
    )
    strategy = strategies.mirrored()
    learner = _learner(config, strategy=strategy)
    first = _device(strategy.extended.worker_devices[0])
    seq = fakes.sequence_batch(OBS, ACT, T, ROWS, seed=5)
    batch = {k: tf.constant(v) for k, v in fakes.time_major(seq).items()}
    if microbatches:
        accumulate = tf.function(lambda b: strategy.run(learner.accumulate_step, args=(b,)))
        update = tf.function(lambda: strategy.run(learner.apply_accumulated))
        # Each replica adds to its own accumulators: no communication per microbatch.
        assert _cross_device_elements(accumulate.get_concrete_function(batch).graph, first) == 0
        graph = update.get_concrete_function().graph
    else:
        update = tf.function(lambda b: strategy.run(learner.train_step, args=(b,)))
        graph = update.get_concrete_function(batch).graph
    groups = 2 if separate_vf else 1
    gradient_elements = groups * sum(
        v.shape.num_elements() for v in learner.model.trainable_variables
    )
    # The loss sums (a maximum as one slot per replica: `learner._all_reduce_sums`) and the
    # env steps.
    maxima = len(losses.MAX_FIELDS)
    stats_elements = len(losses.LossSums._fields) - maxima
    stats_elements += maxima * strategy.num_replicas_in_sync + 1
    assert _cross_device_elements(graph, first) == gradient_elements + stats_elements
    before = _weights(learner)
    if microbatches:
        accumulate(batch)
        update()
    else:
        update(batch)
    assert any(not np.allclose(a, b) for a, b in zip(before, _weights(learner)))


def _strategy(name: str) -> tf.distribute.Strategy:
    if name == "default":
        return tf.distribute.get_strategy()
    if name == "one_device":
        return tf.distribute.OneDeviceStrategy("/cpu:0")
    return strategies.mirrored()


@pytest.mark.parametrize("separate_vf", [False, True])
def test_default_one_device_and_mirrored_strategies_give_the_same_updates(separate_vf):
    # Each replica sums the gradients of its shard's summed loss and the replicas' sums are
    # added: RLlib's average over towers of n x shard losses, i.e. the one-device update.
    # RMSProp with RLlib's epsilon=0.1 moves roughly in proportion to the gradient (Adam nearly
    # ignores its scale), so a gradient summed twice on two replicas would change the update.
    config = _config(opt_type="rmsprop", lr=0.01, _separate_vf_optimizer=separate_vf)
    batches = []
    for seed in (6, 7, 8):
        seq = fakes.sequence_batch(OBS, ACT, T, ROWS, seed=seed)
        for key in ("terminateds", "truncateds"):  # Keras' fit under a strategy wants floats.
            seq[key] = seq[key].astype(np.float32)
        if seed == 7:
            seq["rewards"][1, 2] = np.nan  # This update is skipped on every strategy.
        batches.append(fakes.flat(seq))
    dataset = tf.data.Dataset.from_tensor_slices(
        {k: np.stack([b[k] for b in batches]) for k in batches[0]}
    )
    init = _weights(_learner(config))

    class Recorder(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.logs = []

        def on_train_batch_end(self, batch, logs=None):
            self.logs.append({k: float(v) for k, v in logs.items()})

    results = {}
    for name in ("default", "one_device", "mirrored"):
        trained = _learner(config, weights=init, strategy=_strategy(name))
        recorder = Recorder()
        trained.fit(dataset, epochs=1, verbose=0, callbacks=[recorder])
        results[name] = (trained, recorder.logs)
    reference, reference_logs = results["default"]
    assert [logs["update_skipped"] for logs in reference_logs] == [0.0, 1.0, 0.0]
    for name, (trained, logs) in results.items():
        for key in (
            "policy_loss",
            "vf_loss",
            "entropy",
            "vf_explained_var",
            "max_rho",
            "grad_gnorm",
            "grad_gnorm_unclipped",
            "cur_lr",
        ):
            np.testing.assert_allclose(
                [step[key] for step in logs],
                [step[key] for step in reference_logs],
                rtol=1e-4,
                err_msg=f"{name} {key}",
            )
        for key in ("update_skipped", "num_grad_updates_lifetime", "num_agent_steps_trained"):
            assert [step[key] for step in logs] == [step[key] for step in reference_logs], name
        for wa, wb in zip(_weights(reference), _weights(trained)):
            np.testing.assert_allclose(wb, wa, rtol=1e-4, atol=1e-6, err_msg=name)
        for optimizer, _ in trained._groups:
            assert int(optimizer.iterations.numpy()) == 2, name
        assert int(trained.num_agent_steps_trained.numpy()) == 2 * T * ROWS
    assert not np.allclose(_weights(reference)[0], init[0])


_LEGACY = os.path.join(os.path.dirname(__file__), "data", "legacy_checkpoints", "single_agent")


@pytest.mark.parametrize("strategy_name", ["default", "mirrored"])
def test_optimizer_state_saved_by_older_code_restores_and_trains_on(strategy_name):
    with open(os.path.join(_LEGACY, "driver_state.json")) as f:
        saved = json.load(f)["config"]
    config = ImpalaConfig().environment(saved["env"])
    config.training(model={"fcnet_hiddens": saved["model"]["fcnet_hiddens"]})
    config.training(opt_type=saved["opt_type"], lr=saved["lr"])
    config.env_runners(rollout_fragment_length=T)
    action_space = gym.spaces.Discrete(2)
    strategy = _strategy(strategy_name)
    with strategy.scope():
        trained = ImpalaLearner(config, OBS, action_space)
    tf.train.Checkpoint(
        model=trained.model,
        policy_optimizer=trained.policy_optimizer,
        num_grad_updates=trained.num_grad_updates,
        num_agent_steps_trained=trained.num_agent_steps_trained,
    ).read(os.path.join(_LEGACY, "learner")).assert_consumed()
    updates = int(trained.num_grad_updates.numpy())
    assert updates > 0 and int(trained.policy_optimizer.iterations.numpy()) == updates
    seq = fakes.sequence_batch(OBS, action_space, T, ROWS, seed=9)
    batch = {k: tf.constant(v) for k, v in fakes.time_major(seq).items()}
    tf.function(lambda b: strategy.run(trained.train_step, args=(b,)))(batch)
    assert int(trained.policy_optimizer.iterations.numpy()) == updates + 1


def test_what_the_learner_cannot_apply_itself_is_rejected():
    # The learner applies the summed gradients without `apply_gradients` (which would sum them
    # again), so options and variables that `apply_gradients` would handle must not reach it.
    config = _config()
    model = build_model(OBS, ACT, config.model)
    model.trainable_variables[0].constraint = keras.constraints.NonNeg()
    with pytest.raises(ValueError, match="constrained"):
        ImpalaLearner(config, OBS, ACT, model=model)
    with pytest.raises(ValueError, match="weight_decay"):
        gradients.check_plain_optimizer(keras.optimizers.Adam(weight_decay=0.1), [])


def test_a_learner_keeps_its_settings_and_no_config():
    config = _config(lr=0.003, gamma=0.9, lr_schedule=[[0, 0.003], [1000, 0.001]])
    config.model["max_seq_len"] = 7
    learner = ImpalaLearner(config, OBS, ACT)
    assert learner.spec == learner_spec(config)
    assert (learner.spec.lr, learner.spec.gamma, learner.spec.max_seq_len) == (0.003, 0.9, 7)
    assert learner.spec.lr_schedule == ((0.0, 0.003), (1000.0, 0.001))
    assert not [k for k, v in vars(learner).items() if isinstance(v, AlgorithmConfig)]
    # A spec builds the same learner: RLlib's keys are read once, by `learner_spec`.
    again = ImpalaLearner(learner.spec, OBS, ACT)
    assert again.spec == learner.spec
    assert [v.shape for v in again.model.weights] == [v.shape for v in learner.model.weights]
