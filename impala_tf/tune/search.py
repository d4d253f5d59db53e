"""A tuned-example YAML with search spaces, run as RLlib runs it: one Tune trial per point.

`impala-train --config=FILE` comes here when the file (or a `--set`) holds a Ray Tune search
space: `{grid_search: [...]}` in `env` or in any config key, or Tune's `{eval: "..."}` entries.
Tune's variant generator resolves them as in `rllib train -f FILE`; `num_samples` repeats every
grid point (with fresh samples of the sampled keys). Each trial is an `impala_tf.tune.IMPALA` (or
`APPO`, the entry's `run`) in `<logdir>/<trial name>/`, checkpointed every `checkpoint_freq`
iterations and at the end, keeping `keep_checkpoints_num`; the stop criteria apply to each
trial. An entry's `scheduler:` block (ours, not RLlib's) picks Tune's trial scheduler
(`make_scheduler`: population-based training or ASHA). At the end a table lists every trial:
its varied keys, status, iterations, env steps, time and `episode_reward_mean`.

Every trial's config is validated here first, so that a wrong key or value is an error naming
it before Ray starts, and a trial whose resources (`impala_tf.tune.trainable.trial_resources`)
exceed the cluster's is refused with the keys that size it, rather than left waiting forever.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ray import tune
from ray.tune.error import TuneError
from ray.tune.search.variant_generator import generate_variants

from impala_tf.config.experiments import search_space_paths
from impala_tf.config.registry import config_class
from impala_tf.tune.trainable import APPO, IMPALA, trial_resources

__all__ = [
    "SCHEDULERS",
    "SearchError",
    "make_scheduler",
    "resolved_points",
    "run_search",
    "summary_table",
    "trial_status",
]

#: A YAML entry's `scheduler: {type: ...}` -> Tune's scheduler class (by import path).
SCHEDULERS = {
    "pbt": "ray.tune.schedulers:PopulationBasedTraining",
    "populationbasedtraining": "ray.tune.schedulers:PopulationBasedTraining",
    "pb2": "ray.tune.schedulers.pb2:PB2",
    "asha": "ray.tune.schedulers:ASHAScheduler",
    "ashascheduler": "ray.tune.schedulers:ASHAScheduler",
}

_TRAINABLES = {"IMPALA": IMPALA, "APPO": APPO}


class SearchError(ValueError):
    """A search that cannot run: an invalid point, or trials larger than the cluster."""


def resolved_points(param_space: Mapping[str, Any], num_samples: int = 1) -> list[dict]:
    """The configs Tune will run, one per trial, as Tune's variant generator resolves them."""
    points = []
    for _ in range(max(1, int(num_samples))):
        for _, spec in generate_variants({"config": copy.deepcopy(dict(param_space))}):
            points.append(spec["config"])
    return points


def make_scheduler(spec: Mapping[str, Any]) -> Any:
    """Tune's trial scheduler from a YAML entry's `scheduler` block.

    `type` names it (`PopulationBasedTraining` / `pbt`, `PB2`, `ASHAScheduler` / `asha`; any
    case); the other keys are the scheduler's own arguments (`metric`, `mode`, `time_attr`,
    `perturbation_interval`, `hyperparam_mutations`, PB2's `hyperparam_bounds`, ...).

    Raises:
      SearchError: an unknown `type`, or arguments the scheduler refuses.
      ImportError: PB2 without scikit-learn, naming the extra that installs it.
    """
    import importlib
    import importlib.util

    spec = dict(spec)
    kind = str(spec.pop("type", "")).lower().replace("_", "")
    if kind not in SCHEDULERS:
        raise SearchError(
            f"`scheduler.type` must be one of PopulationBasedTraining (pbt), PB2 or "
            f"ASHAScheduler (asha), got {kind!r}."
        )
    module, _, name = SCHEDULERS[kind].partition(":")
    if kind == "pb2" and importlib.util.find_spec("sklearn") is None:
        raise ImportError(
            "`scheduler.type: PB2` needs scikit-learn (Tune's PB2 fits a Gaussian process): "
            "pip install 'impala_tf[pb2]'"
        )
    try:
        return getattr(importlib.import_module(module), name)(**spec)
    except (TypeError, ValueError, TuneError) as e:  # TuneError: Tune's checks of them.
        raise SearchError(f"`scheduler` ({name}): {e}") from e


def _check_points(algo_name: str, points: Sequence[Mapping[str, Any]]) -> list[Any]:
    configs = []
    cls = config_class(algo_name)
    for k, point in enumerate(points):
        try:
            config = cls.from_dict(point)
            config.validate(require_env=True)
        except ValueError as e:
            raise SearchError(f"trial {k} of the search is invalid: {e}") from e
        configs.append(config)
    return configs


def _check_fits(configs: Sequence[Any], cluster: Mapping[str, float]) -> None:
    for config in configs:
        needed: dict[str, float] = {}
        for bundle in trial_resources(config).bundles:
            for name, amount in bundle.items():
                needed[name] = needed.get(name, 0.0) + float(amount)
        short = {k: v for k, v in needed.items() if v > float(cluster.get(k, 0.0)) + 1e-9}
        if short:
            have = {k: float(cluster.get(k, 0.0)) for k in short}
            raise SearchError(
                f"one trial needs {short} but the Ray cluster has {have}: lower "
                "`num_env_runners`, `num_cpus_per_env_runner`, `num_cpus_for_main_process` or "
                "`num_aggregation_workers` (e.g. `--set num_cpus_per_env_runner=0.5`), or run on "
                "a larger cluster (`ray_address`)."
            )


def run_search(
    name: str,
    algo_name: str,
    param_space: Mapping[str, Any],
    stop: Mapping[str, float],
    *,
    storage_path: str,
    num_samples: int = 1,
    scheduler: Mapping[str, Any] | None = None,
    checkpoint_freq: int = 0,
    keep_checkpoints_num: int | None = None,
    callbacks: Sequence[Any] = (),
    verbose: int = 1,
    resume: bool = True,
) -> Any:
    """Runs every point of `param_space` as a Tune trial and returns Tune's `ResultGrid`.

    An experiment already in `<storage_path>/<name>/` (one that was interrupted, or that
    ended) is continued with Tune's `Tuner.restore`: its unfinished and failed trials go on
    from their latest checkpoints; its stop criteria, scheduler and callbacks are the stored
    ones.

    Ray must be initialised (`impala-train` connects to `ray_address` or starts a local Ray).

    Args:
      name: The experiment's name: its trials go to `<storage_path>/<name>/`.
      algo_name: `IMPALA` or `APPO` (the entry's `run`).
      param_space: The config dict with Tune's search spaces in it.
      stop: Stop criteria of each trial (result keys).
      storage_path: The directory experiments go to.
      num_samples: Times each grid point is run.
      scheduler: A YAML entry's `scheduler` block (`make_scheduler`), or None (FIFO).
      checkpoint_freq: Iterations between checkpoints (0: only at the end).
      keep_checkpoints_num: Checkpoints kept per trial (None: all).
      callbacks: Tune callbacks (e.g. Ray's `WandbLoggerCallback`, `MLflowLoggerCallback`).
      verbose: Tune's verbosity (0 silent, 1 status updates, 2 trial results).
      resume: Continue the experiment in `<storage_path>/<name>/` if there is one; False
        refuses to run over it.

    Raises:
      SearchError: a point's config is invalid, a trial would not fit in the cluster, or
        (with `resume=False`) the experiment's directory holds an experiment.
    """
    import ray

    trainable = _TRAINABLES[str(algo_name).upper()]
    configs = _check_points(trainable.algo_name, resolved_points(param_space, num_samples))
    _check_fits(configs, ray.cluster_resources())
    path = os.path.join(os.path.abspath(storage_path), name)
    if tune.Tuner.can_restore(path):
        if not resume:
            raise SearchError(
                f"{path} holds a search; pass --resume to continue it, or another --logdir."
            )
        return tune.Tuner.restore(
            path,
            trainable,
            resume_unfinished=True,
            resume_errored=True,
            param_space=dict(param_space),
        ).fit()
    tuner = tune.Tuner(
        trainable,
        param_space=dict(param_space),
        tune_config=tune.TuneConfig(
            num_samples=max(1, int(num_samples)),
            scheduler=make_scheduler(scheduler) if scheduler else None,
            # A PBT exploit or the next trial of a search may go on in a paused or ended
            # trial's process (`AlgorithmTrainable.reset_config`): no new TensorFlow import.
            reuse_actors=True,
        ),
        run_config=tune.RunConfig(
            name=name,
            storage_path=os.path.abspath(storage_path),
            stop=dict(stop),
            callbacks=list(callbacks),
            verbose=verbose,
            checkpoint_config=tune.CheckpointConfig(
                checkpoint_frequency=int(checkpoint_freq or 0),
                num_to_keep=keep_checkpoints_num,
                checkpoint_at_end=True,
            ),
        ),
    )
    return tuner.fit()


def _at(config: Mapping[str, Any], path: str) -> Any:
    value: Any = config
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def trial_status(result: Any) -> str:
    """A trial's status from its Tune `Result`: ERROR (it failed past `max_failures`),
    TERMINATED (a stop criterion ended it) or UNFINISHED (the search was interrupted first;
    running the search again resumes it)."""
    if result.error:
        return "ERROR"
    return "TERMINATED" if (result.metrics or {}).get("done") else "UNFINISHED"


def summary_table(results: Any, param_space: Mapping[str, Any]) -> str:
    """One line per trial: name, varied keys, status, iterations, env steps, time, return."""
    varied = search_space_paths(param_space)
    header = ["trial", *varied, "status", "iter", "env steps", "time s", "reward mean"]
    rows = [header]
    for result in sorted(results, key=lambda r: os.path.basename(r.path or "")):
        metrics = result.metrics or {}
        status = trial_status(result)
        reward = metrics.get("episode_reward_mean")
        rows.append(
            [
                os.path.basename(result.path or "?"),
                *(str(_at(result.config or {}, path)) for path in varied),
                status,
                str(metrics.get("training_iteration", 0)),
                f"{int(metrics.get('timesteps_total', 0)):,d}",
                f"{float(metrics.get('time_total_s', 0.0)):.1f}",
                "-" if reward is None else f"{float(reward):.1f}",
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows
    )
