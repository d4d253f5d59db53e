"""Which devices the learner runs on: GPU settings made before TensorFlow initialises, and
whether the learner's devices are accelerators.

`configure_gpus(num_gpus)` runs before the first TensorFlow op of a run
(`impala_tf.learning.strategy.make_strategy` calls it first). With `num_gpus: 0` it hides every
GPU from TensorFlow, so that the learner (and anything else of the driver process) stays on the
CPU, as RLlib's `num_gpus: 0` does; otherwise it turns on memory growth for every visible GPU, so
that TensorFlow takes GPU memory as the learner needs it instead of all of it at once (which
would starve a second process on the GPU, such as an inference server or another run). Both
settings can only be made before TensorFlow initialises its devices; made later they fail, and
then the learner is pinned to the CPU explicitly (`num_gpus: 0`) or a warning says that memory
growth stays off.

`on_accelerator(strategy)` tells the learner thread and the loader whether the update runs on
GPUs (or TPUs): the loader then holds two units so that loading overlaps the update, and copies
them onto the device ahead of use; `jit_compile_update: "auto"` decides from it as well.
"""

from __future__ import annotations

import logging

import tensorflow as tf

__all__ = ["configure_gpus", "on_accelerator", "resolve_jit_compile"]

logger = logging.getLogger(__name__)

_ACCELERATORS = ("GPU", "TPU")


def configure_gpus(num_gpus: float) -> bool:
    """Hides the GPUs (`num_gpus == 0`) or turns on their memory growth; call it before any op.

    Args:
      num_gpus: The config's `num_gpus`.

    Returns:
      True when the learner must be pinned to the CPU explicitly: `num_gpus == 0` but TensorFlow
      was initialised already with GPUs visible, so they could not be hidden.
    """
    gpus = tf.config.list_physical_devices("GPU")  # Does not initialise the runtime.
    if not gpus:
        return False
    if num_gpus == 0:
        try:
            tf.config.set_visible_devices([], "GPU")
            return False
        except RuntimeError:  # Initialised already.
            logger.warning(
                "num_gpus=0 but TensorFlow was initialised with %d GPU(s) visible before the "
                "algorithm was built, so they cannot be hidden: the learner is placed on the "
                "CPU explicitly. Build the algorithm before running any TensorFlow op, or set "
                "CUDA_VISIBLE_DEVICES='' to keep TensorFlow off the GPUs entirely.",
                len(gpus),
            )
            return True
    for gpu in gpus:
        try:
            tf.config.experimental.set_memory_growth(gpu, True)
        except RuntimeError:  # Initialised already (growth may be on already: it is harmless).
            if not tf.config.experimental.get_memory_growth(gpu):
                logger.warning(
                    "TensorFlow was initialised before the algorithm was built: memory growth "
                    "stays off, so TensorFlow holds most of %s's memory. Build the algorithm "
                    "before running any TensorFlow op, or set TF_FORCE_GPU_ALLOW_GROWTH=true.",
                    gpu.name,
                )
            break
    return False


def on_accelerator(strategy: tf.distribute.Strategy) -> bool:
    """True when `strategy` runs the learner's update on GPUs or TPUs.

    TensorFlow's default strategy places ops on the first GPU when one is visible, so it counts
    as on an accelerator exactly then.
    """
    try:
        devices = strategy.extended.worker_devices
    except RuntimeError:  # The default strategy has no device list.
        return bool(tf.config.list_logical_devices("GPU"))
    return any(tf.DeviceSpec.from_string(d).device_type in _ACCELERATORS for d in devices)


def resolve_jit_compile(setting: bool | str, accelerator: bool) -> bool:
    """Whether the learner XLA-compiles its update, from `jit_compile_update`.

    Args:
      setting: `jit_compile_update`: True, False or "auto".
      accelerator: Whether the learner runs on an accelerator (`on_accelerator`).

    Returns:
      The setting, with "auto" resolved: off on a CPU, where XLA measured slower
      (BENCHMARKS.md, `bench_learner_xla`), and off on accelerators until measured there
      (`python -m tools.bench_gpu` measures both).
    """
    if setting == "auto":
        del accelerator  # Decided per device kind once `tools.bench_gpu` has figures.
        return False
    return bool(setting)
