"""`fit`: the driver loop that calls `algorithm.train()` with Keras callbacks, one epoch per
iteration (see `impala_tf.training.callbacks` for the protocol).

    from impala_tf.training.callbacks import PeriodicCheckpoint, StopAtReward
    from impala_tf.training.loop import fit

    algo = ImpalaConfig().environment("CartPole-v1").build()
    fit(algo, callbacks=[
        StopAtReward(450),
        PeriodicCheckpoint("runs/cartpole/checkpoints", every_n_iterations=5, keep=3),
        keras.callbacks.EarlyStopping(monitor="episode_reward_mean", mode="max", patience=50),
    ])
    algo.stop()

The callbacks are called in list order, each with the same `IterationLogs`; Keras'
`CallbackList` is not used because it would flatten the logs once more and drop the nested
result.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import keras

from impala_tf.training.callbacks import IterationLogs

if TYPE_CHECKING:
    from impala_tf.driver.algorithm import Impala

__all__ = ["fit"]


def fit(
    algorithm: Impala,
    callbacks: Sequence[keras.callbacks.Callback] = (),
    max_iterations: int | None = None,
) -> dict[str, Any] | None:
    """Trains until a callback sets `model.stop_training` or `max_iterations` more iterations ran.

    Each callback gets `set_model(algorithm.learner)`, `set_params(...)` and, if it has one,
    `set_algorithm(algorithm)`. Then `on_train_begin`; per iteration `on_epoch_begin(epoch)`,
    `algorithm.train()`, `on_epoch_end(epoch, IterationLogs(result))` with
    `epoch = training_iteration - 1`; and `on_train_end` when the loop ends normally (not when
    `train()` or a callback raises, as in Keras). A resumed algorithm continues its iteration
    numbering, so epochs do too.

    Args:
      algorithm: A built `impala_tf.driver.algorithm.Impala` (possibly restored).
      callbacks: Keras callbacks, called in this order.
      max_iterations: Stop after this many iterations of this call (None: only callbacks stop).

    Returns:
      The last iteration's result dict (None if no iteration ran).
    """
    if max_iterations is None and not callbacks:
        raise ValueError("fit() without callbacks or max_iterations would never stop.")
    model = algorithm.learner
    params = {"epochs": max_iterations, "steps": None, "verbose": 0}
    for callback in callbacks:
        callback.set_model(model)
        callback.set_params(params)
        if hasattr(callback, "set_algorithm"):
            callback.set_algorithm(algorithm)
    model.stop_training = False
    for callback in callbacks:
        callback.on_train_begin()
    result: dict[str, Any] | None = None
    done = 0
    while max_iterations is None or done < max_iterations:
        epoch = algorithm.iteration
        for callback in callbacks:
            callback.on_epoch_begin(epoch)
        result = algorithm.train()
        done += 1
        logs = IterationLogs(result)
        for callback in callbacks:
            callback.on_epoch_end(result["training_iteration"] - 1, logs)
        if model.stop_training:
            break
    end_logs = IterationLogs(result) if result is not None else None
    for callback in callbacks:
        callback.on_train_end(end_logs)
    return result
