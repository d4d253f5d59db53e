"""What is Ray's alone in the Ray backend (`actor_backend="ray"`), on a local Ray.

The config keys of the backend; actors and aggregation workers placed with their CPUs and custom
resources, GPUs hidden, nothing left after `stop`; a weight broadcast put into the object store
once; `impala-train` joining a Ray that uses token authentication. One Ray session serves the
module (started in a temporary HOME with a token of our own: Ray writes ~/.ray/auth_token when
it starts). The runtime scenarios (iterations, restarts, hangs, aggregation workers, save and
restore, evaluation) run on Ray in `tests/runtime_conformance_test.py`, central inference over
TCP in `tests/inference_test.py`, a lost node in `tests/ray_cluster_test.py`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from impala_tf.config import ImpalaConfig
from impala_tf.driver.counters import Counters
from impala_tf.driver.plan import make_plan
from impala_tf.driver.sampling import EnvRunnerGroup
from impala_tf.driver.specs import sampling_spec
from impala_tf.models import build_model
from impala_tf.workers import ray_session
from tests.support import ray as raylib
from tests.support.configs import small_config
from tests.support.processes import alive, wait_until

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

#: The module's Ray: 8 CPUs and 4 units of a custom resource that the actors may ask for.
CPUS, ACCEL = 8.0, 4.0


@pytest.fixture(scope="module")
def ray_local(tmp_path_factory):
    """One Ray for the module (the runtime reuses an initialised Ray)."""
    home = str(tmp_path_factory.mktemp("home"))
    with raylib.local_ray(home, num_cpus=int(CPUS), resources={"accel": ACCEL}) as ray:
        yield ray


def _objects_in_store() -> int:
    import ray
    from ray._private.internal_api import memory_summary

    # This session's address: another xdist worker may run a Ray of its own beside it.
    text = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
    return int(text.split(" objects")[0].rsplit(",", 1)[1])


def _alive_actors() -> list[str]:
    from ray._private import state

    return [i for i, actor in state.actors().items() if actor["State"] != "DEAD"]


def _free(ray, resource: str, expected: float) -> bool:
    return ray.available_resources().get(resource, 0.0) == pytest.approx(expected)


def _environ(pid: int) -> dict[bytes, bytes]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)


def test_actors_take_their_cpus_and_custom_resources_hide_gpus_and_stop_leaves_nothing(
    ray_local,
):
    config = small_config(
        backend="ray",
        num_cpus_per_env_runner=0.5,
        custom_resources_per_env_runner={"accel": 1},
        num_aggregation_workers=1,
    )
    assert wait_until(lambda: not _alive_actors(), 30), _alive_actors()
    algo = config.build()
    try:
        actor_pids = list(algo.actors.pids().values())
        aggregation_pids = list(algo.aggregation.pids().values())
        assert len(set(actor_pids)) == 2 and len(aggregation_pids) == 1
        assert os.getpid() not in actor_pids + aggregation_pids
        here = ray_local.get_runtime_context().get_node_id()
        assert set(algo.actors.workers.node_ids().values()) == {here}
        # Each actor holds half a CPU and one "accel"; the aggregation worker one CPU.
        assert wait_until(lambda: _free(ray_local, "CPU", CPUS - 2 * 0.5 - 1), 30)
        assert wait_until(lambda: _free(ray_local, "accel", ACCEL - 2), 30)
        for pid in actor_pids + aggregation_pids:
            env = _environ(pid)
            assert env[b"CUDA_VISIBLE_DEVICES"] == b"" and env[b"OMP_NUM_THREADS"] == b"1"
        assert len(_alive_actors()) == 3
        result = algo.train()
        assert result["num_env_steps_trained"] > 0
    finally:
        algo.stop()
    # No actor, actor process or object of ours is left, every resource is free again, and
    # Ray itself keeps running (not ours to shut down).
    assert wait_until(lambda: not _alive_actors(), 30), _alive_actors()
    assert wait_until(lambda: not any(alive(p) for p in actor_pids + aggregation_pids), 30)
    assert wait_until(lambda: _objects_in_store() == 0, 30), _objects_in_store()
    assert wait_until(lambda: _free(ray_local, "CPU", CPUS) and _free(ray_local, "accel", ACCEL))
    assert ray_local.is_initialized()


def test_a_restarting_actor_does_not_stall_the_others(ray_local):
    """Ray restarts a killed actor while the driver goes on: `restart` returns at once, the
    other actor's fragments keep training, and the calls held for the restarting actor go out
    once Ray's restart answers (no driver wait, which was up to 60 s)."""
    algo = small_config(backend="ray", num_cpus_per_env_runner=0.5).build()
    seen: list[int] = []
    fetch = algo.actors.fetch

    def recording_fetch(timeout_s):
        fragments, failures = fetch(timeout_s)
        seen.extend(f.actor_id for f in fragments)
        return fragments, failures

    algo.actors.fetch = recording_fetch
    try:
        algo.train()
        impl = algo.actors.workers._impl
        # Ray's restart of a 2-process actor can finish within one driver step, before actor 1
        # has a fragment ready: hold the restart's completion (its probe) until the test lets
        # it go, so "the others go on meanwhile" is checked on every machine.
        check_restarts = impl._check_restarts
        held = [True]
        impl._check_restarts = lambda: None if held[0] else check_restarts()
        old_pid = algo.actors.pids()[0]
        os.kill(old_pid, signal.SIGKILL)
        while impl._actors[0].restarting is None:  # Until the driver noticed and restarted it.
            algo.training_step()
            assert algo.metrics.counters.num_env_runner_restarts <= 1
        # Restarting: the driver's steps go on, and actor 1's fragments arrive and train.
        trained = algo.metrics.counters.num_env_steps_trained
        del seen[:]

        def other_actor_trained():
            algo.training_step()
            assert impl._actors[0].restarting is not None
            return 1 in seen and algo.metrics.counters.num_env_steps_trained > trained

        assert wait_until(other_actor_trained, 60), (
            "no fragment from the other actor trained while actor 0 restarted"
        )
        assert 0 not in seen
        held[0] = False
        del seen[:]
        assert wait_until(lambda: algo.training_step() or 0 in seen, 60)
        assert algo.actors.pids()[0] != old_pid
        assert algo.metrics.counters.num_env_runner_restarts == 1
    finally:
        algo.stop()


def test_a_broadcast_puts_the_weights_into_the_object_store_once(ray_local, monkeypatch):
    config = small_config(backend="ray", num_env_runners=3, num_cpus_per_env_runner=0.5)
    plan = make_plan(config)
    obs_space, act_space = plan.spaces.policies["default_policy"]
    weights = {"default_policy": (build_model(obs_space, act_space, config.model).get_weights(), 7)}
    actors = EnvRunnerGroup(sampling_spec(config, plan), plan, Counters())
    try:
        puts = []
        real_put = ray_local.put
        monkeypatch.setattr(ray_local, "put", lambda value: puts.append(value) or real_put(value))
        actors.broadcast(weights, [0, 1, 2])
        assert len(puts) == 1 and puts[0] is weights  # One object for the three actors.
        actors.request_idle()
        fragments, deadline = [], time.monotonic() + 120
        while len(fragments) < 3 and time.monotonic() < deadline:
            got, failures = actors.fetch(timeout_s=1.0)
            assert not failures, failures
            fragments += got
        assert sorted(f.actor_id for f in fragments) == [0, 1, 2]
        assert all(f.policy_versions == {"default_policy": 7} for f in fragments)
    finally:
        actors.stop()


def _driver(
    tmp_path, address: str, token: bool, *args: str, python_flags: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """impala-train in a fresh process joining `address`, with or without the token."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        HOME=str(tmp_path),  # No ~/.ray/auth_token there.
        PYTHONPATH=REPO,
        TF_CPP_MIN_LOG_LEVEL="2",
        RAY_NUM_REDIS_GET_RETRIES="3",  # A refused driver gives up after ~3 s, not 20.
        RAY_USAGE_STATS_ENABLED="0",
    )
    if token:  # RAY_AUTH_MODE is left unset: the backend turns token mode on when it finds one.
        env["RAY_AUTH_TOKEN"] = raylib.TOKEN
    return subprocess.run(
        [
            sys.executable,
            *python_flags,
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
    # `-X importtime` lists every module the process imported, on stderr.
    refused = _driver(tmp_path / "a", address, token=False, python_flags=("-X", "importtime"))
    assert refused.returncode != 0
    assert "impala-train: error: RayAuthenticationError" in refused.stderr, refused.stderr[-3000:]
    assert "refused this driver: token authentication is on" in refused.stderr
    # Refused before TensorFlow's import (seconds): Ray is joined first.
    assert re.search(r"\|\s+ray$", refused.stderr, re.MULTILINE)  # The list is there.
    assert not re.search(r"\|\s+tensorflow$", refused.stderr, re.MULTILINE)
    joined = _driver(tmp_path / "b", address, token=True)
    assert joined.returncode == 0, joined.stderr[-3000:]
    assert (tmp_path / "b" / "run" / "result.json").exists()
