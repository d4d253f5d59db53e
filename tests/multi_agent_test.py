"""Multi-agent IMPALA: config, envs (MultiAgentCartPole, PettingZoo), per-policy batching,
learners, replay, results, checkpoints and the binary on RLlib's multi-agent CartPole YAML."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import gymnasium as gym
import numpy as np
import pytest
from pettingzoo import ParallelEnv

from impala_tf.config import ConfigWarning, ImpalaConfig
from impala_tf.models import build_model
from impala_tf.multi_agent import algorithm_class, is_multi_agent
from impala_tf.multi_agent import spec as ma_spec
from impala_tf.multi_agent.batch import MultiAgentBatch
from impala_tf.multi_agent.env import MultiAgentCartPole, PettingZooParallelEnv
from impala_tf.multi_agent.runner import MultiAgentEnvRunner
from impala_tf.sample_batch import SampleBatch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
YAML = os.path.join(REPO, "configs", "multi-agent-cartpole-impala.yaml")


def two_agent_config(**overrides) -> ImpalaConfig:
    config = ImpalaConfig(
        env="impala_tf/MultiAgentCartPole",
        env_config={"num_agents": 2},
        num_env_runners=1,
        num_envs_per_env_runner=2,
        rollout_fragment_length=10,
        train_batch_size=40,
        model={"fcnet_hiddens": [8]},
        min_time_s_per_iteration=0,
        min_sample_timesteps_per_iteration=200,
        seed=3,
    )
    config.multi_agent(
        policies=["p0", "p1"], policy_mapping_fn="impala_tf.multi_agent.spec.PolicyMappingFn"
    )
    return config.update_from_dict(overrides)


def random_weights(space_obs, space_act, model) -> list[np.ndarray]:
    return build_model(space_obs, space_act, model).get_weights()


def make_runner(config: ImpalaConfig, **kwargs) -> MultiAgentEnvRunner:
    runner = MultiAgentEnvRunner(config, worker_index=1, **kwargs)
    weights = {
        pid: (random_weights(*runner.spaces[pid], config.model), 0) for pid in runner.policies
    }
    runner.set_weights(weights, 1)
    return runner


# Config ----------------------------------------------------------------------------------------


def test_rllib_yaml_parses_with_warnings_for_torch_only_keys():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config, stop = ImpalaConfig.from_yaml(YAML)
    messages = " ".join(str(w.message) for w in caught if issubclass(w.category, ConfigWarning))
    assert "replay_ratio" in messages
    assert config.policies == ["p0", "p1", "p2", "p3"]
    assert stop == {"episode_reward_mean": 600, "timesteps_total": 200000}
    assert is_multi_agent(config)
    config.validate(require_env=True)
    mapping = ma_spec.resolve_mapping_fn(config.policy_mapping_fn)
    assert [mapping(i, None) for i in range(4)] == ["p0", "p1", "p2", "p3"]


def test_single_agent_config_keeps_the_single_agent_algorithm():
    from impala_tf.algorithm import Impala

    assert algorithm_class(ImpalaConfig(env="CartPole-v1")) is Impala
    assert not is_multi_agent(ImpalaConfig(env="CartPole-v1"))
    # A MultiAgentEnv without `policies` is multi-agent with one shared policy, as in RLlib.
    assert is_multi_agent(ImpalaConfig(env="impala_tf/MultiAgentCartPole"))


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
    fn = ma_spec.resolve_mapping_fn({"type": "impala_tf.multi_agent.spec.PolicyMappingFn"})
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


_COORDINATION_OBS = gym.spaces.Box(0.0, 1.0, (2,), np.float32)
_COORDINATION_ACT = gym.spaces.Discrete(2)


class Coordination(ParallelEnv):
    """A tiny PettingZoo ParallelEnv: two agents are rewarded for choosing the same action."""

    metadata = {"name": "coordination_v0"}

    def __init__(self, max_cycles: int = 7):
        self.possible_agents = ["a", "b"]
        self.agents = []
        self.max_cycles = max_cycles
        self._t = 0

    def observation_space(self, agent):
        return _COORDINATION_OBS

    def action_space(self, agent):
        return _COORDINATION_ACT

    def reset(self, seed=None, options=None):
        self.agents = list(self.possible_agents)
        self._t = 0
        return {a: np.zeros(2, np.float32) for a in self.agents}, {a: {} for a in self.agents}

    def step(self, actions):
        self._t += 1
        same = float(actions["a"] == actions["b"])
        end = self._t >= self.max_cycles
        obs = {a: np.array([same, self._t / self.max_cycles], np.float32) for a in self.agents}
        rewards = {a: same for a in self.agents}
        terms = {a: False for a in self.agents}
        truncs = {a: end for a in self.agents}
        infos = {a: {} for a in self.agents}
        if end:
            self.agents = []
        return obs, rewards, terms, truncs, infos


def _coordination_creator(env_config):
    return PettingZooParallelEnv(Coordination(**env_config))


def test_pettingzoo_adapter_runs_the_api_test_and_a_runner():
    from pettingzoo.test import parallel_api_test

    parallel_api_test(Coordination(), num_cycles=20)
    env = _coordination_creator({})
    obs, _ = env.reset(seed=0)
    assert set(obs) == {"a", "b"}
    for _ in range(6):
        obs, rewards, terms, truncs, _ = env.step({"a": 1, "b": 1})
        assert rewards == {"a": 1.0, "b": 1.0} and not truncs["__all__"]
    obs, rewards, terms, truncs, _ = env.step({"a": 0, "b": 1})
    assert truncs["__all__"] and not terms["__all__"] and truncs["a"] and "a" in obs

    config = ImpalaConfig(
        env=_coordination_creator,
        num_envs_per_env_runner=1,
        rollout_fragment_length=7,
        model={"fcnet_hiddens": [4]},
        seed=0,
    )
    config.multi_agent(policies=["shared"], policy_mapping_fn=lambda *a, **k: "shared")
    runner = make_runner(config)
    fragment = runner.sample()
    batch = fragment.batch.policy_batches["shared"]
    assert fragment.env_steps == 7 and fragment.batch.agent_steps() == 14
    assert batch["obs"].shape == (2, 7, 2)
    # Both agents are truncated at the episode's end: bootstrapped, not cut.
    assert batch["truncateds"][:, -1].all() and not batch["terminateds"].any()
    assert (batch["values_bootstrapped"][:, -1] != 0.0).all()
    assert fragment.episode_returns and fragment.policy_rewards["shared"]


# Batching ----------------------------------------------------------------------------------------


def test_runner_counts_env_steps_and_agent_steps_and_maps_agents_to_policies():
    config = two_agent_config()
    runner = make_runner(config)
    emitted = {"p0": 0, "p1": 0}
    sampled_agent_steps = 0
    for _ in range(8):
        fragment = runner.sample()
        assert fragment.env_steps == 10 * 2  # T x envs, however many agents acted.
        sampled_agent_steps += fragment.agent_steps_sampled
        for pid, batch in fragment.batch.policy_batches.items():
            assert batch["obs"].shape[1:] == (10, 4)
            assert batch["rewards"].shape == batch["policy_version"].shape
            terminated = batch["terminateds"]
            assert (batch["values_bootstrapped"][terminated] == 0.0).all()
            assert not np.isnan(batch["values_bootstrapped"]).any()
            emitted[pid] += batch.env_steps
        assert fragment.batch.agent_steps() == sum(
            b.env_steps for b in fragment.batch.policy_batches.values()
        )
    pending = sum(len(s) for s in runner._streams.values())
    assert sum(emitted.values()) + pending == sampled_agent_steps
    assert sampled_agent_steps > 8 * 20  # Two agents: more agent steps than env steps.
    assert emitted["p0"] > 0 and emitted["p1"] > 0
    # Agent 0 acts in env 0 and 1 with p0 only: its observations are the p0 batch's.
    assert all(
        pid == f"p{agent}" for j in range(2) for agent, pid in runner._agent_policy[j].items()
    )


def test_multi_agent_batch_counts_and_concat():
    def seqs(rows):
        return SampleBatch({"rewards": np.zeros((rows, 5), np.float32)})

    a = MultiAgentBatch({"p0": seqs(2), "p1": seqs(1)}, env_steps=10)
    b = MultiAgentBatch({"p0": seqs(1)}, env_steps=5)
    merged = MultiAgentBatch.concat([a, b])
    assert merged.env_steps() == 15 and merged.agent_steps() == 20
    assert len(merged.policy_batches["p0"]) == 3
    assert a.map(lambda x: x).agent_steps() == 15


# The algorithm ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two policies, only p0 trained, with replay; trained two iterations, stopped, saved."""
    config = two_agent_config(replay_proportion=1.0, replay_buffer_num_slots=4)
    config.multi_agent(policies_to_train=["p0"])
    algo = config.build()
    initial = {pid: algo.get_policy_weights(pid) for pid in ("p0", "p1")}
    try:
        results = [algo.train() for _ in range(2)]
    finally:
        algo.stop()  # No update after the save: the weights below are the checkpoint's.
    path = algo.save(str(tmp_path_factory.mktemp("ma") / "ckpt"))
    yield algo, initial, results, path


def test_per_policy_learner_stats_and_rewards(trained):
    algo, _, results, _ = trained
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
    from impala_tf.reporting import tensorboard_scalars

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
    assert set(algo._local_aggregators) == {"p0"}  # p1 is not trained: nothing to replay.
    replay = algo._local_aggregators["p0"]._replay
    assert len(replay) > 0
    obs_dim = algo.spaces["p0"][0].shape
    assert all(b["obs"].shape[2:] == obs_dim for b in replay._slots)


def test_resume_restores_every_policy_and_the_counters(trained):
    algo, _, results, path = trained
    assert os.path.isdir(os.path.join(path, "policies", "p1"))
    config = algo.config.copy()
    other = config.build()
    try:
        other.restore(path)
        for pid in ("p0", "p1"):
            for a, b in zip(algo.get_policy_weights(pid), other.get_policy_weights(pid)):
                np.testing.assert_array_equal(a, b)
        assert other.iteration == 2
        result = other.train()
        assert result["training_iteration"] == 3
        assert result["num_env_steps_sampled"] > results[-1]["num_env_steps_sampled"]
    finally:
        other.stop()


# The binary ------------------------------------------------------------------------------------


def _train(*args):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": REPO}
    return subprocess.run(
        [sys.executable, "-m", "impala_tf.bin.train", *map(str, args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_binary_on_rllib_yaml_two_iterations_then_resume(tmp_path):
    common = [
        f"--config={YAML}",
        f"--logdir={tmp_path}",
        "--set=num_workers=1",
        "--set=num_envs_per_worker=2",
        "--set=min_time_s_per_iteration=1",
        "--seed=0",
    ]
    run = _train(*common, "--stop_iters=2")
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "result.json").read_text().splitlines()]
    assert [r["training_iteration"] for r in lines] == [1, 2]
    assert set(lines[-1]["policy_reward_mean"]) == {"p0", "p1", "p2", "p3"}
    assert "p3" in lines[-1]["info"]["learner"]
    run = _train(*common, "--stop_iters=3")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "resuming from" in run.stdout
    lines = [json.loads(x) for x in (tmp_path / "result.json").read_text().splitlines()]
    assert [r["training_iteration"] for r in lines] == [1, 2, 3]
    assert lines[2]["num_env_steps_sampled"] > lines[1]["num_env_steps_sampled"]


def test_evaluate_and_export_per_policy(trained):
    from impala_tf import checkpoints
    from impala_tf.multi_agent import evaluation

    algo, _, _, path = trained
    assert evaluation.is_multi_agent_checkpoint(path)
    with pytest.raises(ValueError, match=r"\['p0', 'p1'\]"):
        evaluation.policy_checkpoint_dir(path, "p7")
    # Export reads one policy's checkpoint: its weights, spaces and filter.
    _, policy = checkpoints.load_policy(evaluation.policy_checkpoint_dir(path, "p1"))
    for a, b in zip(policy.model.get_weights(), algo.get_policy_weights("p1")):
        np.testing.assert_array_equal(a, b)
    config = checkpoints.load_config(path)
    config.env_runners(num_envs_per_env_runner=1)
    _, runner = evaluation.load_multi_agent_runner(path, explore=False, config=config)
    try:
        for pid in ("p0", "p1"):
            for a, b in zip(runner.policies[pid].get_weights(), algo.get_policy_weights(pid)):
                np.testing.assert_array_equal(a, b)
        summed = evaluation.run_multi_agent_episodes(runner, 2)
        runner.reset(0)
        own = evaluation.run_multi_agent_episodes(runner, 2, policy_id="p0")
    finally:
        runner.close()
    assert len(summed) == len(own) == 2
    # CartPole pays 1 per step: every episode, summed or p0's agent alone, earns something.
    assert all(total > 0 for total, _ in summed) and all(r > 0 for r, _ in own)


def test_checkpoint_config_stores_a_module_level_mapping_fn_as_its_import_path():
    from impala_tf.multi_agent.algorithm import _storable_config

    config = two_agent_config(policy_mapping_fn=_module_level_mapping)
    stored = _storable_config(config)
    assert stored.policy_mapping_fn == f"{__name__}:_module_level_mapping"
    assert ma_spec.resolve_mapping_fn(stored.policy_mapping_fn) is _module_level_mapping
    instance = _storable_config(two_agent_config(policy_mapping_fn=ma_spec.PolicyMappingFn()))
    assert instance.policy_mapping_fn == "impala_tf.multi_agent.spec:PolicyMappingFn"
    lam = two_agent_config(policy_mapping_fn=lambda agent_id, *a, **k: "p0")
    assert _storable_config(lam).policy_mapping_fn is lam.policy_mapping_fn
