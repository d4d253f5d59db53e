"""Off-policyness: each step labelled with the weights that acted; batches report its mean."""

from __future__ import annotations

import numpy as np

from impala_tf.config import ImpalaConfig
from impala_tf.data.batching import BatchBuilder
from impala_tf.data.sample_batch import SampleBatch
from impala_tf.driver.aggregation import Aggregator
from impala_tf.driver.specs import aggregator_spec, runner_spec
from impala_tf.models import build_model
from impala_tf.rollout.env_runner import EnvRunner
from impala_tf.rollout.fragment import DEFAULT_POLICY_ID, POLICY_VERSION


def _runner(envs: int = 2, horizon: int = 5) -> tuple[EnvRunner, list[np.ndarray]]:
    config = (
        ImpalaConfig()
        .environment("CartPole-v1")
        .env_runners(num_envs_per_env_runner=envs, rollout_fragment_length=horizon)
        .training(model={"fcnet_hiddens": [8]})
        .debugging(seed=0)
    )
    runner = EnvRunner(runner_spec(config), worker_index=1)
    model = build_model(runner.observation_space, runner.action_space, config.model)
    return runner, model.get_weights()


def _load(runner: EnvRunner, weights: list[np.ndarray], version: int) -> None:
    runner.set_weights({DEFAULT_POLICY_ID: (weights, version)})


def _versions(fragment) -> np.ndarray:
    return fragment.batches[DEFAULT_POLICY_ID][POLICY_VERSION]


def test_first_step_after_a_broadcast_is_labelled_with_the_old_weights():
    runner, weights = _runner()
    _load(runner, weights, 3)
    first = runner.sample()
    np.testing.assert_array_equal(_versions(first), np.full((2, 5), 3))
    _load(runner, weights, 8)
    second = runner.sample()
    versions = _versions(second)
    assert versions.dtype == np.int64 and versions.shape == (2, 5)
    # Step 0's action was computed at the end of the previous fragment, with version 3.
    np.testing.assert_array_equal(versions[:, 0], [3, 3])
    np.testing.assert_array_equal(versions[:, 1:], np.full((2, 4), 8))
    assert second.policy_versions == {DEFAULT_POLICY_ID: 8}
    third = runner.sample()
    np.testing.assert_array_equal(_versions(third), np.full((2, 5), 8))


def test_snapshot_keeps_the_version_of_the_precomputed_step():
    runner, weights = _runner()
    _load(runner, weights, 2)
    runner.sample()
    state = runner.get_state()
    _load(runner, weights, 6)
    other, _ = _runner()
    other.set_state(state)
    _load(other, weights, 6)
    np.testing.assert_array_equal(_versions(other.sample())[:, 0], [2, 2])


def _labelled(rows: int, version_per_step: np.ndarray) -> SampleBatch:
    horizon = version_per_step.shape[-1]
    return SampleBatch(
        {
            "rewards": np.zeros((rows, horizon), np.float32),
            POLICY_VERSION: np.broadcast_to(version_per_step, (rows, horizon)).copy(),
        }
    )


def test_batch_version_is_the_step_weighted_mean_of_the_labels():
    builder = BatchBuilder(rows=3)
    # The `version` argument (the fragment's) is ignored where steps are labelled.
    assert builder.add(_labelled(2, np.array([1, 4, 4, 4])), version=4.0) == []
    ((batch, version),) = builder.add(_labelled(2, np.array([4, 9, 9, 9])), version=9.0)
    assert len(batch) == 3
    expected = np.mean([1, 4, 4, 4] * 2 + [4, 9, 9, 9])
    assert version == expected
    # Unlabelled batches still use the argument.
    ((_, version),) = BatchBuilder(rows=1).add(
        SampleBatch({"rewards": np.zeros((1, 4), np.float32)}), version=5.0
    )
    assert version == 5.0


def test_replayed_batches_keep_the_version_they_were_sampled_with():
    config = ImpalaConfig(env="CartPole-v1", replay_proportion=10.0, replay_buffer_num_slots=4)
    config.debugging(seed=0)
    aggregator = Aggregator(aggregator_spec(config, {DEFAULT_POLICY_ID: 1}))
    first = aggregator.process({DEFAULT_POLICY_ID: _labelled(1, np.array([1, 1, 1]))}, {})
    second = aggregator.process({DEFAULT_POLICY_ID: _labelled(1, np.array([7, 7, 7]))}, {})
    # Every train batch reports the version of its own steps, replayed or new ...
    for _, batch, version in first + second:
        assert version == float(batch[POLICY_VERSION].mean())
    # ... so the batch sampled with version 1, replayed after version 7 arrived, reports 1.
    assert {version for _, _, version in second} == {1.0, 7.0}
