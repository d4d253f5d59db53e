"""`_separate_vf_optimizer` as RLlib's TF policy computes it, and `grad_gnorm` after clipping.

RLlib takes the gradient of each loss over all the model's trainable variables, one optimizer per
loss: the policy optimizer on pi_loss - entropy_coeff * entropy, an Adam at `_lr_vf` on vf_loss.
With shared layers (`vf_share_layers`) the value loss therefore trains the torso. Time-major
batches: T is time, B is batch.
"""

from __future__ import annotations

import gymnasium as gym
import keras
import numpy as np
import pytest
import tensorflow as tf

from impala_tf.config import ImpalaConfig
from impala_tf.learning import losses
from impala_tf.learning.learner import ImpalaLearner
from impala_tf.models import distributions
from tests.support import batches as fakes

OBS = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
ACT = gym.spaces.Box(-2.0, 2.0, (2,), np.float32)
T, ROWS = 5, 4


def _config(**overrides) -> ImpalaConfig:
    config = ImpalaConfig().environment("Pendulum-v1")
    config.training(model={"fcnet_hiddens": [16, 16], "vf_share_layers": True})
    config.env_runners(rollout_fragment_length=T)
    config.training(_separate_vf_optimizer=True, lr=0.01, _lr_vf=0.02, grad_clip=0.5)
    return config.update_from_dict(overrides)


def _learner(config: ImpalaConfig) -> ImpalaLearner:
    keras.utils.set_random_seed(0)
    return ImpalaLearner(config, OBS, ACT)


def _batch(seed: int) -> dict[str, tf.Tensor]:
    batch = fakes.time_major(fakes.sequence_batch(OBS, ACT, T, ROWS, seed=seed))
    return {k: tf.constant(v) for k, v in batch.items()}


def _torso(learner: ImpalaLearner) -> list[tf.Variable]:
    """The shared hidden layers: the variables both losses reach."""
    return [v for v in learner.model.trainable_variables if len(v.shape) and v.shape[-1] == 16]


def test_value_loss_alone_trains_the_shared_torso():
    # lr=0 freezes the policy optimizer: whatever moves, the value optimizer moved.
    learner = _learner(_config(lr=0.0))
    torso = _torso(learner)
    assert len(torso) == 4  # two hidden layers' kernels and biases
    before = [v.numpy().copy() for v in torso]
    stats = tf.function(learner.train_step)(_batch(seed=1))
    assert np.isfinite(float(stats["total_loss"]))
    for old, var in zip(before, torso):
        assert not np.allclose(old, var.numpy()), var.name


def _hand_built_update(config, model, batch, policy_opt, value_opt, entropy_coeff):
    """One update the long way: two losses, gradients over all variables, clip each, two Adams."""
    variables = model.trainable_variables
    with tf.GradientTape(persistent=True) as tape:
        dones = tf.logical_or(batch["terminateds"], batch["truncateds"])
        resets = tf.concat([tf.zeros_like(dones[:1]), dones[:-1]], axis=0)
        logits, values, _ = model.unroll(batch["obs"], resets, (), training=True)
        target = distributions.make_distribution(ACT, logits)
        behaviour = distributions.make_distribution(ACT, batch["action_dist_inputs"])
        out = losses.vtrace_loss(
            target_log_probs=target.log_prob(batch["actions"]),
            behaviour_log_probs=behaviour.log_prob(batch["actions"]),
            entropy=target.entropy(),
            values=values,
            rewards=batch["rewards"],
            terminateds=batch["terminateds"],
            truncateds=batch["truncateds"],
            values_bootstrapped=batch["values_bootstrapped"],
            gamma=config.gamma,
            entropy_coeff=entropy_coeff,
        )
        pi_loss = out.sums.pi_loss - entropy_coeff * out.sums.entropy
        vf_loss = out.sums.vf_loss
    norms = []
    for optimizer, loss in ((policy_opt, pi_loss), (value_opt, vf_loss)):
        grads = [
            tf.zeros_like(v) if g is None else g
            for g, v in zip(tape.gradient(loss, variables), variables)
        ]
        norms.append(tf.linalg.global_norm(grads))
        grads, _ = tf.clip_by_global_norm(grads, config.grad_clip)
        optimizer.apply_gradients(zip(grads, variables))
    return norms


def test_update_equals_a_hand_built_two_optimizer_update():
    config = _config()
    learner = _learner(config)
    reference = _learner(config).model
    reference.set_weights(learner.model.get_weights())
    policy_opt = keras.optimizers.Adam(learning_rate=config.lr, epsilon=1e-8)
    value_opt = keras.optimizers.Adam(learning_rate=config._lr_vf, epsilon=1e-8)
    step = tf.function(learner.train_step)
    for seed in (3, 4, 5):  # several steps: the optimizers' moments must match too
        batch = _batch(seed)
        stats = step(batch)
        norms = _hand_built_update(config, reference, batch, policy_opt, value_opt, 0.01)
        for ours, theirs in zip(learner.model.get_weights(), reference.get_weights()):
            np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-6)
        unclipped = float(tf.sqrt(norms[0] ** 2 + norms[1] ** 2))
        clipped = float(
            tf.sqrt(sum(tf.minimum(n, config.grad_clip) ** 2 for n in norms))  # per optimizer
        )
        assert float(stats["grad_gnorm_unclipped"]) == pytest.approx(unclipped, rel=1e-4)
        assert float(stats["grad_gnorm"]) == pytest.approx(clipped, rel=1e-4)
        assert unclipped > config.grad_clip  # the clip is active in this test


@pytest.mark.parametrize("grad_clip", [None, 1e-3])
def test_grad_gnorm_is_reported_after_clipping(grad_clip):
    learner = _learner(_config(_separate_vf_optimizer=False, grad_clip=grad_clip))
    stats = tf.function(learner.train_step)(_batch(seed=6))
    unclipped = float(stats["grad_gnorm_unclipped"])
    assert unclipped > 1e-2
    if grad_clip is None:
        assert float(stats["grad_gnorm"]) == pytest.approx(unclipped, rel=1e-6)
    else:
        assert float(stats["grad_gnorm"]) == pytest.approx(grad_clip, rel=1e-4)
