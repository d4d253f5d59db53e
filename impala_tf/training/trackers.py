"""Experiment trackers: each iteration's result logged to Weights & Biases or MLflow.

`WandbLogger` and `MLflowLogger` are driver-loop Keras callbacks
(`impala_tf.training.loop.fit(algorithm, callbacks=[...])`; `impala-train --wandb_project=P`,
`--mlflow_experiment=E`). Each iteration they log what TensorBoard gets
(`impala_tf.training.reporting.tensorboard_scalars`: the same tags, RLlib's custom metrics
and every numeric result key under `raw/` included) at step `timesteps_total`, and the
evaluation's recorded episodes (`render_env`) as GIFs: W&B videos under `evaluation/video`, MLflow
artifacts under `videos/`. The run's config is logged once, as W&B's run config or MLflow
parameters (flattened to `model/fcnet_hiddens`-style keys).

Both work without a network: W&B with `WANDB_MODE=offline` (the run goes to `./wandb`; `wandb
sync` uploads it later), MLflow with a local file store: `tracking_uri` `file:<directory>`, and
`./mlruns` when neither it nor `MLFLOW_TRACKING_URI` is set. MLflow 3 keeps file stores behind
an opt-in (`MLFLOW_ALLOW_FILE_STORE`), which the logger gives for a file store it is asked to
use; its database stores need the full `mlflow` package (sqlalchemy), not `mlflow-skinny`.

Each needs its package (`pip install 'impala_tf[wandb]'`, `'impala_tf[mlflow]'`); a missing one
is an error naming the extra when training starts. Ray Tune's own `WandbLoggerCallback` and
`MLflowLoggerCallback` serve Tune runs (`impala_tf.tune`).
"""

from __future__ import annotations

import importlib
import json
import os
import tempfile
from collections.abc import Mapping
from typing import Any

from impala_tf.training.callbacks import AlgorithmCallback, result_of
from impala_tf.training.reporting import ResultWriter, lookup, mlflow_store, tensorboard_scalars

__all__ = ["MLflowLogger", "WandbLogger", "flat_params", "mlflow_store"]

_VIDEOS = "evaluation/episode_media/video"


def _require(module: str, extra: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"this tracker needs `{module}`, which is not installed here: run "
            f"`pip install 'impala_tf[{extra}]'`."
        ) from e


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A config dict flattened to `a/b` keys, values as numbers, strings or JSON text."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flat_params(value, f"{name}/"))
        elif value is None or isinstance(value, (bool, int, float, str)):
            out[name] = value
        else:
            try:
                out[name] = json.dumps(value)
            except TypeError:
                out[name] = repr(value)
    return out


def _config_of(callback: AlgorithmCallback) -> dict[str, Any]:
    algorithm = callback.algorithm
    return flat_params(algorithm.config.to_dict()) if algorithm is not None else {}


class WandbLogger(AlgorithmCallback):
    """Logs each iteration to a Weights & Biases run (see the module docstring).

    Args:
      project: The W&B project.
      name: The run's name (W&B picks one if None).
      group: W&B's run group, e.g. one per search.
      tags: W&B's run tags.
      directory: Where W&B writes its files (W&B's default, `./wandb`, if None).
      mode: W&B's mode, "online", "offline" or "disabled" (`WANDB_MODE` or "online" if None).
    """

    def __init__(
        self,
        project: str,
        *,
        name: str | None = None,
        group: str | None = None,
        tags: tuple[str, ...] = (),
        directory: str | None = None,
        mode: str | None = None,
    ):
        super().__init__()
        self.project = project
        self.name = name
        self.group = group
        self.tags = tuple(tags)
        self.directory = directory
        self.mode = mode
        self.run: Any = None

    def on_train_begin(self, logs: Any = None) -> None:
        if self.run is not None:
            return
        wandb = _require("wandb", "wandb")
        if self.directory:
            os.makedirs(self.directory, exist_ok=True)
        self.run = wandb.init(
            project=self.project,
            name=self.name,
            group=self.group,
            tags=list(self.tags) or None,
            dir=self.directory,
            mode=self.mode,
            config=_config_of(self),
            reinit="create_new",
        )

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.on_train_begin()
        wandb = _require("wandb", "wandb")
        result = result_of(logs)
        data: dict[str, Any] = dict(tensorboard_scalars(result))
        with tempfile.TemporaryDirectory() as tmp:  # W&B copies each GIF when it logs it.
            clips = []
            for k, video in enumerate(lookup(result, _VIDEOS) or ()):
                path = os.path.join(tmp, f"episode_{k}.gif")
                with open(path, "wb") as f:
                    f.write(video.gif)
                clips.append(wandb.Video(path, format="gif"))
            if clips:
                data["evaluation/video"] = clips
            self.run.log(data, step=ResultWriter.step_of(result))

    def on_train_end(self, logs: Any = None) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


class MLflowLogger(AlgorithmCallback):
    """Logs each iteration to an MLflow run (see the module docstring).

    Args:
      experiment: The MLflow experiment's name (created if missing).
      tracking_uri: Where MLflow stores runs, e.g. `file:./mlruns` or a server's URL; None
        for `MLFLOW_TRACKING_URI`, else the file store `./mlruns`.
      run_name: The run's name (MLflow picks one if None).
      tags: Tags of the run.
    """

    def __init__(
        self,
        experiment: str,
        *,
        tracking_uri: str | None = None,
        run_name: str | None = None,
        tags: Mapping[str, str] | None = None,
    ):
        super().__init__()
        self.experiment = experiment
        self.tracking_uri = tracking_uri
        self.run_name = run_name
        self.tags = dict(tags or {})
        self.client: Any = None
        self.run_id: str | None = None

    def on_train_begin(self, logs: Any = None) -> None:
        if self.client is not None:
            return
        tracking = _require("mlflow.tracking", "mlflow")
        self.client = tracking.MlflowClient(tracking_uri=mlflow_store(self.tracking_uri))
        found = self.client.get_experiment_by_name(self.experiment)
        experiment_id = (
            found.experiment_id if found else self.client.create_experiment(self.experiment)
        )
        run = self.client.create_run(experiment_id, run_name=self.run_name, tags=self.tags)
        self.run_id = run.info.run_id
        for key, value in _config_of(self).items():
            self.client.log_param(self.run_id, key, str(value)[:6000])

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.on_train_begin()
        result = result_of(logs)
        step = ResultWriter.step_of(result)
        entities = _require("mlflow.entities", "mlflow")
        timestamp = int(1000 * float(result.get("timestamp", 0) or 0))
        metrics = [
            entities.Metric(_metric_name(tag), float(value), timestamp, step)
            for tag, value in tensorboard_scalars(result).items()
        ]
        for start in range(0, len(metrics), 1000):  # MLflow's batch limit.
            self.client.log_batch(self.run_id, metrics=metrics[start : start + 1000])
        videos = lookup(result, _VIDEOS)
        if videos:
            with tempfile.TemporaryDirectory() as tmp:
                iteration = int(result.get("training_iteration", epoch + 1))
                for k, video in enumerate(videos):
                    path = os.path.join(tmp, f"iteration_{iteration:06d}_episode_{k}.gif")
                    with open(path, "wb") as f:
                        f.write(video.gif)
                    self.client.log_artifact(self.run_id, path, artifact_path="videos")

    def on_train_end(self, logs: Any = None) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id)
            self.run_id = None
            self.client = None


def _metric_name(tag: str) -> str:
    """MLflow's metric names allow letters, digits, `_ - . / space`: others become `_`."""
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in tag)
