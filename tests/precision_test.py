"""The `precision` key: models built under Keras' `mixed_bfloat16` policy, everything else float32.

With "mixed_bfloat16" every TensorFlow model of a run (learner, actor policy, inference server,
evaluation) computes its torso in bfloat16 and keeps float32 variables; heads, LSTM core, V-trace,
the loss, the broadcast weights and checkpoints stay float32. `inference_precision`, when set,
decides for the acting models alone. T is time, B is batch.
"""

from __future__ import annotations

import os

import gymnasium as gym
import keras
import numpy as np
import pytest
import tensorflow as tf

from impala_tf import checkpoints
from impala_tf.acting.factory import make_policy
from impala_tf.acting.inference import InferenceServer
from impala_tf.acting.numpy_policy import NumpyPolicy
from impala_tf.acting.remote_policy import RemotePolicy
from impala_tf.acting.tf_policy import ActorPolicy
from impala_tf.checkpoints.store import learner_checkpoint
from impala_tf.config import ImpalaConfig
from impala_tf.config.policies import PolicySpec
from impala_tf.driver.evaluation import load_checkpoint_policies, load_policy_model
from impala_tf.driver.specs import probe_spaces, runner_spec
from impala_tf.learning import losses, pipeline, sequences
from impala_tf.learning.learner import ImpalaLearner
from impala_tf.models import build_model
from impala_tf.models.precision import dtype_policy
from impala_tf.rollout import make_env_runner
from impala_tf.rollout.env_runner import EnvRunner
from impala_tf.rollout.fragment import DEFAULT_POLICY_ID
from tests.support import batches as fakes
from tests.support import strategies
from tests.support.configs import small_config

VEC = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
IMG = gym.spaces.Box(0, 255, (36, 36, 2), np.uint8)  # The Nature CNN's smallest input.
ACT = gym.spaces.Discrete(3)
T, ROWS = 5, 4
BF16 = "mixed_bfloat16"
#: A checkpoint written by an older impala_tf in float32, before `precision` existed.
LEGACY = os.path.join(os.path.dirname(__file__), "data", "legacy_checkpoints", "single_agent")

MODELS = {
    "mlp": (VEC, ACT, {"fcnet_hiddens": [16, 16], "vf_share_layers": False}),
    "lstm": (VEC, ACT, {"fcnet_hiddens": [8], "use_lstm": True, "lstm_cell_size": 8}),
    "free_log_std": (
        VEC,
        gym.spaces.Box(-1.0, 1.0, (2,), np.float32),
        {"fcnet_hiddens": [8], "free_log_std": True},
    ),
    "nature_cnn": (IMG, ACT, {"custom_model": "nature_cnn"}),
}


def _config(**overrides) -> ImpalaConfig:
    config = ImpalaConfig().environment("CartPole-v1")
    config.training(model={"fcnet_hiddens": [16, 16]}, lr=0.01)
    config.env_runners(rollout_fragment_length=T)
    return config.update_from_dict(overrides)


def _learner(precision: str, seed: int = 0) -> ImpalaLearner:
    keras.utils.set_random_seed(seed)
    return ImpalaLearner(_config(precision=precision), VEC, ACT)


def _batch(seed: int = 0) -> dict[str, tf.Tensor]:
    batch = fakes.time_major(fakes.sequence_batch(VEC, ACT, T, ROWS, seed=seed))
    return {k: tf.constant(v) for k, v in batch.items()}


def _float_dtypes(model: keras.Model) -> set[str]:
    return {str(np.dtype(w.dtype)) for w in model.get_weights()}


# ----------------------------------------------------------------------------- the key


@pytest.mark.parametrize("value", ["bfloat16", "float16", "mixed_float16", None, 32])
def test_a_bad_precision_is_an_error_naming_the_key(value):
    with pytest.raises(ValueError, match="`precision`"):
        _config(precision=value).validate()
    with pytest.raises(ValueError, match="`precision`"):
        build_model(VEC, ACT, {"fcnet_hiddens": [4]}, precision=value)


@pytest.mark.parametrize("value", ["float32", BF16])
def test_the_precisions_are_valid_and_float32_is_the_default(value):
    assert ImpalaConfig().precision == "float32"
    _config(precision=value).validate()


@pytest.mark.parametrize("value", ["bfloat16", "float16", "auto", 32])
def test_a_bad_inference_precision_is_an_error_naming_the_key(value):
    with pytest.raises(ValueError, match="`inference_precision`"):
        _config(inference_precision=value).validate()


@pytest.mark.parametrize(
    "precision, inference, acting",
    [
        ("float32", None, "float32"),
        (BF16, None, BF16),
        (BF16, "float32", "float32"),
        ("float32", BF16, BF16),
    ],
)
def test_the_acting_models_follow_precision_unless_inference_precision_is_set(
    precision, inference, acting
):
    assert ImpalaConfig().inference_precision is None
    config = _config(precision=precision, inference_precision=inference)
    config.validate()
    assert config.acting_precision == acting


def test_the_dtype_policy_is_scoped_to_the_block_even_when_it_raises():
    assert keras.config.dtype_policy().name == "float32"
    with dtype_policy(BF16):
        assert keras.config.dtype_policy().name == BF16
        with dtype_policy("float32"):
            assert keras.config.dtype_policy().name == "float32"
        assert keras.config.dtype_policy().name == BF16
    assert keras.config.dtype_policy().name == "float32"
    with pytest.raises(RuntimeError), dtype_policy(BF16):
        raise RuntimeError
    assert keras.config.dtype_policy().name == "float32"
    build_model(VEC, ACT, {"fcnet_hiddens": [4]}, precision=BF16)
    assert keras.config.dtype_policy().name == "float32"
    assert keras.layers.Dense(2).compute_dtype == "float32"


# ----------------------------------------------------------------------------- models


@pytest.mark.parametrize("name", sorted(MODELS))
def test_models_compute_their_torso_in_bfloat16_with_float32_variables_and_outputs(name):
    obs_space, act_space, config = MODELS[name]
    f32 = build_model(obs_space, act_space, config)
    bf16 = build_model(obs_space, act_space, config, precision=BF16)
    assert f32.torso.compute_dtype == "float32"
    assert bf16.torso.compute_dtype == "bfloat16"
    assert _float_dtypes(bf16) == {"float32"}
    assert {v.dtype for v in bf16.variables} == {"float32"}
    for head in (bf16.logits_head, bf16.value_head, bf16.core, bf16.free_log_std):
        assert head is None or head.compute_dtype == "float32"
    bf16.set_weights(f32.get_weights())
    obs = np.stack([obs_space.sample() for _ in range(T * 2)]).reshape(T, 2, *obs_space.shape)
    obs = tf.constant(obs)
    features = bf16.torso(bf16._preprocess(obs[0]))
    assert features.dtype == tf.bfloat16
    resets = tf.zeros((T, 2), tf.bool)
    want = f32.unroll(obs, resets, f32.initial_state(2))
    got = bf16.unroll(obs, resets, bf16.initial_state(2))
    for w, g in zip(tf.nest.flatten(want), tf.nest.flatten(got)):
        assert g.dtype == tf.float32
        # bfloat16 keeps 8 bits of mantissa: close to float32, and not equal to it.
        np.testing.assert_allclose(g, w, rtol=0.1, atol=0.05)
    assert not np.array_equal(got[0].numpy(), want[0].numpy())


# ----------------------------------------------------------------------------- the learner


def test_a_bfloat16_learner_updates_with_float32_loss_vtrace_and_stats(monkeypatch):
    seen = []

    def recording_loss(**kwargs):
        seen.append({k: v.dtype for k, v in kwargs.items() if isinstance(v, tf.Tensor)})
        return vtrace_loss(**kwargs)

    vtrace_loss = losses.vtrace_loss
    monkeypatch.setattr(losses, "vtrace_loss", recording_loss)
    f32, bf16 = _learner("float32"), _learner(BF16)
    assert f32.model.torso.compute_dtype == "float32"
    assert bf16.model.torso.compute_dtype == "bfloat16"
    bf16.model.set_weights(f32.model.get_weights())
    before = bf16.get_policy_weights()
    batch = _batch()
    want = {k: v.numpy() for k, v in tf.function(f32.train_step)(batch).items()}
    got = tf.function(bf16.train_step)(batch)
    assert seen and all(d == tf.float32 for s in seen for d in s.values() if d.is_floating)
    for key, value in got.items():
        assert value.dtype in (tf.float32, tf.int64), key
        assert np.all(np.isfinite(value.numpy())), key
    assert got["update_skipped"].numpy() == 0.0
    np.testing.assert_allclose(got["total_loss"], want["total_loss"], rtol=0.05)
    assert got["total_loss"].numpy() != want["total_loss"]
    after = bf16.get_policy_weights()
    assert {w.dtype for w in after} == {np.dtype(np.float32)}
    assert any(not np.array_equal(a, b) for a, b in zip(before, after))
    assert int(bf16.num_grad_updates.numpy()) == 1


def test_a_bfloat16_learner_updates_on_two_devices_as_on_one():
    # The mirrored update sums the replicas' gradients of float32 variables (gradients.py).
    one = _learner(BF16)
    strategy = strategies.mirrored()
    with strategy.scope():
        two = _learner(BF16)
    two.model.set_weights(one.model.get_weights())
    batch = _batch()
    want = tf.function(one.train_step)(batch)
    half = ROWS // 2  # Each device gets half of the B sequences of the time-major batch.
    shards = strategy.experimental_distribute_values_from_function(
        lambda ctx: {
            k: v[:, ctx.replica_id_in_sync_group * half :][:, :half] for k, v in batch.items()
        }
    )
    got = tf.function(lambda b: strategy.run(two.train_step, args=(b,)))(shards)
    got = {k: strategy.experimental_local_results(v)[0] for k, v in got.items()}
    assert two.model.torso.compute_dtype == "bfloat16"
    assert {v.dtype for v in two.model.variables} == {"float32"}
    for key in ("total_loss", "grad_gnorm_unclipped", "var_gnorm"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-3, err_msg=key)
    # Adam's first step moves each weight by about lr: a gradient element near zero may take
    # either sign when the devices round their halves in bfloat16, so weights agree to lr only.
    for a, b in zip(one.get_policy_weights(), two.get_policy_weights()):
        np.testing.assert_allclose(b, a, atol=2 * one.spec.lr)


def test_weights_broadcast_from_a_bfloat16_learner_round_trip_as_float32_arrays():
    learner = _learner(BF16)
    tf.function(learner.train_step)(_batch())
    weights = learner.get_policy_weights()
    actor = ActorPolicy(VEC, ACT, learner.spec.model, precision=BF16)
    assert actor.model.torso.compute_dtype == "bfloat16"
    actor.set_weights(weights)
    for sent, held in zip(weights, actor.get_weights()):
        assert sent.dtype == held.dtype == np.float32
        np.testing.assert_array_equal(held, sent)
    learner.set_policy_weights(actor.get_weights())
    for a, b in zip(weights, learner.get_policy_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("saved, restored", [("float32", BF16), (BF16, "float32")])
def test_a_learner_checkpoint_restores_across_precisions(tmp_path, saved, restored):
    writer = _learner(saved, seed=1)
    tf.function(writer.train_step)(_batch())
    prefix = learner_checkpoint(writer).write(str(tmp_path / "learner"))
    reader = _learner(restored, seed=2)
    learner_checkpoint(reader).read(prefix).assert_consumed()
    for a, b in zip(writer.get_policy_weights(), reader.get_policy_weights()):
        assert b.dtype == np.float32
        np.testing.assert_array_equal(a, b)
    for a, b in zip(writer.policy_optimizer.variables, reader.policy_optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    stats = tf.function(reader.train_step)(_batch(seed=1))
    assert np.isfinite(stats["total_loss"].numpy())
    assert int(reader.num_grad_updates.numpy()) == 2


def test_a_float32_checkpoint_loads_into_bfloat16_models_for_evaluation_and_export():
    config = checkpoints.load_config(LEGACY)
    assert config.precision == "float32"  # Saved before the key existed: the default.
    f32, _, _ = load_policy_model(LEGACY, config)
    bf16_config = config.copy().update_from_dict({"precision": BF16})
    bf16, _, _ = load_policy_model(LEGACY, bf16_config)
    assert (f32.torso.compute_dtype, bf16.torso.compute_dtype) == ("float32", "bfloat16")
    for a, b in zip(f32.get_weights(), bf16.get_weights()):
        assert b.dtype == np.float32
        np.testing.assert_array_equal(a, b)
    # Evaluation and export act: `inference_precision` decides when it is set.
    split = bf16_config.copy().update_from_dict({"inference_precision": "float32"})
    assert load_policy_model(LEGACY, split)[0].torso.compute_dtype == "float32"
    weights, _ = load_checkpoint_policies(LEGACY, bf16_config, probe_spaces(bf16_config))
    for a, b in zip(f32.get_weights(), weights[DEFAULT_POLICY_ID][0]):
        np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------- acting


def test_actor_policies_act_in_the_configured_precision():
    obs_space, act_space, model = MODELS["nature_cnn"]
    f32 = ActorPolicy(obs_space, act_space, model, seed=3)
    bf16 = ActorPolicy(obs_space, act_space, model, seed=3, precision=BF16)
    assert bf16.model.torso.compute_dtype == "bfloat16"
    bf16.set_weights(f32.get_weights())
    obs = np.stack([obs_space.sample() for _ in range(16)])
    got, want = bf16.step(obs), f32.step(obs)
    assert got.logits.dtype == got.values.dtype == got.logp.dtype == np.float32
    assert got.actions.shape == (16,)
    np.testing.assert_allclose(got.logits, want.logits, rtol=0.1, atol=0.02)
    assert not np.array_equal(got.logits, want.logits)
    # Numpy MLP actors stay float32 whatever the key says; other models act in TensorFlow.
    assert isinstance(make_policy(VEC, ACT, {"fcnet_hiddens": [8]}, precision=BF16), NumpyPolicy)
    lstm = make_policy(VEC, ACT, MODELS["lstm"][2], precision=BF16)
    assert isinstance(lstm, ActorPolicy) and lstm.model.torso.compute_dtype == "bfloat16"


@pytest.mark.parametrize("precision", ["float32", BF16])
def test_an_env_runner_builds_its_tensorflow_policy_in_the_configured_precision(precision):
    config = _config(precision=precision, num_envs_per_env_runner=2, seed=0)
    config.training(model={"fcnet_hiddens": [8], "use_lstm": True, "lstm_cell_size": 8})
    runner = EnvRunner(runner_spec(config), worker_index=1)
    assert runner.policy.model.torso.compute_dtype == tf.as_dtype(
        "bfloat16" if precision == BF16 else "float32"
    )
    weights = build_model(runner.observation_space, runner.action_space, config.model)
    runner.set_weights({DEFAULT_POLICY_ID: (weights.get_weights(), 1)})
    fragment = runner.sample()
    batch = fragment.batches[DEFAULT_POLICY_ID]
    for column in ("action_dist_inputs", "vf_preds", "action_logp"):
        assert batch[column].dtype == np.float32 and np.all(np.isfinite(batch[column])), column


def test_a_bfloat16_learner_with_float32_actors_trains_on_their_fragments():
    """`precision: mixed_bfloat16` with `inference_precision: float32`: the learner's torso
    computes in bfloat16, the env runner's in float32, and the runner's fragment (float32
    behaviour logits) trains the learner to finite stats with the weights round-tripping."""
    config = _config(precision=BF16, inference_precision="float32", num_envs_per_env_runner=2)
    config.training(
        model={"fcnet_hiddens": [8], "use_lstm": True, "lstm_cell_size": 8},
        train_batch_size=2 * T,  # One fragment of 2 envs.
    )
    config.debugging(seed=0)
    runner = EnvRunner(runner_spec(config), worker_index=1)
    learner = ImpalaLearner(config, runner.observation_space, runner.action_space)
    assert learner.model.torso.compute_dtype == "bfloat16"
    assert runner.policy.model.torso.compute_dtype == "float32"
    runner.set_weights({DEFAULT_POLICY_ID: (learner.get_policy_weights(), 0)})
    batch = runner.sample().batches[DEFAULT_POLICY_ID]
    assert batch["action_dist_inputs"].dtype == np.float32
    states = sequences.state_column_shapes(
        T, config.model["max_seq_len"], tuple(s.shape[1:] for s in learner.model.initial_state(1))
    )
    signature = pipeline.batch_signature(
        config, runner.observation_space, runner.action_space, state_shapes=states
    )
    (shard,) = pipeline.replica_shards(batch, signature, 1)
    stats = learner.train_step({k: tf.constant(v) for k, v in shard.items()})
    assert all(np.isfinite(v.numpy()).all() for v in stats.values())
    assert int(learner.num_grad_updates.numpy()) == 1
    weights = learner.get_policy_weights()
    assert {w.dtype for w in weights} == {np.dtype(np.float32)}
    runner.set_weights({DEFAULT_POLICY_ID: (weights, 1)})
    for a, b in zip(weights, runner.get_weights()[DEFAULT_POLICY_ID]):
        np.testing.assert_array_equal(a, b)


def test_a_multi_agent_runner_builds_each_policy_in_its_acting_precision():
    """Per-policy configs may set `inference_precision` too (`policies[pid].config`)."""
    config = small_config(policies=2, num_envs_per_env_runner=2, precision=BF16)
    config.training(model={"fcnet_hiddens": [8], "use_lstm": True, "lstm_cell_size": 8})
    config.multi_agent(
        policies={"p0": PolicySpec(), "p1": PolicySpec(config={"inference_precision": "float32"})}
    )
    config.validate()
    runner = make_env_runner(runner_spec(config), worker_index=1)
    try:
        dtypes = {pid: p.model.torso.compute_dtype for pid, p in runner.policies.items()}
    finally:
        runner.close()
    assert dtypes == {"p0": "bfloat16", "p1": "float32"}


def test_the_inference_server_builds_each_policy_in_its_precision():
    specs = {"p0": (VEC, ACT, {"fcnet_hiddens": [16]}), "p1": (VEC, ACT, {"fcnet_hiddens": [16]})}
    server = InferenceServer(specs, precisions={"p1": BF16})
    try:
        weights = build_model(VEC, ACT, {"fcnet_hiddens": [16]}).get_weights()
        server.set_weights({pid: (weights, 1) for pid in specs})
        local = ActorPolicy(VEC, ACT, {"fcnet_hiddens": [16]}, seed=7, precision=BF16)
        local.set_weights(weights)
        conn = server.attach(0)
        obs = np.random.default_rng(0).uniform(-1, 1, (8, 4)).astype(np.float32)
        served = {pid: RemotePolicy(conn, pid, ACT, [], seed=7).step(obs) for pid in specs}
        np.testing.assert_array_equal(served["p1"].logits, local.forward(obs)[0])
        assert served["p0"].logits.dtype == served["p1"].logits.dtype == np.float32
        np.testing.assert_allclose(served["p1"].logits, served["p0"].logits, rtol=0.1, atol=0.02)
        assert not np.array_equal(served["p1"].logits, served["p0"].logits)
    finally:
        server.stop()
