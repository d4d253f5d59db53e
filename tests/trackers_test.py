"""W&B and MLflow trackers: one real training run logs to both, offline, and the logged values
are the result's (TensorBoard's tags, custom metrics, evaluation videos, the config)."""

from __future__ import annotations

import glob
import os

import pytest

from impala_tf import DefaultCallbacks
from impala_tf.training import reporting
from impala_tf.training.loop import fit
from impala_tf.training.trackers import MLflowLogger, WandbLogger, flat_params
from tests.support.configs import small_config

wandb = pytest.importorskip("wandb")
mlflow_tracking = pytest.importorskip("mlflow.tracking")


class RecordedWandbLogger(WandbLogger):
    """Also keeps what it hands the (real, offline) W&B run: an offline run's files are W&B's
    binary format, and its in-process summary lags behind the logged values."""

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        if not hasattr(self, "logged"):
            self.logged, self.run_dir, log = [], self.run.dir, self.run.log

            def recorded(data, step=None):
                self.logged.append((step, dict(data)))
                log(data, step=step)

            self.run.log = recorded


class PoleCallbacks(DefaultCallbacks):
    def on_episode_end(self, *, episode, **kwargs):
        episode.custom_metrics["pole_len"] = episode.length


def test_flat_params_flattens_nested_keys_and_encodes_the_rest():
    flat = flat_params({"lr": 0.1, "model": {"fcnet_hiddens": [8, 8], "use_lstm": False}})
    assert flat == {"lr": 0.1, "model/fcnet_hiddens": "[8, 8]", "model/use_lstm": False}


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trackers")
    config = small_config(
        callbacks=PoleCallbacks,
        evaluation_interval=2,
        evaluation_duration=1,
        evaluation_config={"render_env": True, "video_max_frames": 20},
    )
    mlflow_uri = f"file:{tmp / 'mlruns'}"
    trackers = [
        RecordedWandbLogger("impala-tf-test", name="run", directory=str(tmp), mode="offline"),
        MLflowLogger("impala-tf-test", tracking_uri=mlflow_uri, run_name="run"),
    ]
    algo = config.build()
    try:
        result = fit(algo, trackers, max_iterations=2)
    finally:
        algo.stop()
    return tmp, mlflow_uri, trackers, result


def test_mlflow_gets_the_tensorboard_scalars_custom_metrics_videos_and_config(tracked_run):
    tmp, uri, _, result = tracked_run
    client = mlflow_tracking.MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("impala-tf-test")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    expected = reporting.tensorboard_scalars(result)
    assert "raw/custom_metrics/pole_len_mean" in expected
    for tag in ("raw/custom_metrics/pole_len_mean", "raw/episode_reward_mean"):
        history = client.get_metric_history(run.info.run_id, tag)
        assert [m.step for m in history][-1] == result["timesteps_total"]
        assert history[-1].value == pytest.approx(expected[tag])
    assert run.data.params["lr"] == str(result["config"]["lr"]) if "config" in result else True
    assert run.data.params["model/fcnet_hiddens"] == "[16]"
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id, "videos")]
    assert artifacts and all(p.endswith(".gif") for p in artifacts)


def test_wandb_offline_run_gets_each_result_and_the_video(tracked_run):
    tmp, _, trackers, result = tracked_run
    wandb_logger = trackers[0]
    assert wandb_logger.run is None  # Finished at the end of training.
    assert glob.glob(os.path.join(tmp, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(wandb_logger.logged) == 2  # One log per iteration.
    step, data = wandb_logger.logged[-1]
    assert step == result["timesteps_total"]
    expected = reporting.tensorboard_scalars(result)
    assert "raw/custom_metrics/pole_len_mean" in expected
    assert {k: v for k, v in data.items() if k != "evaluation/video"} == expected
    assert len(data["evaluation/video"]) == len(result["evaluation"]["episode_media"]["video"])
    videos = glob.glob(os.path.join(wandb_logger.run_dir, "media", "videos", "evaluation", "*"))
    assert videos and all(v.endswith(".gif") for v in videos)


def test_a_missing_tracker_package_is_an_error_naming_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"impala_tf\[wandb\]"):
        WandbLogger("p").on_train_begin()
