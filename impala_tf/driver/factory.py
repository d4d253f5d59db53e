"""`build_algorithm`: the one factory behind `ImpalaConfig.build()` and `impala-train`.

It validates the config (never changing it), decides the run's modes once (`make_plan`, which
probes the env's spaces once), starts the local actors' fork server before TensorFlow is
imported here, so that the two imports overlap (with `actor_backend: ray` it connects to Ray
first instead, so that a refused or missing cluster fails before that import), and builds the
`Impala` algorithm with the Keras callbacks for its learner threads, deterministic mode and the
run's logdir. RLlib's `build(logger_creator=...)` is accepted: the logger it returns gives the
logdir when it has one (RLlib's loggers have a `logdir`); otherwise it is ignored with a
warning, since results go through Keras callbacks here (`impala_tf.training.callbacks`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from impala_tf.config.base import AlgorithmConfig
from impala_tf.config.keys import ConfigWarning
from impala_tf.driver.plan import make_plan
from impala_tf.utils import timeline
from impala_tf.utils.quiet import import_tensorflow
from impala_tf.workers.process import prestart_fork_server

__all__ = ["build_algorithm"]


def build_algorithm(
    config: AlgorithmConfig,
    *,
    callbacks: list | Callable[[], list] | None = None,
    deterministic: bool = False,
    logdir: str | None = None,
    logger_creator: Callable[[dict], Any] | None = None,
) -> Any:
    """Validates `config` and builds the algorithm (see the module docstring).

    Args:
      config: The config; `env` must be set.
      callbacks: Keras callbacks for the learner threads (called around each update), or a
        callable returning them, called once TensorFlow is imported (`impala-train` loads the
        user's callback modules so, after the actors' fork server has started).
      deterministic: Sample and train in lockstep (a seeded run is reproducible exactly).
      logdir: The run's directory (batches of skipped non-finite updates go there).
      logger_creator: RLlib's `logger_creator(config_dict) -> logger`.

    Returns:
      An `impala_tf.driver.algorithm.Impala`.

    Raises:
      ValueError: an invalid config (the message names the key), or one that cannot run
        deterministically when asked to.
      impala_tf.workers.memory.ActorMemoryError: the local actors would not fit in memory.
    """
    config.validate(require_env=True)
    if logger_creator is not None:
        logdir = _logdir_of(logger_creator(config.to_dict()), logdir)
    plan = make_plan(config, deterministic)
    timeline.mark("plan")
    with contextlib.ExitStack() as held:
        if plan.backend == "process":
            prestart_fork_server(plan.preload)  # Its imports overlap TensorFlow's below.
            timeline.mark("fork server")
        else:  # Released once built: the algorithm's Ray pools hold their own use of it.
            held.enter_context(_ray_held(config, plan))
            timeline.mark("ray")
        import_tensorflow()  # Without TensorFlow's C++ start-up lines unless asked for.
        timeline.mark("tensorflow")
        from impala_tf.driver.algorithm import Impala

        if callable(callbacks):
            callbacks = callbacks()

        algo = Impala(
            config, callbacks=callbacks, deterministic=deterministic, logdir=logdir, plan=plan
        )
    timeline.mark("built")
    return algo


@contextlib.contextmanager
def _ray_held(config: AlgorithmConfig, plan: Any) -> Iterator[None]:
    """Holds a use of Ray from before TensorFlow's import (connecting, or starting Ray as the
    actors' pool would), so that a cluster that refuses this driver, none at `ray_address` or
    a missing Ray is an error in a second rather than after that import."""
    from impala_tf.driver.sampling import ray_request
    from impala_tf.driver.specs import sampling_spec
    from impala_tf.workers import ray_session

    ray_session.acquire(*ray_request(sampling_spec(config, plan)))
    try:
        yield
    finally:
        ray_session.release()


def _logdir_of(logger: Any, logdir: str | None) -> str | None:
    found = getattr(logger, "logdir", None)
    if isinstance(found, str):
        if logdir is not None and logdir != found:
            raise ValueError(
                f"build(logger_creator=...) gave the logdir {found!r} but logdir={logdir!r} "
                "was also given; pass one."
            )
        return found
    warnings.warn(
        f"`logger_creator` returned {type(logger).__name__}, which has no `logdir`: it is "
        "ignored (results go through Keras callbacks, impala_tf.training.callbacks).",
        ConfigWarning,
        stacklevel=3,
    )
    return logdir
