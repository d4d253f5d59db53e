"""Tests that the loss hyper-parameters of a config reach the update at non-default values.

`gamma`, `vtrace_clip_rho_threshold`, `vtrace_clip_pg_rho_threshold` and `vtrace_drop_last_ts`
are set one at a time away from RLlib's defaults; each policy's learner is built as the algorithm
builds it (`config.validate`, `make_plan`, `policy_learners`, which applies the per-policy
overrides, `LearnerGroup`), and its stats on one hand-made train batch are compared with the
numpy V-trace of `tests/losses_test.py` at the same value, and checked to differ from the stats
at the default value, so a learner that hard-coded a default would fail. A per-policy `lr` (a
multi-agent `PolicySpec` override, in the `multi_agent()` and the YAML `multiagent:` forms) must
set that policy's optimizer, and only its, and scale its update.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from impala_tf.config import ImpalaConfig
from impala_tf.config.policies import PolicySpec
from impala_tf.driver.learners import LearnerGroup
from impala_tf.driver.plan import make_plan
from impala_tf.driver.specs import policy_learners
from impala_tf.learning.learner import ImpalaLearner
from tests.losses_test import _numpy_vtrace
from tests.support import batches as fakes
from tests.support.batches import ROWS, T, learner_config
from tests.support.configs import small_config

#: RLlib's defaults, which each test moves away from.
DEFAULTS = {
    "gamma": 0.99,
    "vtrace_clip_rho_threshold": 1.0,
    "vtrace_clip_pg_rho_threshold": 1.0,
    "vtrace_drop_last_ts": False,
}

# The hand-made train batch: ROWS (4) sequences of T (5) steps, batch-major [ROWS, T], on
# CartPole (two actions). MU is the behaviour probability of the action taken: against a near
# uniform target policy the importance ratios run from about 0.5 to 5, so both rho thresholds
# tested below (and the default 1.0) clip some steps and not others.
ACTIONS = np.array([[0, 1, 1, 0, 1], [1, 0, 0, 1, 1], [0, 0, 1, 1, 0], [1, 1, 0, 0, 1]])
MU = np.array(
    [
        [0.10, 0.90, 0.30, 0.60, 0.20],
        [0.80, 0.15, 0.50, 0.25, 0.95],
        [0.40, 0.70, 0.12, 0.35, 0.55],
        [0.65, 0.22, 0.85, 0.45, 0.18],
    ]
)
REWARDS = np.array(
    [
        [1.0, 0.0, 1.0, 1.0, 0.0],
        [0.5, 1.0, -1.0, 1.0, 1.0],
        [1.0, 1.0, 1.0, 1.0, 1.0],
        [0.0, 2.0, 0.0, -0.5, 1.0],
    ]
)
TERMINATED = (0, 2)  # Row 0 ends in a terminal state at step 2, and a new episode starts.
TRUNCATED = (1, 3)  # Row 1 hits a time limit at step 3, bootstrapped from V(final obs) = 0.8.
BOOTSTRAP = np.array([0.5, -0.3, 1.2, 0.7])  # V of the observation after each row's last step.


def _hand_made_batch() -> dict[str, np.ndarray]:
    """The train batch above in RLlib's columns, batch-major [ROWS, T, ...]."""
    shape = (ROWS, T)
    obs = np.linspace(-1.0, 1.0, ROWS * T * 4, dtype=np.float32).reshape(ROWS, T, 4)
    taken = np.eye(2, dtype=bool)[ACTIONS]
    probs = np.where(taken, MU[..., None], 1.0 - MU[..., None])
    terminateds = np.zeros(shape, bool)
    terminateds[TERMINATED] = True
    truncateds = np.zeros(shape, bool)
    truncateds[TRUNCATED] = True
    values_bootstrapped = np.full(shape, 0.3, np.float32)
    values_bootstrapped[TERMINATED] = 0.0
    values_bootstrapped[TRUNCATED] = 0.8
    values_bootstrapped[:, -1] = BOOTSTRAP
    return {
        "obs": obs,
        "actions": ACTIONS.astype(np.int64),
        "rewards": REWARDS.astype(np.float32),
        "terminateds": terminateds,
        "truncateds": truncateds,
        "action_dist_inputs": np.log(probs).astype(np.float32),
        "action_logp": np.log(MU).astype(np.float32),
        "vf_preds": np.zeros(shape, np.float32),
        "values_bootstrapped": values_bootstrapped,
    }


def _learners(config: ImpalaConfig) -> dict[str, ImpalaLearner]:
    """Each policy's learner, built as `Impala` builds them (validate, plan, `LearnerGroup`)."""
    config.validate(require_env=True)
    keras.utils.set_random_seed(0)
    plan = make_plan(config)
    group = LearnerGroup(policy_learners(config, plan.models), plan, tf.distribute.get_strategy())
    group.stop()  # Never started: the tests drive the learners' `train_step` themselves.
    return group.learners


def _step(learner: ImpalaLearner, batch: dict[str, np.ndarray]) -> dict[str, float]:
    """One update, as the learner thread runs it (`strategy.run(learner.train_step)`)."""
    batch = {k: tf.constant(v) for k, v in batch.items()}
    strategy = tf.distribute.get_strategy()
    out = tf.function(lambda b: strategy.run(learner.train_step, args=(b,)))(batch)
    return {k: float(v) for k, v in out.items()}


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _numpy_stats(
    batch: dict[str, np.ndarray],
    logits: np.ndarray,
    values: np.ndarray,
    config: ImpalaConfig,
    **settings,
) -> dict[str, float]:
    """The learner's loss stats in numpy, from time-major columns, the model's logits and values
    and `config`'s coefficients, at `DEFAULTS` updated with `settings`."""
    s = {**DEFAULTS, **settings}
    gamma = s["gamma"]
    rho_bar = s["vtrace_clip_rho_threshold"]
    pg_rho_bar = s["vtrace_clip_pg_rho_threshold"]
    actions = batch["actions"][..., None]
    target = _log_softmax(logits)
    logp = np.take_along_axis(target, actions, -1)[..., 0]
    mu = np.take_along_axis(_log_softmax(batch["action_dist_inputs"]), actions, -1)[..., 0]
    entropy = -np.sum(np.exp(target) * target, -1)
    logit_range = np.ptp(logits, -1)
    term = batch["terminateds"].astype(np.float32)
    trunc = batch["truncateds"].astype(np.float32)
    vb = batch["values_bootstrapped"]
    discounts = gamma * (1 - np.maximum(term, trunc))
    rewards = batch["rewards"] + gamma * trunc * (1 - term) * vb
    columns = [logp, mu, entropy, logit_range, values, rewards, discounts]
    if s["vtrace_drop_last_ts"]:
        bootstrap = values[-1]
        columns = [c[:-1] for c in columns]
    else:
        bootstrap = vb[-1]
    logp, mu, entropy, logit_range, values, rewards, discounts = columns
    vs, pg = _numpy_vtrace(
        logp - mu,
        discounts,
        rewards,
        values,
        bootstrap,
        rho_bar=np.inf if rho_bar is None else rho_bar,
        pg_rho_bar=np.inf if pg_rho_bar is None else pg_rho_bar,
    )
    rhos = np.exp(logp - mu)
    pi_loss, vf_loss = -np.mean(logp * pg), 0.5 * np.mean((values - vs) ** 2)
    return {
        "policy_loss": pi_loss,
        "vf_loss": vf_loss,
        "entropy": np.mean(entropy),
        "total_loss": pi_loss
        + config.vf_loss_coeff * vf_loss
        - config.entropy_coeff * np.mean(entropy),
        "mean_rho": np.mean(rhos),
        "max_rho": np.max(rhos),
        "rho_clipped_frac": 0.0 if rho_bar is None else np.mean(rhos > rho_bar),
        "pg_rho_clipped_frac": 0.0 if pg_rho_bar is None else np.mean(rhos > pg_rho_bar),
        "pg_advantage_mean": np.mean(pg),
        "pg_advantage_std": np.std(pg),
        "vf_error_mean": np.mean(vs - values),
        "logit_range_mean": np.mean(logit_range),
    }


@pytest.mark.parametrize(
    "key, value, moved",
    [
        ("gamma", 0.5, ("policy_loss", "vf_loss", "pg_advantage_mean", "vf_error_mean")),
        (
            "vtrace_clip_rho_threshold",
            3.0,
            ("policy_loss", "vf_loss", "pg_advantage_mean", "vf_error_mean", "rho_clipped_frac"),
        ),
        (
            "vtrace_clip_rho_threshold",
            None,
            ("policy_loss", "vf_loss", "pg_advantage_mean", "vf_error_mean", "rho_clipped_frac"),
        ),
        (
            "vtrace_clip_pg_rho_threshold",
            0.7,
            ("policy_loss", "pg_advantage_mean", "pg_rho_clipped_frac"),
        ),
        (
            "vtrace_clip_pg_rho_threshold",
            None,
            ("policy_loss", "pg_advantage_mean", "pg_rho_clipped_frac"),
        ),
        (
            "vtrace_drop_last_ts",
            True,
            ("policy_loss", "vf_loss", "vf_error_mean"),
        ),
    ],
    ids=["gamma", "rho_bar", "no_rho_clip", "pg_rho_bar", "no_pg_rho_clip", "drop_last_ts"],
)
def test_a_non_default_loss_setting_reaches_the_learners_update(key, value, moved):
    config = learner_config(**{key: value})
    learner = _learners(config)["default_policy"]
    batch = _hand_made_batch()
    tm = fakes.time_major(batch)
    dones = tm["terminateds"] | tm["truncateds"]
    resets = np.concatenate([np.zeros_like(dones[:1]), dones[:-1]], 0)
    logits, values, _ = learner.model.unroll(tf.constant(tm["obs"]), tf.constant(resets), ())
    logits, values = logits.numpy(), values.numpy()
    expected = _numpy_stats(tm, logits, values, config, **{key: value})
    default = _numpy_stats(tm, logits, values, config)
    # The batch clips at each threshold tested and at the default one, not everywhere.
    rhos = np.exp(_log_softmax(logits) - _log_softmax(tm["action_dist_inputs"]))
    rhos = np.take_along_axis(rhos, tm["actions"][..., None], -1)
    for threshold in (0.7, 1.0, 3.0):
        assert 0 < np.sum(rhos > threshold) < rhos.size

    stats = _step(learner, fakes.flat(batch))  # RLlib's flat SampleBatch layout.
    for name, want in expected.items():
        np.testing.assert_allclose(
            stats[name], want, rtol=1e-4, atol=1e-6, err_msg=f"{name} with {key}={value}"
        )
    # A learner that used the default instead would have reported these.
    for name in moved:
        assert stats[name] != pytest.approx(default[name], rel=1e-2, abs=1e-4), name
    assert stats["num_agent_steps_trained"] == T * ROWS  # Env steps, whatever the loss uses.


TOP_LR = 0.001  # Not the default 0.0005 either.
P0_LR = 0.02


@pytest.mark.parametrize("form", ["multi_agent", "yaml_multiagent_block"])
def test_a_per_policy_lr_sets_only_that_policys_optimizer_and_update_size(form):
    config = small_config(policies=2, lr=TOP_LR)
    if form == "multi_agent":
        config.multi_agent(policies={"p0": PolicySpec(config={"lr": P0_LR}), "p1": PolicySpec()})
    else:  # A YAML config's `multiagent:` block.
        config.update_from_dict(
            {"multiagent": {"policies": {"p0": {"config": {"lr": P0_LR}}, "p1": None}}}
        )
    learners = _learners(config)
    assert sorted(learners) == ["p0", "p1"]
    for pid, lr in (("p0", P0_LR), ("p1", TOP_LR)):
        learner = learners[pid]
        assert float(learner.policy_optimizer.learning_rate.numpy()) == pytest.approx(lr), pid
        seq = fakes.sequence_batch(
            learner.observation_space, learner.action_space, config.rollout_fragment_length, 2
        )
        before = [w.copy() for w in learner.model.get_weights()]
        stats = _step(learner, fakes.time_major(seq))
        assert stats["cur_lr"] == pytest.approx(lr), pid
        assert float(learner.policy_optimizer.learning_rate.numpy()) == pytest.approx(lr), pid
        # Adam's first step moves each weight by lr * m / sqrt(v) = lr * sign(gradient).
        moved = max(np.max(np.abs(a - b)) for a, b in zip(learner.model.get_weights(), before))
        assert moved == pytest.approx(lr, rel=1e-3), pid
