"""Tests of impala_tf.training.reporting: TensorBoard tags read back from the event files,
result.json, and the console progress line."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from impala_tf.training.reporting import (
    ResultWriter,
    flatten,
    lookup,
    progress_line,
    tensorboard_scalars,
)


def make_result(iteration: int, steps: int, reward: float = 21.5, evaluation: bool = False):
    """A result dict shaped like `Impala.train()`'s, with distinct values to tell apart."""
    result = {
        "episode_reward_mean": reward,
        "episode_reward_min": reward - 10,
        "episode_reward_max": reward + 10,
        "episode_len_mean": reward,
        "episodes_this_iter": 3,
        "episodes_total": 3 * iteration,
        "env_runners": {"episode_return_mean": reward, "num_episodes": 3},
        "training_iteration": iteration,
        "timesteps_total": steps,
        "time_this_iter_s": 1.25,
        "time_total_s": 1.25 * iteration,
        "num_env_steps_sampled": steps,
        "num_env_steps_trained": steps - 40,
        "num_times_learner_queue_full": 2,
        "num_env_steps_sampled_throughput_per_sec": 812.0,
        "num_env_steps_trained_throughput_per_sec": 790.0,
        "num_healthy_workers": 2,
        "counters": {
            "num_env_steps_sampled": steps,
            "num_env_steps_trained": steps - 40,
            "num_weight_broadcasts": 7,
        },
        "info": {
            "learner": {
                "default_policy": {
                    "learner_stats": {
                        "cur_lr": 0.0005,
                        "policy_loss": -0.25,
                        "entropy": 0.69,
                        "entropy_coeff": 0.01,
                        "var_gnorm": 12.0,
                        "vf_loss": 3.5,
                        "vf_explained_var": 0.4,
                        "grad_gnorm": 2.0,
                        "total_loss": 1.5,
                        "num_agent_steps_trained": steps - 40,
                        "num_grad_updates_lifetime": 9,
                    },
                    "num_agent_steps_trained": steps - 40,
                    "num_grad_updates_lifetime": 9,
                    "diff_num_grad_updates_vs_sampler_policy": 1.5,
                }
            },
            "learner_queue": {
                "size_count": 9,
                "size_mean": 0.5,
                "size_std": 0.25,
                "size_quantiles": [0.0, 0.0, 0.5, 1.0, 1.0],
            },
            "timing_breakdown": {
                "learner_grad_time_ms": 4.5,
                "learner_load_time_ms": 0.5,
                "learner_load_wait_time_ms": 1.5,
                "learner_dequeue_time_ms": 2.5,
            },
        },
        "date": "2026-01-01_00-00-00",
        "hostname": "host",
        "done": False,
    }
    if evaluation:
        result["evaluation"] = {
            "episode_reward_mean": 99.0,
            "episode_reward_min": 90.0,
            "episode_reward_max": 120.0,
            "episode_len_mean": 99.0,
            "episodes_this_iter": 5,
            "time_this_iter_s": 0.75,
        }
    return result


def test_curated_tags_carry_the_result_values():
    scalars = tensorboard_scalars(make_result(2, 800, evaluation=True), raw=False)
    expected = {
        "episode/return_mean": 21.5,
        "episode/return_min": 11.5,
        "episode/return_max": 31.5,
        "episode/length_mean": 21.5,
        "episode/episodes_this_iter": 3,
        "episode/episodes_total": 6,
        "evaluation/return_mean": 99.0,
        "evaluation/return_min": 90.0,
        "evaluation/return_max": 120.0,
        "evaluation/length_mean": 99.0,
        "evaluation/episodes": 5,
        "evaluation/time_s": 0.75,
        "learner/learning_rate": 0.0005,
        "learner/entropy_coeff": 0.01,
        "learner/policy_loss": -0.25,
        "learner/vf_loss": 3.5,
        "learner/entropy": 0.69,
        "learner/total_loss": 1.5,
        "learner/vf_explained_var": 0.4,
        "learner/grad_gnorm": 2.0,
        "learner/var_gnorm": 12.0,
        "learner/num_agent_steps_trained": 760,
        "learner/num_grad_updates": 9,
        "learner/off_policyness": 1.5,
        "learner_queue/size_mean": 0.5,
        "learner_queue/size_std": 0.25,
        "learner_queue/size_p0": 0.0,
        "learner_queue/size_p50": 0.5,
        "learner_queue/size_p100": 1.0,
        "learner_queue/times_full": 2,
        "timing/iteration_s": 1.25,
        "timing/learner_grad_time_ms": 4.5,
        "timing/learner_load_time_ms": 0.5,
        "timing/learner_load_wait_time_ms": 1.5,
        "timing/learner_dequeue_time_ms": 2.5,
        "throughput/env_steps_sampled_per_s": 812.0,
        "throughput/env_steps_trained_per_s": 790.0,
        "counters/env_steps_sampled": 800,
        "counters/env_steps_trained": 760,
        "counters/weight_broadcasts": 7,
        "counters/healthy_env_runners": 2,
        "counters/training_iteration": 2,
    }
    for tag, value in expected.items():
        assert scalars.get(tag) == pytest.approx(value), tag
    # Every learner stat has a tag; none appears twice under two names.
    assert "learner/cur_lr" not in scalars
    assert "learner/num_grad_updates_lifetime" not in scalars
    assert not any(tag.startswith("raw/") for tag in scalars)


def test_raw_tags_hold_every_numeric_leaf_and_nan_gives_no_tag():
    result = make_result(1, 400, reward=float("nan"))
    scalars = tensorboard_scalars(result)
    assert "episode/return_mean" not in scalars  # NaN before the first episode.
    assert "raw/episode_reward_mean" not in scalars
    assert "evaluation/return_mean" not in scalars  # Not an evaluation iteration.
    assert scalars["raw/info/learner/default_policy/learner_stats/vf_loss"] == 3.5
    assert scalars["raw/info/timing_breakdown/learner_grad_time_ms"] == 4.5
    assert {f"raw/{key}" for key, _ in flatten(result)} <= set(scalars)
    assert "raw/done" not in scalars and "raw/date" not in scalars  # Not numbers.
    assert all(math.isfinite(v) for v in scalars.values())


def test_lookup_reads_nested_and_flat_keys():
    result = make_result(1, 400, evaluation=True)
    assert lookup(result, "evaluation/episode_reward_mean") == 99.0
    assert lookup(result, "evaluation/missing", "x") == "x"
    assert lookup({"a/b": 1}, "a/b") == 1


def test_event_files_read_back_with_tags_and_steps(tmp_path):
    from tensorboard.backend.event_processing import event_accumulator

    writer = ResultWriter(str(tmp_path))
    steps = [400, 800, 1200]
    for i, step in enumerate(steps, 1):
        writer.write(make_result(i, step, reward=10.0 * i, evaluation=(i == 2)))
    writer.write_histograms(1200, [("torso/dense/kernel", np.arange(6.0).reshape(2, 3))])
    writer.close()

    lines = (tmp_path / "result.json").read_text().splitlines()
    assert [json.loads(line)["training_iteration"] for line in lines] == [1, 2, 3]

    accumulator = event_accumulator.EventAccumulator(
        str(tmp_path), size_guidance={event_accumulator.TENSORS: 0}
    )
    accumulator.Reload()
    tags = set(accumulator.Tags()["tensors"])
    assert {
        "episode/return_mean",
        "learner/vf_loss",
        "learner/learning_rate",
        "learner/entropy_coeff",
        "learner/off_policyness",
        "learner_queue/size_mean",
        "timing/learner_grad_time_ms",
        "throughput/env_steps_sampled_per_s",
        "throughput/env_steps_trained_per_s",
        "raw/info/learner/default_policy/learner_stats/vf_loss",
        "weights/torso/dense/kernel",
    } <= tags

    def series(tag):
        import tensorflow as tf

        return [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in accumulator.Tensors(tag)]

    assert series("episode/return_mean") == [(400, 10.0), (800, 20.0), (1200, 30.0)]
    assert series("evaluation/return_mean") == [(800, 99.0)]
    assert [step for step, _ in series("learner/vf_loss")] == steps
    histogram = accumulator.Tensors("weights/torso/dense/kernel")
    assert [e.step for e in histogram] == [1200]


def test_hist_stats_and_scalars_read_back_as_tensorflow_writes_them(tmp_path):
    # Written in one Summary built in numpy; read back as `tf.summary.histogram` and
    # `tf.summary.scalar` would have written them (float64 [30, 3] buckets, float32 scalars).
    import tensorflow as tf
    from tensorboard.backend.event_processing import event_accumulator

    rewards = [9.0, 10.0, 10.0, 35.0, 500.0]
    result = make_result(1, 400, reward=21.5)
    result["hist_stats"] = {"episode_reward": rewards, "empty": []}
    writer = ResultWriter(str(tmp_path))
    writer.write(result)
    writer.close()
    accumulator = event_accumulator.EventAccumulator(
        str(tmp_path), size_guidance={event_accumulator.TENSORS: 0}
    )
    accumulator.Reload()
    assert "hist_stats/empty" not in accumulator.Tags()["tensors"]
    (event,) = accumulator.Tensors("hist_stats/episode_reward")
    buckets = tf.make_ndarray(event.tensor_proto)
    assert event.step == 400 and buckets.shape == (30, 3) and buckets.dtype == np.float64
    assert buckets[0, 0] == 9.0 and buckets[-1, 1] == 500.0 and buckets[:, 2].sum() == 5
    assert buckets[0, 2] == 3 and buckets[-1, 2] == 1  # 9, 10, 10 in the first; 500 in the last.
    (scalar,) = accumulator.Tensors("episode/return_mean")
    assert scalar.tensor_proto.dtype == tf.float32.as_datatype_enum
    assert float(tf.make_ndarray(scalar.tensor_proto)) == 21.5
    metadata = accumulator.SummaryMetadata("episode/return_mean")
    assert metadata.plugin_data.plugin_name == "scalars"


def test_progress_line_summarises_an_iteration():
    result = make_result(3, 1200, reward=21.5, evaluation=True)
    line = progress_line(result, timestep_budget=1200 + 812 * 125)
    assert line.startswith("iter    3")
    assert "steps     1,200" in line
    assert "return 21.5 [12, 32]" in line
    assert "eval 99.0" in line
    assert "sampled 812/s" in line
    assert "pi -0.250 vf 3.500 H 0.690" in line
    # 101,500 steps left at 1200 / 3.75 s = 320 steps/s.
    assert line.endswith("ETA 5m17s")


@pytest.mark.parametrize(
    ("budget", "suffix"),
    [(None, "H 0.690"), (1200, "H 0.690"), (1200 + 320 * 3 * 3600, "ETA 3h00m")],
)
def test_progress_line_eta_only_while_the_budget_is_ahead(budget, suffix):
    assert progress_line(make_result(3, 1200), timestep_budget=budget).endswith(suffix)


def test_progress_line_shows_missing_values_as_dashes_and_nan_as_nan():
    line = progress_line({"training_iteration": 1, "episode_reward_mean": float("nan")})
    assert "return nan [-, -]" in line and "pi - vf - H -" in line
    result = make_result(3, 1200)
    stats = result["info"]["learner"]["default_policy"]["learner_stats"]
    stats.update(policy_loss=float("nan"), vf_loss=float("inf"))
    assert "pi nan vf inf H 0.690" in progress_line(result)
