"""The Ray backend (`actor_backend="ray"`) on a local Ray (2 CPUs, loopback only).

One Ray session serves the whole module (started in a temporary HOME with a token of our own:
Ray writes ~/.ray/auth_token when it starts). The runtime tests of the local pool that make
sense on Ray run here against `RayActorPool`: counters, an actor killed and restarted, stop.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from impala_tf.actors import ray_session
from impala_tf.config import ImpalaConfig
from tests import raylib
from tests.raylib import alive, small_config, wait_until

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Config (no Ray started) ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("actor_backend", "dask", "`actor_backend` must be one of"),
        ("ray_address", "localhost", "`ray_address` must be None"),
        ("ray_address", "10.0.0.1:99999", "`ray_address` must be None"),
        ("ray_address", 6379, "`ray_address` must be None"),
        ("num_cpus_per_env_runner", -1, "`num_cpus_per_env_runner` must be a number >= 0.0"),
        ("custom_resources_per_env_runner", {"node2": 0}, "`custom_resources_per_env_runner`"),
        ("custom_resources_per_env_runner", ["node2"], "`custom_resources_per_env_runner`"),
    ],
)
def test_bad_backend_values_name_the_key(key, value, message):
    config = ImpalaConfig(env="CartPole-v1", **{key: value})
    with pytest.raises(ValueError, match=message):
        config.validate()


def test_good_addresses_and_rllib_aliases():
    for address in (None, "auto", "127.0.0.1:6379", "head.example.com:6380", "[::1]:6379"):
        ImpalaConfig(env="CartPole-v1", actor_backend="ray", ray_address=address).validate()
    with pytest.warns(FutureWarning, match="num_cpus_per_env_runner"):
        config = ImpalaConfig.from_dict(
            {"num_cpus_per_worker": 0.5, "custom_resources_per_worker": {"a": 1}}
        )
    assert config.num_cpus_per_env_runner == 0.5
    assert config.custom_resources_per_env_runner == {"a": 1}


def test_ray_keys_with_local_actors_warn():
    config = ImpalaConfig(env="CartPole-v1", ray_address="auto")
    with pytest.warns(UserWarning, match="`ray_address` only apply with `actor_backend='ray'`"):
        config.validate()


def test_without_ray_the_ray_backend_fails_at_once_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError.
    config = ImpalaConfig(env="CartPole-v1", actor_backend="ray")
    with pytest.raises(ValueError, match=r"pip install -e '\.\[ray\]'"):
        config.validate()
    with pytest.raises(ImportError, match=r"pip install -e '\.\[ray\]'"):
        ray_session.require_ray()


# On a local Ray ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_local(tmp_path_factory):
    import ray

    home = tmp_path_factory.mktemp("home")
    with raylib.ray_environment(str(home)):
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            object_store_memory=100 * 2**20,
            logging_level="WARNING",
        )
        try:
            yield ray
        finally:
            ray.shutdown()


def _objects_in_store() -> int:
    import ray
    from ray._private.internal_api import memory_summary

    # This session's address: another xdist worker may run a Ray of its own beside it.
    text = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
    return int(text.split(" objects")[0].rsplit(",", 1)[1])


def test_iterations_counters_gpu_hidden_and_stop_leaves_nothing(ray_local):
    from impala_tf.actors.ray_pool import RayActorPool

    algo = small_config().build()
    try:
        assert isinstance(algo.pool, RayActorPool)
        pids = algo.pool.pids()
        assert len(pids) == 2 and os.getpid() not in pids
        with open(f"/proc/{pids[0]}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        assert env[b"CUDA_VISIBLE_DEVICES"] == b"" and env[b"OMP_NUM_THREADS"] == b"1"
        ray_ids = algo.pool.actor_ids_in_ray()
        results = [algo.train() for _ in range(3)]
    finally:
        algo.stop()
    last = results[-1]
    assert [r["training_iteration"] for r in results] == [1, 2, 3]
    assert 0 < last["num_env_steps_trained"] <= last["num_samples_added_to_queue"]
    assert last["num_samples_added_to_queue"] <= last["num_env_steps_sampled"]
    assert last["num_weight_broadcasts"] > 0 and last["episodes_total"] > 0
    assert np.isfinite(last["episode_reward_mean"])
    # No actor, actor process or object of ours is left (Ray itself keeps running).
    assert all(raylib.actor_state(i) == "DEAD" for i in ray_ids)
    assert wait_until(lambda: not any(alive(p) for p in pids), 30)
    assert wait_until(lambda: _objects_in_store() == 0, 30), _objects_in_store()
    assert ray_local.is_initialized()  # Not ours to shut down.


def test_killed_actor_is_restarted_and_counted(ray_local):
    algo = small_config(min_time_s_per_iteration=1).build()
    try:
        algo.train()
        old = algo.pool.pids()
        os.kill(old[0], signal.SIGKILL)
        results = [algo.train() for _ in range(3)]
        assert results[-1]["num_env_runner_restarts"] >= 1
        assert results[-1]["num_env_runner_failures"] >= 1
        assert results[-1]["num_healthy_workers"] == 2
        assert results[-1]["num_env_steps_sampled"] > results[0]["num_env_steps_sampled"]
        new = algo.pool.pids()
        assert old[0] not in new and len(new) == 2
    finally:
        algo.stop()


def test_killed_actor_raises_without_restarts(ray_local):
    algo = small_config(restart_failed_env_runners=False).build()
    try:
        algo.train()
        os.kill(algo.pool.pids()[0], signal.SIGKILL)
        with pytest.raises(RuntimeError, match="Actor 0 failed"):
            for _ in range(20):
                algo.train()
    finally:
        algo.stop()


def test_weights_put_once_requests_bounded_and_cpus_per_actor(ray_local, monkeypatch):
    from impala_tf.actors.ray_pool import RayActorPool

    config = small_config(num_cpus_per_env_runner=0.5, max_requests_in_flight_per_env_runner=2)
    config.training(model={"fcnet_hiddens": [16], "vf_share_layers": True})
    pool = RayActorPool(config)
    try:
        pool.pids()  # Both actors are up.
        # Each asks for half a CPU: one of the two CPUs is left.
        assert ray_local.available_resources().get("CPU", 0) == pytest.approx(1.0)
        puts = []
        real_put = ray_local.put
        monkeypatch.setattr(ray_local, "put", lambda value: puts.append(1) or real_put(value))
        shapes = [(4, 16), (16,), (16, 2), (2,), (16, 1), (1,)]  # Hidden, logits, value.
        weights = [np.full(shape, 0.1, np.float32) for shape in shapes]
        pool.broadcast_weights(weights, 7, [0, 1])
        assert len(puts) == 1
        pool.request_samples([0, 1], 2)
        with pytest.raises(RuntimeError, match="max_requests_in_flight_per_env_runner=2"):
            pool.request_samples([0], 1)
        fragments = []
        while len(fragments) < 4:
            got, failures = pool.fetch_ready(5.0)
            assert not failures
            fragments += got
        assert {f.actor_id for f in fragments} == {0, 1}
        assert all(f.policy_version == 7 for f in fragments)
        # Copied out of the object store: writable arrays that own their memory.
        obs = fragments[0].batch["obs"]
        assert obs.flags.writeable and obs.base is None
    finally:
        pool.stop()


def test_aggregation_workers_on_ray_with_a_killed_one(ray_local):
    from impala_tf.actors.ray_aggregation import RayAggregatorPool

    config = small_config(
        num_cpus_per_env_runner=0.5,
        num_aggregation_workers=1,
        compress_observations=True,
        replay_proportion=0.5,
        replay_buffer_num_slots=8,
        min_time_s_per_iteration=1,
    )
    algo = config.build()
    try:
        assert isinstance(algo.aggregators, RayAggregatorPool)
        first = algo.train()
        assert first["num_env_steps_trained"] > 0
        os.kill(algo.aggregators.pids()[0], signal.SIGKILL)
        results = [algo.train() for _ in range(3)]
        ids = algo.aggregators.actor_ids_in_ray()
    finally:
        algo.stop()
    assert results[-1]["num_aggregation_worker_restarts"] >= 1
    assert results[-1]["num_env_steps_trained"] > first["num_env_steps_trained"]
    assert all(raylib.actor_state(i) == "DEAD" for i in ids)


def _driver(tmp_path, address: str, token: bool, *args: str) -> subprocess.CompletedProcess:
    """impala-train in a fresh process joining `address`, with or without the token."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        HOME=str(tmp_path),  # No ~/.ray/auth_token there.
        PYTHONPATH=REPO,
        TF_CPP_MIN_LOG_LEVEL="2",
        RAY_NUM_REDIS_GET_RETRIES="3",  # A refused driver gives up after ~3 s, not 20.
        RAY_USAGE_STATS_ENABLED="0",
    )
    if token:  # RAY_AUTH_MODE is left unset: the pool turns token mode on when it finds one.
        env["RAY_AUTH_TOKEN"] = raylib.TOKEN
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "impala_tf.bin.train",
            f"--logdir={tmp_path / 'run'}",
            "--stop_iters=2",
            "--seed=0",
            "--set=actor_backend=ray",
            f"--set=ray_address={address}",
            "--set=num_env_runners=1",
            "--set=num_envs_per_env_runner=4",
            "--set=rollout_fragment_length=10",
            "--set=train_batch_size=40",
            "--set=min_time_s_per_iteration=0.3",
            "--set=model.fcnet_hiddens=[16]",
            *args,
        ],  # fmt: skip
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.slow
def test_impala_train_joins_with_the_token_and_is_refused_without(ray_local, tmp_path):
    address = ray_local.get_runtime_context().gcs_address
    refused = _driver(tmp_path / "a", address, token=False)
    assert refused.returncode != 0
    assert "impala-train: error: RayAuthenticationError" in refused.stderr, refused.stderr[-3000:]
    assert "refused this driver: token authentication is on" in refused.stderr
    joined = _driver(tmp_path / "b", address, token=True)
    assert joined.returncode == 0, joined.stderr[-3000:]
    assert (tmp_path / "b" / "run" / "result.json").exists()


@pytest.mark.slow
def test_cartpole_learns_to_150_on_ray(ray_local):
    path = os.path.join(REPO, "configs", "cartpole-impala.yaml")
    config, _ = ImpalaConfig.from_yaml(path)
    config.debugging(seed=0).resources(actor_backend="ray")
    algo = config.build()
    best, result = 0.0, {}
    try:
        for _ in range(90):
            result = algo.train()
            best = max(best, result["episode_reward_mean"])
            if best >= 150:
                break
    finally:
        algo.stop()
    assert best >= 150, f"mean return only reached {best:.1f} in {result['timesteps_total']} steps"
