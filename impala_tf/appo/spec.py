"""`AppoLearnerSpec`: IMPALA's learner settings plus APPO's, and what they build.

Plain data, no TensorFlow. The learner thread calls `make_queue`, which is how APPO's circular
buffer enters the runtime without any other module knowing which algorithm it runs (the learner
class comes from the config, `APPOConfig.learner_class`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from impala_tf.learning.spec import LearnerSpec, learner_spec
from impala_tf.utils.seeds import Stream, stream_seed

__all__ = ["AppoLearnerSpec", "appo_learner_spec"]


@dataclasses.dataclass(frozen=True)
class AppoLearnerSpec(LearnerSpec):
    """One policy's APPO learner settings (RLlib's key names; `impala_tf.appo.config`).

    Attributes:
      clip_param: The surrogate's clip epsilon.
      use_kl_loss: Add the KL(target || policy) penalty.
      kl_coeff: The penalty's initial coefficient (adapted towards `kl_target`).
      kl_target: The KL the coefficient is adapted towards.
      target_update_steps: Steps trained between two target network updates:
        `target_network_update_freq * circular_buffer_num_batches *
        circular_buffer_iterations_per_batch * train_batch_size`.
      tau: The target update's Polyak coefficient (1.0: a copy).
      target_worker_clipping: Upper bound of the importance weight mu / pi_target.
      circular_buffer_num_batches: Train batches the circular buffer holds.
      circular_buffer_iterations_per_batch: Times each batch is trained on at most.
      buffer_seed: The seed of the buffer's draws (None: from the OS).
    """

    clip_param: float = 0.4
    use_kl_loss: bool = False
    kl_coeff: float = 1.0
    kl_target: float = 0.01
    target_update_steps: float = 8000.0
    tau: float = 1.0
    target_worker_clipping: float = 2.0
    circular_buffer_num_batches: int = 4
    circular_buffer_iterations_per_batch: int = 2
    buffer_seed: int | None = None

    def make_queue(self) -> Any:
        """The learner thread's queue: RLlib's APPO circular buffer."""
        from impala_tf.appo.buffer import CircularBuffer

        return CircularBuffer(
            self.circular_buffer_num_batches,
            self.circular_buffer_iterations_per_batch,
            seed=self.buffer_seed,
        )


def appo_learner_spec(config: Any, model: Any = None) -> AppoLearnerSpec:
    """The APPO learner settings of one policy's validated `APPOConfig` (overrides applied).

    Args:
      config: The policy's config.
      model: The policy's resolved `ModelSpec` (None: resolved from `config.model`).
    """
    base = learner_spec(config, model)
    n = int(config.circular_buffer_num_batches)
    k = int(config.circular_buffer_iterations_per_batch)
    return AppoLearnerSpec(
        **{f.name: getattr(base, f.name) for f in dataclasses.fields(LearnerSpec)},
        clip_param=float(config.clip_param),
        use_kl_loss=bool(config.use_kl_loss),
        kl_coeff=float(config.kl_coeff),
        kl_target=float(config.kl_target),
        target_update_steps=float(config.target_network_update_freq)
        * n
        * k
        * int(config.train_batch_size),
        tau=float(config.tau),
        target_worker_clipping=float(config.target_worker_clipping),
        circular_buffer_num_batches=n,
        circular_buffer_iterations_per_batch=k,
        buffer_seed=stream_seed(config.seed, Stream.LEARNER_BUFFER, 0),
    )
