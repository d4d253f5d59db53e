"""EnvRunner: fragment layout, bootstrapping at episode ends, seeding, reward clipping.

Fragments hold one policy's batch (`"default_policy"`), B envs x T steps.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np

from impala_tf.config import ImpalaConfig
from impala_tf.data.sample_batch import decompress
from impala_tf.driver.specs import runner_spec
from impala_tf.models import build_model
from impala_tf.rollout.env_runner import EnvRunner
from impala_tf.rollout.fragment import DEFAULT_POLICY_ID, POLICY_VERSION, Episode
from impala_tf.utils.seeds import env_seed


def _config(envs=3, horizon=7, seed=0, **overrides) -> ImpalaConfig:
    return (
        ImpalaConfig()
        .environment("CartPole-v1")
        .env_runners(num_envs_per_env_runner=envs, rollout_fragment_length=horizon)
        .training(model={"fcnet_hiddens": [8]})
        .debugging(seed=seed)
        .update_from_dict(overrides)
    )


def _weights(runner: EnvRunner, config: ImpalaConfig, scale: float = 0.3) -> list[np.ndarray]:
    model = build_model(runner.observation_space, runner.action_space, config.model)
    rng = np.random.default_rng(0)
    return [rng.normal(scale=scale, size=w.shape).astype(np.float32) for w in model.get_weights()]


def _runner(envs=3, horizon=7, seed=0, worker=1, **overrides) -> EnvRunner:
    config = _config(envs, horizon, seed, **overrides)
    runner = EnvRunner(runner_spec(config), worker_index=worker)
    runner.set_weights({DEFAULT_POLICY_ID: (_weights(runner, config), 5)})
    return runner


def test_fragment_layout_and_counts():
    runner = _runner()
    fragment = runner.sample()
    assert list(fragment.batches) == [DEFAULT_POLICY_ID]
    batch = fragment.batches[DEFAULT_POLICY_ID]
    assert len(batch) == 3 and fragment.env_steps == fragment.agent_steps == 21
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
        POLICY_VERSION,
    ):
        assert batch[key].shape == (3, 7), key
    assert fragment.policy_versions == {DEFAULT_POLICY_ID: 5}
    assert np.all(batch[POLICY_VERSION] == 5)
    assert fragment.actor_id == 0
    # Actions are computed one step ahead: the next fragment's first step was chosen by the
    # weights loaded before, the others by the new ones.
    weights = runner.get_weights()[DEFAULT_POLICY_ID]
    runner.set_weights({DEFAULT_POLICY_ID: (weights, 6)})
    fragment = runner.sample()
    versions = fragment.batches[DEFAULT_POLICY_ID][POLICY_VERSION]
    assert np.all(versions[:, 0] == 5) and np.all(versions[:, 1:] == 6)
    assert fragment.policy_versions == {DEFAULT_POLICY_ID: 6}


def test_values_bootstrapped_follow_the_episode():
    runner = _runner(envs=4, horizon=40)
    for _ in range(3):
        batch = runner.sample().batches[DEFAULT_POLICY_ID]
        vb, vf = batch["values_bootstrapped"], batch["vf_preds"]
        term, trunc = batch["terminateds"], batch["truncateds"]
        inside = ~(term | trunc)[:, :-1]
        # Within an episode the bootstrap is the next step's behaviour value.
        np.testing.assert_allclose(vb[:, :-1][inside], vf[:, 1:][inside], rtol=1e-6)
        # A termination bootstraps nothing.
        assert np.all(vb[term] == 0.0)
        assert term.any()


class _RecordTruncations(gym.Wrapper):
    """Keeps every observation its env returned together with `truncated=True` (and not
    `terminated`), in order, in `finals[vector_index]`."""

    finals: dict[int, list[np.ndarray]] = {}

    def __init__(self, env: gym.Env, vector_index: int):
        super().__init__(env)
        self.vector_index = vector_index
        self.finals[vector_index] = []

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        if truncated and not terminated:
            self.finals[self.vector_index].append(np.array(obs, copy=True))
        return obs, reward, terminated, truncated, info


def test_truncation_bootstraps_from_the_final_observation():
    # A 5-step time limit truncates every episode that has not terminated.
    def make(ctx):
        env = gym.make("CartPole-v1", max_episode_steps=5)
        return _RecordTruncations(env, ctx.vector_index)

    config = (
        ImpalaConfig()
        .environment(make)
        .env_runners(num_envs_per_env_runner=2, rollout_fragment_length=12)
        .training(model={"fcnet_hiddens": [8]})
        .debugging(seed=1)
    )
    runner = EnvRunner(runner_spec(config), worker_index=1)
    weights = _weights(runner, config, scale=1.0)
    runner.set_weights({DEFAULT_POLICY_ID: (weights, 0)})
    batch = runner.sample().batches[DEFAULT_POLICY_ID]
    truncated = batch["truncateds"] & ~batch["terminateds"]
    vb, vf = batch["values_bootstrapped"], batch["vf_preds"]

    # V(final observation), from the model's own forward pass on what the env returned.
    model = build_model(runner.observation_space, runner.action_space, config.model)
    model.set_weights(weights)
    for row in range(2):
        cols = np.flatnonzero(truncated[row])
        finals = _RecordTruncations.finals[row]
        assert len(cols) == len(finals) >= 2
        _, expected = model(np.stack(finals))
        np.testing.assert_allclose(vb[row, cols], np.asarray(expected), rtol=1e-5, atol=1e-6)
        # Not the value of the reset observation that follows (the next step's behaviour value).
        inner = cols[cols < batch["truncateds"].shape[1] - 1]
        assert inner.size and not np.allclose(vb[row, inner], vf[row, inner + 1])


def test_episodes_continue_across_fragments_and_report_returns():
    runner = _runner(envs=2, horizon=5)
    episodes: list[Episode] = []
    for _ in range(30):
        episodes += runner.sample().episodes
    assert episodes
    for episode in episodes:  # CartPole: reward 1 per step.
        assert episode.ret == float(episode.length)
        assert episode.policy_returns == {DEFAULT_POLICY_ID: [episode.ret]}
    assert max(e.length for e in episodes) > 5  # longer than one fragment


def test_same_seed_same_fragments_and_distinct_env_seeds():
    a, b = _runner(seed=3), _runner(seed=3)
    for _ in range(2):
        fa, fb = a.sample().batches[DEFAULT_POLICY_ID], b.sample().batches[DEFAULT_POLICY_ID]
        for key in fa:
            np.testing.assert_array_equal(fa[key], fb[key])
    other = _runner(seed=3, worker=2).sample().batches[DEFAULT_POLICY_ID]
    assert not np.array_equal(other["obs"], a.sample().batches[DEFAULT_POLICY_ID]["obs"])
    assert len({env_seed(3, w, j) for w in (1, 2) for j in range(3)}) == 6


def test_clip_rewards_and_observations_left_unpacked():
    # compress_observations packs fragments in the actor process, at the transport
    # (impala_tf.rollout.host.RunnerHost.sample), not in sample().
    runner = _runner(clip_rewards=0.5, compress_observations=True)
    fragment = runner.sample()
    batch = fragment.batches[DEFAULT_POLICY_ID]
    assert not batch.compressed
    assert np.all(batch["rewards"] == 0.5)
    assert decompress(batch)["obs"].shape == (3, 7, 4)
    assert all(e.ret == float(e.length) for e in fragment.episodes)  # reported unclipped


def test_gym_make_kwargs_come_from_env_config():
    runner = _runner(envs=1, horizon=10, env_config={"max_episode_steps": 3})
    assert runner.env_batch.env.max_episode_steps == 3  # CartPole's vector env.
    evaluation = _runner(envs=1, horizon=10, worker=0, env_config={"max_episode_steps": 3})
    assert evaluation.envs[0].spec.max_episode_steps == 3
    batch = runner.sample().batches[DEFAULT_POLICY_ID]
    # Every 3rd step ends the episode: truncated by the time limit unless it terminated first.
    ends = batch["truncateds"] | batch["terminateds"]
    assert ends[0, 2] and ends[0, 5] and ends[0, 8]
