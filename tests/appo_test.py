"""Tests of APPO: its loss against RLlib's formulas, the circular buffer, the config, the learner
(target network, KL coefficient, devices, checkpoints) and a run on the shared runtime."""

from __future__ import annotations

import queue
import threading
import time

import gymnasium as gym
import keras
import numpy as np
import pytest
import tensorflow as tf

from impala_tf.appo import APPOConfig, CircularBuffer
from impala_tf.appo.learner import AppoLearner
from impala_tf.appo.losses import appo_loss
from impala_tf.appo.spec import AppoLearnerSpec
from impala_tf.checkpoints import learner_checkpoint, load_config
from impala_tf.config import ImpalaConfig
from impala_tf.config.base import AlgorithmConfig
from impala_tf.data.sample_batch import SampleBatch
from impala_tf.data.train_batch import TrainBatch
from impala_tf.driver.plan import check_deterministic
from impala_tf.models import distributions
from tests.support import batches as fakes
from tests.support import strategies
from tests.support.configs import small_config

OBS = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
ACT = gym.spaces.Discrete(3)
T, ROWS = 5, 4


# The loss against a hand computation of RLlib's formulas -------------------------------------


def _np_vtrace(log_rhos, discounts, rewards, values, bootstrap, rho_bar=1.0, pg_rho_bar=1.0):
    """V-trace as the IMPALA paper writes it, one step at a time (c-bar = 1)."""
    rhos = np.exp(log_rhos)
    clipped, cs = np.minimum(rho_bar, rhos), np.minimum(1.0, rhos)
    next_values = np.concatenate([values[1:], bootstrap[None]])
    deltas = clipped * (rewards + discounts * next_values - values)
    vs_minus_v = np.zeros_like(values)
    acc = np.zeros_like(bootstrap)
    for t in reversed(range(len(values))):
        acc = deltas[t] + discounts[t] * cs[t] * acc
        vs_minus_v[t] = acc
    vs = vs_minus_v + values
    next_vs = np.concatenate([vs[1:], bootstrap[None]])
    return vs, np.minimum(pg_rho_bar, rhos) * (rewards + discounts * next_vs - values)


def _fixed_inputs(seed=3):
    rng = np.random.default_rng(seed)
    shape = (4, 3)
    inputs = {
        "target_log_probs": np.log(rng.uniform(0.2, 0.9, shape)),
        "old_log_probs": np.log(rng.uniform(0.2, 0.9, shape)),
        "behaviour_log_probs": np.log(rng.uniform(0.05, 0.9, shape)),
        "entropy": rng.uniform(0.1, 1.0, shape),
        "kl": rng.uniform(0.0, 0.05, shape),
        "values": rng.normal(size=shape),
        "rewards": rng.normal(size=shape),
        "terminateds": np.zeros(shape, bool),
        "truncateds": np.zeros(shape, bool),
        "values_bootstrapped": rng.normal(size=shape),
    }
    inputs["terminateds"][1, 0] = True
    mask = np.ones(shape, np.float32)
    mask[3, 2] = 0.0
    return {k: v.astype(np.float32) if v.dtype != bool else v for k, v in inputs.items()}, mask


@pytest.mark.parametrize("use_kl", [False, True])
def test_appo_loss_is_rllibs_formula_on_fixed_inputs(use_kl):
    x, mask = _fixed_inputs()
    gamma, eps, coeffs = 0.9, 0.3, dict(vf=0.5, ent=0.01, kl=0.7)
    # RLlib (APPO learner): V-trace with the target network as the target policy.
    discounts = gamma * (1.0 - x["terminateds"])
    vs, adv = _np_vtrace(
        x["old_log_probs"] - x["behaviour_log_probs"],
        discounts,
        x["rewards"],
        x["values"],
        x["values_bootstrapped"][-1],
    )
    is_ratio = np.clip(np.exp(x["behaviour_log_probs"] - x["old_log_probs"]), 0.0, 2.0)
    ratio = is_ratio * np.exp(x["target_log_probs"] - x["behaviour_log_probs"])
    surrogate = np.minimum(adv * ratio, adv * np.clip(ratio, 1 - eps, 1 + eps))
    n = mask.sum()

    def mean(v):
        return float((v * mask).sum() / n)

    expected = (
        -mean(surrogate)
        + coeffs["vf"] * 0.5 * mean((x["values"] - vs) ** 2)
        - coeffs["ent"] * mean(x["entropy"])
        + (coeffs["kl"] * mean(x["kl"]) if use_kl else 0.0)
    )
    total, sums = appo_loss(
        **{k: tf.constant(v) for k, v in x.items()},
        mask=tf.constant(mask),
        gamma=gamma,
        clip_param=eps,
        vf_loss_coeff=coeffs["vf"],
        entropy_coeff=coeffs["ent"],
        kl_coeff=coeffs["kl"] if use_kl else None,
    )
    assert float(total) / float(sums.num_valid) == pytest.approx(expected, rel=1e-5)
    assert float(sums.pi_loss) / n == pytest.approx(-mean(surrogate), rel=1e-5)
    assert float(sums.kl) / n == pytest.approx(mean(x["kl"]), rel=1e-5)
    assert float(sums.is_ratio) / n == pytest.approx(mean(is_ratio), rel=1e-5)
    clipped = np.abs(ratio - 1.0) > eps
    assert float(sums.ratio_clipped) == pytest.approx((clipped * mask).sum())


def test_appo_gradient_flows_through_the_policy_and_value_only():
    x, mask = _fixed_inputs()
    variables = {k: tf.Variable(v) for k, v in x.items() if v.dtype != bool}
    flags = {k: tf.constant(v) for k, v in x.items() if v.dtype == bool}
    with tf.GradientTape() as tape:
        total, _ = appo_loss(
            **variables, **flags, mask=tf.constant(mask), kl_coeff=0.5, entropy_coeff=0.01
        )
    grads = dict(zip(variables, tape.gradient(total, list(variables.values()))))
    for name in ("old_log_probs", "behaviour_log_probs", "rewards", "values_bootstrapped"):
        assert grads[name] is None or not np.any(grads[name].numpy()), name
    for name in ("target_log_probs", "values", "entropy", "kl"):
        assert np.any(grads[name].numpy()), name


def test_kl_of_each_distribution_matches_numpy():
    rng = np.random.default_rng(0)
    p, q = rng.normal(size=(5, 3)), rng.normal(size=(5, 3))
    sp = np.exp(p) / np.exp(p).sum(-1, keepdims=True)
    sq = np.exp(q) / np.exp(q).sum(-1, keepdims=True)
    expected = (sp * (np.log(sp) - np.log(sq))).sum(-1)
    got = distributions.make_distribution(ACT, p).kl(distributions.make_distribution(ACT, q))
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5)
    box = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    a, b = rng.normal(size=(5, 4)), rng.normal(size=(5, 4))
    m1, s1, m2, s2 = a[:, :2], np.exp(a[:, 2:]), b[:, :2], np.exp(b[:, 2:])
    expected = (np.log(s2 / s1) + (s1**2 + (m1 - m2) ** 2) / (2 * s2**2) - 0.5).sum(-1)
    got = distributions.make_distribution(box, a).kl(distributions.make_distribution(box, b))
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5)
    multi = gym.spaces.MultiDiscrete([3, 3])
    c, d = rng.normal(size=(5, 6)), rng.normal(size=(5, 6))
    parts = [
        distributions.make_distribution(ACT, c[:, i : i + 3]).kl(
            distributions.make_distribution(ACT, d[:, i : i + 3])
        )
        for i in (0, 3)
    ]
    got = distributions.make_distribution(multi, c).kl(distributions.make_distribution(multi, d))
    np.testing.assert_allclose(got.numpy(), (parts[0] + parts[1]).numpy(), rtol=1e-5)


# The circular buffer ---------------------------------------------------------------------------


def _item(steps=10):
    return TrainBatch(SampleBatch({"rewards": np.zeros(steps, np.float32)}))


def test_circular_buffer_serves_each_batch_at_most_k_times():
    buffer = CircularBuffer(num_batches=3, iterations_per_batch=2, seed=0)
    items = [_item() for _ in range(3)]
    for item in items:
        buffer.put(item)
    drawn = [buffer.get_nowait() for _ in range(6)]
    assert sorted(map(id, drawn)) == sorted(map(id, items * 2))
    with pytest.raises(queue.Empty):
        buffer.get_nowait()
    assert buffer.qsize() == 0
    assert buffer.stats()["circular_buffer_num_dropped"] == 0


def test_circular_buffer_pushes_out_the_oldest_and_counts_unused_ones():
    released = []

    class Handle(TrainBatch):
        def release(self):
            released.append(self)

    buffer = CircularBuffer(num_batches=2, iterations_per_batch=3, seed=1)
    first, second, third = (Handle(SampleBatch({"rewards": np.zeros(7)})) for _ in range(3))
    buffer.put(first)
    buffer.put(second)
    buffer.put(third)  # Pushes out `first`, never drawn.
    assert released == [first]
    assert buffer.stats() == {
        "circular_buffer_num_added": 3,
        "circular_buffer_num_dropped": 1,
        "learner_thread_env_steps_dropped": 7,
    }
    assert {id(buffer.get_nowait()) for _ in range(6)} == {id(second), id(third)}
    # A batch drawn once is fetched: pushing it out releases nothing and drops nothing.
    buffer.put(_item())
    buffer.put(_item())
    assert released == [first] and buffer.stats()["circular_buffer_num_dropped"] == 1


def test_circular_buffer_draws_are_seeded_and_weighted_by_uses_left():
    def draws(seed):
        buffer = CircularBuffer(num_batches=4, iterations_per_batch=2, seed=seed)
        items = [_item(steps=i + 1) for i in range(4)]
        for item in items:
            buffer.put(item)
        return [buffer.get_nowait().env_steps for _ in range(8)]

    assert draws(5) == draws(5)
    assert sorted(draws(5)) == [1, 1, 2, 2, 3, 3, 4, 4]
    assert len({tuple(draws(s)) for s in range(6)}) > 1


def test_circular_buffer_get_waits_for_a_put_and_times_out():
    buffer = CircularBuffer(num_batches=2, iterations_per_batch=1)
    start = time.monotonic()
    with pytest.raises(queue.Empty):
        buffer.get(timeout=0.05)
    assert time.monotonic() - start >= 0.05
    item = _item()
    threading.Timer(0.05, buffer.put, args=(item,)).start()
    assert buffer.get(timeout=5) is item


def test_circular_buffer_drain_releases_what_was_never_drawn():
    released = []

    class Handle(TrainBatch):
        def release(self):
            released.append(self)

    buffer = CircularBuffer(num_batches=3, iterations_per_batch=2, seed=0)
    a, b = (
        Handle(SampleBatch({"rewards": np.zeros(3)})),
        Handle(SampleBatch({"rewards": np.zeros(3)})),
    )
    buffer.put(a)
    buffer.get_nowait()  # Draws `a` (the only one).
    buffer.put(b)
    assert buffer.drain() == 2
    assert released == [b]
    with pytest.raises(queue.Empty):
        buffer.get_nowait()


# The config -------------------------------------------------------------------------------------


def test_appo_config_has_rllibs_keys_and_defaults():
    config = APPOConfig()
    assert isinstance(config, ImpalaConfig)
    assert (config.clip_param, config.use_kl_loss, config.kl_coeff, config.kl_target) == (
        0.4,
        False,
        1.0,
        0.01,
    )
    assert (config.target_network_update_freq, config.tau, config.target_worker_clipping) == (
        2,
        1.0,
        2.0,
    )
    assert (config.circular_buffer_num_batches, config.circular_buffer_iterations_per_batch) == (
        4,
        2,
    )
    config.training(clip_param=0.3, use_kl_loss=True)
    assert APPOConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="Unknown APPO config key `clip_parm`.*clip_param"):
        APPOConfig().training(clip_parm=0.3)
    with pytest.raises(ValueError, match="Unknown IMPALA config key `clip_param`"):
        ImpalaConfig().training(clip_param=0.3)
    with pytest.raises(ValueError, match="`target_update_frequency`.*not supported"):
        APPOConfig().update_from_dict({"target_update_frequency": 1})


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("clip_param", 0.0, "`clip_param` must be a number > 0.0"),
        ("tau", 1.5, "`tau` must be a number > 0.0 and <= 1.0"),
        ("kl_target", -1.0, "`kl_target`"),
        ("circular_buffer_num_batches", 0, "`circular_buffer_num_batches` must be an int >= 1"),
        ("minibatch_buffer_size", 2, "`minibatch_buffer_size` must be 1 for APPO"),
        ("learner_queue_size", 4, "`learner_queue_size` has no effect in APPO"),
        ("vtrace", False, "APPO does not support vtrace=False"),
    ],
)
def test_appo_config_checks_name_the_key(key, value, message):
    config = APPOConfig().environment("CartPole-v1").update_from_dict({key: value})
    with pytest.raises(ValueError, match=message):
        config.validate()


def test_the_appo_page_lists_every_appo_key_with_its_default():
    import ast
    import dataclasses
    import pathlib

    page = (pathlib.Path(__file__).parents[1] / "docs" / "appo.md").read_text(encoding="utf-8")
    table = page.split("## Keys", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in table.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0].strip("`")] = cells[1].strip("`")
    own = {f.name for f in dataclasses.fields(APPOConfig)} - {
        f.name for f in dataclasses.fields(ImpalaConfig)
    }
    assert set(rows) == own
    for key, default in rows.items():
        assert ast.literal_eval(default) == getattr(APPOConfig(), key), key


def test_yaml_run_picks_the_algorithm(tmp_path):
    path = tmp_path / "appo.yaml"
    path.write_text(
        "cartpole-appo:\n  env: CartPole-v1\n  run: APPO\n  stop: {timesteps_total: 1000}\n"
        "  config: {clip_param: 0.2}\n"
    )
    config, stop = ImpalaConfig.from_yaml(path)
    assert type(config) is APPOConfig and config.clip_param == 0.2
    assert stop == {"timesteps_total": 1000}
    path.write_text("x:\n  env: CartPole-v1\n  run: PPO\n")
    with pytest.raises(ValueError, match="`run` must be one of IMPALA, APPO, got 'PPO'"):
        AlgorithmConfig.from_yaml(path)


def test_lockstep_needs_a_buffer_of_one_batch_used_once():
    config = APPOConfig(env="CartPole-v1", seed=0, num_env_runners=1, min_time_s_per_iteration=0)
    with pytest.raises(ValueError, match="circular_buffer_num_batches=1"):
        check_deterministic(config)
    config.training(circular_buffer_num_batches=1, circular_buffer_iterations_per_batch=1)
    check_deterministic(config)


def test_the_spec_carries_the_target_update_period_in_steps():
    config = APPOConfig(train_batch_size=100, target_network_update_freq=0.5)
    spec = config.learner_spec()
    assert isinstance(spec, AppoLearnerSpec)
    assert spec.target_update_steps == 0.5 * 4 * 2 * 100
    assert isinstance(spec.make_queue(), CircularBuffer)
    assert type(ImpalaConfig().learner_spec().make_queue()).__name__ == "LearnerQueue"


# The learner ------------------------------------------------------------------------------------


def _config(**overrides) -> APPOConfig:
    config = APPOConfig().environment("CartPole-v1")
    config.training(model={"fcnet_hiddens": [16, 16]})
    config.env_runners(rollout_fragment_length=T)
    return config.update_from_dict(overrides)


def _learner(config, strategy=None) -> AppoLearner:
    keras.utils.set_random_seed(0)
    with (strategy or tf.distribute.get_strategy()).scope():
        return AppoLearner(config, OBS, ACT)


def _step(learner, batch) -> dict[str, float]:
    out = tf.function(learner.train_step)({k: tf.constant(v) for k, v in batch.items()})
    return {k: float(v) for k, v in out.items()}


def _batch(seed=0):
    return fakes.time_major(fakes.sequence_batch(OBS, ACT, T, ROWS, seed=seed))


def _same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a.get_weights(), b.get_weights()))


def test_learner_loss_is_appo_loss_on_the_policy_and_target_outputs():
    config = _config(use_kl_loss=True, clip_param=0.2)
    learner = _learner(config)
    # A target network that differs from the policy, so that every term is exercised.
    learner.target_model.set_weights([w * 0.5 for w in learner.model.get_weights()])
    batch = _batch()
    resets = tf.zeros((T, ROWS), tf.bool)
    logits, values, _ = learner.model.unroll(tf.constant(batch["obs"]), resets, ())
    old_logits, _, _ = learner.target_model.unroll(tf.constant(batch["obs"]), resets, ())
    pi, old = (distributions.make_distribution(ACT, x) for x in (logits, old_logits))
    mu = distributions.make_distribution(ACT, tf.constant(batch["action_dist_inputs"]))
    total, sums = appo_loss(
        target_log_probs=pi.log_prob(batch["actions"]),
        old_log_probs=old.log_prob(batch["actions"]),
        behaviour_log_probs=mu.log_prob(batch["actions"]),
        entropy=pi.entropy(),
        kl=old.kl(pi),
        values=values,
        rewards=batch["rewards"],
        terminateds=batch["terminateds"],
        truncateds=batch["truncateds"],
        values_bootstrapped=batch["values_bootstrapped"],
        gamma=config.gamma,
        clip_param=0.2,
        vf_loss_coeff=config.vf_loss_coeff,
        entropy_coeff=config.entropy_coeff,
        kl_coeff=config.kl_coeff,
    )
    stats = _step(learner, batch)
    n = float(sums.num_valid)
    assert stats["total_loss"] == pytest.approx(float(total) / n, rel=1e-5)
    assert stats["kl"] == pytest.approx(float(sums.kl) / n, rel=1e-5)
    assert stats["mean_IS"] == pytest.approx(float(sums.is_ratio) / n, rel=1e-5)
    assert stats["policy_loss"] == pytest.approx(float(sums.pi_loss) / n, rel=1e-5)


def test_target_network_follows_the_policy_every_period():
    # 20 steps per batch; the period is 0.25 x 4 x 2 x 20 = 40 steps: every second update.
    learner = _learner(_config(train_batch_size=T * ROWS, target_network_update_freq=0.25))
    assert _same(learner.model, learner.target_model)
    before = [w.copy() for w in learner.target_model.get_weights()]
    stats = _step(learner, _batch(0))
    assert stats["num_target_updates"] == 0
    assert all(np.array_equal(a, b) for a, b in zip(before, learner.target_model.get_weights()))
    assert not _same(learner.model, learner.target_model)
    stats = _step(learner, _batch(1))
    assert stats["num_target_updates"] == 1 and stats["last_target_update_ts"] == 40
    assert _same(learner.model, learner.target_model)


def test_tau_moves_the_target_part_of_the_way():
    learner = _learner(
        _config(train_batch_size=T * ROWS, target_network_update_freq=0.125, tau=0.25)
    )
    old = [w.copy() for w in learner.target_model.get_weights()]
    _step(learner, _batch())
    for target, new, prev in zip(
        learner.target_model.get_weights(), learner.model.get_weights(), old
    ):
        np.testing.assert_allclose(target, 0.25 * new + 0.75 * prev, rtol=1e-5, atol=1e-7)


def test_kl_coefficient_adapts_as_rllib_does():
    config = _config(use_kl_loss=True, kl_coeff=1.0, kl_target=1e6)  # KL far below the target.
    learner = _learner(config)
    assert _step(learner, _batch())["KL_Coeff"] == pytest.approx(0.5)
    config = _config(use_kl_loss=True, kl_coeff=1.0, kl_target=1e-9)  # KL far above it.
    learner = _learner(config)
    learner.target_model.set_weights([w * -1.0 for w in learner.model.get_weights()])
    assert _step(learner, _batch())["KL_Coeff"] == pytest.approx(1.5)
    config = _config(use_kl_loss=False)
    learner = _learner(config)
    assert _step(learner, _batch())["KL_Coeff"] == pytest.approx(1.0)


def test_mirrored_strategy_gives_the_same_appo_update_as_one_device():
    # The loss is a mean: the summed gradient is divided by the whole batch's valid steps, so
    # two replicas of half the batch each give the one-device update.
    config = _config(num_gpus=2, _fake_gpus=True, use_kl_loss=True)
    seq = fakes.sequence_batch(OBS, ACT, T, ROWS, seed=5)
    for key in ("terminateds", "truncateds"):
        seq[key] = seq[key].astype(np.float32)
    dataset = tf.data.Dataset.from_tensors(fakes.flat(seq))
    single = _learner(config)
    mirrored = _learner(config, strategy=strategies.mirrored())
    mirrored.model.set_weights(single.model.get_weights())
    mirrored.target_model.set_weights(single.target_model.get_weights())
    h1 = single.fit(dataset, epochs=1, verbose=0).history
    h2 = mirrored.fit(dataset, epochs=1, verbose=0).history
    for key in ("policy_loss", "vf_loss", "kl", "mean_IS", "grad_gnorm", "total_loss"):
        assert h1[key][0] == pytest.approx(h2[key][0], rel=1e-4, abs=1e-6), key
    for a, b in zip(single.model.get_weights(), mirrored.model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_checkpoint_holds_the_target_network_and_kl_state(tmp_path):
    config = _config(use_kl_loss=True, kl_target=1e6)
    learner = _learner(config)
    learner.target_model.set_weights([w + 1.0 for w in learner.target_model.get_weights()])
    _step(learner, _batch())
    prefix = learner_checkpoint(learner).write(str(tmp_path / "learner"))
    fresh = _learner(_config(use_kl_loss=True, kl_target=1e6))
    learner_checkpoint(fresh).read(prefix).assert_consumed()
    assert _same(fresh.target_model, learner.target_model)
    assert float(fresh.kl_coeff.numpy()) == pytest.approx(0.5)
    assert int(fresh.num_grad_updates.numpy()) == 1


def test_a_built_model_is_refused():
    model = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="builds its target network from the model's spec"):
        AppoLearner(_config(), OBS, ACT, model=model)


# On the shared runtime --------------------------------------------------------------------------


def _appo_config(**overrides) -> APPOConfig:
    return APPOConfig.from_dict({**small_config().to_dict(), **overrides})


def test_appo_trains_saves_and_resumes_on_the_shared_runtime(tmp_path):
    config = _appo_config(use_kl_loss=True)
    with config.build() as algo:
        result = algo.train()
        stats = result["info"]["learner"]["default_policy"]["learner_stats"]
        assert {"kl", "KL_Coeff", "mean_IS", "var_IS", "num_target_updates"} <= set(stats)
        assert "learner_thread_env_steps_dropped" in result["info"]["learner_queue"]
        assert isinstance(algo.learner, AppoLearner)
        # Read before the save: the learner thread trains on meanwhile, so the checkpoint holds
        # at least this many updates.
        trained = algo.learner.num_grad_updates.numpy()
        path = algo.save(str(tmp_path / "ckpt"))
    assert type(load_config(path)) is APPOConfig
    from impala_tf import Impala

    with Impala.from_checkpoint(path) as algo:
        action = algo.compute_single_action(np.zeros(4, np.float32))
        assert action in (0, 1)
        result = algo.train()
        assert isinstance(algo.learner, AppoLearner)
        assert result["info"]["learner"]["default_policy"]["learner_stats"][
            "num_grad_updates_lifetime"
        ] > int(trained)


def test_each_policy_of_a_multi_agent_config_gets_an_appo_learner():
    config = APPOConfig.from_dict(small_config(policies=2).to_dict())
    config.multi_agent(
        policies={"p0": (None, None, None, {"clip_param": 0.1}), "p1": (None, None, None, {})}
    )
    with config.build() as algo:
        learners = algo.learners.learners
        assert all(isinstance(learners[p], AppoLearner) for p in ("p0", "p1"))
        assert learners["p0"].spec.clip_param == 0.1 and learners["p1"].spec.clip_param == 0.4
        seen = set()
        for _ in range(20):  # Until each policy has reported an update.
            info = algo.train()["info"]["learner"]
            seen |= {p for p in ("p0", "p1") if "kl" in info.get(p, {}).get("learner_stats", {})}
            if len(seen) == 2:
                break
        assert seen == {"p0", "p1"}
