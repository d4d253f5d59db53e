"""GymVectorEnvBatch: gymnasium vector envs as an env runner's envs.

The reference is today's per-env path (`GymEnvBatch` over `gym.make` envs): the same physics,
rewards, ends and bootstrapping observations, step by step, with same-step resets whatever the
vector env's autoreset mode.
"""

from __future__ import annotations

import dataclasses

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from impala_tf.config import ImpalaConfig
from impala_tf.driver.specs import env_spec, runner_spec
from impala_tf.envs.batch import GymEnvBatch, GymVectorEnvBatch
from impala_tf.envs.faults import EnvGuard, NonFiniteEnvError
from impala_tf.envs.make import EnvContext, EnvSpec, make_env_batch
from impala_tf.models import build_model
from impala_tf.rollout.env_runner import EnvRunner
from impala_tf.rollout.fragment import DEFAULT_POLICY_ID


def _config(env="CartPole-v1", **env_config) -> ImpalaConfig:
    return ImpalaConfig().environment(env, env_config=env_config).debugging(seed=3)


def _spec(config: ImpalaConfig, num_envs: int) -> EnvSpec:
    """`config`'s env spec, for a runner of `num_envs` envs."""
    return dataclasses.replace(env_spec(config), num_envs=num_envs)


def test_cartpole_training_runners_step_its_vector_entry_point():
    batch = make_env_batch(_spec(_config(), 8), worker_index=1)
    assert isinstance(batch, GymVectorEnvBatch)
    assert type(batch.env).__name__ == "CartPoleVectorEnv" and batch.num_envs == 8
    # Evaluation (worker 0) keeps gymnasium envs: it renders and wraps them.
    assert isinstance(make_env_batch(_spec(_config(), 2), worker_index=0), GymEnvBatch)
    # An env_config key the vector class does not take: the per-env path.
    from gymnasium.envs.classic_control.cartpole import CartPoleEnv, CartPoleVectorEnv

    class Single(CartPoleEnv):
        def __init__(self, extra=0, **kwargs):
            super().__init__(**kwargs)

    gym.register("ImpalaTfVectorProbe-v0", Single, vector_entry_point=CartPoleVectorEnv)
    try:
        probe = _config("ImpalaTfVectorProbe-v0")
        assert isinstance(make_env_batch(_spec(probe, 2), 1), GymVectorEnvBatch)
        odd = _config("ImpalaTfVectorProbe-v0", extra=1)
        assert isinstance(make_env_batch(_spec(odd, 2), 1), GymEnvBatch)
    finally:
        del gym.registry["ImpalaTfVectorProbe-v0"]
    # Keys it does take reach it.
    short = make_env_batch(_spec(_config(max_episode_steps=7), 2), worker_index=1)
    assert isinstance(short, GymVectorEnvBatch) and short.env.max_episode_steps == 7
    # No vector entry point (the shipped StatelessCartPole): the per-env path.
    import impala_tf.envs  # noqa: F401 - registers the shipped envs.

    assert isinstance(
        make_env_batch(_spec(_config("impala_tf/StatelessCartPole-v1"), 2), 1), GymEnvBatch
    )


@pytest.mark.parametrize("limit", [500, 6])
def test_cartpole_vector_steps_match_single_envs(limit):
    """Each step of the vector batch equals a `GymEnvBatch` of gymnasium's CartPole envs put in
    the same states: observations, rewards, terminations, truncations and the observations
    truncated episodes ended on (what the runner bootstraps from)."""
    n, rng = 6, np.random.default_rng(0)
    vector = GymVectorEnvBatch(
        gym.make_vec(
            "CartPole-v1", n, vectorization_mode="vector_entry_point", max_episode_steps=limit
        )  # fmt: skip
    )
    single = GymEnvBatch([gym.make("CartPole-v1", max_episode_steps=limit) for _ in range(n)])
    obs = vector.reset([5] * n)
    single.reset([None] * n)

    def align(rows):  # The single envs take over the vector env's fresh states.
        for j in rows:
            env = single.envs[j]
            env.unwrapped.state = vector.env.state[:, j].copy()
            _time_limit(env)._elapsed_steps = 0

    align(range(n))
    ends = truncations = 0
    lengths = np.zeros(n, int)
    for _ in range(300):
        actions = rng.integers(0, 2, n)
        got, want = vector.step(actions), single.step(actions)
        lengths += 1
        ended = got.terminateds | got.truncateds
        np.testing.assert_array_equal(got.rewards, want.rewards)
        assert (got.rewards == 1.0).all()  # No reset step with a zero reward.
        np.testing.assert_array_equal(got.terminateds, want.terminateds)
        np.testing.assert_array_equal(got.truncateds, want.truncateds)
        np.testing.assert_array_equal(got.episode_ends, ended)
        assert set(got.final_obs) == set(want.final_obs)
        for j, final in got.final_obs.items():
            np.testing.assert_allclose(final, want.final_obs[j], rtol=1e-6)
            assert lengths[j] == limit
        live = ~ended
        np.testing.assert_allclose(got.obs[live], want.obs[live], rtol=1e-6, atol=1e-7)
        # Ended envs start again in this step, from a state drawn in CartPole's reset bounds.
        assert (np.abs(got.obs[ended]) <= 0.05).all()
        ends += int(ended.sum())
        truncations += len(got.final_obs)
        lengths[ended] = 0
        align(np.flatnonzero(ended))
        obs = got.obs
    assert obs.shape == (n, 4)
    assert ends > 20
    assert (truncations > 10) == (limit == 6)


def _time_limit(env: gym.Env) -> gym.wrappers.TimeLimit:
    while not isinstance(env, gym.wrappers.TimeLimit):
        env = env.env
    return env


def test_same_seed_same_steps_and_collect_infos():
    def run(seed):
        batch = make_env_batch(_spec(_config(), 4), worker_index=1)
        batch.collect_infos = True
        out = [batch.reset([seed] * 4)]
        for _ in range(40):
            step = batch.step(np.zeros(4, np.int64))  # Always left: episodes of ~10 steps.
            out.append(step.obs)
            assert len(step.infos) == 4
            # The observation each ended episode ended on: past CartPole's 12-degree limit.
            for j, last in step.ended_obs.items():
                assert step.terminateds[j] and abs(last[2]) > 0.2
        return np.stack(out)

    np.testing.assert_array_equal(run(7), run(7))
    assert not np.array_equal(run(7), run(8))


class _Flaky(gym.Env):
    """A CartPole-shaped env whose reward turns NaN at step `bad`."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, bad=3, limit=4):
        self.bad, self.limit, self.t = bad, limit, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.t += 1
        reward = float("nan") if self.t == self.bad else 1.0
        obs = np.full(2, self.t / 10, np.float32)
        return obs, reward, False, self.t >= self.limit, {"t": self.t}


def _sync(mode, n=3, **kwargs):
    return SyncVectorEnv([lambda: _Flaky(**kwargs) for _ in range(n)], autoreset_mode=mode)


@pytest.mark.parametrize("mode", [AutoresetMode.SAME_STEP, AutoresetMode.DISABLED])
def test_same_step_and_disabled_vector_envs_reset_in_the_ending_step(mode):
    batch = GymVectorEnvBatch(_sync(mode, bad=99, limit=4))
    batch.reset([1, 2, 3])
    for t in range(1, 9):
        step = batch.step(np.zeros(3, np.int64))
        if t % 4 == 0:  # Truncated: bootstrapped from the observation it ended on.
            assert step.truncateds.all() and not step.terminateds.any()
            for j in range(3):
                np.testing.assert_allclose(step.final_obs[j], [0.4, 0.4])
            np.testing.assert_allclose(step.obs, 0.0)  # Already reset.
        else:
            assert not step.truncateds.any() and not step.final_obs
            np.testing.assert_allclose(step.obs, t % 4 / 10)


def test_next_step_vector_envs_other_than_cartpole_are_refused():
    with pytest.raises(ValueError, match="NEXT_STEP.*SAME_STEP"):
        GymVectorEnvBatch(_sync(AutoresetMode.NEXT_STEP))


@pytest.mark.parametrize("mode", [AutoresetMode.SAME_STEP, AutoresetMode.DISABLED])
def test_a_non_finite_reward_raises_or_drops_its_episode(mode):
    batch = GymVectorEnvBatch(_sync(mode, bad=3, limit=50), EnvGuard("'flaky'", "actor 0"))
    batch.reset([1, 2, 3])
    batch.step(np.zeros(3, np.int64))
    batch.step(np.zeros(3, np.int64))
    with pytest.raises(NonFiniteEnvError, match="'flaky'.*non-finite reward"):
        batch.step(np.zeros(3, np.int64))

    guard = EnvGuard("'flaky'", "actor 0", drop_nonfinite=True)
    batch = GymVectorEnvBatch(_sync(mode, bad=3, limit=50), guard)
    batch.reset([1, 2, 3])
    for _ in range(2):
        batch.step(np.zeros(3, np.int64))
    step = batch.step(np.zeros(3, np.int64))
    assert step.dropped.all() and step.truncateds.all() and not step.episode_ends.any()
    assert (step.rewards == 0.0).all() and not step.final_obs
    np.testing.assert_allclose(step.obs, 0.0)  # Cut and started again.
    step = batch.step(np.zeros(3, np.int64))
    assert not step.dropped.any()
    np.testing.assert_allclose(step.obs, 0.1)


def test_runner_on_the_vector_env_reports_exact_episode_returns():
    """CartPole's return is its length: every reported episode's return equals its length, and
    truncated steps carry the value of the observation the episode ended on."""
    config = (
        ImpalaConfig()
        .environment("CartPole-v1", env_config={"max_episode_steps": 9})
        .env_runners(num_envs_per_env_runner=4, rollout_fragment_length=20)
        .training(model={"fcnet_hiddens": [8]})
        .debugging(seed=2)
    )
    runner = EnvRunner(runner_spec(config), worker_index=1)
    assert isinstance(runner.env_batch, GymVectorEnvBatch)
    model = build_model(runner.observation_space, runner.action_space, config.model)
    runner.set_weights({DEFAULT_POLICY_ID: (model.get_weights(), 0)})
    episodes = []
    for _ in range(3):
        sample = runner.sample()
        episodes.extend(sample.episodes)
        batch = sample.batches[DEFAULT_POLICY_ID]
        assert (batch["rewards"] == 1.0).all()
    assert len(episodes) > 8
    for episode in episodes:
        assert episode.ret == episode.length <= 9
    runner.close()


def _vector_creator(context):
    """An env_creator returning one vector env for all of a runner's envs."""
    return SyncVectorEnv(
        [lambda: gym.make("CartPole-v1", max_episode_steps=9)] * context.num_envs,
        autoreset_mode=AutoresetMode.SAME_STEP,
    )


def test_an_env_creator_may_return_a_vector_env():
    from impala_tf.driver.specs import probe_spaces

    config = (
        ImpalaConfig()
        .environment(_vector_creator)
        .env_runners(num_envs_per_env_runner=3, rollout_fragment_length=20)
        .training(model={"fcnet_hiddens": [8]})
        .debugging(seed=4)
    )
    spaces = probe_spaces(config).policies[DEFAULT_POLICY_ID]
    assert spaces[0].shape == (4,) and spaces[1].n == 2
    runner = EnvRunner(runner_spec(config), worker_index=1)
    assert isinstance(runner.env_batch, GymVectorEnvBatch) and runner.env_batch.num_envs == 3
    model = build_model(runner.observation_space, runner.action_space, config.model)
    runner.set_weights({DEFAULT_POLICY_ID: (model.get_weights(), 0)})
    episodes = runner.sample().episodes
    assert episodes and all(e.ret == e.length <= 9 for e in episodes)
    runner.close()

    wrong = config.copy().env_runners(num_envs_per_env_runner=3)
    wrong.env = lambda context: _vector_creator(EnvContext({}, 1, 0, 1, num_envs=2))
    with pytest.raises(ValueError, match="VectorEnv of 2 envs for a runner of 3"):
        make_env_batch(env_spec(wrong), 1)
