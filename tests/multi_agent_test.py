"""Multi-agent IMPALA end to end: config and YAML, envs (MultiAgentCartPole, PettingZoo),
per-policy learners, replay, results, checkpoints, evaluation and export, the binaries; and what
multi-agent configs run like single-agent ones: recurrent policies, aggregation workers,
deterministic mode.

The runner (per-agent streams, bootstrapping, states, snapshots) is tested in
`tests/multi_agent_runner_test.py`; the runtime scenarios (restarts, hangs, save/restore,
evaluation during training) on every placement, two policies included, in
`tests/runtime_conformance_test.py`; central inference for two policies, on local processes
and on Ray, in `tests/inference_test.py`; `impala-evaluate --video` of a multi-agent checkpoint
(the agents side by side) in `tests/evaluate_test.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import gymnasium as gym
import numpy as np
import pytest

from impala_tf import checkpoints
from impala_tf.config import ConfigWarning, ImpalaConfig
from impala_tf.config import policies as ma_spec
from impala_tf.driver import evaluation
from impala_tf.driver.specs import probe_spaces
from impala_tf.multi_agent.env import MultiAgentCartPole
from tests.support import envs
from tests.support.configs import small_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
YAML = os.path.join(REPO, "configs", "multi-agent-cartpole-impala.yaml")
POLICIES = ["p0", "p1"]


def two_agent_config(**overrides) -> ImpalaConfig:
    """Two agents of MultiAgentCartPole, agent i acting with policy p{i} (`small_config`)."""
    return small_config(policies=2, **overrides)


# Config ----------------------------------------------------------------------------------------


def test_rllib_yaml_parses_with_warnings_for_torch_only_keys():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config, stop = ImpalaConfig.from_yaml(YAML)
    messages = " ".join(str(w.message) for w in caught if issubclass(w.category, ConfigWarning))
    assert "replay_ratio" in messages
    assert config.policies == ["p0", "p1", "p2", "p3"]
    assert stop == {"episode_reward_mean": 600, "timesteps_total": 200000}
    config.validate(require_env=True)
    spaces = probe_spaces(config)
    assert spaces.multi_agent and spaces.policy_ids == ["p0", "p1", "p2", "p3"]
    mapping = ma_spec.resolve_mapping_fn(config.policy_mapping_fn)
    assert [mapping(i, None) for i in range(4)] == ["p0", "p1", "p2", "p3"]


def test_probe_spaces_tells_multi_agent_envs_from_single_agent_ones():
    single = probe_spaces(ImpalaConfig(env="CartPole-v1"))
    assert not single.multi_agent and single.policy_ids == ["default_policy"]
    # A MultiAgentEnv without `policies` is multi-agent with one shared policy, as in RLlib.
    shared = probe_spaces(ImpalaConfig(env="impala_tf/MultiAgentCartPole"))
    assert shared.multi_agent and shared.policy_ids == ["default_policy"]
    assert probe_spaces(two_agent_config()).policy_ids == POLICIES
    with pytest.raises(ValueError, match="not a MultiAgentEnv"):
        probe_spaces(ImpalaConfig(env="CartPole-v1", policies=POLICIES))


def _module_level_mapping(agent_id, episode, worker=None, **kwargs):
    return "even" if agent_id % 2 == 0 else "odd"


@pytest.mark.parametrize(
    "spec",
    [
        _module_level_mapping,
        "tests.multi_agent_test:_module_level_mapping",
        "tests.multi_agent_test._module_level_mapping",
    ],
)
def test_mapping_fn_forms(spec):
    fn = ma_spec.resolve_mapping_fn(spec)
    assert [fn(i, None) for i in range(3)] == ["even", "odd", "even"]


def test_mapping_fn_type_form_instantiates_the_class():
    fn = ma_spec.resolve_mapping_fn({"type": "impala_tf.config.policies.PolicyMappingFn"})
    assert fn(3, None) == "p3"
    assert ma_spec.resolve_mapping_fn(None)(7, None) == "default_policy"


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"policy_mapping_fn": "no.such.module.fn"}, "policy_mapping_fn"),
        ({"policy_mapping_fn": {"kwargs": 1}}, "needs a `type`"),
        ({"policies_to_train": ["p9"]}, "policies_to_train"),
        ({"policies": {"p0": {"config": {"lr": -1.0}}, "p1": None}}, r"policies\['p0'\]"),
        ({"policies": {"p0": {"bad": 1}}}, "unknown PolicySpec keys"),
        ({"policies": []}, "empty"),
    ],
)
def test_bad_multi_agent_settings_name_the_key(settings, match):
    config = two_agent_config()
    config.multi_agent(**settings)
    with pytest.raises(ValueError, match=match):
        config.validate(require_env=True)


def test_unknown_multiagent_key_is_refused():
    with pytest.raises(ValueError, match="Unknown multiagent key `polices`"):
        ImpalaConfig(multiagent={"polices": ["p0"]})
    with pytest.raises(ValueError, match="replay_mode"):
        ImpalaConfig(multiagent={"replay_mode": "lockstep"})
    with pytest.raises(ValueError, match="replay_proportion"):
        ImpalaConfig(replay_ratio=0.5)


def test_policy_spec_overrides_reach_only_that_policy():
    config = two_agent_config()
    config.multi_agent(
        policies={"p0": ma_spec.PolicySpec(config={"lr": 0.01}), "p1": (None, None, None, None)}
    )
    config.validate(require_env=True)
    assert ma_spec.policy_config(config, "p0").lr == 0.01
    assert ma_spec.policy_config(config, "p1").lr == config.lr
    assert ma_spec.policy_config(config, "p0").policies is None


# Envs --------------------------------------------------------------------------------------------


def test_multi_agent_cartpole_reads_rllibs_nested_env_config_and_ends_when_all_are_done():
    env = gym.make(
        "ray.rllib.examples.env.multi_agent.MultiAgentCartPole", config={"num_agents": 3}
    )
    assert isinstance(env, MultiAgentCartPole) and env.possible_agents == [0, 1, 2]
    obs, _ = env.reset(seed=0)
    assert set(obs) == {0, 1, 2}
    done: set[int] = set()
    for _ in range(600):
        actions = {a: 0 for a in obs if a not in done}  # Always left: each pole falls soon.
        obs, rewards, terms, truncs, _ = env.step(actions)
        assert set(rewards) == set(actions)
        done |= {a for a in actions if terms[a] or truncs[a]}
        if terms["__all__"]:
            break
    assert done == {0, 1, 2}
    with pytest.raises(ValueError, match="num_agents"):
        MultiAgentCartPole({"num_agents": 0})


def test_pettingzoo_adapter_passes_the_api_test_and_truncates_every_agent_at_the_end():
    from pettingzoo.test import parallel_api_test

    parallel_api_test(envs.Coordination(), num_cycles=20)
    env = envs.coordination({})
    assert probe_spaces(ImpalaConfig(env=envs.coordination)).multi_agent
    obs, _ = env.reset(seed=0)
    assert set(obs) == {"a", "b"}
    for _ in range(6):
        obs, rewards, terms, truncs, _ = env.step({"a": 1, "b": 1})
        assert rewards == {"a": 1.0, "b": 1.0} and not truncs["__all__"]
    obs, rewards, terms, truncs, _ = env.step({"a": 0, "b": 1})
    assert truncs["__all__"] and not terms["__all__"] and truncs["a"] and "a" in obs
    assert rewards == {"a": 0.0, "b": 0.0}


# The algorithm ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two policies, only p0 trained, with replay; trained two iterations, stopped, saved."""
    config = two_agent_config(
        replay_proportion=1.0, replay_buffer_num_slots=4, policies_to_train=["p0"]
    )
    algo = config.build()
    initial = {pid: algo.get_policy_weights(pid) for pid in POLICIES}
    try:
        results = [algo.train() for _ in range(2)]
    finally:
        algo.stop()  # No update after the save: the weights below are the checkpoint's.
    path = algo.save(str(tmp_path_factory.mktemp("ma") / "ckpt"))
    yield algo, initial, results, path


def test_per_policy_learner_stats_and_rewards(trained):
    _, _, results, _ = trained
    result = results[-1]
    assert set(result["info"]["learner"]) == {"p0"}
    stats = result["info"]["learner"]["p0"]["learner_stats"]
    for key in ("policy_loss", "vf_loss", "entropy", "cur_lr", "vf_explained_var", "grad_gnorm"):
        assert key in stats
    assert result["info"]["learner"]["p0"]["num_grad_updates_lifetime"] > 0
    assert set(result["policy_reward_mean"]) == {"p0", "p1"}
    assert result["num_agent_steps_sampled"] > result["num_env_steps_sampled"]
    assert result["num_agent_steps_trained"] > 0
    # The episode return is summed over agents; each policy's mean is one agent's.
    mean = result["policy_reward_mean"]
    assert result["episode_reward_mean"] == pytest.approx(mean["p0"] + mean["p1"], rel=0.25)
    from impala_tf.training.reporting import tensorboard_scalars

    tags = tensorboard_scalars(result, raw=False)
    assert "learner/p0/policy_loss" in tags and "episode/p1/return_mean" in tags


def test_policy_not_trained_keeps_its_weights(trained):
    algo, initial, _, _ = trained
    for w0, w1 in zip(initial["p1"], algo.get_policy_weights("p1")):
        np.testing.assert_array_equal(w0, w1)
    changed = [
        not np.array_equal(a, b) for a, b in zip(initial["p0"], algo.get_policy_weights("p0"))
    ]
    assert any(changed)


def test_replay_is_per_policy(trained):
    algo, _, _, _ = trained
    state = algo.aggregation.local.get_state()
    assert set(state) == {"p0"}  # p1 is not trained: nothing to replay.
    slots = state["p0"]["replay"]["slots"]
    assert 0 < len(slots) <= 4
    assert all(slot["obs"].shape[1:] == (10, 4) for slot in slots)  # [R, T, obs]


def test_a_checkpoint_restores_every_policy_trained_or_not(trained):
    algo, initial, _, path = trained
    assert sorted(os.listdir(os.path.join(path, checkpoints.POLICIES_DIR))) == POLICIES
    other = two_agent_config(seed=4).build()  # Other initial weights than the saved run's.
    try:
        assert any(
            not np.array_equal(a, b) for a, b in zip(initial["p1"], other.get_policy_weights("p1"))
        )
        other.restore(path)
        for pid in POLICIES:
            for a, b in zip(algo.get_policy_weights(pid), other.get_policy_weights(pid)):
                np.testing.assert_array_equal(a, b)
    finally:
        other.stop()


def test_evaluate_and_export_per_policy(trained):
    algo, _, _, path = trained
    config = checkpoints.load_config(path)
    # Export takes one policy's model, named when the checkpoint holds several.
    with pytest.raises(ValueError, match=r"\['p0', 'p1'\]: pass --policy_id"):
        evaluation.load_policy_model(path, config)
    with pytest.raises(ValueError, match=r"p7.*\['p0', 'p1'\]"):
        evaluation.load_policy_model(path, config, "p7")
    model, action_space, obs_filter = evaluation.load_policy_model(path, config, "p1")
    assert action_space == gym.spaces.Discrete(2) and obs_filter is None
    for a, b in zip(model.get_weights(), algo.get_policy_weights("p1")):
        np.testing.assert_array_equal(a, b)
    # The same seeded episodes, reported summed over the agents or as p0's agent's return.
    summed = evaluation.evaluate_checkpoint(path, config, 2, explore=False)
    own = evaluation.evaluate_checkpoint(path, config, 2, explore=False, policy_id="p0")
    assert len(summed) == len(own) == 2
    for total, mine in zip(summed, own):
        assert sorted(total.policy_returns) == POLICIES and total.length == mine.length
        assert total.ret == pytest.approx(
            sum(r for rs in total.policy_returns.values() for r in rs)
        )
        assert mine.ret == pytest.approx(total.policy_returns["p0"][0]) and mine.ret > 0
    with pytest.raises(ValueError, match=r"p7.*\['p0', 'p1'\]"):
        evaluation.evaluate_checkpoint(path, config, 1, policy_id="p7")


def test_checkpoint_config_stores_a_module_level_mapping_fn_as_its_import_path():
    config = two_agent_config(policy_mapping_fn=_module_level_mapping)
    stored = checkpoints.storable_config(config)
    assert stored["policy_mapping_fn"] == f"{__name__}:_module_level_mapping"
    assert ma_spec.resolve_mapping_fn(stored["policy_mapping_fn"]) is _module_level_mapping
    instance = checkpoints.storable_config(
        two_agent_config(policy_mapping_fn=ma_spec.PolicyMappingFn())
    )
    assert instance["policy_mapping_fn"] == "impala_tf.config.policies:PolicyMappingFn"
    lam = two_agent_config(policy_mapping_fn=lambda agent_id, *a, **k: "p0")
    assert checkpoints.storable_config(lam)["policy_mapping_fn"] is lam.policy_mapping_fn


# What multi-agent configs run like single-agent ones ----------------------------------------------


def _learner_info(result: dict) -> dict:
    return result["info"]["learner"]


def _train_until_every_policy_updated(algo, max_iterations: int = 30) -> dict:
    """Trains until each trained policy's learner has applied an update; the last result."""
    result: dict = {}
    for _ in range(max_iterations):
        result = algo.train()
        info = _learner_info(result)
        if info and all(v["num_grad_updates_lifetime"] >= 1 for v in info.values()):
            return result
    raise AssertionError(f"not every policy updated in {max_iterations} iterations: {result}")


def test_a_recurrent_policy_trains_beside_a_feedforward_one():
    lstm = {"use_lstm": True, "lstm_cell_size": 8, "max_seq_len": 5, "fcnet_hiddens": [16]}
    config = two_agent_config(num_env_runners=1).multi_agent(
        policies={"p0": ma_spec.PolicySpec(config={"model": lstm}), "p1": None}
    )
    algo = config.build()
    try:
        assert algo.plan.actors_need_tensorflow  # The LSTM acts in TensorFlow in the actors.
        assert algo.learners.learners["p0"].model.is_recurrent
        assert not algo.learners.learners["p1"].model.is_recurrent
        initial = algo.get_policy_weights("p0")
        info = _learner_info(_train_until_every_policy_updated(algo))
        trained = algo.get_policy_weights("p0")
    finally:
        algo.stop()
    assert sorted(info) == POLICIES
    for pid in POLICIES:
        assert np.isfinite(info[pid]["learner_stats"]["total_loss"])
    assert any(not np.array_equal(a, b) for a, b in zip(initial, trained))


def test_aggregation_workers_cut_and_replay_the_trained_policies_only():
    config = two_agent_config(
        num_aggregation_workers=1,
        # No in-flight limit to reach: the worker cuts every fragment (aggregation_test.py).
        max_requests_in_flight_per_aggregator_worker=1000,
        replay_proportion=1.0,
        replay_buffer_num_slots=4,
        policies_to_train=["p0"],
        compress_observations=True,
    )
    algo = config.build()
    try:
        assert len(algo.aggregation.pids()) == 1
        initial = algo.get_policy_weights("p1")
        results = [algo.train() for _ in range(2)]
        after = algo.get_policy_weights("p1")
        # The worker did the cutting and the replay: the driver's aggregator holds nothing.
        assert algo.aggregation.local.get_state()["p0"]["replay"]["slots"] == []
    finally:
        algo.stop()
    assert sorted(_learner_info(results[-1])) == ["p0"]
    assert results[-1]["num_env_steps_trained"] > 0
    assert results[-1]["num_aggregation_worker_restarts"] == 0
    for a, b in zip(initial, after):
        np.testing.assert_array_equal(a, b)


def _deterministic_run() -> tuple[list[dict], dict[str, list[np.ndarray]]]:
    config = two_agent_config(
        num_env_runners=1, min_time_s_per_iteration=0, min_sample_timesteps_per_iteration=100
    )
    algo = config.build(deterministic=True)
    try:
        results = [algo.train() for _ in range(2)]
        weights = {pid: algo.get_policy_weights(pid) for pid in POLICIES}
    finally:
        algo.stop()
    return results, weights


def test_deterministic_mode_repeats_a_run_exactly():
    (first, first_weights), (second, second_weights) = _deterministic_run(), _deterministic_run()
    for a, b in zip(first, second):
        for key in (
            "num_env_steps_sampled",
            "num_agent_steps_sampled",
            "num_env_steps_trained",
            "episodes_total",
            "episode_reward_mean",
            "policy_reward_mean",
        ):
            assert a[key] == b[key], key
        for pid in POLICIES:
            stats_a = _learner_info(a)[pid]["learner_stats"]
            stats_b = _learner_info(b)[pid]["learner_stats"]
            assert stats_a["total_loss"] == stats_b["total_loss"], pid
    assert _learner_info(first[-1])["p1"]["num_grad_updates_lifetime"] >= 1
    for pid in POLICIES:
        for a, b in zip(first_weights[pid], second_weights[pid]):
            np.testing.assert_array_equal(a, b)


# The binaries ------------------------------------------------------------------------------------


def _run_module(module: str, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": REPO}
    return subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_binary_trains_every_policy_of_rllibs_yaml(tmp_path):
    # Resuming a logdir through the binary is train_binary_test's; restoring a multi-policy
    # algorithm (weights, counters, iteration) is runtime_conformance_test's, on both backends.
    run = _run_module(
        "impala_tf.bin.train",
        f"--config={YAML}",
        f"--logdir={tmp_path}",
        "--set=num_workers=1",
        "--set=num_envs_per_worker=2",
        "--set=min_time_s_per_iteration=1",
        "--seed=0",
        "--stop_iters=2",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "result.json").read_text().splitlines()]
    assert [r["training_iteration"] for r in lines] == [1, 2]
    assert set(lines[-1]["policy_reward_mean"]) == {"p0", "p1", "p2", "p3"}
    assert set(lines[-1]["info"]["learner"]) >= {"p0", "p1", "p2", "p3"}
    assert lines[1]["num_env_steps_sampled"] > lines[0]["num_env_steps_sampled"]
