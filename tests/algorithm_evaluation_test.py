"""`Impala.evaluate()` and `evaluation_interval`: in-training evaluation in the driver."""

from __future__ import annotations

import numpy as np
import pytest

from impala_tf.config import ImpalaConfig


def test_evaluation_interval_duration_explore_and_seeds():
    config = (
        ImpalaConfig()
        .environment("CartPole-v1")
        .env_runners(num_env_runners=1, num_envs_per_env_runner=2, rollout_fragment_length=10)
        .training(train_batch_size=40, model={"fcnet_hiddens": [8]})
        .reporting(min_time_s_per_iteration=0, min_sample_timesteps_per_iteration=40)
        .evaluation(evaluation_interval=2, evaluation_duration=3)
        .debugging(seed=4)
    )
    from impala_tf.algorithm import Impala

    # Lockstep, so that the learner's weights do not change between two evaluate() calls.
    algo = Impala(config, deterministic=True)
    try:
        results = [algo.train() for _ in range(2)]
        assert "evaluation" not in results[0]
        evaluation = results[1]["evaluation"]
        assert evaluation["episodes_this_iter"] == 3
        assert evaluation["episode_reward_min"] <= evaluation["episode_reward_mean"]
        assert evaluation["num_env_steps_sampled_this_iter"] == 3 * evaluation["episode_len_mean"]
        # RLlib's default: the evaluation config's `explore` (True), sampling actions.
        assert algo._eval_runner.policy.explore is True

        # Each evaluation starts new episodes from seeds derived from the seed and iteration.
        runner, starts = algo._eval_runner, []
        reset = runner.reset

        def recording_reset(seed):
            reset(seed)
            starts.append(runner._obs.copy())

        runner.reset = recording_reset
        first, again = algo.evaluate(), algo.evaluate()
        assert first == {**again, "time_this_iter_s": first["time_this_iter_s"]}
        algo._iteration += 1
        algo.evaluate()
        np.testing.assert_array_equal(starts[0], starts[1])
        assert not np.array_equal(starts[0], starts[2])

        # evaluation_config overrides apply to the evaluation runner only.
        algo.config.evaluation_config = {"explore": False}
        algo._eval_runner.close()
        algo._eval_runner = None
        greedy = algo.evaluate()
        assert algo._eval_runner.policy.explore is False
        assert greedy["episodes_this_iter"] == 3
    finally:
        algo.stop()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"seed": None}, "a `seed`"),
        ({"num_env_runners": 2}, "one actor"),
        ({"min_time_s_per_iteration": 1}, "min_time_s_per_iteration=0"),
        ({"num_sgd_iter": 2, "minibatch_buffer_size": 2}, "minibatch_buffer_size=1"),
    ],
)
def test_check_deterministic_names_what_to_change(overrides, message):
    from impala_tf.algorithm import check_deterministic

    config = (
        ImpalaConfig()
        .environment("CartPole-v1")
        .env_runners(num_env_runners=1)
        .reporting(min_time_s_per_iteration=0)
        .debugging(seed=0)
    )
    check_deterministic(config)  # Fine as it is.
    config.update_from_dict(overrides)
    with pytest.raises(ValueError, match="deterministic=True needs") as info:
        check_deterministic(config)
    assert message in str(info.value)
