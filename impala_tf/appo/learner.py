"""`AppoLearner`: IMPALA's learner with APPO's loss, target network and KL coefficient.

Everything but the loss is `impala_tf.learning.learner.ImpalaLearner`'s: the devices and their one
all-reduce, gradient clipping, the optimizers and schedules, microbatches, the skip of a
non-finite update. What APPO adds (RLlib's APPO learner; `impala_tf.appo.config` has the keys):

* the loss of `impala_tf.appo.losses` (means over the valid steps: the learner divides the
  summed gradient by the batch's valid steps, `gradient_scale`);
* a target network, a second model built from the same `ModelSpec` and equal to the policy
  at the start. After each applied update, once `target_update_steps` steps were trained since
  its last update, it moves to `tau * policy + (1 - tau) * target` (every weight; `tau=1`
  copies). `set_policy_weights` copies the policy into it too, as RLlib's old stack does;
* the KL coefficient (`kl_coeff`, a variable): with `use_kl_loss`, after each applied update it
  is multiplied by 1.5 when the update's mean KL was above 2 x `kl_target`, by 0.5 when below
  half of it (RLlib's rule).

Extra stats (RLlib's old-stack TF policy's names): `kl` (mean KL(target || policy)),
`KL_Coeff` (the coefficient after the update), `mean_IS` and `var_IS` (of the clipped weight
mu / pi_target), and ours: `ratio_clipped_frac` (steps whose ratio was clipped),
`num_target_updates` and `last_target_update_ts` (steps trained at the last target update).
Checkpoints hold the target network, the coefficient and the two counters
(`checkpoint_parts`).
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import tensorflow as tf

from impala_tf.appo.losses import AppoSums, appo_loss
from impala_tf.appo.spec import AppoLearnerSpec
from impala_tf.learning.learner import ImpalaLearner, LossInputs
from impala_tf.models import distributions
from impala_tf.models.catalog import build_model
from impala_tf.models.spec import ModelSpec

__all__ = ["AppoLearner"]


class AppoLearner(ImpalaLearner):
    """The APPO learner (module docstring); built as `ImpalaLearner` is.

    Args:
      spec: The policy's `AppoLearnerSpec`, or an `APPOConfig` (read once).
      observation_space: The policy's observation space.
      action_space: The policy's action space.
      model: None, or the `ModelSpec` to build the model and its target network from. A
        built model is refused: the target network is built from the same spec.
      name: The Keras name.

    Attributes:
      target_model: The target network.
      kl_coeff: float32 variable, the KL penalty's coefficient.
      num_target_updates: int64 variable, target network updates so far.
      last_target_update_ts: int64 variable, `num_agent_steps_trained` at the last one.
    """

    sums_type = AppoSums
    count_keys = (*ImpalaLearner.count_keys, "num_target_updates", "last_target_update_ts")

    def __init__(
        self,
        spec: AppoLearnerSpec | Any,
        observation_space: gym.Space,
        action_space: gym.Space,
        model: ModelSpec | None = None,
        name: str = "appo_learner",
    ):
        if model is not None and not isinstance(model, ModelSpec):
            raise ValueError(
                "AppoLearner builds its target network from the model's spec: pass a "
                f"ModelSpec (or None) as `model`, not a built {type(model).__name__}."
            )
        super().__init__(spec, observation_space, action_space, model=model, name=name)
        if not isinstance(self.spec, AppoLearnerSpec):
            raise TypeError(
                f"AppoLearner needs APPO's settings (an APPOConfig or an AppoLearnerSpec), got "
                f"{type(self.spec).__name__}."
            )
        self.target_model = build_model(
            observation_space,
            action_space,
            self.spec.model,
            name="target_model",
            precision=self.spec.precision,
        )
        self.target_model.trainable = False
        self.target_model.set_weights(self.model.get_weights())
        state = dict(trainable=False, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        self.kl_coeff = tf.Variable(self.spec.kl_coeff, dtype=tf.float32, name="kl_coeff", **state)
        self.num_target_updates = tf.Variable(0, dtype=tf.int64, name="num_target_updates", **state)
        self.last_target_update_ts = tf.Variable(
            0, dtype=tf.int64, name="last_target_update_ts", **state
        )

    def compute_loss(
        self, inputs: LossInputs, entropy_coeff: tf.Tensor
    ) -> tuple[list[tf.Tensor], AppoSums]:
        spec = self.spec
        batch, actions = inputs.batch, inputs.batch["actions"]
        old_logits, _, _ = self.target_model.unroll(
            batch["obs"], inputs.resets, inputs.state, training=False
        )
        current = distributions.make_distribution(self.action_space, inputs.logits)
        old = distributions.make_distribution(self.action_space, tf.stop_gradient(old_logits))
        total, sums = appo_loss(
            target_log_probs=current.log_prob(actions),
            old_log_probs=old.log_prob(actions),
            behaviour_log_probs=self.behaviour_distribution(inputs).log_prob(actions),
            entropy=current.entropy(),
            kl=old.kl(current),
            clip_param=spec.clip_param,
            target_worker_clipping=spec.target_worker_clipping,
            kl_coeff=self.kl_coeff.read_value() if spec.use_kl_loss else None,
            **self.vtrace_arguments(inputs, entropy_coeff),
        )
        if self._separate_vf:
            policy = sums.pi_loss - entropy_coeff * sums.entropy + sums.kl_penalty
            return [policy, sums.vf_loss], sums
        return [total], sums

    def gradient_scale(self, sums: AppoSums) -> tf.Tensor:
        """1 / the batch's valid steps: the gradient of the mean loss (module docstring)."""
        return 1.0 / tf.maximum(sums.num_valid, 1.0)

    def update_stats(self, sums: AppoSums, entropy_coeff: tf.Tensor) -> dict[str, tf.Tensor]:
        n = tf.maximum(sums.num_valid, 1.0)
        spec = self.spec
        mean_is = sums.is_ratio / n
        total = sums.pi_loss + spec.vf_loss_coeff * sums.vf_loss - entropy_coeff * sums.entropy
        return {
            "total_loss": (total + sums.kl_penalty) / n,
            "kl": sums.kl / n,
            "KL_Coeff": self.kl_coeff.read_value(),
            "mean_IS": mean_is,
            "var_IS": tf.maximum(sums.is_ratio_sq / n - tf.square(mean_is), 0.0),
            "ratio_clipped_frac": sums.ratio_clipped / n,
            "num_target_updates": self.num_target_updates.read_value(),
            "last_target_update_ts": self.last_target_update_ts.read_value(),
        }

    def after_update(self, sums: AppoSums) -> None:
        """The target network's update when due, then the KL coefficient's (module docstring)."""
        spec = self.spec
        steps = self.num_agent_steps_trained.read_value()
        due = tf.cast(steps - self.last_target_update_ts, tf.float32) >= spec.target_update_steps

        def update_target() -> tf.Tensor:
            self._move_target(spec.tau)
            self.num_target_updates.assign_add(1)
            self.last_target_update_ts.assign(steps)
            return tf.constant(True)

        tf.cond(due, update_target, lambda: tf.constant(False))
        if spec.use_kl_loss:
            kl = sums.kl / tf.maximum(sums.num_valid, 1.0)
            coeff = self.kl_coeff.read_value()
            coeff = tf.where(
                kl > 2.0 * spec.kl_target,
                coeff * 1.5,
                tf.where(kl < 0.5 * spec.kl_target, coeff * 0.5, coeff),
            )
            self.kl_coeff.assign(coeff)

    def _move_target(self, tau: float) -> None:
        for target, source in zip(self.target_model.weights, self.model.weights, strict=True):
            if tau == 1.0 or not tf.as_dtype(target.dtype).is_floating:
                target.assign(source.value)
            else:
                target.assign(tau * source.value + (1.0 - tau) * target.value)

    def checkpoint_parts(self) -> dict[str, Any]:
        return {
            **super().checkpoint_parts(),
            "target_model": self.target_model,
            "kl_coeff": self.kl_coeff,
            "num_target_updates": self.num_target_updates,
            "last_target_update_ts": self.last_target_update_ts,
        }

    def state_variables(self) -> list[tf.Variable]:
        return [
            *super().state_variables(),
            *self.target_model.weights,
            self.kl_coeff,
            self.num_target_updates,
            self.last_target_update_ts,
        ]

    def set_policy_weights(self, weights: list[Any]) -> None:
        """Sets the model's weights and copies them into the target network."""
        super().set_policy_weights(weights)
        self._move_target(1.0)
