"""`APPOConfig`: RLlib's APPO config, IMPALA's keys plus APPO's own.

APPO (Asynchronous PPO; Luo et al. 2020, "IMPACT") is IMPALA with a PPO-style clipped surrogate.
RLlib builds it as `APPOConfig(IMPALAConfig)`, and so does this module: every IMPALA key keeps
its meaning and default, and these are added, with RLlib's names and defaults:

* `clip_param` (0.4): the surrogate's clip, epsilon;
* `use_kl_loss` (False), `kl_coeff` (1.0), `kl_target` (0.01): the KL(target || policy)
  penalty and its adaptive coefficient;
* `target_network_update_freq` (2) and `tau` (1.0): the target network follows the policy every
  `target_network_update_freq * circular_buffer_num_batches *
  circular_buffer_iterations_per_batch * train_batch_size` steps trained, by Polyak averaging
  with `tau` (1.0: a copy);
* `target_worker_clipping` (2.0): the bound of the behaviour/target importance weight;
* `circular_buffer_num_batches` (4) and `circular_buffer_iterations_per_batch` (2): the learner
  queue is a circular buffer of that many train batches, each trained on at most that many times.

The loss, the buffer and the learner are in this package (`impala_tf.appo`); the rest of the
runtime (actors, driver, learner thread, checkpoints) is IMPALA's, reached through the learner
spec this config makes (`learner_spec`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from impala_tf.config import ImpalaConfig
from impala_tf.config.base import config_key
from impala_tf.config.keys import IGNORED, UNSUPPORTED
from impala_tf.config.validation import check_bool, check_int, check_number

__all__ = ["APPOConfig"]


@dataclasses.dataclass(init=False, repr=False, eq=True)
class APPOConfig(ImpalaConfig):
    """RLlib's APPO config: `ImpalaConfig`'s keys, builders and checks, plus APPO's keys
    (module docstring). `build()` returns the algorithm with APPO's learner.

        config = APPOConfig().environment("CartPole-v1").training(clip_param=0.3)
        algo = config.build()
    """

    algo_name: ClassVar[str] = "APPO"
    ignored_keys: ClassVar[Mapping[str, str]] = {
        **IGNORED,
        "use_gae": "APPO always uses V-trace advantages (`vtrace=True`)",
        "lambda": "APPO's V-trace has no lambda (RLlib's old-stack TF policy has none either)",
        "lambda_": "APPO's V-trace has no lambda (RLlib's old-stack TF policy has none either)",
    }
    unsupported_keys: ClassVar[Mapping[str, str]] = {
        **UNSUPPORTED,
        "target_update_frequency": (
            "RLlib replaced it by `target_network_update_freq` (in units of "
            "circular_buffer_num_batches x circular_buffer_iterations_per_batch train batches)"
        ),
        "use_critic": "APPO always trains its value function",
    }

    # training(): APPO
    clip_param: float = config_key(0.4, "training")
    use_kl_loss: bool = config_key(False, "training")
    kl_coeff: float = config_key(1.0, "training")
    kl_target: float = config_key(0.01, "training")
    target_network_update_freq: float = config_key(2, "training")
    tau: float = config_key(1.0, "training")
    target_worker_clipping: float = config_key(2.0, "training")
    circular_buffer_num_batches: int = config_key(4, "training")
    circular_buffer_iterations_per_batch: int = config_key(2, "training")

    def learner_class(self) -> type:
        """`impala_tf.appo.learner.AppoLearner`."""
        from impala_tf.appo.learner import AppoLearner

        return AppoLearner

    def learner_spec(self, model: Any = None) -> Any:
        """IMPALA's learner settings plus APPO's: an `impala_tf.appo.spec.AppoLearnerSpec`,
        which also makes the circular buffer."""
        from impala_tf.appo.spec import appo_learner_spec

        return appo_learner_spec(self, model)

    def lockstep_problems(self) -> list[str]:
        problems = []
        if self.circular_buffer_num_batches != 1 or self.circular_buffer_iterations_per_batch != 1:
            problems.append(
                "`circular_buffer_num_batches=1` and `circular_buffer_iterations_per_batch=1` "
                "(the learner draws from its circular buffer at random, as often as it can)"
            )
        return problems

    def validate(self, *, require_env: bool = False) -> None:
        """IMPALA's checks, then APPO's keys (each error names its key)."""
        super().validate(require_env=require_env)
        check_number(self, "clip_param", minimum=0.0, strict=True)
        check_bool(self, "use_kl_loss")
        check_number(self, "kl_coeff", minimum=0.0)
        check_number(self, "kl_target", minimum=0.0, strict=True)
        check_number(self, "target_network_update_freq", minimum=0.0, strict=True)
        check_number(self, "tau", minimum=0.0, maximum=1.0, strict=True)
        check_number(self, "target_worker_clipping", minimum=0.0, strict=True)
        check_int(self, "circular_buffer_num_batches", minimum=1)
        check_int(self, "circular_buffer_iterations_per_batch", minimum=1)
        # RLlib's APPO refuses these too: the circular buffer is the learner's queue and its
        # reuse of batches (`learner_queue_size` and `minibatch_buffer_size` would be a second
        # queue and a second reuse beside it).
        if self.minibatch_buffer_size != 1:
            raise ValueError(
                f"`minibatch_buffer_size` must be 1 for APPO, got {self.minibatch_buffer_size}: "
                "APPO reuses train batches through its circular buffer "
                "(`circular_buffer_num_batches`, `circular_buffer_iterations_per_batch`)."
            )
        if self.learner_queue_size != type(self)().learner_queue_size:
            raise ValueError(
                f"`learner_queue_size` has no effect in APPO (got {self.learner_queue_size}): "
                "its learner queue is the circular buffer of `circular_buffer_num_batches` "
                "train batches; leave `learner_queue_size` at its default."
            )
