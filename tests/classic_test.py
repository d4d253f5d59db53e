"""The shipped classic-control envs: StatelessCartPole and its gymnasium id."""

from __future__ import annotations

import os
import subprocess
import sys

import gymnasium as gym
import numpy as np

from impala_tf.envs.classic import STATELESS_CARTPOLE_ID, StatelessCartPole

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_stateless_cartpole_hides_the_velocities():
    full = gym.make("CartPole-v1").unwrapped
    env = StatelessCartPole()
    obs, _ = env.reset(seed=3)
    full_obs, _ = full.reset(seed=3)
    assert env.observation_space.shape == (2,) and obs.dtype == np.float32
    np.testing.assert_array_equal(obs, full_obs[[0, 2]])
    np.testing.assert_allclose(env.observation_space.high, [4.8, 2 * 12 * 2 * np.pi / 360])
    for action in [0, 1, 1, 0, 1]:
        obs, reward, terminated, _, _ = env.step(action)
        full_obs, full_reward, full_terminated, _, _ = full.step(action)
        np.testing.assert_array_equal(obs, full_obs[[0, 2]])
        assert (reward, terminated) == (full_reward, full_terminated)
        assert env.observation_space.contains(obs)


def test_registered_id_has_cartpoles_time_limit():
    env = gym.make(STATELESS_CARTPOLE_ID)
    assert env.spec.max_episode_steps == 500
    assert env.observation_space.shape == (2,)


def test_a_fresh_actor_process_can_make_the_env_by_id():
    code = (
        "from impala_tf.envs.make import make_env\n"
        "from impala_tf.config import ImpalaConfig\n"
        "from impala_tf.driver.specs import env_spec\n"
        f"env = make_env(env_spec(ImpalaConfig(env={STATELESS_CARTPOLE_ID!r})))\n"
        "print(env.observation_space.shape)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "(2,)"


def test_config_accepts_the_id():
    from impala_tf.config import ImpalaConfig

    ImpalaConfig(env=STATELESS_CARTPOLE_ID).validate()
    path = os.path.join(REPO, "configs/stateless-cartpole-impala.yaml")
    config, stop = ImpalaConfig.from_yaml(path)
    assert stop == {"episode_reward_mean": 350, "timesteps_total": 2000000}
    config.validate()
    assert config.env == STATELESS_CARTPOLE_ID and config.model["max_seq_len"] == 20
    assert config.model["use_lstm"] and config.model["vf_share_layers"]
    assert (config.lr, config.vf_loss_coeff, config.entropy_coeff) == (0.0005, 0.05, 0.0)
    assert config.learner_queue_size == 1
