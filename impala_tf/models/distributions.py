"""Action distributions, built from an action space and logits.

The model emits one flat vector of distribution inputs per step ("logits", RLlib's
`action_dist_inputs`), shaped [..., logits_size(space)], where the leading dims are any mix of
time and batch (T is time, B is batch: [T, B, A] in the learner, [B, A] in the actors).

Supported action spaces and their layouts:

- `Discrete(n)`: logits [..., n]; actions [...] int64; a `Categorical`.
- `MultiDiscrete(nvec)` (1-D nvec): logits [..., sum(nvec)], the components' logits concatenated
  in order; actions [..., len(nvec)] int64; a `MultiCategorical` of independent categoricals.
- `Box(shape)`: logits [..., 2 * prod(shape)], the means followed by the log standard deviations
  (RLlib's DiagGaussian layout); actions [..., *shape] float32;
  a `DiagGaussian`: independent normals N(mean, exp(log_std)) over all of `shape`.

Every distribution's `log_prob(actions)` and `entropy()` return [...] float32, summed over the
action components or dimensions, which is what V-trace needs for log rho (Espeholt et al. 2018).
The functions here hold no variables and work under `tf.function`, `jit_compile=True` and
`MirroredStrategy`. They are a few tensor ops each, written here rather than taken from
tensorflow-probability, whose import (with the tf_keras and setuptools it loads) cost every
learner process about 1.3 s of start-up.
"""

from __future__ import annotations

import math
from typing import Any

import gymnasium as gym
import numpy as np
import tensorflow as tf

__all__ = [
    "Categorical",
    "DiagGaussian",
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


def _seed_pair(seed: Any) -> tf.Tensor:
    """A stateless-op seed: shape [2] int32 (an int seed becomes [seed, 0])."""
    if isinstance(seed, int):
        return tf.constant([seed, 0], tf.int32)
    return tf.cast(tf.reshape(seed, [2]), tf.int32)


class Categorical:
    """A categorical distribution over the last axis of `logits` [..., n]; int64 actions [...].

    Attributes:
        logits: float32 [..., n], unnormalised log-probabilities.
    """

    def __init__(self, logits: tf.Tensor):
        self.logits = tf.convert_to_tensor(logits, tf.float32)

    def log_prob(self, actions: tf.Tensor) -> tf.Tensor:
        """Returns log p(actions), float32 [...], for int actions [...]."""
        actions = tf.cast(actions, tf.int32)
        logits = tf.broadcast_to(
            self.logits, tf.concat([tf.shape(actions), tf.shape(self.logits)[-1:]], 0)
        )
        return -tf.nn.sparse_softmax_cross_entropy_with_logits(labels=actions, logits=logits)

    def entropy(self) -> tf.Tensor:
        """Returns -sum_a p(a) log p(a), float32 [...] (a p of 0 adds 0, even at a -inf logit)."""
        log_p = tf.nn.log_softmax(self.logits)
        return -tf.reduce_sum(tf.math.multiply_no_nan(log_p, tf.exp(log_p)), axis=-1)

    def mode(self) -> tf.Tensor:
        """Returns the most likely action, int64 [...]."""
        return tf.argmax(self.logits, axis=-1, output_type=tf.int64)

    def kl(self, other: Categorical) -> tf.Tensor:
        """Returns KL(self || other) = sum_a p(a) (log p(a) - log q(a)), float32 [...]."""
        log_p = tf.nn.log_softmax(self.logits)
        log_q = tf.nn.log_softmax(other.logits)
        return tf.reduce_sum(tf.math.multiply_no_nan(log_p - log_q, tf.exp(log_p)), axis=-1)

    def sample(self, seed: Any = None) -> tf.Tensor:
        """Draws int64 actions [...]; a seed (an int or a [2] tensor) makes the draw repeatable."""
        flat = tf.reshape(self.logits, [-1, tf.shape(self.logits)[-1]])
        if seed is None:
            draws = tf.random.categorical(flat, 1, dtype=tf.int64)
        else:
            draws = tf.random.stateless_categorical(flat, 1, _seed_pair(seed), dtype=tf.int64)
        return tf.reshape(draws, tf.shape(self.logits)[:-1])


class DiagGaussian:
    """Independent normals N(mean, exp(log_std)) over the trailing `event_ndims` axes, whose
    log-probabilities and entropies are summed (RLlib's DiagGaussian).

    Attributes:
        mean: float32 [..., *event].
        log_std: float32 [..., *event].
    """

    def __init__(self, mean: tf.Tensor, log_std: tf.Tensor, event_ndims: int):
        self.mean = tf.convert_to_tensor(mean, tf.float32)
        self.log_std = tf.convert_to_tensor(log_std, tf.float32)
        self._axes = list(range(-event_ndims, 0))

    def log_prob(self, actions: tf.Tensor) -> tf.Tensor:
        """Returns log p(actions), float32 [...], for float32 actions [..., *event]."""
        z = (tf.cast(actions, tf.float32) - self.mean) * tf.exp(-self.log_std)
        log_p = -0.5 * tf.square(z) - self.log_std - 0.5 * math.log(2.0 * math.pi)
        return tf.reduce_sum(log_p, axis=self._axes)

    def entropy(self) -> tf.Tensor:
        """Returns the summed entropy 1/2 + 1/2 log(2 pi) + log_std, float32 [...]."""
        per_dim = 0.5 + 0.5 * math.log(2.0 * math.pi) + self.log_std
        return tf.reduce_sum(per_dim, axis=self._axes)

    def mode(self) -> tf.Tensor:
        """Returns the mean, float32 [..., *event]."""
        return self.mean

    def kl(self, other: DiagGaussian) -> tf.Tensor:
        """Returns KL(self || other), summed over the event axes, float32 [...]."""
        var, other_var = tf.exp(2.0 * self.log_std), tf.exp(2.0 * other.log_std)
        per_dim = (
            other.log_std
            - self.log_std
            + (var + tf.square(self.mean - other.mean)) / (2.0 * other_var)
            - 0.5
        )
        return tf.reduce_sum(per_dim, axis=self._axes)

    def sample(self, seed: Any = None) -> tf.Tensor:
        """Draws float32 actions [..., *event]; a seed makes the draw repeatable."""
        shape = tf.shape(self.mean)
        if seed is None:
            noise = tf.random.normal(shape)
        else:
            noise = tf.random.stateless_normal(shape, _seed_pair(seed))
        return self.mean + tf.exp(self.log_std) * noise


class MultiCategorical:
    """Independent categoricals, one per MultiDiscrete component, with summed log-probs.

    Attributes:
        components: the list of `Categorical`, component i over logits [..., nvec[i]].
    """

    def __init__(self, logits_list: list[tf.Tensor]):
        self.components = [Categorical(lg) for lg in logits_list]

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
        n = len(self.components)
        if seed is None:
            seeds = [None] * n
        else:
            split = tf.random.experimental.stateless_split(_seed_pair(seed), num=n)
            seeds = [split[i] for i in range(n)]
        return tf.stack(
            [d.sample(seed=s) for d, s in zip(self.components, seeds, strict=True)], axis=-1
        )

    def mode(self) -> tf.Tensor:
        """Returns the most likely int64 action [..., n] (the argmax of each component)."""
        return tf.stack([d.mode() for d in self.components], axis=-1)

    def kl(self, other: MultiCategorical) -> tf.Tensor:
        """Returns the summed KL(self_i || other_i) of the components, float32 [...]."""
        return tf.add_n([d.kl(o) for d, o in zip(self.components, other.components, strict=True)])


def make_distribution(action_space: gym.Space, logits: tf.Tensor) -> Any:
    """Builds the action distribution pi(.|x) for `action_space` from the model's logits.

    Args:
        action_space: a Discrete, MultiDiscrete or Box space.
        logits: float32 [..., logits_size(action_space)], any number of leading dims.

    Returns:
        An object with `log_prob(actions)`, `entropy()` and `kl(other)` (KL(self || other)),
        all float32 [...] and summed over action components/dims, and `sample(seed=None)` and
        `mode()` (actions of `action_dtype(action_space)`, shaped
        [..., *action_shape(action_space)]): a `Categorical` (Discrete), a `MultiCategorical`
        (MultiDiscrete) or a `DiagGaussian` (Box; feed it float32 actions).

    Raises:
        ValueError: for unsupported spaces.
    """
    _check_supported(action_space)
    logits = tf.convert_to_tensor(logits, dtype=tf.float32)
    if isinstance(action_space, gym.spaces.Discrete):
        return Categorical(logits)
    if isinstance(action_space, gym.spaces.MultiDiscrete):
        return MultiCategorical(split_logits(action_space, logits))
    shape = action_shape(action_space)
    mean, log_std = tf.split(logits, 2, axis=-1)
    event_shape = tf.concat([tf.shape(logits)[:-1], tf.constant(shape, tf.int32)], axis=0)
    mean = tf.reshape(mean, event_shape)
    log_std = tf.reshape(log_std, event_shape)
    return DiagGaussian(mean, log_std, len(shape))
