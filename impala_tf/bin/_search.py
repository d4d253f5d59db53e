"""impala-train's searches: when a run is a Tune search, and running one (no absl flags here).

A run is a search when its settings (the YAML's entry with `--set` applied) hold a Ray Tune
search space, when the entry names a trial `scheduler` (population-based training), or when more
than one sample per point is asked for. The search runs on the Ray at the settings'
`ray_address`, else on a local Ray started here, through `impala_tf.tune.search.run_search`;
trackers are Ray Tune's own W&B and MLflow logger callbacks.

Of Tune's default loggers only the JSON one (each trial's `result.json`) runs: each trial writes
its TensorBoard files itself, with impala_tf's tags (`impala_tf.tune.trainable`), and Tune's
CSV and tensorboardX loggers, which flatten every result of every trial in the driver, took as
much CPU as the training on a 2-core machine (a 4-trial CartPole grid: 91 s with them, 55 s
without). `TUNE_DISABLE_AUTO_CALLBACK_LOGGERS=0` in the environment brings them back.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from typing import Any

from impala_tf.config.experiments import read_search_file, search_space_paths

__all__ = ["run", "search_request"]

_DEFAULT = ("cartpole-impala", "IMPALA", {"env": "CartPole-v1"})
_DEFAULT_STOP = {"episode_reward_mean": 450, "timesteps_total": 2_000_000}


def search_request(
    config_path: str | None,
    overrides: Mapping[str, Any],
    seed: int | None,
    stop_flags: Mapping[str, float | None],
    num_samples: int,
) -> tuple[str, str, dict, dict, dict | None] | None:
    """(name, algorithm, settings, stop, scheduler) of a search, or None for a single run.

    Args:
      config_path: The YAML (None: the CartPole default).
      overrides: Parsed `--set` keys (`model` a dict of model keys).
      seed: `--seed`, or None.
      stop_flags: {result key: `--stop_*` value or None}.
      num_samples: `--num_samples`.
    """
    scheduler = None
    if config_path:
        name, algo_name, settings, stop, scheduler = read_search_file(config_path)
    else:
        (name, algo_name, settings), stop = _DEFAULT, dict(_DEFAULT_STOP)
    overrides = dict(overrides)
    model = {**(settings.get("model") or {}), **(overrides.pop("model", None) or {})}
    settings = {**settings, **overrides, **({"model": model} if model else {})}
    if not search_space_paths(settings) and scheduler is None and num_samples <= 1:
        return None
    if seed is not None:
        settings["seed"] = seed
    stop = {**stop, **{k: v for k, v in stop_flags.items() if v is not None}}
    return name, algo_name, settings, stop, scheduler


def _tracker_callbacks(
    name: str,
    wandb_project: str | None,
    mlflow_experiment: str | None,
    mlflow_tracking_uri: str | None,
) -> list:
    callbacks = []
    if wandb_project:
        from impala_tf.tune.loggers import WandbLoggerCallback

        callbacks.append(WandbLoggerCallback(project=wandb_project, group=name))
    if mlflow_experiment:
        from ray.air.integrations.mlflow import MLflowLoggerCallback

        from impala_tf.training.reporting import mlflow_store

        callbacks.append(
            MLflowLoggerCallback(
                tracking_uri=mlflow_store(mlflow_tracking_uri),
                experiment_name=mlflow_experiment,
            )
        )
    return callbacks


def run(
    name: str,
    algo_name: str,
    settings: dict,
    stop: dict,
    scheduler: dict | None = None,
    *,
    logdir: str,
    num_samples: int = 1,
    ray_num_cpus: float | None = None,
    checkpoint_freq: int | None = None,
    wandb_project: str | None = None,
    mlflow_experiment: str | None = None,
    mlflow_tracking_uri: str | None = None,
    verbose: bool = False,
    resume: bool = True,
) -> int:
    """Runs the search (or resumes the one in `logdir`), prints the table of trials; returns 0
    if every trial ended at a stop criterion, 1 if one failed, 130 if Tune was interrupted
    (SIGINT) before every trial ended.

    Raises:
      ImportError: Ray Tune (or a tracker's package) is not installed, naming the extra.
      ValueError: a trial's config is invalid, or a trial does not fit in the cluster.
    """
    from ray.tune.logger import JsonLoggerCallback

    from impala_tf.tune import search as tune_search
    from impala_tf.workers import ray_session

    logdir = os.path.abspath(logdir)
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")  # See the docstring.
    callbacks = [
        JsonLoggerCallback(),
        *_tracker_callbacks(name, wandb_project, mlflow_experiment, mlflow_tracking_uri),
    ]
    ray_session.acquire(settings.get("ray_address"), ray_num_cpus or os.cpu_count() or 1)
    print(f"impala-train: {name}, a search, logdir {logdir}, stop {stop}", flush=True)
    try:
        results = tune_search.run_search(
            os.path.basename(logdir),
            algo_name,
            settings,
            stop,
            storage_path=os.path.dirname(logdir),
            num_samples=num_samples,
            scheduler=scheduler,
            checkpoint_freq=int(checkpoint_freq or settings.get("checkpoint_freq") or 0),
            keep_checkpoints_num=settings.get("keep_checkpoints_num"),
            callbacks=callbacks,
            verbose=2 if verbose else 1,
            resume=resume,
        )
    finally:
        ray_session.release()
    print(tune_search.summary_table(results, settings), flush=True)
    statuses = [tune_search.trial_status(result) for result in results]
    ended, unfinished = statuses.count("TERMINATED"), statuses.count("UNFINISHED")
    print(f"impala-train: {ended} of {len(results)} trials ended", flush=True)
    if "ERROR" in statuses:
        return 1
    if unfinished:  # Tune stopped at a SIGINT: the exit status of an interrupted run.
        print(
            f"impala-train: interrupted with {unfinished} trial(s) unfinished; the same command "
            f"resumes them from their latest checkpoints",
            flush=True,
        )
        return 128 + signal.SIGINT
    return 0
