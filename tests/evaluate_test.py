"""Tests of checkpoint round trips, the one evaluation path (`impala_tf.driver.evaluation`) and the
impala-evaluate binary (its runs in one subprocess), for single-agent and multi-agent checkpoints.

Checkpoints are written from `ImpalaLearner`s with random weights (no algorithm, no actor
processes). Video is tested on a CartPole whose frames are drawn with numpy, since gymnasium's
CartPole renders with pygame, which impala_tf does not depend on (its test extra installs it);
the binary imports this module through the gymnasium id
`tests.evaluate_test:ImpalaTfRenderedCartPole-v0`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.envs.classic_control.cartpole import CartPoleEnv

from tests.support.binaries import run_binary_in_one_process
from tests.support.configs import small_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RENDER_ENV_ID = "ImpalaTfRenderedCartPole-v0"
RENDER_ENV = f"tests.evaluate_test:{RENDER_ENV_ID}"
FRAME_SHAPE = (24, 64, 3)


class RenderedCartPole(CartPoleEnv):
    """CartPole-v1 whose `rgb_array` frames are drawn with numpy.

    The top row counts the steps of the episode, so consecutive frames always differ (GIF
    writers may merge equal ones).
    """

    def reset(self, *, seed=None, options=None):
        self._steps = 0
        return super().reset(seed=seed, options=options)

    def step(self, action):
        self._steps += 1
        return super().step(action)

    def render(self):
        height, width, _ = FRAME_SHAPE
        frame = np.full(FRAME_SHAPE, 255, np.uint8)
        x = int(np.clip((self.state[0] + 2.4) / 4.8 * (width - 1), 2, width - 3))
        frame[height - 6 : height - 2, x - 2 : x + 3] = (0, 0, 192)
        frame[0, : self._steps % width] = 0
        return frame


if RENDER_ENV_ID not in gym.registry:
    gym.register(RENDER_ENV_ID, entry_point=RenderedCartPole, max_episode_steps=500)


def write_test_checkpoint(directory, env="CartPole-v1", model=None, seed=0):
    """Writes a checkpoint of a learner with random (not initial) weights; returns it."""
    from impala_tf.checkpoints import write_checkpoint
    from impala_tf.config import ImpalaConfig
    from impala_tf.driver.specs import env_spec
    from impala_tf.envs.make import make_env
    from impala_tf.learning.learner import ImpalaLearner

    config = (
        ImpalaConfig()
        .environment(env)
        .training(model=model or {"fcnet_hiddens": [16]})
        .debugging(seed=seed)
    )
    probe = make_env(env_spec(config))
    learner = ImpalaLearner(config, probe.observation_space, probe.action_space)
    probe.close()
    _randomize(learner, seed)
    learner.num_grad_updates.assign(7)
    learner.num_agent_steps_trained.assign(3500)
    write_checkpoint(str(directory), learner, config, {"iteration": 3})
    return config, learner


def write_multi_agent_checkpoint(directory):
    """A two-agent MultiAgentCartPole checkpoint, policies p0 and p1 with different random
    weights; returns the config and {policy_id: learner}."""
    from impala_tf.checkpoints import write_checkpoint
    from impala_tf.config.policies import policy_config
    from impala_tf.driver.specs import probe_spaces
    from impala_tf.learning.learner import ImpalaLearner

    config = small_config(policies=2)
    learners = {}
    for i, (pid, (obs, act)) in enumerate(probe_spaces(config).policies.items()):
        learners[pid] = ImpalaLearner(policy_config(config, pid), obs, act)
        _randomize(learners[pid], seed=10 + i)
    write_checkpoint(str(directory), learners, config, {"iteration": 2})
    return config, learners


def _randomize(learner, seed):
    rng = np.random.default_rng(seed)
    learner.set_policy_weights(
        [rng.normal(scale=0.5, size=w.shape).astype(w.dtype) for w in learner.get_policy_weights()]
    )


def evaluation_config(checkpoint_dir, seed):
    """The config impala-evaluate runs: the checkpoint's, evaluation_config applied, one env."""
    from impala_tf.checkpoints import load_config

    config = load_config(str(checkpoint_dir)).get_evaluation_config()
    return config.env_runners(num_envs_per_env_runner=1).debugging(seed=seed)


def run_module(module, *args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        cwd=REPO,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": REPO},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# impala_tf.checkpoints ---------------------------------------------------------------------------


def test_write_checkpoint_restores_every_learner_part(tmp_path):
    from impala_tf.checkpoints import (
        DRIVER_STATE_FILE,
        learner_checkpoint,
        learner_prefix,
        load_config,
        read_driver_state,
    )
    from impala_tf.learning.learner import ImpalaLearner

    config, learner = write_test_checkpoint(tmp_path / "ckpt")
    assert sorted(os.listdir(tmp_path / "ckpt")) == [DRIVER_STATE_FILE, "policies"]
    assert sorted(os.listdir(tmp_path / "ckpt" / "policies" / "default_policy")) == [
        "learner.data-00000-of-00001",
        "learner.index",
    ]
    state = read_driver_state(str(tmp_path / "ckpt"))
    assert state["iteration"] == 3
    assert state["config"] == json.loads(json.dumps(config.to_dict()))
    assert load_config(str(tmp_path / "ckpt")).to_dict() == config.to_dict()

    # What `Impala.restore` does: every part, optimizer slots and counters included.
    fresh = ImpalaLearner(config, learner.observation_space, learner.action_space)
    prefix = learner_prefix(str(tmp_path / "ckpt"))
    learner_checkpoint(fresh).read(prefix).assert_consumed()
    assert int(fresh.num_grad_updates.numpy()) == 7
    assert int(fresh.num_agent_steps_trained.numpy()) == 3500
    for got, want in zip(fresh.get_policy_weights(), learner.get_policy_weights(), strict=True):
        np.testing.assert_array_equal(got, want)


def test_load_config_refuses_a_checkpoint_of_an_env_callable(tmp_path):
    from impala_tf.checkpoints import load_config, read_driver_state, write_checkpoint
    from impala_tf.config import ImpalaConfig
    from impala_tf.learning.learner import ImpalaLearner

    config = ImpalaConfig().environment(lambda ctx: gym.make("CartPole-v1"))
    config.training(model={"fcnet_hiddens": [4]})
    probe = gym.make("CartPole-v1")
    learner = ImpalaLearner(config, probe.observation_space, probe.action_space)
    write_checkpoint(str(tmp_path), learner, config)
    assert read_driver_state(str(tmp_path))["config"] is None
    with pytest.raises(ValueError, match="env_creator callable"):
        load_config(str(tmp_path))


def test_resolve_checkpoint_dir(tmp_path):
    from impala_tf.checkpoints import DRIVER_STATE_FILE, resolve_checkpoint_dir

    def make(path):
        path.mkdir(parents=True)
        (path / DRIVER_STATE_FILE).write_text("{}")
        return str(path)

    direct = make(tmp_path / "a" / "checkpoint")
    assert resolve_checkpoint_dir(direct) == direct
    assert resolve_checkpoint_dir(str(tmp_path / "a")) == direct  # A training logdir.
    make(tmp_path / "b" / "checkpoint" / "checkpoint_000002")
    latest = make(tmp_path / "b" / "checkpoint" / "checkpoint_000010")
    assert resolve_checkpoint_dir(str(tmp_path / "b")) == latest
    assert resolve_checkpoint_dir(str(tmp_path / "b" / "checkpoint")) == latest
    with pytest.raises(FileNotFoundError, match="No checkpoint at"):
        resolve_checkpoint_dir(str(tmp_path / "missing"))


def test_load_policy_model_restores_the_weights_of_the_policy_asked_for(tmp_path):
    from impala_tf.checkpoints import load_config
    from impala_tf.driver.evaluation import load_policy_model

    _, learner = write_test_checkpoint(tmp_path, model={"fcnet_hiddens": [16], "use_lstm": True})
    model, action_space, obs_filter = load_policy_model(str(tmp_path), load_config(str(tmp_path)))
    assert model.is_recurrent and action_space.n == 2 and obs_filter is None
    for got, want in zip(model.get_weights(), learner.get_policy_weights(), strict=True):
        np.testing.assert_array_equal(got, want)

    other = load_config(str(tmp_path))
    other.training(model={"fcnet_hiddens": [16], "use_lstm": True, "lstm_cell_size": 8})
    with pytest.raises((ValueError, AssertionError)):
        load_policy_model(str(tmp_path), other)

    config, learners = write_multi_agent_checkpoint(tmp_path / "multi")
    with pytest.raises(ValueError, match=r"several policies \['p0', 'p1'\]: pass --policy_id"):
        load_policy_model(str(tmp_path / "multi"), config)
    with pytest.raises(ValueError, match=r"--policy_id=p2: no such policy.*\['p0', 'p1'\]"):
        load_policy_model(str(tmp_path / "multi"), config, "p2")
    model, _, _ = load_policy_model(str(tmp_path / "multi"), config, "p1")
    for got, want in zip(model.get_weights(), learners["p1"].get_policy_weights(), strict=True):
        np.testing.assert_array_equal(got, want)


def test_restore_model_refuses_variables_a_checkpoint_cannot_hold(tmp_path):
    import keras
    import tensorflow as tf

    from impala_tf.checkpoints import DRIVER_STATE_FILE, restore_model, untracked_variables

    class ListTorso(keras.layers.Layer):
        def __init__(self):
            super().__init__(name="list_torso")
            self.hidden = [keras.layers.Dense(3, name="in_list")]
            self.head = keras.layers.Dense(2, name="attribute")

        def call(self, x):
            return self.head(self.hidden[0](x))

    model = ListTorso()
    model(tf.zeros([1, 4]))
    assert [v.path for v in untracked_variables(model)] == [
        "list_torso/in_list/kernel",
        "list_torso/in_list/bias",
    ]
    (tmp_path / DRIVER_STATE_FILE).write_text("{}")
    tf.train.Checkpoint(model=model).write(str(tmp_path / "learner"))
    with pytest.raises(ValueError, match="2 of the model's 4 variables"):
        restore_model(model, str(tmp_path))


def test_evaluate_checkpoint_is_reproducible_with_a_seed(tmp_path):
    from impala_tf.driver.evaluation import evaluate_checkpoint

    write_test_checkpoint(tmp_path)

    def episodes(seed, explore):
        return evaluate_checkpoint(str(tmp_path), evaluation_config(tmp_path, seed), 5, explore)

    sampled = episodes(0, explore=True)
    assert len(sampled) == 5
    assert episodes(0, explore=True) == sampled
    assert episodes(1, explore=True) != sampled
    assert episodes(0, explore=False) != sampled


def test_evaluate_checkpoint_reports_one_policys_returns(tmp_path):
    from impala_tf.driver.evaluation import evaluate_checkpoint

    write_multi_agent_checkpoint(tmp_path)
    config = evaluation_config(tmp_path, 3)
    summed = evaluate_checkpoint(str(tmp_path), config, 3)
    for pid in ("p0", "p1"):
        mine = evaluate_checkpoint(str(tmp_path), config, 3, policy_id=pid)
        # The same episodes (same seed), each reported as the return of this policy's agent.
        assert [e.length for e in mine] == [e.length for e in summed]
        assert [e.ret for e in mine] == [e.policy_returns[pid][0] for e in summed]
    assert [e.ret for e in summed] == [
        sum(r for returns in e.policy_returns.values() for r in returns) for e in summed
    ]
    with pytest.raises(ValueError, match=r"no such policy.*\['p0', 'p1'\]"):
        evaluate_checkpoint(str(tmp_path), config, 1, policy_id="default_policy")


# The impala-evaluate binary ----------------------------------------------------------------------


def _summary(episodes):
    returns = [e.ret for e in episodes]
    return {
        "episodes": len(episodes),
        "episode_reward_mean": pytest.approx(np.mean(returns)),
        "episode_reward_min": min(returns),
        "episode_reward_max": max(returns),
        "episode_len_mean": pytest.approx(np.mean([e.length for e in episodes])),
    }


@pytest.fixture(scope="module")
def evaluations(tmp_path_factory):
    """Runs impala-evaluate on the checkpoints below, one after another in one process started
    as a job manager starts it (each start of the binary imports TensorFlow).

    Returns:
      (root, {run name: (exit status, its output)}).
    """
    root = tmp_path_factory.mktemp("evaluate")
    write_test_checkpoint(root / "rendered", env=RENDER_ENV)
    write_test_checkpoint(root / "cartpole")  # gymnasium's own CartPole-v1 (pygame renders it).
    write_multi_agent_checkpoint(root / "multi")
    runs = {
        "gif": [
            f"--checkpoint={root / 'rendered'}",
            "--episodes=3",
            "--explore=false",
            "--seed=5",
            "--policy_id=default_policy",  # Accepted for a single-agent checkpoint.
            f"--video={root / 'episode.gif'}",
        ],
        "multi": [
            f"--checkpoint={root / 'multi'}",
            "--episodes=2",
            "--seed=3",
            "--policy_id=p1",
            f"--video={root / 'agents.gif'}",
            "--video_max_width=300",
        ],
        "unknown_policy": [f"--checkpoint={root / 'multi'}", "--policy_id=p7"],
        "missing": [f"--checkpoint={root / 'missing'}"],
        "avi": [f"--checkpoint={root / 'rendered'}", f"--video={root / 'out.avi'}"],
        "mp4": [
            f"--checkpoint={root / 'rendered'}",
            "--episodes=1",
            f"--video={root / 'episode.mp4'}",
        ],
        "classic": [
            f"--checkpoint={root / 'cartpole'}",
            "--episodes=1",
            f"--video={root / 'cartpole.gif'}",
        ],
    }
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": REPO}
    return root, run_binary_in_one_process(
        "impala_tf.bin.evaluate", runs, cwd=REPO, env=env, log_dir=root, timeout_s=240
    )


def _summary_line(output):
    """The JSON summary impala-evaluate prints last, and the readable line before it."""
    lines = output.strip().splitlines()
    last = max(i for i, line in enumerate(lines) if line.startswith('{"episodes"'))
    return json.loads(lines[last]), lines[last - 1]


def test_evaluate_reports_the_returns_and_records_a_gif(evaluations):
    from PIL import Image

    from impala_tf.driver.evaluation import evaluate_checkpoint

    root, runs = evaluations
    code, output = runs["gif"]
    assert code == 0, output[-3000:]
    summary, readable = _summary_line(output)
    assert "return mean" in readable and "explore=False" in readable

    config = evaluation_config(root / "rendered", 5)
    episodes = evaluate_checkpoint(str(root / "rendered"), config, 3, explore=False)
    assert summary == _summary(episodes)

    with Image.open(root / "episode.gif") as gif:
        # The first episode: one frame after the reset, one after each step.
        assert gif.n_frames == episodes[0].length + 1
        assert gif.size == (FRAME_SHAPE[1], FRAME_SHAPE[0])
        assert gif.info["duration"] == 20  # The env's render_fps is 50.


def test_evaluate_a_multi_agent_checkpoint_per_policy_with_its_agents_side_by_side(evaluations):
    import importlib.util

    from PIL import Image

    from impala_tf.driver.evaluation import evaluate_checkpoint

    root, runs = evaluations
    ckpt = str(root / "multi")
    code, output = runs["multi"]
    if importlib.util.find_spec("pygame") is None:  # gymnasium[classic-control] renders.
        assert code == 1 and "needed to render --video" in output
        proc = run_module("impala_tf.bin.evaluate", f"--checkpoint={ckpt}", "--episodes=2",
                          "--seed=3", "--policy_id=p1")  # fmt: skip
        code, output = proc.returncode, proc.stdout + proc.stderr
    else:
        cartpole = gym.make("CartPole-v1", render_mode="rgb_array")
        cartpole.reset(seed=0)
        height, width, _ = cartpole.render().shape
        cartpole.close()
        with Image.open(root / "agents.gif") as gif:
            # The two agents' CartPoles side by side, downscaled to --video_max_width.
            assert gif.size == (300, round(height * 300 / (2 * width)))
        # Counted as written: the GIF encoder merges identical consecutive frames (a still one).
        frames = int(re.search(r"wrote (\d+) frames", output).group(1))
    assert code == 0, output[-3000:]
    summary, _ = _summary_line(output)
    config = evaluation_config(ckpt, 3)
    assert summary == _summary(evaluate_checkpoint(ckpt, config, 2, policy_id="p1"))
    summed = evaluate_checkpoint(ckpt, config, 2)
    assert summary["episode_reward_mean"] < np.mean([e.ret for e in summed])  # p1's share only.
    if importlib.util.find_spec("pygame") is not None:
        assert frames == summed[0].length + 1  # The whole first episode.

    code, output = runs["unknown_policy"]
    assert code == 1
    assert "impala-evaluate: error: --policy_id=p7: no such policy" in output
    assert "['p0', 'p1']" in output


@pytest.mark.parametrize(
    "run, message",
    [("missing", "No checkpoint at"), ("avi", "use a .gif or .mp4")],
)
def test_evaluate_explains_bad_arguments(evaluations, run, message):
    _, runs = evaluations
    code, output = runs[run]
    assert code == 1
    assert "impala-evaluate: error: " in output and message in output


def test_evaluate_mp4_without_imageio_says_what_to_install(evaluations):
    import importlib.util

    root, runs = evaluations
    code, output = runs["mp4"]
    video = root / "episode.mp4"
    if importlib.util.find_spec("imageio") is None:
        assert code == 1
        assert "pip install 'imageio[ffmpeg]'" in output
        assert not video.exists()
    else:
        assert code == 0, output[-3000:]
        assert video.stat().st_size > 0


def test_evaluate_video_of_classic_control_needs_pygame(evaluations):
    import importlib.util

    root, runs = evaluations
    code, output = runs["classic"]
    if importlib.util.find_spec("pygame") is None:
        assert code == 1
        assert "gymnasium[classic-control]" in output
        assert "needed to render --video" in output
    else:
        assert code == 0, output[-3000:]
        assert (root / "cartpole.gif").stat().st_size > 0
