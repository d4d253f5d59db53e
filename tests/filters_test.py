"""Observation filters: RunningStat arithmetic, the merge protocol, acting, checkpoints, export."""

from __future__ import annotations

import json

import numpy as np
import pytest

from impala_tf.acting import filters
from impala_tf.acting.filters import (
    MeanStdFilter,
    NoFilter,
    RunningStat,
    filter_from_state,
    get_filter,
)
from impala_tf.config import ImpalaConfig
from impala_tf.driver.specs import runner_spec
from impala_tf.models import build_model
from impala_tf.rollout.env_runner import EnvRunner
from tests.support.configs import small_config


def _data(seed: int, n: int, shape=(3,)) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.normal(loc=seed, scale=1 + seed, size=(n, *shape))


def test_running_stat_matches_numpy_pushed_in_any_chunks():
    xs = _data(1, 50)
    stat = RunningStat((3,))
    for chunk in np.array_split(xs, [1, 2, 17, 40]):
        stat.push_batch(chunk)
    assert stat.n == 50
    np.testing.assert_allclose(stat.mean, xs.mean(0), rtol=1e-12)
    np.testing.assert_allclose(stat.var, xs.var(0, ddof=1), rtol=1e-12)
    one = RunningStat((3,))
    one.push_batch(xs[:1])
    # RLlib's convention: with one sample the variance is mean^2.
    np.testing.assert_allclose(one.var, np.square(xs[0]))
    with pytest.raises(ValueError, match="shape"):
        stat.push_batch(np.zeros((2, 4)))


def test_merged_actor_deltas_equal_one_filter_over_all_the_data():
    driver = MeanStdFilter((3,), clip=None)
    actors = [MeanStdFilter((3,), clip=None) for _ in range(3)]
    single = MeanStdFilter((3,), clip=None)
    seen = []
    for round_ in range(3):
        for i, actor in enumerate(actors):
            xs = _data(10 * round_ + i, 5 + 7 * i)
            actor(xs)
            single(xs)
            seen.append(xs)
            delta = actor.delta()
            actor.reset_buffer()
            driver.apply_changes(delta)
        for actor in actors:  # The broadcast: actors take the merged statistics.
            actor.sync(driver.as_serializable())
    everything = np.concatenate(seen)
    assert driver.rs.n == single.rs.n == len(everything)
    np.testing.assert_allclose(driver.rs.mean, everything.mean(0), rtol=1e-10)
    np.testing.assert_allclose(driver.rs.var, everything.var(0, ddof=1), rtol=1e-10)
    np.testing.assert_allclose(driver.rs.var, single.rs.var, rtol=1e-10)
    # After the sync every actor filters as the driver would.
    x = _data(99, 4)
    np.testing.assert_allclose(actors[1](x, update=False), driver(x, update=False))
    assert driver.buffer.n == 0


def test_rllib_apply_changes_example():
    a = MeanStdFilter(())
    a(np.array(1.0))
    a(np.array(2.0))
    assert [a.rs.n, float(a.rs.mean), a.buffer.n] == [2, 1.5, 2]
    b = MeanStdFilter(())
    b(np.array(10.0))
    a.apply_changes(b, with_buffer=False)
    assert a.rs.n == 3 and float(a.rs.mean) == pytest.approx(4.333333333333333)
    assert a.buffer.n == 2
    a.apply_changes(b, with_buffer=True)
    assert [a.rs.n, float(a.rs.mean), a.buffer.n] == [4, pytest.approx(5.75), 1]


def test_filtering_formula_clip_and_update_flag():
    f = MeanStdFilter((2,), clip=1.5)
    xs = np.array([[0.0, 10.0], [2.0, 30.0], [4.0, 20.0]], np.float32)
    out = f(xs)
    assert out.dtype == np.float32 and f.rs.n == 3
    mean, std = xs.mean(0), xs.std(0, ddof=1)
    np.testing.assert_allclose(out, np.clip((xs - mean) / (std + 1e-6), -1.5, 1.5), rtol=1e-5)
    before = f.get_state()
    single = f(np.array([100.0, 100.0], np.float32), update=False)
    assert f.get_state() == before
    np.testing.assert_array_equal(single, [1.5, 1.5])
    assert NoFilter()(xs) is not None and np.array_equal(NoFilter()(xs), xs)


def test_get_filter_names_and_errors():
    assert isinstance(get_filter("NoFilter", (4,)), NoFilter)
    made = get_filter("MeanStdFilter", (4,))
    assert isinstance(made, MeanStdFilter) and made.clip is None  # RLlib's get_filter
    assert isinstance(get_filter("ConcurrentMeanStdFilter", (4,)), MeanStdFilter)
    with pytest.raises(ValueError, match="observation_filter"):
        get_filter("MeanStd", (4,))
    with pytest.raises(ValueError, match="observation_filter"):
        ImpalaConfig(env="CartPole-v1", observation_filter="Bogus").validate()
    ImpalaConfig(env="CartPole-v1", observation_filter="MeanStdFilter").validate()
    assert ImpalaConfig().observation_filter == "NoFilter"


def test_state_round_trips_through_json():
    f = MeanStdFilter((3,), clip=5.0)
    f(_data(2, 9))
    restored = filter_from_state(json.loads(json.dumps(f.get_state())))
    assert restored.rs.n == 9 and restored.clip == 5.0
    x = _data(3, 2)
    np.testing.assert_allclose(restored(x, update=False), f(x, update=False))
    assert isinstance(filter_from_state(NoFilter().get_state()), NoFilter)


def _runner(observation_filter: str, update_filter: bool = True) -> EnvRunner:
    config = (
        ImpalaConfig()
        .environment("CartPole-v1")
        .env_runners(num_envs_per_env_runner=2, rollout_fragment_length=6)
        .training(model={"fcnet_hiddens": [8]})
        .debugging(seed=4)
        .update_from_dict({"observation_filter": observation_filter})
    )
    runner = EnvRunner(runner_spec(config), worker_index=1, update_filter=update_filter)
    model = build_model(runner.observation_space, runner.action_space, config.model)
    # Zero weights: uniform logits, so the actions (and the episodes) do not depend on the obs.
    zeros = [np.zeros_like(w) for w in model.get_weights()]
    runner.set_weights({"default_policy": (zeros, 0)})
    return runner


def test_actors_act_on_filtered_observations_and_ship_their_changes():
    raw_runner = _runner("NoFilter")
    first, second = raw_runner.sample(), raw_runner.sample()
    assert first.filter_deltas is None
    first_obs = first.batches["default_policy"]["obs"]
    # Every observation the envs returned during the first fragment (T steps + the next one).
    raw = np.concatenate([first_obs, second.batches["default_policy"]["obs"][:, :1]], axis=1)

    runner = _runner("MeanStdFilter")
    fragment = runner.sample()
    delta = fragment.filter_deltas["default_policy"]
    assert isinstance(delta, MeanStdFilter) and delta.buffer.n == raw.size // 4
    np.testing.assert_allclose(delta.buffer.mean, raw.reshape(-1, 4).mean(0), rtol=1e-6, atol=1e-8)
    assert runner.obs_filter.buffer.n == 0  # flushed into the fragment
    assert not np.allclose(fragment.batches["default_policy"]["obs"], first_obs)

    # A runner that applies a fixed (synced) filter: obs = (raw - mean) / (std + 1e-6).
    fixed = MeanStdFilter((4,), clip=None)
    fixed(_data(5, 20, (4,)))
    fixed.reset_buffer()  # The driver's merged filter has no buffer of its own.
    frozen = _runner("MeanStdFilter", update_filter=False)
    weights = frozen.get_weights()["default_policy"]
    frozen.set_weights({"default_policy": (weights, 0)}, {"default_policy": fixed})
    fragment = frozen.sample()
    expected = (first_obs - fixed.rs.mean) / (fixed.rs.std + 1e-6)
    obs = fragment.batches["default_policy"]["obs"]
    np.testing.assert_allclose(obs, expected, rtol=1e-5, atol=1e-5)
    assert fragment.filter_deltas is None and frozen.obs_filter.rs.n == 20


def test_filter_needs_a_float_observation_space():
    config = ImpalaConfig(env="ALE/Pong-v5", observation_filter="MeanStdFilter")
    config.env_runners(num_envs_per_env_runner=1)
    with pytest.raises(ValueError, match="observation_filter"):
        EnvRunner(runner_spec(config))


def test_module_exports():
    assert set(filters.__all__) >= {"MeanStdFilter", "NoFilter", "RunningStat", "get_filter"}


@pytest.mark.slow
def test_driver_merges_saves_restores_evaluates_and_exports_the_filter(tmp_path):
    import tensorflow as tf

    from impala_tf import checkpoints
    from impala_tf.bin.export import export_saved_model
    from impala_tf.driver import evaluation
    from impala_tf.driver.specs import evaluator_spec, probe_spaces

    def config():
        return small_config(observation_filter="MeanStdFilter", evaluation_duration=2)

    algo = config().build()
    try:
        algo.train()
        algo.train()
        steps = algo.metrics.counters.num_env_steps_sampled
        merged = algo.actors.filters["default_policy"]
        # Each merged fragment's 40 observations, plus each actor's 4 first ones.
        assert merged.rs.n - steps in (0, 4, 8) and steps > 0
        assert merged.buffer.n == 0
        state = merged.get_state()
        algo.evaluate()
        assert merged.get_state() == state  # Evaluation does not feed the merged filter.
        saved = algo.save(str(tmp_path / "ckpt"))
    finally:
        algo.stop()

    fresh = config().build()
    try:
        fresh.restore(saved)
        assert fresh.actors.filters["default_policy"].get_state() == state
    finally:
        fresh.stop()

    # The evaluation path (training-time evaluation and impala-evaluate) applies the saved
    # filter without updating it.
    saved_config = checkpoints.load_config(saved)
    weights, saved_filters = evaluation.load_checkpoint_policies(
        saved, saved_config, probe_spaces(saved_config)
    )
    evaluator = evaluation.Evaluator(evaluator_spec(saved_config))
    try:
        evaluator.run(weights, saved_filters, num_episodes=1, seed=0)
        assert evaluator.runner.obs_filter.get_state()["rs"] == state["rs"]
    finally:
        evaluator.close()

    model, action_space, obs_filter = evaluation.load_policy_model(saved, saved_config)
    assert obs_filter.get_state()["rs"] == state["rs"]
    export_saved_model(model, action_space, str(tmp_path / "export"), obs_filter)
    serve = tf.saved_model.load(str(tmp_path / "export")).signatures["serving_default"]
    raw = np.array([[0.1, 1.0, -0.05, -1.5], [0.0, 0.0, 0.0, 0.0]], np.float32)
    logits, _, _ = model.step(tf.constant(obs_filter(raw, update=False)), ())
    np.testing.assert_allclose(serve(obs=tf.constant(raw))["logits"], logits, rtol=1e-5, atol=1e-5)
