"""Central inference through the driver: the plan's choice, actors acting through the server.

`tests/inference_server_test.py` unit-tests the server itself (batching, versions, errors,
pipes and TCP); here the driver runs it: `RuntimePlan` decides where the actors act,
`EnvRunnerGroup` starts the actors (local processes or Ray actors) connected to its server, and
`Impala` trains single-agent and multi-agent configs with it. Fragments are [B, T] per policy
(B envs of an actor, T = `rollout_fragment_length`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import gymnasium as gym
import numpy as np
import pytest

from impala_tf.config import ImpalaConfig
from impala_tf.config.policies import policy_config
from impala_tf.data.sample_batch import decompress
from impala_tf.driver.counters import Counters
from impala_tf.driver.plan import RuntimePlan, make_plan
from impala_tf.driver.sampling import EnvRunnerGroup
from impala_tf.driver.specs import runner_spec, sampling_spec
from impala_tf.models import build_model
from impala_tf.rollout import make_env_runner
from impala_tf.rollout.fragment import Fragment
from tests.support import envs
from tests.support.configs import small_config
from tests.support.processes import EXIT_WITHOUT_TEARDOWN

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGE = gym.spaces.Box(0, 255, (10, 10, 4), np.uint8)
ACTIONS = gym.spaces.Discrete(3)
CNN = {"vf_share_layers": True}
LSTM = {"use_lstm": True, "lstm_cell_size": 8, "max_seq_len": 5, "fcnet_hiddens": [16]}
#: More TensorFlow actors than any machine's memory holds (`impala_tf.workers.memory`).
TOO_MANY_RUNNERS = 100_000


def _image_config(**overrides) -> ImpalaConfig:
    """2 actors x 3 envs of 10x10x4 uint8 frame stacks, fragments of 8 steps, a small CNN."""
    config = (
        ImpalaConfig()
        .environment(envs.stacked_frames, env_config={"size": 10, "k": 4, "episode_len": 6})
        .env_runners(num_env_runners=2, num_envs_per_env_runner=3, rollout_fragment_length=8)
        .training(train_batch_size=24, model=CNN)
        .reporting(min_time_s_per_iteration=0.5)
        .debugging(seed=3)
    )
    return config.update_from_dict(overrides)


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory):
    """One Ray for the module's Ray tests (the runtime reuses an initialised Ray)."""
    from tests.support.ray import local_ray

    with local_ray(str(tmp_path_factory.mktemp("ray-home"))) as ray:
        yield ray


# The plan ----------------------------------------------------------------------------------------


def test_auto_acts_in_the_actors_unless_tensorflow_actors_would_not_fit():
    # MLPs act in numpy in the actors: light, whatever their number.
    mlp = make_plan(small_config(num_env_runners=TOO_MANY_RUNNERS))
    assert not mlp.central_inference and not mlp.actors_need_tensorflow
    assert mlp.preload == ("impala_tf.rollout.host",)
    # CNN: per-actor inference (faster on an idle machine) while TensorFlow actors fit ...
    cnn = make_plan(_image_config())
    assert not cnn.central_inference and cnn.actors_need_tensorflow
    assert "impala_tf.acting.tf_policy" in cnn.preload
    # ... the server when they would not: its actors never import TensorFlow.
    crowded = make_plan(_image_config(num_env_runners=TOO_MANY_RUNNERS))
    assert crowded.central_inference and not crowded.actors_need_tensorflow
    assert crowded.preload == ("impala_tf.rollout.host",)
    # Explicit choices win; on Ray "auto" acts in the actors (spread over the cluster).
    chosen = _image_config(num_env_runners=TOO_MANY_RUNNERS, inference="actor")
    assert not make_plan(chosen).central_inference
    assert make_plan(small_config(inference="central")).central_inference
    ray = make_plan(_image_config(actor_backend="ray", num_env_runners=TOO_MANY_RUNNERS))
    assert ray.backend == "ray" and not ray.central_inference
    with pytest.raises(ValueError, match="`inference` must be"):
        _image_config(inference="gpu").validate()


# Actors acting through the server ----------------------------------------------------------------


def _fetch(actors: EnvRunnerGroup, count: int, timeout_s: float = 120.0) -> tuple[list, list]:
    """Fragments (up to `count`) and failures, waiting up to `timeout_s` for them."""
    fragments, failures, deadline = [], [], time.monotonic() + timeout_s
    while len(fragments) < count and not failures and time.monotonic() < deadline:
        got, failed = actors.fetch(timeout_s=1.0)
        fragments.extend(got)
        failures.extend(failed)
    return fragments, failures


def _initial_weights(config: ImpalaConfig, plan: RuntimePlan) -> dict[str, list[np.ndarray]]:
    """{policy_id: a freshly initialised model's weights}."""
    return {
        pid: build_model(obs, act, policy_config(config, pid).model).get_weights()
        for pid, (obs, act) in plan.spaces.policies.items()
    }


def _sample_twice_through_the_driver(config: ImpalaConfig, weights: dict) -> list[Fragment]:
    """Two fragments of actor 0 (a process acting through the driver's server), one after
    the other."""
    plan = make_plan(config)
    assert plan.central_inference and not plan.actors_need_tensorflow
    actors = EnvRunnerGroup(sampling_spec(config, plan), plan, Counters())
    try:
        actors.broadcast({p: (w, 5) for p, w in weights.items()}, actors.healthy_ids())
        out = []
        for _ in range(2):
            actors.request_idle()
            fragments, failures = _fetch(actors, 1)
            assert not failures, failures
            out += fragments
        stats = actors.server.stats()
        assert stats["num_requests"] >= 2 * config.rollout_fragment_length
        if plan.spaces.frame_stacks:  # The stacks whole once, then each env's newest frames.
            steps = 2 * config.rollout_fragment_length * config.num_envs_per_env_runner
            assert stats["num_frames"] == steps
        return out
    finally:
        actors.stop()


@pytest.mark.parametrize("case", ["cnn", "lstm", "two-policies", "bfloat16-learner"])
def test_central_and_per_actor_inference_sample_the_same_fragments(case):
    """Same weights, same seeds: an actor process acting through the driver's server samples
    the fragments a runner acting itself samples (actions, logits, values, states, versions)."""
    if case == "two-policies":
        config = small_config(policies=2, num_env_runners=1)
    elif case == "bfloat16-learner":  # The server acts in `inference_precision`, as a runner.
        config = _image_config(
            num_env_runners=1, precision="mixed_bfloat16", inference_precision="float32"
        )
    else:
        config = _image_config(num_env_runners=1, model=CNN if case == "cnn" else LSTM)
    plan = make_plan(config)
    weights = _initial_weights(config, plan)
    central = config.copy().update_from_dict({"inference": "central"})
    remote = _sample_twice_through_the_driver(central, weights)
    runner = make_env_runner(runner_spec(config), worker_index=1)
    try:
        runner.set_weights({p: (w, 5) for p, w in weights.items()})
        local = [runner.sample() for _ in range(2)]
    finally:
        runner.close()
    for a, b in zip(local, remote):
        assert b.actor_id == 0
        assert a.episodes == b.episodes and a.policy_versions == b.policy_versions
        assert sorted(a.batches) == sorted(b.batches) and a.batches
        for pid in a.batches:
            batch, other = a.batches[pid], decompress(b.batches[pid])
            assert sorted(batch) == sorted(other)
            # Frame-stacking envs send frames (impala_tf.models.frames), others `obs`.
            obs = [k for k in ("obs", "obs_frames", "obs_restarts") if k in batch]
            for name in (*obs, "actions", "terminateds", "truncateds", "policy_version"):
                np.testing.assert_array_equal(batch[name], other[name], err_msg=name)
            for name in batch:
                np.testing.assert_allclose(
                    batch[name], other[name], rtol=1e-4, atol=1e-5, err_msg=name
                )
            states = [k for k in batch if k.startswith("state_in")]
            assert len(states) == (2 if case == "lstm" else 0)


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_central_actors_label_the_servers_versions_and_a_restarted_one_reconnects(backend, request):
    """Local actors reach the server through pipes, Ray actors over TCP; a broadcast loads the
    server once, and a restarted actor gets a new connection (a pipe, or the TCP endpoint
    again under its id)."""
    if backend == "ray":
        request.getfixturevalue("ray_session")
    config = _image_config(inference="central", actor_backend=backend)
    plan = make_plan(config)
    weights = _initial_weights(config, plan)["default_policy"]
    counters = Counters()
    actors = EnvRunnerGroup(sampling_spec(config, plan), plan, counters)
    try:
        actors.broadcast({"default_policy": (weights, 2)}, actors.healthy_ids())
        actors.request_idle()
        fragments, failures = _fetch(actors, 2)
        assert not failures and sorted(f.actor_id for f in fragments) == [0, 1]
        for f in fragments:
            assert f.batches["default_policy"]["actions"].shape == (3, 8)
            np.testing.assert_array_equal(f.batches["default_policy"]["policy_version"], 2)
        # The server acts with version 9 at once; each actor's next fragment was chosen by it
        # but for its first step, computed one step ahead with version 2.
        actors.broadcast({"default_policy": (weights, 9)}, [0, 1])
        for first in (True, False):
            actors.request_idle()
            fragments, failures = _fetch(actors, 2)
            assert not failures and len(fragments) == 2
            for f in fragments:
                versions = f.batches["default_policy"]["policy_version"]
                np.testing.assert_array_equal(versions[:, 0], 2 if first else 9)
                np.testing.assert_array_equal(versions[:, 1:], 9)
                assert f.policy_versions == {"default_policy": 9}
        os.kill(actors.pids()[0], signal.SIGKILL)
        actors.request_idle()
        fragments, failures = _fetch(actors, 2, timeout_s=60)
        assert [f.worker_id for f in failures] == [0]
        assert actors.handle_failures(failures) == [0]
        actors.broadcast({"default_policy": (weights, 10)}, [0])
        assert counters.num_env_runner_restarts == 1
        mine = []
        while not mine:  # Actor 1's fragments may come first.
            actors.request_idle()
            fragments, failures = _fetch(actors, 1)
            assert not failures, failures
            mine = [f for f in fragments if f.actor_id == 0]
        np.testing.assert_array_equal(mine[0].batches["default_policy"]["policy_version"], 10)
    finally:
        actors.stop()


# Training ----------------------------------------------------------------------------------------

PLACEMENTS = [("local", 1), ("local", 2), ("ray", 2)]


@pytest.mark.parametrize("backend, policies", PLACEMENTS, ids=[f"{b}-{p}" for b, p in PLACEMENTS])
def test_central_inference_trains_every_policy(backend, policies, request):
    if backend == "ray":
        request.getfixturevalue("ray_session")
    algo = small_config(policies=policies, backend=backend, inference="central").build()
    try:
        assert algo.plan.central_inference and algo.actors.server is not None
        last: dict = {}
        # Until every policy's learner has applied an update and an episode has ended: the
        # first updates can come before any episode ends (a two-agent CartPole episode lasts
        # until both poles fall, and the first train batches are ~20 env steps per env).
        for _ in range(30):
            last = algo.train()
            updates = [i["num_grad_updates_lifetime"] for i in last["info"]["learner"].values()]
            if len(updates) == policies and min(updates) >= 1 and last["episodes_total"] > 0:
                break
        served = algo.actors.server.stats()
    finally:
        algo.stop()
    expected = ["default_policy"] if policies == 1 else ["p0", "p1"]
    assert sorted(last["info"]["learner"]) == expected
    for info in last["info"]["learner"].values():
        assert info["num_grad_updates_lifetime"] >= 1
    assert last["episodes_total"] > 0 and last["num_env_steps_trained"] > 0
    # Every agent step of every actor was acted by the server (one request per policy that
    # acted in an env step of an actor; the actors' in-flight fragments were sampled too).
    steps_per_request = 4  # num_envs_per_env_runner: an actor's envs share a request.
    assert served["num_requests"] * steps_per_request >= last["num_env_steps_sampled"]


def actor_libraries() -> None:
    """Builds a central-inference CNN run in a fresh driver and prints, per actor, whether
    TensorFlow's library is mapped into it (run in a subprocess by the next test)."""
    algo = _image_config(inference="central").build()
    try:
        algo.train()
        mapped = {}
        for actor_id, pid in algo.actors.pids().items():
            with open(f"/proc/{pid}/maps") as f:
                mapped[actor_id] = "libtensorflow" in f.read()
    finally:
        algo.stop()
    print(json.dumps({"tensorflow_mapped": mapped}))


def test_central_inference_actors_never_load_tensorflow():
    """A fresh driver (the actors' fork server is one per driver, made by the first build)."""
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "import tests.inference_test as m; m.actor_libraries()" + EXIT_WITHOUT_TEARDOWN,
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO, "TF_CPP_MIN_LOG_LEVEL": "2"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report == {"tensorflow_mapped": {"0": False, "1": False}}
