"""RLlib's algorithms as Ray Tune Trainables: `tune.Tuner(IMPALA, param_space=config.to_dict())`.

A trial is one algorithm, built and driven as `impala-train` drives it:

* `setup` builds the algorithm from the trial's config dict, with the config class of the
  Trainable's algorithm (`IMPALA`: `ImpalaConfig`, `APPO`: `APPOConfig`), into the trial's
  directory;
* `step` is one `train()`: RLlib's result dict, which Tune reports, checks against the stop
  criteria and hands to its loggers and callbacks. The same result also goes to
  `<trial dir>/impala_tf/` as `result.json` and TensorBoard summaries with impala_tf's tags
  and the evaluation videos (`impala_tf.training.reporting`), with the batches of skipped
  non-finite updates (`nonfinite/`). The trial dir is the experiment's on a local storage
  path, else the trial's working directory (uploaded with `SyncConfig(sync_artifacts=True)`);
* `save_checkpoint` / `load_checkpoint` are the algorithm's own checkpoints (weights, optimizer
  state, counters, filters, the driver's state), so Tune's fault tolerance resumes a trial and
  population-based training's exploit copies one trial's state into another. The learning rate
  and entropy coefficient are the config's (the learner evaluates them every update from its
  spec), so a restored trial trains with the hyperparameters PBT gave it, not the donor's;
* `cleanup` stops every process of the trial (actors, aggregation workers, learner threads);
* `reset_config` (Tune's `TuneConfig(reuse_actors=True)`, which `impala-train` searches set)
  stops the algorithm and builds one from another trial's config in the same process, when
  Tune hands this trial's process to another (it does when a trial is already waiting for the
  same resources as this one pauses or ends);
* `default_resource_request` reserves the trial's actors: one bundle for the driver and its
  learner (`num_cpus_for_main_process` CPUs, and `num_gpus` GPUs on a cluster that has GPUs,
  unless `_fake_gpus`), one per
  env runner (`num_cpus_per_env_runner` and `custom_resources_per_env_runner`) and one CPU per
  aggregation worker. With `actor_backend: ray` the actors are Ray actors, placed in the
  trial's placement group (Tune captures a trial's child actors), so trials on a cluster put
  their actors on the cluster, packed where they fit ("PACK"); with local actor processes every
  bundle must be on the trial's own node ("STRICT_PACK").

Importing this module registers the Trainables with Tune as `"impala_tf.IMPALA"` and
`"impala_tf.APPO"`, so `tune.Tuner("impala_tf.IMPALA", ...)` works too. Tune keeps registered
names in the Ray cluster it is connected to, so a `ray.init` after a `ray.shutdown` would start
without them: they are registered again after every `ray.init` of this process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, ClassVar

try:
    from ray import tune
    from ray.tune import PlacementGroupFactory
except ImportError as e:  # pragma: no cover - depends on the install.
    raise ImportError(
        "impala_tf.tune needs Ray Tune, which is not installed here: run "
        "`pip install 'impala_tf[tune]'` (or `pip install 'ray[tune]==2.60.0'`)."
    ) from e

from impala_tf.config.base import AlgorithmConfig
from impala_tf.config.registry import config_class

__all__ = [
    "APPO",
    "IMPALA",
    "AlgorithmTrainable",
    "register_trainables",
    "trial_resources",
    "tune_result",
]

#: Where a trial writes impala_tf's own `result.json` and TensorBoard files, in its directory
#: (Tune writes its `result.json`, `progress.csv` and event files at the top).
RESULTS_SUBDIR = "impala_tf"


def trial_resources(
    config: AlgorithmConfig, cluster_gpus: float | None = None
) -> PlacementGroupFactory:
    """The placement group one trial of `config` reserves (see the module docstring).

    `num_gpus` counts learner devices, one CPU device when there is no GPU (as outside Tune),
    so GPUs are asked for only where the cluster has some.

    Args:
      config: The trial's config.
      cluster_gpus: The cluster's GPUs; None asks Ray (0 when Ray is not initialised).

    Returns:
      A `PlacementGroupFactory`: the driver's bundle first, then one per env runner, then one
      per aggregation worker. Bundles of zero resources are left out.
    """
    if cluster_gpus is None:
        import ray

        cluster_gpus = ray.cluster_resources().get("GPU", 0.0) if ray.is_initialized() else 0.0
    head = {"CPU": float(config.num_cpus_for_main_process)}
    if config.num_gpus and not config._fake_gpus and cluster_gpus > 0:
        head["GPU"] = float(config.num_gpus)
    runner = {"CPU": float(config.num_cpus_per_env_runner)}
    runner.update({k: float(v) for k, v in (config.custom_resources_per_env_runner or {}).items()})
    runner = {k: v for k, v in runner.items() if v > 0}
    bundles = [{k: v for k, v in head.items() if v > 0} or {"CPU": 0.01}]
    if runner:
        bundles += [dict(runner) for _ in range(int(config.num_env_runners))]
    bundles += [{"CPU": 1.0} for _ in range(int(config.num_aggregation_workers))]
    strategy = "PACK" if config.actor_backend == "ray" else "STRICT_PACK"
    return PlacementGroupFactory(bundles, strategy=strategy)


def tune_result(result: Mapping[str, Any]) -> dict[str, Any]:
    """The result dict as Tune gets it: the evaluation's videos (`episode_media`, which only
    impala_tf's TensorBoard writer and trackers encode) left out, everything else as is."""
    out = dict(result)
    evaluation = out.get("evaluation")
    if isinstance(evaluation, Mapping) and "episode_media" in evaluation:
        out["evaluation"] = {k: v for k, v in evaluation.items() if k != "episode_media"}
    return out


class AlgorithmTrainable(tune.Trainable):
    """One algorithm as a Tune trial; subclasses name the algorithm (`IMPALA`, `APPO`).

    Tune constructs it with the trial's config: a dict of RLlib's keys (`config.to_dict()`,
    with search spaces resolved), or an `AlgorithmConfig`.
    """

    #: The algorithm's name in `impala_tf.config.registry`.
    algo_name: ClassVar[str] = "IMPALA"

    @classmethod
    def algorithm_config(cls, config: Mapping[str, Any] | AlgorithmConfig) -> AlgorithmConfig:
        """The trial's config as the algorithm's config class."""
        if isinstance(config, AlgorithmConfig):
            return config.copy()
        return config_class(cls.algo_name).from_dict(dict(config))

    @classmethod
    def default_resource_request(
        cls, config: Mapping[str, Any] | AlgorithmConfig
    ) -> PlacementGroupFactory:
        return trial_resources(cls.algorithm_config(config))

    def setup(self, config: dict) -> None:
        from impala_tf.driver.factory import build_algorithm
        from impala_tf.training.reporting import ResultWriter

        directory = self._results_dir()
        self.algorithm = build_algorithm(self.algorithm_config(config), logdir=directory)
        self._writer = ResultWriter(directory)

    def _results_dir(self) -> str:
        """`<trial dir>/impala_tf`: in the trial's directory of the experiment when the storage
        is this machine's file system, else in the trial's working directory (which Tune
        uploads with `SyncConfig(sync_artifacts=True)`)."""
        storage = getattr(self, "_storage", None)  # Tune's StorageContext (Ray 2.7+).
        filesystem = getattr(storage, "storage_filesystem", None)
        if filesystem is not None and filesystem.type_name == "local":
            return os.path.join(storage.trial_fs_path, RESULTS_SUBDIR)
        return os.path.join(self.logdir, RESULTS_SUBDIR)

    def step(self) -> dict[str, Any]:
        result = self.algorithm.train()
        self._writer.write(result)
        return tune_result(result)

    def save_checkpoint(self, checkpoint_dir: str) -> None:
        self.algorithm.save(checkpoint_dir)

    def load_checkpoint(self, checkpoint: str) -> None:
        from impala_tf.training.reporting import ResultWriter, truncate_results

        self.algorithm.restore(checkpoint)
        # Results logged after the checkpoint (by the trial's process that died or was
        # interrupted) go to `result.discarded.json`, as a resumed `impala-train` run's do.
        self._writer.close()
        truncate_results(self._writer.logdir, self.algorithm.iteration)
        self._writer = ResultWriter(self._writer.logdir)

    def reset_config(self, new_config: dict) -> bool:
        """Tune's `reuse_actors`: this trial's process takes on another config (a PBT exploit,
        or the next trial of a search) instead of Tune starting a process for it. The algorithm
        is stopped and built again from `new_config` into the (new) trial's directory; Tune then
        restores the checkpoint it chose, if any. TensorFlow and the local actors' fork server
        stay loaded: a new process would spend seconds of CPU importing them again."""
        self.cleanup()
        self.setup(new_config)
        return True

    def cleanup(self) -> None:
        try:
            self._writer.close()
        finally:
            self.algorithm.stop()


class IMPALA(AlgorithmTrainable):
    """IMPALA as a Tune Trainable (RLlib's `IMPALA`); registered as `"impala_tf.IMPALA"`."""

    algo_name = "IMPALA"


class APPO(AlgorithmTrainable):
    """APPO as a Tune Trainable (RLlib's `APPO`); registered as `"impala_tf.APPO"`."""

    algo_name = "APPO"


def register_trainables() -> None:
    """Registers `IMPALA` and `APPO` with Tune as `"impala_tf.IMPALA"` and `"impala_tf.APPO"`
    (in the connected Ray's store; before Ray starts, when it starts)."""
    for trainable in (IMPALA, APPO):
        tune.register_trainable(f"impala_tf.{trainable.algo_name}", trainable)


register_trainables()


def _register_after_each_init() -> None:
    # After each `ray.init` of this process, as Tune's own registry flushes its names then
    # (through the same list of Ray's post-init hooks; Ray is pinned, see setup.py).
    import ray._private.worker as ray_worker

    hooks = getattr(ray_worker, "_post_init_hooks", None)
    if hooks is not None and register_trainables not in hooks:
        hooks.append(register_trainables)


_register_after_each_init()
