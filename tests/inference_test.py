"""Central inference (`impala_tf.inference`): the driver's server acts for the actors."""

from __future__ import annotations

import os
import signal
import time

import gymnasium as gym
import numpy as np
import pytest

from impala_tf.actors.env_runner import EnvRunner
from impala_tf.actors.local import LocalActorPool, _preload, central_inference
from impala_tf.config import ImpalaConfig
from impala_tf.inference import InferenceError, InferenceServer
from impala_tf.policy import ActorPolicy
from tests import envs

IMAGE = gym.spaces.Box(0, 255, (10, 10, 4), np.uint8)
ACTIONS = gym.spaces.Discrete(3)
CNN = {"vf_share_layers": True}
LSTM = {"use_lstm": True, "lstm_cell_size": 8, "max_seq_len": 5, "fcnet_hiddens": [16]}


def _image_config(**overrides) -> ImpalaConfig:
    config = (
        ImpalaConfig()
        .environment(envs.stacked_frames, env_config={"size": 10, "k": 4, "episode_len": 6})
        .env_runners(num_env_runners=2, num_envs_per_env_runner=3, rollout_fragment_length=8)
        .training(train_batch_size=24, model=CNN)
        .debugging(seed=3)
    )
    return config.update_from_dict(overrides)


def _remote_runner(server: InferenceServer, config: ImpalaConfig, worker_index: int = 1):
    conn = server.attach(worker_index - 1)
    return EnvRunner(config, worker_index, remote=(conn, server.state_shapes))


def test_auto_is_per_actor_unless_tensorflow_actors_would_not_fit():
    cartpole = gym.make("CartPole-v1")
    mlp = ImpalaConfig(env="CartPole-v1")
    space, actions = cartpole.observation_space, cartpole.action_space
    plenty, scarce = {"MemAvailable": 64 * 2**30}, {"MemAvailable": 2**30}
    assert not central_inference(mlp, space, actions, plenty)
    assert not central_inference(mlp, space, actions, scarce)  # numpy actors are light anyway
    assert central_inference(mlp.copy().update_from_dict({"inference": "central"}), space, actions)
    # CNN: per-actor inference (faster on an idle machine) while TensorFlow actors fit.
    assert not central_inference(_image_config(), IMAGE, ACTIONS, plenty)
    assert central_inference(_image_config(), IMAGE, ACTIONS, scarce)
    assert not central_inference(_image_config(inference="actor"), IMAGE, ACTIONS, scarce)
    assert central_inference(_image_config(inference="central"), IMAGE, ACTIONS, plenty)
    # Actors of a central pool never import TensorFlow; per-actor CNN inference needs it.
    assert _preload(_image_config(inference="central")) == ["impala_tf.actors.env_runner"]
    assert "impala_tf.policy" in _preload(_image_config(inference="actor"))
    with pytest.raises(ValueError, match="`inference` must be"):
        _image_config(inference="gpu").validate()


@pytest.mark.parametrize("model", [CNN, LSTM], ids=["cnn", "lstm"])
def test_central_and_per_actor_inference_take_the_same_actions(model):
    """Same weights, same seeds: the same fragment (actions, logits, values, state columns)."""
    config = _image_config(model=model)
    server = InferenceServer(IMAGE, ACTIONS, config.model)
    try:
        weights = ActorPolicy(IMAGE, ACTIONS, config.model, seed=7).get_weights()
        server.set_weights(weights, policy_version=5)
        remote = _remote_runner(server, config)
        local = EnvRunner(config, 1)
        local.set_weights(weights, policy_version=5)
        remote.set_weights(None, policy_version=5)
        for _ in range(2):
            a, b = local.sample(), remote.sample()
            np.testing.assert_array_equal(a.batch["actions"], b.batch["actions"])
            np.testing.assert_array_equal(a.batch["obs"], b.batch["obs"])
            for column in ("action_dist_inputs", "action_logp", "vf_preds", "values_bootstrapped"):
                np.testing.assert_allclose(a.batch[column], b.batch[column], rtol=1e-4, atol=1e-5)
            states = [k for k in a.batch if k.startswith("state_in")]
            assert len(states) == (2 if model is LSTM else 0)
            for k in states:
                np.testing.assert_allclose(a.batch[k], b.batch[k], rtol=1e-4, atol=1e-5)
            np.testing.assert_array_equal(b.batch["policy_version"], 5)
        assert server.stats()["num_requests"] > 0
    finally:
        server.stop()


def test_requests_of_several_actors_share_one_forward_pass():
    config = _image_config()
    server = InferenceServer(IMAGE, ACTIONS, config.model)
    try:
        server.set_weights(ActorPolicy(IMAGE, ACTIONS, config.model).get_weights(), 1)
        conns = [server.attach(i) for i in range(3)]
        obs = np.zeros((2, *IMAGE.shape), np.uint8)
        for conn in conns:  # All three wait before the server answers any.
            conn.send((obs, ()))
        replies = [conn.recv() for conn in conns]
        assert [r[0] for r in replies] == ["ok"] * 3
        assert all(r[1].shape == (2, 3) and r[4] == 1 for r in replies)
        stats = server.stats()
        assert stats["num_requests"] == 3 and stats["num_batches"] < 3  # Batched.
    finally:
        server.stop()


def test_a_request_the_server_cannot_serve_raises_in_the_actor():
    config = _image_config()
    server = InferenceServer(IMAGE, ACTIONS, config.model)
    try:
        runner = _remote_runner(server, config)
        with pytest.raises(InferenceError, match=r"observations of shape \(5, 5, 4\)"):
            runner.policy.step(np.zeros((1, 5, 5, 4), np.uint8))
        assert runner.policy.step(np.zeros((1, *IMAGE.shape), np.uint8)).actions.shape == (1,)
    finally:
        server.stop()
    with pytest.raises((EOFError, BrokenPipeError)):  # The server is gone: no wait forever.
        runner.policy.step(np.zeros((1, *IMAGE.shape), np.uint8))


def _fetch(pool, count, timeout_s=120.0):
    fragments, failures, deadline = [], [], time.time() + timeout_s
    while len(fragments) < count and time.time() < deadline:
        got, failed = pool.fetch_ready(timeout_s=1.0)
        fragments.extend(got)
        failures.extend(failed)
        if failures:
            break
    return fragments, failures


def _maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


@pytest.mark.slow
def test_a_central_pool_samples_versions_restarts_and_keeps_tensorflow_out_of_actors():
    config = _image_config(inference="central")
    weights = ActorPolicy(IMAGE, ACTIONS, config.model, seed=1).get_weights()
    pool = LocalActorPool(config, weights=weights, policy_version=2)
    try:
        server = pool.inference_server
        assert server is not None
        pool.request_samples([0, 1], count=1)
        fragments, failures = _fetch(pool, 2)
        assert not failures and len(fragments) == 2
        for f in fragments:
            assert f.batch["actions"].shape == (3, 8)
            np.testing.assert_array_equal(f.batch["policy_version"], 2)
        for pid in pool.pids():
            assert "libtensorflow" not in _maps(pid)  # Light actors: no TensorFlow loaded.
        # A broadcast loads the server once; the next fragment is labelled with its version
        # (its first step may still come from the older weights, computed one step ahead).
        pool.broadcast_weights(weights, 9, [0, 1])
        pool.request_samples([0], count=2)
        fragments, failures = _fetch(pool, 2)
        assert not failures
        assert fragments[-1].policy_version == 9
        assert set(np.unique(fragments[-1].batch["policy_version"])) == {9}
        # A killed actor is reported; its restart gets a fresh pipe to the server.
        os.kill(pool.pids()[0], signal.SIGKILL)
        fragments, failures = _fetch(pool, 1, timeout_s=30)
        assert failures
        failed = failures[0].actor_id
        pool.restart(failed, weights, 10)
        pool.request_samples([failed], count=1)
        fragments, failures = _fetch(pool, 1)
        assert not failures and fragments[0].actor_id == failed
        assert fragments[0].policy_version == 10
    finally:
        pool.stop()
    assert not pool.inference_server._thread.is_alive()


def test_ray_actors_run_the_policy_themselves():
    ray_config = _image_config(actor_backend="ray")
    assert not central_inference(ray_config, IMAGE, ACTIONS)  # "auto" on Ray: per actor.
    with pytest.raises(ValueError, match="inference='central'.*actor_backend='ray'"):
        _image_config(actor_backend="ray", inference="central").validate()


def test_multi_agent_actors_run_their_policies_themselves():
    config = ImpalaConfig(env="impala_tf/MultiAgentCartPole", policies=["p0", "p1"])
    assert not central_inference(config, IMAGE, ACTIONS)
    with pytest.raises(ValueError, match="inference='central'.*multi-agent"):
        config.copy().update_from_dict({"inference": "central"}).validate()
    with pytest.raises(ValueError, match="actor_backend='ray'.*multiagent"):
        config.copy().update_from_dict({"actor_backend": "ray"}).validate()
