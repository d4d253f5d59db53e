"""Action distributions over tensorflow-probability, built from an action space and logits.

The model emits one flat vector of distribution inputs per step ("logits", RLlib's
`action_dist_inputs`), shaped [..., logits_size(space)], where the leading dims are any mix of
time and batch (T is time, B is batch: [T, B, A] in the learner, [B, A] in the actors).

Supported action spaces and their layouts:

- `Discrete(n)`: logits [..., n]; actions [...] int64; a `tfd.Categorical`.
- `MultiDiscrete(nvec)` (1-D nvec): logits [..., sum(nvec)], the components' logits concatenated
  in order; actions [..., len(nvec)] int64; a `MultiCategorical` of independent categoricals.
- `Box(shape)`: logits [..., 2 * prod(shape)], the means followed by the log standard deviations
  (RLlib's DiagGaussian layout); actions [..., *shape] float32;
  `tfd.Independent(tfd.Normal(mean, exp(log_std)))` over all of `shape`.

Every distribution's `log_prob(actions)` and `entropy()` return [...] float32, summed over the
action components or dimensions, which is what V-trace needs for log rho (Espeholt et al. 2018).
The functions here hold no variables and work under `tf.function`, `jit_compile=True` and
`MirroredStrategy`.
"""

from __future__ import annotations

import math
from typing import Any

import gymnasium as gym
import numpy as np
import tensorflow as tf
import tensorflow_probability as tfp

tfd = tfp.distributions

__all__ = [
    "MultiCategorical",
    "action_dtype",
    "action_shape",
    "logits_size",
    "make_distribution",
    "split_logits",
]


def _unsupported(action_space: gym.Space) -> ValueError:
    return ValueError(
        f"Unsupported action space {action_space!r}: impala_tf supports Discrete, "
        "MultiDiscrete (1-D nvec) and Box action spaces."
    )


def _nvec(action_space: gym.spaces.MultiDiscrete) -> list[int]:
    nvec = np.asarray(action_space.nvec)
    if nvec.ndim != 1:
        raise _unsupported(action_space)
    return [int(n) for n in nvec]


def _check_supported(action_space: gym.Space) -> None:
    if isinstance(action_space, gym.spaces.MultiDiscrete):
        _nvec(action_space)
    elif not isinstance(action_space, gym.spaces.Discrete | gym.spaces.Box):
        raise _unsupported(action_space)


def logits_size(action_space: gym.Space) -> int:
    """Returns the size of the distribution inputs the model must emit for `action_space`.

    Args:
        action_space: a Discrete, MultiDiscrete or Box space.

    Returns:
        n for Discrete(n), sum(nvec) for MultiDiscrete(nvec), 2 * prod(shape) for Box(shape).

    Raises:
        ValueError: for any other space.
    """
    _check_supported(action_space)
    if isinstance(action_space, gym.spaces.Discrete):
        return int(action_space.n)
    if isinstance(action_space, gym.spaces.MultiDiscrete):
        return sum(_nvec(action_space))
    return 2 * int(math.prod(action_space.shape))


def action_dtype(action_space: gym.Space) -> np.dtype:
    """Returns the numpy dtype actions of `action_space` are stored and fed with.

    Discrete and MultiDiscrete actions are int64 (gymnasium's and RLlib's dtype); Box actions are
    float32 whatever the space's own dtype, since the model and the Normal are float32.
    """
    _check_supported(action_space)
    if isinstance(action_space, gym.spaces.Box):
        return np.dtype(np.float32)
    return np.dtype(np.int64)


def action_shape(action_space: gym.Space) -> tuple[int, ...]:
    """Returns the per-step shape of one action: () Discrete, (n,) MultiDiscrete, shape Box."""
    _check_supported(action_space)
    if isinstance(action_space, gym.spaces.Discrete):
        return ()
    if isinstance(action_space, gym.spaces.MultiDiscrete):
        return (len(_nvec(action_space)),)
    return tuple(int(d) for d in action_space.shape)


def split_logits(action_space: gym.Space, logits: tf.Tensor) -> list[tf.Tensor]:
    """Splits flat logits into one logits tensor per categorical action component.

    This is the list form RLlib's V-trace `multi_*` functions take.

    Args:
        action_space: a Discrete or MultiDiscrete space.
        logits: float32 [..., logits_size(action_space)].

    Returns:
        For MultiDiscrete(nvec), a list of len(nvec) tensors [..., nvec[i]]; for Discrete, the
        one-element list [logits].

    Raises:
        ValueError: for Box (a Gaussian has no per-component logits) and unsupported spaces.
    """
    _check_supported(action_space)
    if isinstance(action_space, gym.spaces.Discrete):
        return [logits]
    if isinstance(action_space, gym.spaces.MultiDiscrete):
        return tf.split(logits, _nvec(action_space), axis=-1)
    raise ValueError(
        f"split_logits needs a Discrete or MultiDiscrete action space, got {action_space!r}."
    )


class MultiCategorical:
    """Independent categoricals, one per MultiDiscrete component, with summed log-probs.

    A plain wrapper rather than `tfd.Blockwise`/`JointDistribution`: it is a handful of tensor
    ops, so it traces cleanly under `tf.function`, XLA and `MirroredStrategy` replicas.

    Attributes:
        components: the list of `tfd.Categorical`, component i over logits [..., nvec[i]].
    """

    def __init__(self, logits_list: list[tf.Tensor]):
        self.components = [tfd.Categorical(logits=lg, dtype=tf.int64) for lg in logits_list]

    def log_prob(self, actions: tf.Tensor) -> tf.Tensor:
        """Returns sum_i log p_i(actions[..., i]), float32 [...], for int actions [..., n]."""
        actions = tf.convert_to_tensor(actions)
        parts = [d.log_prob(actions[..., i]) for i, d in enumerate(self.components)]
        return tf.add_n(parts)

    def entropy(self) -> tf.Tensor:
        """Returns the summed entropy of the components, float32 [...]."""
        return tf.add_n([d.entropy() for d in self.components])

    def sample(self, seed: Any = None) -> tf.Tensor:
        """Draws int64 actions [..., n]; a seed is split so the components draw independently."""
        if seed is None:
            seeds = [None] * len(self.components)
        else:
            seeds = tfp.random.split_seed(seed, n=len(self.components))
            seeds = [seeds[i] for i in range(len(self.components))]
        return tf.stack(
            [d.sample(seed=s) for d, s in zip(self.components, seeds, strict=True)], axis=-1
        )

    def mode(self) -> tf.Tensor:
        """Returns the most likely int64 action [..., n] (the argmax of each component)."""
        return tf.stack([d.mode() for d in self.components], axis=-1)


def make_distribution(action_space: gym.Space, logits: tf.Tensor) -> Any:
    """Builds the action distribution pi(.|x) for `action_space` from the model's logits.

    Args:
        action_space: a Discrete, MultiDiscrete or Box space.
        logits: float32 [..., logits_size(action_space)], any number of leading dims.

    Returns:
        An object with `log_prob(actions)` and `entropy()` (both float32 [...], summed over
        action components/dims), `sample(seed=None)` and `mode()` (actions of
        `action_dtype(action_space)`, shaped [..., *action_shape(action_space)]):
        a `tfd.Categorical` (Discrete), a `MultiCategorical` (MultiDiscrete) or a
        `tfd.Independent` of `tfd.Normal` (Box; feed it float32 actions).

    Raises:
        ValueError: for unsupported spaces.
    """
    _check_supported(action_space)
    logits = tf.convert_to_tensor(logits, dtype=tf.float32)
    if isinstance(action_space, gym.spaces.Discrete):
        return tfd.Categorical(logits=logits, dtype=tf.int64)
    if isinstance(action_space, gym.spaces.MultiDiscrete):
        return MultiCategorical(split_logits(action_space, logits))
    shape = action_shape(action_space)
    mean, log_std = tf.split(logits, 2, axis=-1)
    event_shape = tf.concat([tf.shape(logits)[:-1], tf.constant(shape, tf.int32)], axis=0)
    mean = tf.reshape(mean, event_shape)
    log_std = tf.reshape(log_std, event_shape)
    return tfd.Independent(
        tfd.Normal(loc=mean, scale=tf.exp(log_std)),
        reinterpreted_batch_ndims=len(shape),
    )
