"""EnvRunner: fragment layout, bootstrapping at episode ends, seeding, reward clipping."""

from __future__ import annotations

import gymnasium as gym
import numpy as np

from impala_tf.actors.env_runner import EnvRunner, env_seed
from impala_tf.config import ImpalaConfig
from impala_tf.models import build_model
from impala_tf.sample_batch import decompress


def _runner(envs=3, horizon=7, seed=0, worker=1, **overrides) -> EnvRunner:
    config = (
        ImpalaConfig()
        .environment("CartPole-v1")
        .env_runners(num_envs_per_env_runner=envs, rollout_fragment_length=horizon)
        .training(model={"fcnet_hiddens": [8]})
        .debugging(seed=seed)
        .update_from_dict(overrides)
    )
    runner = EnvRunner(config, worker_index=worker)
    model = build_model(runner.observation_space, runner.action_space, config.model)
    rng = np.random.default_rng(0)
    weights = [rng.normal(scale=0.3, size=w.shape).astype(np.float32) for w in model.get_weights()]
    runner.set_weights(weights, policy_version=5)
    return runner


def test_fragment_layout_and_counts():
    runner = _runner()
    fragment = runner.sample()
    batch = fragment.batch
    assert len(batch) == 3 and batch.env_steps == 21
    assert batch["obs"].shape == (3, 7, 4)
    assert batch["action_dist_inputs"].shape == (3, 7, 2)
    for key in (
        "rewards",
        "terminateds",
        "truncateds",
        "action_logp",
        "vf_preds",
        "values_bootstrapped",
        "actions",
    ):
        assert batch[key].shape == (3, 7), key
    assert fragment.policy_version == 5
    assert fragment.actor_id == 0


def test_values_bootstrapped_follow_the_episode():
    runner = _runner(envs=4, horizon=40)
    for _ in range(3):
        batch = runner.sample().batch
        vb, vf = batch["values_bootstrapped"], batch["vf_preds"]
        term, trunc = batch["terminateds"], batch["truncateds"]
        inside = ~(term | trunc)[:, :-1]
        # Within an episode the bootstrap is the next step's behaviour value.
        np.testing.assert_allclose(vb[:, :-1][inside], vf[:, 1:][inside], rtol=1e-6)
        # A termination bootstraps nothing.
        assert np.all(vb[term] == 0.0)
        assert term.any()


def test_truncation_bootstraps_from_the_final_observation():
    # A 5-step time limit truncates every episode that has not terminated.
    config = (
        ImpalaConfig()
        .environment("CartPole-v1", env_config={"max_episode_steps": 5})
        .env_runners(num_envs_per_env_runner=2, rollout_fragment_length=12)
        .training(model={"fcnet_hiddens": [8]})
        .debugging(seed=1)
    )
    runner = EnvRunner(config, worker_index=1)
    model = build_model(runner.observation_space, runner.action_space, config.model)
    rng = np.random.default_rng(0)
    runner.set_weights([rng.normal(size=w.shape).astype(np.float32) for w in model.get_weights()])
    batch = runner.sample().batch
    trunc = batch["truncateds"]
    assert trunc.any()
    rows, cols = np.nonzero(trunc[:, :-1])
    vb, vf = batch["values_bootstrapped"], batch["vf_preds"]
    # Not the next episode's first value, but V(final observation), which differs from it.
    assert not np.allclose(vb[rows, cols], vf[rows, cols + 1])
    assert np.all(vb[rows, cols] != 0.0)


def test_episodes_continue_across_fragments_and_report_returns():
    runner = _runner(envs=2, horizon=5)
    returns, lengths = [], []
    for _ in range(30):
        fragment = runner.sample()
        returns += fragment.episode_returns
        lengths += fragment.episode_lengths
    assert returns and returns == [float(n) for n in lengths]  # CartPole: reward 1 per step
    assert max(lengths) > 5  # longer than one fragment


def test_same_seed_same_fragments_and_distinct_env_seeds():
    a, b = _runner(seed=3), _runner(seed=3)
    for _ in range(2):
        fa, fb = a.sample().batch, b.sample().batch
        for key in fa:
            np.testing.assert_array_equal(fa[key], fb[key])
    other = _runner(seed=3, worker=2).sample().batch
    assert not np.array_equal(other["obs"], a.sample().batch["obs"])
    assert len({env_seed(3, w, j) for w in (1, 2) for j in range(3)}) == 6


def test_clip_rewards_and_observations_left_unpacked():
    # compress_observations packs fragments in the actor process, at the transport
    # (impala_tf.frames.encode_observations), not in sample().
    runner = _runner(clip_rewards=0.5, compress_observations=True)
    batch = runner.sample().batch
    assert not batch.compressed
    assert np.all(batch["rewards"] == 0.5)
    assert decompress(batch)["obs"].shape == (3, 7, 4)


def test_gym_make_kwargs_come_from_env_config():
    runner = _runner(envs=1)
    assert isinstance(runner.envs[0], gym.Env)
