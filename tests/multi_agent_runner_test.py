"""`MultiAgentEnvRunner`: the one `Fragment`, per-agent recurrent state, exact snapshots,
central inference, seeding, turn-based envs and rendering of multi-agent envs.

This module imports no TensorFlow at the top (models are built inside the tests), so that a
subprocess can import its fake inference connection and check that a central-inference runner
never imports TensorFlow.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

from impala_tf.config import ImpalaConfig
from impala_tf.config.policies import PolicySpec, policy_config
from impala_tf.driver.specs import runner_spec
from impala_tf.multi_agent.env import ALL, MultiAgentCartPole, MultiAgentEnv, PettingZooParallelEnv
from impala_tf.rollout.fragment import Fragment
from impala_tf.rollout.multi_agent_runner import MultiAgentEnvRunner
from tests.support import envs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T = 10
LSTM = {"use_lstm": True, "lstm_cell_size": 8, "max_seq_len": 4, "fcnet_hiddens": [8]}
C = 3  # ceil(T / LSTM["max_seq_len"])


def two_agent_config(**overrides: Any) -> ImpalaConfig:
    """MultiAgentCartPole with two agents, agent i acting with policy "pi"."""
    config = ImpalaConfig(
        env="impala_tf/MultiAgentCartPole",
        env_config={"num_agents": 2},
        num_env_runners=1,
        num_envs_per_env_runner=2,
        rollout_fragment_length=T,
        train_batch_size=40,
        model={"fcnet_hiddens": [8]},
        seed=3,
    ).multi_agent(
        policies=["p0", "p1"], policy_mapping_fn="impala_tf.config.policies.PolicyMappingFn"
    )
    return config.update_from_dict(overrides)


def mixed_config(**overrides: Any) -> ImpalaConfig:
    """Two agents: agent 0 acts with an LSTM policy ("p0"), agent 1 with an MLP ("p1")."""
    config = two_agent_config(**overrides)
    return config.multi_agent(policies={"p0": PolicySpec(config={"model": LSTM}), "p1": None})


def initial_weights(config: ImpalaConfig, version: int = 0) -> dict[str, tuple[list, int]]:
    """Freshly initialised weights of every policy of `config`, at `version`."""
    from impala_tf.driver.specs import probe_spaces
    from impala_tf.models import build_model

    spaces = probe_spaces(config).policies
    return {
        pid: (build_model(*spaces[pid], policy_config(config, pid).model).get_weights(), version)
        for pid in sorted(spaces)
    }


def make_runner(config: ImpalaConfig, weights=None, **kwargs: Any) -> MultiAgentEnvRunner:
    runner = MultiAgentEnvRunner(runner_spec(config), **kwargs)
    runner.set_weights(weights or initial_weights(config))
    return runner


def assert_same_fragments(a: Fragment, b: Fragment) -> None:
    assert (a.env_steps, a.agent_steps, a.policy_versions) == (
        b.env_steps,
        b.agent_steps,
        b.policy_versions,
    )
    assert a.episodes == b.episodes
    assert list(a.batches) == list(b.batches)
    for pid, batch in a.batches.items():
        assert list(batch) == list(b.batches[pid])
        for name, column in batch.items():
            np.testing.assert_array_equal(column, b.batches[pid][name], err_msg=f"{pid} {name}")
    if a.filter_deltas is None:
        assert b.filter_deltas is None
    else:
        np.testing.assert_equal(
            {p: f.get_state() for p, f in a.filter_deltas.items()},
            {p: f.get_state() for p, f in b.filter_deltas.items()},
        )


def steps_since_episode_start(batches: list) -> np.ndarray:
    """For one stream's rows in order: per step, the steps its agent took before it in its
    episode (the stream starts with an episode)."""
    dones = np.concatenate([(b["terminateds"] | b["truncateds"]).reshape(-1) for b in batches])
    out, count = np.zeros(len(dones), np.int64), 0
    for t, done in enumerate(dones):
        out[t] = count
        count = 0 if done else count + 1
    return out


# The fragment ------------------------------------------------------------------------------------


def test_fragment_counts_env_and_agent_steps_and_bootstraps_within_each_agent_stream():
    runner = make_runner(two_agent_config())
    assert runner.policy_ids == ("p0", "p1")
    agent_steps = emitted = 0
    episodes = []
    for _ in range(8):
        fragment = runner.sample()
        assert isinstance(fragment, Fragment)
        assert fragment.env_steps == T * 2  # T x envs, however many agents acted.
        assert T * 2 <= fragment.agent_steps <= T * 2 * 2
        assert fragment.policy_versions == {"p0": 0, "p1": 0}
        assert fragment.actor_id == 0 and fragment.filter_deltas is None
        agent_steps += fragment.agent_steps
        episodes += fragment.episodes
        for batch in fragment.batches.values():
            assert batch["obs"].shape[1:] == (T, 4) and batch["actions"].shape[1:] == (T,)
            assert batch["policy_version"].dtype == np.int64
            assert not [k for k in batch if k.startswith("state_in")]
            vf, vb = batch["vf_preds"], batch["values_bootstrapped"]
            terminated, truncated = batch["terminateds"], batch["truncateds"]
            assert (vb[terminated] == 0.0).all() and not np.isnan(vb).any()
            # Each row is one agent's stream: V of its next observation is its next step's V.
            inside = ~(terminated | truncated)[:, :-1]
            np.testing.assert_array_equal(vb[:, :-1][inside], vf[:, 1:][inside])
            emitted += batch.env_steps
    # Steps wait in their stream until it holds T: at most T per (env, agent) are pending.
    assert 0 <= agent_steps - emitted <= 2 * 2 * T
    assert agent_steps > 8 * T * 2  # Two agents: more agent steps than env steps.
    assert episodes
    for episode in episodes:
        # CartPole pays 1 per step: an agent's return is its episode length, the episode lasts
        # until its last agent is done, and its return sums the agents'.
        assert sorted(episode.policy_returns) == ["p0", "p1"]
        returns = [episode.policy_returns[p][0] for p in ("p0", "p1")]
        assert episode.length == max(returns) and episode.ret == sum(returns)


def test_pettingzoo_env_with_one_shared_policy_bootstraps_truncated_agents():
    config = ImpalaConfig(
        env=envs.coordination,
        num_envs_per_env_runner=1,
        rollout_fragment_length=7,
        model={"fcnet_hiddens": [4]},
        seed=0,
    )
    config.multi_agent(policies=["shared"], policy_mapping_fn=lambda *a, **k: "shared")
    runner = make_runner(config)
    fragment = runner.sample()
    batch = fragment.batches["shared"]
    assert fragment.env_steps == 7 and fragment.agent_steps == 14
    assert batch["obs"].shape == (2, 7, 2)
    # Both agents are truncated at the episode's end: bootstrapped, not cut.
    assert batch["truncateds"][:, -1].all() and not batch["terminateds"].any()
    np.testing.assert_array_equal(batch["values_bootstrapped"][:, -1] != 0.0, True)
    (episode,) = fragment.episodes
    assert episode.length == 7 and len(episode.policy_returns["shared"]) == 2
    assert episode.ret == sum(episode.policy_returns["shared"]) == batch["rewards"].sum()


class TurnTaking(MultiAgentEnv):
    """Agents "a" and "b" take turns (a, b, a, b, a), five steps an episode. The agent that acts
    earns 1, the other 0.5 in the same step; both terminate at the end, or with
    `{"truncate": True}` the episode is truncated and only "a" gets a final observation."""

    def __init__(self, env_config=None):
        self.truncate = bool((env_config or {}).get("truncate"))
        self.possible_agents = ["a", "b"]
        space = gym.spaces.Box(0.0, 1.0, (1,), np.float32)
        self.observation_spaces = {a: space for a in self.possible_agents}
        self.action_spaces = {a: gym.spaces.Discrete(2) for a in self.possible_agents}
        self._set_common_spaces()
        self._t = 0

    def reset(self, *, seed=None, options=None):
        self._t = 0
        return {"a": np.zeros(1, np.float32)}, {}

    def step(self, action_dict):
        mover = "a" if self._t % 2 == 0 else "b"
        other = "b" if mover == "a" else "a"
        assert list(action_dict) == [mover]
        self._t += 1
        rewards = {mover: 1.0, other: 0.5}
        if self._t == 5 and self.truncate:
            final = {"a": np.ones(1, np.float32)}
            return final, rewards, {ALL: False}, {ALL: True}, {}
        if self._t == 5:
            return {}, rewards, {"a": True, "b": True, ALL: True}, {ALL: False}, {}
        obs = {other: np.array([self._t / 5], np.float32)}
        return obs, rewards, {ALL: False}, {ALL: False}, {}


def turn_taking_config(**env_config: Any) -> ImpalaConfig:
    config = ImpalaConfig(
        env=TurnTaking,
        env_config=env_config,
        num_envs_per_env_runner=1,
        rollout_fragment_length=3,
        model={"fcnet_hiddens": [4]},
        seed=0,
    )
    return config.multi_agent(
        policies=["pa", "pb"], policy_mapping_fn=lambda agent, *a, **k: f"p{agent}"
    )


def test_turn_based_env_credits_rewards_between_turns_and_closes_the_waiting_agent():
    runner = make_runner(turn_taking_config())
    batches: dict[str, list] = {"pa": [], "pb": []}
    episodes = []
    for _ in range(10):  # Six episodes.
        fragment = runner.sample()
        assert fragment.agent_steps == fragment.env_steps == 3  # One agent acts per step.
        episodes += fragment.episodes
        for pid, batch in fragment.batches.items():
            batches[pid].append(batch)
    # Each agent's steps reach its batch: none is left waiting for an observation it never gets.
    a = {k: np.concatenate([b[k] for b in batches["pa"]]) for k in batches["pa"][0]}
    b = {k: np.concatenate([b[k] for b in batches["pb"]]) for k in batches["pb"][0]}
    assert len(a["rewards"]) == 6 and len(b["rewards"]) == 4
    # "a" acts at t = 0, 2, 4: 1 + the 0.5 earned while "b" moved, and 1 at the end.
    np.testing.assert_array_equal(a["rewards"], np.tile([1.5, 1.5, 1.0], (6, 1)))
    np.testing.assert_array_equal(a["terminateds"], np.tile([False, False, True], (6, 1)))
    # "b" acts at t = 1, 3; its last step ends (terminated) when "a" ends the episode.
    np.testing.assert_array_equal(b["rewards"], 1.5)
    np.testing.assert_array_equal(b["terminateds"].reshape(-1), np.tile([False, True], 6))
    for stream in (a, b):
        vf, vb, term = stream["vf_preds"], stream["values_bootstrapped"], stream["terminateds"]
        assert (vb[term] == 0.0).all() and not stream["truncateds"].any()
        inside = ~term[:, :-1]
        np.testing.assert_array_equal(vb[:, :-1][inside], vf[:, 1:][inside])
    assert len(episodes) == 6
    assert all(e[:3] == (7.5, 5, {"pa": [4.0], "pb": [3.5]}) for e in episodes)


def test_turn_based_truncation_bootstraps_the_waiting_agent_from_its_last_value():
    runner = make_runner(turn_taking_config(truncate=True))
    fragments = [runner.sample() for _ in range(3)]  # Nine steps: "b" acts in 4.
    a = next(f.batches["pa"] for f in fragments if "pa" in f.batches)  # First T steps of each.
    b = next(f.batches["pb"] for f in fragments if "pb" in f.batches)
    assert [e[:3] for f in fragments for e in f.episodes] == [(7.5, 5, {"pa": [4.0], "pb": [3.5]})]
    np.testing.assert_array_equal(a["truncateds"][0], [False, False, True])
    assert not a["terminateds"].any() and not b["terminateds"].any()
    # "a" is bootstrapped from the final observation the env gave it, which it never acts on.
    assert a["values_bootstrapped"][0, -1] not in (0.0, a["vf_preds"][0, -1])
    # "b" got none: its last step (t = 3) bootstraps from V of the observation it acted on.
    np.testing.assert_array_equal(b["truncateds"][0], [False, True, False])
    assert b["values_bootstrapped"][0, 1] == b["vf_preds"][0, 1] != 0.0


# Recurrent policies ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mixed_weights():
    return initial_weights(mixed_config())


def test_recurrent_states_are_kept_per_agent_and_match_stepping_the_agent_alone(mixed_weights):
    from impala_tf.acting.tf_policy import ActorPolicy

    config = mixed_config(env_config={"num_agents": 1})  # Agent 0 alone, acting with p0.
    runner = make_runner(config, mixed_weights)
    fragments = [runner.sample() for _ in range(5)]
    reference = ActorPolicy(*runner.spaces["p0"], policy_config(config, "p0").model)
    reference.set_weights(mixed_weights["p0"][0])
    batches = [f.batches["p0"] for f in fragments]
    assert all(len(b) == 2 for b in batches)  # One row per env and T steps.
    for j in range(2):  # Agent 0 of env j: row j of each p0 batch.
        obs = np.concatenate([b["obs"][j] for b in batches])
        dones = np.concatenate([(b["terminateds"] | b["truncateds"])[j] for b in batches])
        assert dones.any()  # The state restarts inside the stream.
        state = reference.initial_state(1)
        starts, logits, values = [], [], []
        for t in range(len(obs)):
            if t % T % LSTM["max_seq_len"] == 0:
                starts.append(state)
            out_logits, out_values, state = reference.forward(obs[t : t + 1], state)
            logits.append(out_logits[0])
            values.append(out_values[0])
            if dones[t]:
                state = reference.initial_state(1)
        for i in range(2):  # LSTM: h and c.
            emitted = np.concatenate([b[f"state_in_{i}"][j] for b in batches])
            assert emitted.shape == (5 * C, 8)
            np.testing.assert_allclose(emitted, [s[i][0] for s in starts], atol=1e-5)
        batch_logits = np.concatenate([b["action_dist_inputs"][j] for b in batches])
        np.testing.assert_allclose(batch_logits, logits, atol=1e-5)
        batch_values = np.concatenate([b["vf_preds"][j] for b in batches])
        np.testing.assert_allclose(batch_values, values, atol=1e-5)


# Snapshots and seeds -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["mlp_filter", "lstm_and_mlp"])
def test_restored_snapshot_continues_exactly(kind, mixed_weights):
    if kind == "mlp_filter":
        config = two_agent_config(observation_filter="MeanStdFilter")
        weights = initial_weights(config)
    else:
        config, weights = mixed_config(), mixed_weights
    first, second = make_runner(config, weights), make_runner(config, weights)
    for _ in range(3):
        first.sample()
    snapshot = pickle.loads(pickle.dumps(first.get_state()))  # Plain, picklable data.
    assert snapshot["envs"] is not None and snapshot["envs_error"] is None
    assert sorted(snapshot["weights"]) == sorted(snapshot["obs_filters"]) == ["p0", "p1"]
    expected = [first.sample() for _ in range(4)]
    second.sample()  # Elsewhere: the snapshot replaces it all.
    second.set_state(snapshot)
    for want in expected:
        assert_same_fragments(second.sample(), want)
    if kind == "mlp_filter":
        assert expected[0].filter_deltas["p0"].buffer.n > 0


class _Unpicklable(MultiAgentCartPole):
    def __reduce__(self):
        raise TypeError("this env holds a simulator handle")


def test_unpicklable_envs_are_reported_and_the_seed_starts_new_episodes():
    config = two_agent_config(env=_Unpicklable, env_config={"num_agents": 2})
    weights = initial_weights(config)
    runner = make_runner(config, weights)
    runner.sample()
    state = runner.get_state()
    assert state["envs"] is None and "simulator handle" in state["envs_error"]
    fresh = make_runner(config, weights)
    del state["policy_rngs"]  # Else the samplers would continue from the snapshot's.
    runner.set_state({**state, "seed": 3})
    assert_same_fragments(runner.sample(), fresh.sample())


def test_set_state_reads_the_earlier_multi_agent_runners_snapshot():
    config = two_agent_config(observation_filter="MeanStdFilter")
    source = make_runner(config)
    source.sample()
    legacy = {  # What MultiAgentEnvRunner.get_state() wrote before the one runtime.
        "weights": {pid: (w, 9) for pid, w in source.get_weights().items()},
        "policy_version": 9,
        "obs_filter": {pid: f.get_state() for pid, f in source.filters.items()},
        "envs": None,
        "envs_error": "multi-agent runners do not snapshot their envs",
    }
    target = MultiAgentEnvRunner(runner_spec(config))
    target.set_state(legacy)
    assert target.versions == {"p0": 9, "p1": 9}
    np.testing.assert_equal(target.get_weights(), source.get_weights())
    np.testing.assert_equal(target.get_state()["obs_filters"], legacy["obs_filter"])
    assert target.filters["p0"].rs.n > 0


def test_same_seed_same_fragments_and_reset_reseeds():
    config = two_agent_config()
    weights = initial_weights(config)
    a, b = make_runner(config, weights), make_runner(config, weights)
    first = [a.sample() for _ in range(3)]
    for want in first:
        assert_same_fragments(b.sample(), want)
    a.sample()
    a.reset(3)
    for want in first:
        assert_same_fragments(a.sample(), want)
    other = make_runner(two_agent_config(seed=4), weights).sample()
    assert not np.array_equal(other.batches["p0"]["obs"][0], first[0].batches["p0"]["obs"][0])


def test_set_weights_takes_a_subset_and_refuses_unknown_policies():
    config = two_agent_config()
    runner = make_runner(config)
    new = initial_weights(config, version=4)
    runner.set_weights({"p1": new["p1"]})
    assert runner.versions == {"p0": 0, "p1": 4}
    for got, want in zip(runner.get_weights()["p1"], new["p1"][0]):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="p7"):
        runner.set_weights({"p7": new["p1"]})
    fragment = runner.sample()
    assert fragment.policy_versions == {"p0": 0, "p1": 4}
    assert (fragment.batches["p1"]["policy_version"] == 4).all()
    assert (fragment.batches["p0"]["policy_version"] == 0).all()


# Central inference -------------------------------------------------------------------------------


class FakeInferenceConnection:
    """Answers `RemotePolicy` requests as the inference server does, without a model: uniform
    logits over two actions, V(x) = x[0], the recurrent state plus one, version 7."""

    def __init__(self, policy_ids: tuple[str, ...]):
        self.policy_ids = policy_ids
        self.requests: list[str] = []
        self._reply = None

    def send(self, message):
        policy_id, obs, state = message
        if policy_id not in self.policy_ids:
            self._reply = ("error", f"no policy {policy_id!r}")
            return
        self.requests.append(policy_id)
        values = obs[:, 0].astype(np.float32)
        logits = np.zeros((len(obs), 2), np.float32)
        self._reply = ("ok", logits, values, tuple(s + 1.0 for s in state), 7)

    def recv(self):
        assert self._reply is not None, "recv before send: the real connection would hang"
        reply, self._reply = self._reply, None
        return reply


def sample_with_fake_server(fragments: int = 4) -> list[Fragment]:
    """Samples through `FakeInferenceConnection` with one env, p0 recurrent (a state of 3)."""
    config = two_agent_config(num_envs_per_env_runner=1, model={"max_seq_len": 4})
    conn = FakeInferenceConnection(("p0", "p1"))
    remote = (conn, {"p0": [(3,)], "p1": []})
    runner = MultiAgentEnvRunner(runner_spec(config), remote=remote)
    runner.set_weights({"p0": (None, 6), "p1": (None, 6)})
    out = [runner.sample() for _ in range(fragments)]
    assert set(conn.requests) == {"p0", "p1"}
    return out


def test_central_inference_acts_through_one_connection_with_per_agent_state():
    fragments = sample_with_fake_server()
    # The server's version (newer than the 6 loaded) for the policies that acted.
    assert fragments[0].policy_versions == {"p0": 7, "p1": 7}
    for fragment in fragments:
        assert set(fragment.policy_versions.values()) <= {6, 7}
        for batch in fragment.batches.values():
            np.testing.assert_array_equal(batch["vf_preds"], batch["obs"][..., 0])
            assert (batch["policy_version"] == 7).all()
    assert "state_in_0" not in fragments[0].batches["p1"]
    p0 = [f.batches["p0"] for f in fragments if "p0" in f.batches]
    assert len(p0) >= 2 and all(len(b) == 1 for b in p0)  # One env: one p0 stream.
    # The fake server adds one per step: the state at each chunk start counts the agent's steps
    # in its episode (zeros again after the episode ended).
    counts = steps_since_episode_start(p0)
    starts = np.concatenate([b["state_in_0"][0] for b in p0])
    assert starts.shape == (len(p0) * C, 3)
    chunk_starts = [r * T + c * 4 for r in range(len(p0)) for c in range(C)]
    assert counts[chunk_starts].max() > 0 and (counts[chunk_starts][1:] == 0).any()
    np.testing.assert_array_equal(starts, np.repeat(counts[chunk_starts][:, None], 3, axis=1))


def run_without_tensorflow() -> None:
    """Samples through the fake server, then fails if TensorFlow was imported (subprocess)."""
    sample_with_fake_server(fragments=2)
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("tensorflow", "keras"))
    assert not loaded, f"a central-inference runner imported {loaded[:5]}"
    print("no tensorflow")


def test_central_inference_runner_never_imports_tensorflow():
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "import tests.multi_agent_runner_test as m; m.run_without_tensorflow()",
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO, "TF_CPP_MIN_LOG_LEVEL": "2"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and "no tensorflow" in run.stdout, run.stderr[-3000:]


def test_central_and_local_inference_take_the_same_actions(mixed_weights):
    from impala_tf.acting.inference import InferenceServer
    from impala_tf.driver.specs import probe_spaces

    config = mixed_config()
    spaces = probe_spaces(config).policies
    server = InferenceServer(
        {pid: (*spaces[pid], policy_config(config, pid).model) for pid in spaces}
    )
    try:
        server.set_weights({pid: (w, 5) for pid, (w, _) in mixed_weights.items()})
        local = make_runner(config, {pid: (w, 5) for pid, (w, _) in mixed_weights.items()})
        remote = MultiAgentEnvRunner(
            runner_spec(config), remote=(server.attach(0), server.state_shapes)
        )
        remote.set_weights({pid: (None, 5) for pid in mixed_weights})
        for _ in range(3):
            a, b = local.sample(), remote.sample()
            assert list(a.batches) == list(b.batches) and a.episodes == b.episodes
            for pid, batch in a.batches.items():
                assert sorted(batch) == sorted(b.batches[pid])
                for name in ("obs", "actions", "terminateds", "truncateds", "policy_version"):
                    np.testing.assert_array_equal(batch[name], b.batches[pid][name])
                for name in batch:
                    np.testing.assert_allclose(
                        batch[name], b.batches[pid][name], rtol=1e-4, atol=1e-5, err_msg=name
                    )
    finally:
        server.stop()


# Rendering ---------------------------------------------------------------------------------------


def test_multi_agent_cartpole_renders_the_agents_side_by_side_through_a_wrapper():
    env = gym.Wrapper(MultiAgentCartPole({"num_agents": 2, "render_mode": "rgb_array"}))
    assert env.render_mode == "rgb_array" and env.metadata["render_fps"] == 50
    env.reset(seed=0)
    frame = env.render()
    assert frame.dtype == np.uint8 and frame.shape == (400, 2 * 600, 3)
    carts = env.unwrapped.envs
    np.testing.assert_array_equal(frame[:, :600], carts[0].render())
    env.step({0: 0, 1: 1})
    moved = env.render()
    assert moved.shape == frame.shape and not np.array_equal(moved, frame)
    np.testing.assert_array_equal(moved[:, 600:], carts[1].render())
    env.close()
    made = gym.make("impala_tf/MultiAgentCartPole", num_agents=3, render_mode="rgb_array")
    made.reset(seed=1)
    assert made.render().shape == (400, 3 * 600, 3)
    made.close()
    assert MultiAgentCartPole({"num_agents": 2}).render() is None
    with pytest.raises(ValueError, match="render_mode"):
        MultiAgentCartPole({"num_agents": 2, "render_mode": "ascii"})


_FRAMES: list[np.ndarray] = []


class _FrameRecorder(gym.Wrapper):
    """Keeps a frame after every reset and step in `_FRAMES` (an env creator's wrapper)."""

    def reset(self, **kwargs):
        out = self.env.reset(**kwargs)
        _FRAMES.append(self.env.render())
        return out

    def step(self, action):
        out = self.env.step(action)
        _FRAMES.append(self.env.render())
        return out


def test_a_runner_steps_a_wrapped_multi_agent_env_and_pettingzoo_renders():
    def recorded(env_config):
        return _FrameRecorder(MultiAgentCartPole({**env_config, "render_mode": "rgb_array"}))

    _FRAMES.clear()
    config = two_agent_config(env=recorded, num_envs_per_env_runner=1)
    weights = initial_weights(two_agent_config())  # The same spaces, unwrapped.
    runner = make_runner(config, weights, worker_index=0, explore=False, update_filter=False)
    (episode,) = runner.run_episodes(1)
    # One frame for the reset, one per step of the episode, one for the next reset.
    assert len(_FRAMES) >= episode.length + 2
    assert all(f.shape == (400, 1200, 3) for f in _FRAMES)
    runner.close()
    env = PettingZooParallelEnv(envs.Coordination(render_mode="rgb_array"))
    env.reset(seed=0)
    env.step({"a": 0, "b": 0})
    assert env.render_mode == "rgb_array" and "rgb_array" in env.metadata["render_modes"]
    np.testing.assert_array_equal(env.render(), np.full((2, 3, 3), 1, np.uint8))
