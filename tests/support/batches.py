"""Synthetic batches for learner tests: RLlib columns with random but valid contents.

`learner_config` is `tests.support.configs.small_config` with the learner tests' sizes: train
batches of ROWS fragments of T steps on the spaces OBS and ACT. `Gate` holds a learner thread in
its first update until the test releases it.
"""

from __future__ import annotations

import threading

import gymnasium as gym
import keras
import numpy as np

from impala_tf.config import ImpalaConfig
from impala_tf.models import distributions
from tests.support.configs import small_config


class Gate(keras.callbacks.Callback):
    """Holds the learner in its first update until `release` is set (at most `timeout_s`)."""

    def __init__(self, timeout_s: float = 60.0):
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()
        self.timeout_s = timeout_s

    def on_train_batch_begin(self, batch, logs=None):
        self.entered.set()
        self.release.wait(self.timeout_s)


#: Spaces, fragment length and rows of the small learner tests (`learner_config`).
OBS = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
ACT = gym.spaces.Discrete(3)
T, ROWS = 5, 4


def learner_config(**overrides) -> ImpalaConfig:
    """A CartPole config with a [16] MLP and train batches of ROWS fragments of T steps."""
    return small_config(rollout_fragment_length=T, train_batch_size=ROWS * T, lr=0.01, **overrides)


def sequence_batch(
    observation_space: gym.Space,
    action_space: gym.Space,
    horizon: int,
    rows: int,
    seed: int = 0,
    state_shapes: tuple[tuple[int, ...], ...] = (),
) -> dict[str, np.ndarray]:
    """A batch of `rows` env sequences of `horizon` steps, per-step columns [rows, horizon, ...]."""
    rng = np.random.default_rng(seed)
    observation_space.seed(seed)
    action_space.seed(seed + 1)
    shape = (rows, horizon)
    obs = np.stack([observation_space.sample() for _ in range(rows * horizon)])
    actions = np.stack([action_space.sample() for _ in range(rows * horizon)])
    terminateds = rng.random(shape) < 0.05
    truncateds = (rng.random(shape) < 0.05) & ~terminateds
    values_bootstrapped = rng.normal(size=shape).astype(np.float32)
    values_bootstrapped[terminateds] = 0.0
    batch = {
        "obs": obs.reshape(*shape, *observation_space.shape),
        "actions": actions.reshape(*shape, *distributions.action_shape(action_space)).astype(
            distributions.action_dtype(action_space)
        ),
        "rewards": rng.normal(size=shape).astype(np.float32),
        "terminateds": terminateds,
        "truncateds": truncateds,
        "action_dist_inputs": rng.normal(
            scale=0.5, size=(*shape, distributions.logits_size(action_space))
        ).astype(np.float32),
        "action_logp": np.zeros(shape, np.float32),
        "vf_preds": rng.normal(size=shape).astype(np.float32),
        "values_bootstrapped": values_bootstrapped,
    }
    for i, s in enumerate(state_shapes):
        batch[f"state_in_{i}"] = rng.normal(scale=0.1, size=(rows, *s)).astype(np.float32)
    return batch


def flat(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """[rows, T, ...] -> RLlib's flat [rows * T, ...] (state columns unchanged)."""
    return {
        k: v if k.startswith("state_in_") else v.reshape(-1, *v.shape[2:]) for k, v in batch.items()
    }


def time_major(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """[rows, T, ...] -> [T, rows, ...] (state columns unchanged)."""
    return {k: v if k.startswith("state_in_") else np.swapaxes(v, 0, 1) for k, v in batch.items()}
