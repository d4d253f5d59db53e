"""`LearnerSpec`: what one policy's learner and learner thread are built from.

The fields are RLlib's key names, read once from a policy's config (`learner_spec(config)`, with
the policy's `PolicySpec` overrides applied by the caller, `impala_tf.config.policies
.policy_config`); the learner (`impala_tf.learning.learner.ImpalaLearner`), its thread
(`impala_tf.learning.thread.LearnerThread`) and its batch layout (`impala_tf.learning.pipeline`,
`impala_tf.data.batching`) read only these, so no learner holds the algorithm config. Plain data,
no TensorFlow.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from impala_tf.models.spec import ModelSpec, model_spec

__all__ = ["LearnerSpec", "learner_spec"]

#: A schedule: `[[timestep, value], ...]` (checked and sorted), or None for a constant.
Schedule = tuple[tuple[float, float], ...] | None


@dataclasses.dataclass(frozen=True)
class LearnerSpec:
    """One policy's learner settings (RLlib's keys; see the module docstring).

    Attributes:
      model: The policy's resolved model.
      precision: The learner model's dtype policy (`precision`).
      rollout_fragment_length: Steps per sequence (T).
      train_batch_size: Env steps per update.
      microbatch_size: Env steps per accumulated microbatch (None: whole batches).
      lr: Learning rate.
      lr_schedule: `lr`'s piecewise-linear schedule over agent steps trained (None: constant).
      entropy_coeff: Entropy bonus coefficient.
      entropy_coeff_schedule: Its schedule (None: constant).
      gamma: Discount.
      vf_loss_coeff: Weight of the value loss in the summed loss.
      vtrace_clip_rho_threshold: V-trace's rho-bar (None: no clipping).
      vtrace_clip_pg_rho_threshold: The policy gradient's rho clip (None: no clipping).
      vtrace_drop_last_ts: Leave each sequence's last step out of the loss.
      grad_clip: Global-norm gradient clip (None: none).
      opt_type: "adam" or "rmsprop".
      decay: RMSProp's decay.
      momentum: RMSProp's momentum.
      epsilon: RMSProp's epsilon.
      separate_vf_optimizer: RLlib's `_separate_vf_optimizer`.
      lr_vf: RLlib's `_lr_vf`, the value optimizer's learning rate.
      jit_compile_update: XLA for the update's per-device part ("auto", True or False).
      learner_queue_size: Train batches the learner thread's queue holds.
      learner_queue_timeout: Seconds without a batch before the thread stops.
      minibatch_ring_size: The minibatch buffer's slots (`minibatch_buffer_size`, or with
        several learner devices `num_multi_gpu_tower_stacks`).
      num_sgd_iter: Passes over each train batch.
      num_multi_gpu_tower_stacks: Loader slots.
      num_gpu_loader_threads: The loader's threads.
      max_nonfinite_updates: Non-finite updates in a row before the thread stops.
    """

    model: ModelSpec
    precision: str = "float32"
    rollout_fragment_length: int = 50
    train_batch_size: int = 500
    microbatch_size: int | None = None
    lr: float = 0.0005
    lr_schedule: Schedule = None
    entropy_coeff: float = 0.01
    entropy_coeff_schedule: Schedule = None
    gamma: float = 0.99
    vf_loss_coeff: float = 0.5
    vtrace_clip_rho_threshold: float | None = 1.0
    vtrace_clip_pg_rho_threshold: float | None = 1.0
    vtrace_drop_last_ts: bool = False
    grad_clip: float | None = 40.0
    opt_type: str = "adam"
    decay: float = 0.99
    momentum: float = 0.0
    epsilon: float = 0.1
    separate_vf_optimizer: bool = False
    lr_vf: float = 0.0005
    jit_compile_update: Any = "auto"
    learner_queue_size: int = 16
    learner_queue_timeout: float = 300.0
    minibatch_ring_size: int = 1
    num_sgd_iter: int = 1
    num_multi_gpu_tower_stacks: int = 1
    num_gpu_loader_threads: int = 8
    max_nonfinite_updates: int = 10

    @property
    def max_seq_len(self) -> int:
        """Steps per recurrent training sequence (`model.max_seq_len`)."""
        return self.model.max_seq_len

    def make_queue(self) -> Any:
        """The learner thread's queue of train batches: RLlib's bounded learner queue
        (`learner_queue_size`), a `impala_tf.data.train_batch.LearnerQueue`."""
        from impala_tf.data.train_batch import LearnerQueue

        return LearnerQueue(self.learner_queue_size)


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _schedule(points: Any) -> Schedule:
    return None if points is None else tuple((float(t), float(v)) for t, v in points)


def learner_spec(config: Any, model: ModelSpec | None = None) -> LearnerSpec:
    """The learner settings of one policy's `config` (its overrides applied).

    Args:
      config: A validated policy config.
      model: The policy's resolved model (None: resolves `config.model` here).
    """
    return LearnerSpec(
        model=model_spec(config.model) if model is None else model,
        precision=str(config.precision),
        rollout_fragment_length=int(config.rollout_fragment_length),
        train_batch_size=int(config.train_batch_size),
        microbatch_size=None if config.microbatch_size is None else int(config.microbatch_size),
        lr=float(config.lr),
        lr_schedule=_schedule(config.lr_schedule_points()),
        entropy_coeff=float(config.entropy_coeff),
        entropy_coeff_schedule=_schedule(config.entropy_coeff_schedule_points()),
        gamma=float(config.gamma),
        vf_loss_coeff=float(config.vf_loss_coeff),
        vtrace_clip_rho_threshold=_optional_float(config.vtrace_clip_rho_threshold),
        vtrace_clip_pg_rho_threshold=_optional_float(config.vtrace_clip_pg_rho_threshold),
        vtrace_drop_last_ts=bool(config.vtrace_drop_last_ts),
        grad_clip=_optional_float(config.grad_clip),
        opt_type=str(config.opt_type),
        decay=float(config.decay),
        momentum=float(config.momentum),
        epsilon=float(config.epsilon),
        separate_vf_optimizer=bool(config._separate_vf_optimizer),
        lr_vf=float(config._lr_vf),
        jit_compile_update=config.jit_compile_update,
        learner_queue_size=int(config.learner_queue_size),
        learner_queue_timeout=float(config.learner_queue_timeout),
        minibatch_ring_size=int(config.minibatch_ring_size),
        num_sgd_iter=int(config.num_sgd_iter),
        num_multi_gpu_tower_stacks=int(config.num_multi_gpu_tower_stacks),
        num_gpu_loader_threads=int(config.num_gpu_loader_threads),
        max_nonfinite_updates=int(config.max_nonfinite_updates),
    )
