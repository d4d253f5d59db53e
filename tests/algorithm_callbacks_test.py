"""RLlib's callbacks: the hooks each runner calls and when, the episodes they see, custom metrics
in the result dict, and the error a raising hook stops the run with.

The runtime scenarios on every placement (processes, Ray; one and two policies) are in
`tests/runtime_conformance_test.py`; these drive the runners in this process.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from impala_tf.config import ImpalaConfig
from impala_tf.config.callbacks import (
    CallbackError,
    Callbacks,
    DefaultCallbacks,
    custom_metric_stats,
    hist_stats,
    make_multi_callbacks,
    resolve_callbacks,
)
from impala_tf.data.sample_batch import MultiAgentBatch, SampleBatch
from impala_tf.driver.counters import Counters
from impala_tf.driver.metrics import Metrics
from impala_tf.driver.specs import runner_spec
from impala_tf.models import build_model
from impala_tf.rollout.env_runner import EnvRunner
from impala_tf.rollout.fragment import DEFAULT_POLICY_ID, Episode, Fragment
from impala_tf.rollout.multi_agent_runner import MultiAgentEnvRunner
from impala_tf.training.reporting import tensorboard_scalars
from tests.support import callbacks as cbs

#: Every hook call of the `Recorder` callbacks of this process: (hook, env index, length).
CALLS: list[tuple] = []


class Recorder(DefaultCallbacks):
    """Records each hook call and the episode's state; sets the metrics RLlib's example sets."""

    def on_episode_start(self, *, worker, base_env, policies, episode, env_index, **kwargs):
        CALLS.append(("start", env_index, episode.length, episode.episode_id))
        episode.user_data["obs"] = [episode.last_raw_obs_for(episode.get_agents()[0])]

    def on_episode_step(self, *, worker, base_env, episode, env_index, **kwargs):
        agent = episode.get_agents()[0]
        CALLS.append(("step", env_index, episode.length, episode.episode_id))
        assert episode.last_action_for(agent) is not None
        episode.user_data["obs"].append(episode.last_raw_obs_for(agent))

    def on_episode_end(self, *, worker, base_env, policies, episode, env_index, **kwargs):
        CALLS.append(("end", env_index, episode.length, episode.episode_id))
        episode.custom_metrics["length"] = episode.length
        episode.custom_metrics["reward"] = episode.total_reward
        episode.hist_data["obs0"] = [float(np.ravel(o)[0]) for o in episode.user_data["obs"]]

    def on_sample_end(self, *, worker, samples, **kwargs):
        CALLS.append(("sample", type(samples).__name__, samples.count))


def _config(**overrides) -> ImpalaConfig:
    return (
        ImpalaConfig()
        .environment("CartPole-v1")
        .env_runners(num_envs_per_env_runner=2, rollout_fragment_length=40)
        .training(model={"fcnet_hiddens": [8]})
        .debugging(seed=3)
        .update_from_dict(overrides)
    )


def _runner(config: ImpalaConfig, cls: type = Recorder) -> EnvRunner:
    runner = EnvRunner(runner_spec(config, callbacks=resolve_callbacks(cls)), worker_index=1)
    model = build_model(runner.observation_space, runner.action_space, config.model)
    runner.set_weights({DEFAULT_POLICY_ID: (model.get_weights(), 0)})
    return runner


def test_episode_hooks_run_in_order_and_their_metrics_travel_with_the_episode():
    CALLS.clear()
    runner = _runner(_config())
    episodes = [e for _ in range(3) for e in runner.sample().episodes]
    assert episodes, "CartPole with random weights ends episodes within 120 steps"
    for j in range(2):
        calls = [c for c in CALLS if c[0] != "sample" and c[1] == j]
        assert calls[0][:3] == ("start", j, 0)
        current = None
        for hook, _, length, episode_id in calls:
            if hook == "start":
                assert length == 0 and episode_id != current
                current, expected = episode_id, 1
            else:
                assert (episode_id, length) == (current, expected)
                expected += 1
    ends = [c for c in CALLS if c[0] == "end"]
    assert len(ends) == len(episodes)
    for episode in episodes:
        assert episode.custom_metrics["length"] == episode.length
        assert episode.custom_metrics["reward"] == episode.ret
        # The first observation, then one per step but the last (no step hook after it).
        assert len(episode.hist_data["obs0"]) == episode.length
    assert [c for c in CALLS if c[0] == "sample"] == [("sample", "SampleBatch", 80)] * 3


def test_runners_without_episode_hooks_keep_no_episodes():
    class OnlySampleEnd(DefaultCallbacks):
        def on_sample_end(self, **kwargs):
            pass

    runner = _runner(_config(), OnlySampleEnd)
    assert not runner.callbacks.episodes and not runner.env_batch.collect_infos
    episodes = [e for _ in range(3) for e in runner.sample().episodes]
    assert all(e.custom_metrics == {} for e in episodes)


def test_the_episode_sees_the_final_observation_and_info():
    seen = []

    class Final(DefaultCallbacks):
        def on_episode_end(self, *, episode, **kwargs):
            seen.append((episode.last_raw_obs_for(), episode.last_info_for()))

    runner = _runner(_config(num_envs_per_env_runner=1), Final)
    for _ in range(4):
        runner.sample()
    assert seen
    for obs, info in seen:  # CartPole ends when the pole or the cart leaves its bounds.
        assert abs(obs[2]) > 0.2 or abs(obs[0]) > 2.4
        assert isinstance(info, dict)


def test_a_multi_agent_runner_calls_the_hooks_per_episode_and_on_sample_end_with_all_batches():
    CALLS.clear()
    config = _config(env="impala_tf/MultiAgentCartPole", env_config={"num_agents": 2}).multi_agent(
        policies=["p0", "p1"], policy_mapping_fn="impala_tf.config.policies.PolicyMappingFn"
    )
    runner = MultiAgentEnvRunner(
        runner_spec(config, callbacks=resolve_callbacks(Recorder)), worker_index=1
    )
    weights = {}
    for pid, (obs, act) in runner.spaces.items():
        weights[pid] = (build_model(obs, act, config.model).get_weights(), 0)
    runner.set_weights(weights)
    episodes = [e for _ in range(3) for e in runner.sample().episodes]
    assert episodes
    for episode in episodes:
        assert episode.custom_metrics["length"] == episode.length
        assert episode.custom_metrics["reward"] == pytest.approx(episode.ret)
    samples = [c for c in CALLS if c[0] == "sample"]
    assert samples == [("sample", "MultiAgentBatch", 80)] * 3


def test_a_raising_hook_names_the_hook_and_the_class():
    runner = _runner(_config(), cbs.FailingEpisodeEnd)
    with pytest.raises(CallbackError, match="FailingEpisodeEnd.on_episode_end raised in actor 0"):
        for _ in range(5):
            runner.sample()
    assert CallbackError.fatal  # An actor is not restarted for it.


def test_the_callbacks_setting_is_checked_when_the_config_is():
    assert resolve_callbacks(None) is None and resolve_callbacks(DefaultCallbacks) is None
    assert resolve_callbacks("tests.support.callbacks:EpisodeStats").obj is cbs.EpisodeStats
    with pytest.raises(ValueError, match="callbacks_class.*subclass of impala_tf.DefaultCallbacks"):
        resolve_callbacks(dict)
    with pytest.raises(ValueError, match="does not resolve"):
        resolve_callbacks("tests.support.callbacks:NoSuchCallbacks")

    class LearnOnBatch(DefaultCallbacks):
        def on_learn_on_batch(self, **kwargs):
            pass

    with pytest.raises(ValueError, match="on_learn_on_batch.*does not call"):
        ImpalaConfig().callbacks(LearnOnBatch).validate()
    config = ImpalaConfig.from_dict({"callbacks": "tests.support.callbacks:EpisodeStats"})
    assert config.callbacks_class == "tests.support.callbacks:EpisodeStats"


def test_multi_callbacks_call_every_member_in_turn():
    order = []

    class A(DefaultCallbacks):
        def on_train_result(self, *, result, **kwargs):
            order.append("a")

    class B(DefaultCallbacks):
        def on_train_result(self, *, result, **kwargs):
            order.append("b")

    callbacks = Callbacks(resolve_callbacks([A, B]))
    assert "on_train_result" in callbacks and "on_episode_end" not in callbacks
    callbacks("on_train_result", algorithm=None, result={})
    callbacks = Callbacks(resolve_callbacks(make_multi_callbacks([B, A])))
    callbacks("on_train_result", algorithm=None, result={})
    assert order == ["a", "b", "b", "a"]


def test_custom_metrics_are_summarised_as_rllib_does_nan_left_out():
    episodes = [
        Episode(1.0, 1, {}, {"x": 1.0, "y": math.nan}, {"h": [1.0]}),
        Episode(2.0, 2, {}, {"x": 3.0, "y": math.nan}, {"h": [2.0, 3.0]}),
        Episode(3.0, 3, {}, {"x": math.nan}),
    ]
    stats = custom_metric_stats(episodes)
    assert (stats["x_mean"], stats["x_min"], stats["x_max"]) == (2.0, 1.0, 3.0)
    assert all(math.isnan(stats[f"y_{s}"]) for s in ("mean", "min", "max"))
    hist = hist_stats(episodes)
    assert hist == {
        "episode_reward": [1.0, 2.0, 3.0],
        "episode_lengths": [1, 2, 3],
        "h": [1.0, 2.0, 3.0],
    }


def test_the_result_dict_and_tensorboard_carry_the_window_s_custom_metrics():
    metrics = Metrics(2, ["default_policy"], False)
    batch = SampleBatch({"rewards": np.zeros((1, 1), np.float32)})
    for ret in (1.0, 2.0, 6.0):
        metrics.record_fragment(
            Fragment({"default_policy": batch}, 1, 1, {}, [Episode(ret, 1, {}, {"r": ret})])
        )
    result = metrics.result(Counters(), 1.0, 1, 1.0, {"num_healthy_workers": 1,
                                               "num_in_flight_async_sample_reqs": 0,
                                               "node_ip": "127.0.0.1"})  # fmt: skip
    assert result["custom_metrics"] == {"r_mean": 4.0, "r_min": 2.0, "r_max": 6.0}
    assert result["hist_stats"]["episode_reward"] == [2.0, 6.0]
    scalars = tensorboard_scalars(result, raw=False)
    assert scalars["custom_metrics/r_mean"] == 4.0
    restored = Metrics(2, ["default_policy"], False)
    restored.set_state(metrics.get_state())
    assert [e.custom_metrics for e in restored.episodes] == [{"r": 2.0}, {"r": 6.0}]


def test_multi_agent_batch_counts_env_and_agent_steps():
    batch = SampleBatch({"rewards": np.zeros((2, 5), np.float32)})
    samples = MultiAgentBatch({"p0": batch, "p1": batch}, 5)
    assert samples.count == samples.env_steps() == 5 and samples.agent_steps() == 20
