"""Checkpoints written before the one runtime (tests/data/legacy_checkpoints) work today.

`single_agent/` is the old single-agent driver's layout (learner at the top, one observation
filter, a pickled `Aggregator`); `multi_agent/` the old multi-agent driver's (one complete
single-policy checkpoint per policy under `policies/`). `expected.json` holds the counters each
run had when it saved. Each is resumed (weights, iteration, counters and episodes as saved, then
training goes on), evaluated and exported with the binaries, and saved again in today's layout.
The fixtures are copied to `tmp_path` first: nothing writes into tests/data.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import trackable_object_graph_pb2

from impala_tf import checkpoints
from impala_tf.driver.evaluation import load_policy_model
from tests.support.binaries import run_binary_in_one_process
from tests.support.processes import EXIT_WITHOUT_TEARDOWN, kill_session, log_tail, run_in_background

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(REPO, "tests", "data", "legacy_checkpoints")
with open(os.path.join(FIXTURES, "expected.json"), encoding="utf-8") as _f:
    EXPECTED = json.load(_f)
#: Each fixture's policies, and the --policy_id that impala-evaluate and impala-export get.
CASES = {
    "single_agent": {"policies": ["default_policy"], "evaluate": [], "export": []},
    "multi_agent": {
        "policies": ["p0", "p1"],
        "evaluate": ["--policy_id=p0"],
        "export": ["--policy_id=p1"],
    },
}
#: Counters that one iteration of training must advance.
GROWING = (
    "num_env_steps_sampled",
    "num_agent_steps_sampled",
    "num_env_steps_trained",
    "num_agent_steps_trained",
    "num_samples_added_to_queue",
    "num_training_step_calls",
    "num_weight_broadcasts",
)
_TIMEOUT_S = 240


def _copy(name: str, tmp_path) -> str:
    return shutil.copytree(os.path.join(FIXTURES, name), str(tmp_path / name))


def _legacy_prefix(directory: str, policy_id: str) -> str:
    """Where the old layouts kept a policy's learner (read independently of today's code)."""
    if policy_id == "default_policy":
        return os.path.join(directory, "learner")
    return os.path.join(directory, "policies", policy_id, "learner")


def stored_model_weights(prefix: str) -> list[np.ndarray]:
    """The values of every variable reachable from the checkpoint's `model` part.

    Read from the checkpoint's object graph: a variable's key is its shortest path, which for
    the old torso (kept in a list) runs through the optimizer, not through `model`.
    """
    reader = tf.train.load_checkpoint(prefix)
    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    graph.ParseFromString(reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"))
    (model,) = [c.node_id for c in graph.nodes[0].children if c.local_name == "model"]
    seen, stack, keys = set(), [model], set()
    while stack:
        node_id = stack.pop()
        if node_id in seen:
            continue
        seen.add(node_id)
        node = graph.nodes[node_id]
        keys.update(a.checkpoint_key for a in node.attributes if a.name == "VARIABLE_VALUE")
        stack.extend(c.node_id for c in node.children)
    return [reader.get_tensor(key) for key in keys]


def _assert_same_arrays(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    """Equal as multisets (the two lists name their variables differently)."""

    def order(arrays):
        return sorted((np.asarray(a) for a in arrays), key=lambda a: (a.shape, a.tobytes()))

    assert len(got) == len(want)
    for g, w in zip(order(got), order(want), strict=True):
        np.testing.assert_array_equal(g, w)


def _build(directory: str):
    config = checkpoints.load_config(directory)
    config.env_runners(num_env_runners=1).reporting(min_time_s_per_iteration=0)
    return config.build()


@pytest.mark.parametrize("name", sorted(CASES))
def test_resumes_continues_and_saves_in_todays_layout(name, tmp_path):
    directory = _copy(name, tmp_path)
    expected = EXPECTED[name]
    policies = CASES[name]["policies"]
    stored = {pid: stored_model_weights(_legacy_prefix(directory, pid)) for pid in policies}
    resaved = str(tmp_path / "resaved")
    algo = _build(directory)
    try:
        assert algo.policy_ids == policies
        initial = {pid: algo.get_policy_weights(pid) for pid in policies}
        algo.restore(directory)
        for pid in policies:
            _assert_same_arrays(algo.get_policy_weights(pid), stored[pid])
            with pytest.raises(AssertionError):  # The fixture trained: restoring changed them.
                _assert_same_arrays(initial[pid], stored[pid])
        assert algo.iteration == expected["training_iteration"]
        counters = algo.metrics.counters.as_dict()
        for key in ("num_env_steps_sampled", "num_agent_steps_sampled"):
            assert counters[key] == expected[key], key
        assert algo.metrics.episodes_total == expected["episodes_total"]

        result = algo.train()
        assert result["training_iteration"] == expected["training_iteration"] + 1
        assert result["episodes_total"] > expected["episodes_total"]
        # Every counter goes on from the restored value (a short iteration may hold no
        # broadcast, so train on until each has grown, at most a few more iterations).
        latest = result
        for _ in range(20):
            if all(latest[k] > counters.get(k, 0) for k in GROWING):
                break
            latest = algo.train()
        # Asserted at the end, so that a stalled counter does not hide the checks of the save.
        stalled = {
            k: (counters.get(k, 0), latest[k])
            for k in GROWING
            if not latest[k] > counters.get(k, 0)
        }
        result = latest
        assert algo.save(resaved) == resaved
    finally:
        algo.stop()

    # Today's layout: every policy under policies/<id>/, nothing at the top.
    assert not os.path.exists(os.path.join(resaved, "learner.index"))
    for pid in policies:
        assert os.path.isfile(os.path.join(resaved, "policies", pid, "learner.index"))
    state = checkpoints.read_driver_state(resaved)
    assert state["format"] == 2 and state["policy_ids"] == policies
    assert sorted(state["observation_filters"]) == policies
    resumed = _build(resaved)
    try:
        resumed.restore(resaved)
        assert resumed.iteration == result["training_iteration"]
        assert resumed.metrics.counters.num_env_steps_sampled == result["num_env_steps_sampled"]
        for pid in policies:
            saved = stored_model_weights(os.path.join(resaved, "policies", pid, "learner"))
            _assert_same_arrays(resumed.get_policy_weights(pid), saved)
    finally:
        resumed.stop()
    assert not stalled, f"counters that did not grow in the iteration after resuming: {stalled}"


# Loads each SavedModel (arguments: directory, observations as JSON, ...) with TensorFlow alone
# and prints {directory: logits}.
_EXPORTED_OUTPUTS = (
    """
import json, sys
import numpy as np
import tensorflow as tf

logits = {}
for directory, obs in zip(sys.argv[1::2], sys.argv[2::2]):
    serve = tf.saved_model.load(directory).signatures["serving_default"]
    obs = np.array(json.loads(obs), np.float32)
    logits[directory] = serve(obs=tf.constant(obs))["logits"].numpy().tolist()
print(json.dumps(logits))
"""
    + EXIT_WITHOUT_TEARDOWN
)


def test_evaluates_and_exports_with_the_binaries(tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO, "TF_CPP_MIN_LOG_LEVEL": "2"}
    runs = {"evaluate": {}, "export": {}}
    for name, case in CASES.items():
        directory = _copy(name, tmp_path)
        out = str(tmp_path / f"{name}_saved_model")
        runs["evaluate"][name] = [f"--checkpoint={directory}", "--episodes=2", *case["evaluate"]]
        runs["export"][name] = [f"--checkpoint={directory}", f"--out={out}", *case["export"]]
    outputs = {}
    for binary, binary_runs in runs.items():
        logs = tmp_path / binary
        logs.mkdir()
        outputs[binary] = run_binary_in_one_process(
            f"impala_tf.bin.{binary}", binary_runs, cwd=REPO, env=env, log_dir=logs,
            timeout_s=_TIMEOUT_S,
        )  # fmt: skip
        for name, (code, output) in outputs[binary].items():
            assert code == 0, (name, binary, output[-3000:])

    expected, served_args = {}, []
    for name, case in CASES.items():
        lines = outputs["evaluate"][name][1].strip().splitlines()
        summary = json.loads(lines[-1])
        assert summary["episodes"] == 2
        assert summary["episode_reward_min"] <= summary["episode_reward_max"]
        assert "2 episodes of" in lines[-2] and name in lines[-2]

        # The SavedModel acts like the checkpoint's policy: its model and frozen filter.
        directory = str(tmp_path / name)
        policy_id = case["export"][0].split("=")[1] if case["export"] else None
        model, _, obs_filter = load_policy_model(
            directory, checkpoints.load_config(directory), policy_id
        )
        assert obs_filter is not None  # Both runs used MeanStdFilter.
        obs = np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32)
        logits, _, _ = model.step(obs_filter(obs, update=False), ())
        saved_model = str(tmp_path / f"{name}_saved_model")
        expected[saved_model] = logits
        served_args += [saved_model, json.dumps(obs.tolist())]
    log = tmp_path / "serve.log"
    process = run_in_background(
        [sys.executable, "-c", _EXPORTED_OUTPUTS, *served_args], REPO, env, log
    )
    try:
        assert process.wait(timeout=_TIMEOUT_S) == 0, log_tail(log)
    finally:
        kill_session(process)
    served = json.loads(log.read_text().strip().splitlines()[-1])
    assert sorted(served) == sorted(expected)
    for saved_model, logits in expected.items():
        np.testing.assert_allclose(served[saved_model], logits, rtol=1e-5, atol=1e-5)
