"""Observation filters (RLlib's `observation_filter`): `NoFilter` and the running `MeanStdFilter`.

numpy only, so actor processes load it cheaply. N is the number of observations in a batch.

RLlib's protocol, reproduced here:

* every env runner owns a filter and applies it to each observation its envs return, updating
  the running statistics (`rs`) and a `buffer` of the statistics gathered since the last flush;
* the driver owns the master filter. Each fragment carries its runner's buffer (`delta()`, then
  the runner resets it); the driver merges it with `apply_changes` (Chan et al.'s parallel
  mean/variance combination, so merging the deltas equals one filter over all the data);
* the driver sends the merged filter back with the weights; the runner `sync`s its running
  statistics to it (its buffer, empty between fragments, is kept);
* the master filter is saved in checkpoints and applied (without updates) by evaluation and by
  the exported SavedModel.

`MeanStdFilter` computes (x - mean) / (std + 1e-6), then clips to [-clip, clip] when `clip` is
set. As RLlib's `get_filter`, `observation_filter: MeanStdFilter` builds it without clipping;
the class default `clip=10.0` is RLlib's too. As RLlib's `RunningStat`, the variance is the
sample variance S / (n - 1), and mean^2 while fewer than two observations were seen.
"""

from __future__ import annotations

import abc
from typing import Any

import numpy as np

__all__ = [
    "FILTER_NAMES",
    "Filter",
    "MeanStdFilter",
    "NoFilter",
    "RunningStat",
    "filter_from_state",
    "get_filter",
]

#: The `observation_filter` values accepted (RLlib's names).
FILTER_NAMES = ("NoFilter", "MeanStdFilter", "ConcurrentMeanStdFilter")

#: RLlib's SMALL_NUMBER, added to the standard deviation before dividing.
_EPSILON = 1e-6


class RunningStat:
    """Count, mean and sum of squared deviations of a stream of arrays of one shape.

    Args:
      shape: The shape of one observation.
    """

    def __init__(self, shape: tuple[int, ...] = ()):
        self.n = 0
        self.mean_ = np.zeros(shape, np.float64)
        self.sum_sq = np.zeros(shape, np.float64)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.mean_.shape

    @property
    def mean(self) -> np.ndarray:
        return self.mean_

    @property
    def var(self) -> np.ndarray:
        """The sample variance S / (n - 1); mean^2 while n < 2 (RLlib's convention)."""
        return self.sum_sq / (self.n - 1) if self.n > 1 else np.square(self.mean_)

    @property
    def std(self) -> np.ndarray:
        return np.sqrt(self.var)

    def copy(self) -> RunningStat:
        other = RunningStat(self.shape)
        other.n, other.mean_, other.sum_sq = self.n, self.mean_.copy(), self.sum_sq.copy()
        return other

    def push_batch(self, xs: np.ndarray) -> None:
        """Adds N observations, xs of shape [N, *shape] (the same result as N single pushes)."""
        xs = np.asarray(xs, np.float64)
        if xs.shape[1:] != self.shape:
            raise ValueError(
                f"Observation filter: observations of shape {xs.shape[1:]} given to a filter of "
                f"shape {self.shape}."
            )
        if len(xs) == 0:
            return
        batch = RunningStat(self.shape)
        batch.n = len(xs)
        batch.mean_ = xs.mean(axis=0)
        batch.sum_sq = np.square(xs - batch.mean_).sum(axis=0)
        self.update(batch)

    def update(self, other: RunningStat) -> None:
        """Merges `other`'s statistics into these (Chan et al.'s parallel combination)."""
        n1, n2 = self.n, other.n
        n = n1 + n2
        if n == 0:
            return
        delta = other.mean_ - self.mean_
        self.mean_ = self.mean_ + delta * (n2 / n)
        self.sum_sq = self.sum_sq + other.sum_sq + np.square(delta) * (n1 * n2 / n)
        self.n = n

    def get_state(self) -> dict[str, Any]:
        """JSON-serialisable state: `n`, `mean`, `sum_sq` (lists)."""
        return {"n": int(self.n), "mean": self.mean_.tolist(), "sum_sq": self.sum_sq.tolist()}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> RunningStat:
        mean = np.asarray(state["mean"], np.float64)
        stat = cls(mean.shape)
        stat.n = int(state["n"])
        stat.mean_ = mean
        stat.sum_sq = np.asarray(state["sum_sq"], np.float64).reshape(mean.shape)
        return stat


class Filter(abc.ABC):
    """What every observation filter offers (RLlib's `Filter` interface)."""

    name = "Filter"

    @abc.abstractmethod
    def __call__(self, x: np.ndarray, update: bool = True) -> np.ndarray:
        """Filters a batch of observations [N, *shape]; `update` also updates the statistics."""

    @abc.abstractmethod
    def apply_changes(self, other: Filter, with_buffer: bool = False) -> None:
        """Merges the buffer (the changes since its last flush) of `other` into this filter."""

    @abc.abstractmethod
    def sync(self, other: Filter) -> None:
        """Copies all of `other`'s state into this filter."""

    @abc.abstractmethod
    def copy(self) -> Filter:
        """An independent copy."""

    @abc.abstractmethod
    def reset_buffer(self) -> None:
        """Forgets the changes gathered since the last flush."""

    @abc.abstractmethod
    def delta(self) -> Filter | None:
        """A copy holding the changes since the last flush (what a fragment carries), or None."""

    @abc.abstractmethod
    def get_state(self) -> dict[str, Any]:
        """JSON-serialisable state; `filter_from_state` rebuilds the filter."""

    def as_serializable(self) -> Filter:
        return self.copy()


class NoFilter(Filter):
    """Observations pass unchanged (RLlib's default)."""

    name = "NoFilter"

    def __call__(self, x: np.ndarray, update: bool = True) -> np.ndarray:
        return np.asarray(x)

    def apply_changes(self, other: Filter, with_buffer: bool = False) -> None:
        pass

    def sync(self, other: Filter) -> None:
        pass

    def copy(self) -> NoFilter:
        return self

    def reset_buffer(self) -> None:
        pass

    def delta(self) -> None:
        return None

    def get_state(self) -> dict[str, Any]:
        return {"name": self.name}


class MeanStdFilter(Filter):
    """Standardises observations by running statistics: (x - mean) / (std + 1e-6), clipped.

    Args:
      shape: The shape of one observation.
      demean: Subtract the running mean.
      destd: Divide by the running standard deviation (+ 1e-6).
      clip: Clip the result to [-clip, clip]; None or 0 for no clipping.
    """

    name = "MeanStdFilter"

    def __init__(
        self,
        shape: tuple[int, ...],
        demean: bool = True,
        destd: bool = True,
        clip: float | None = 10.0,
    ):
        self.shape = tuple(int(d) for d in shape)
        self.demean = demean
        self.destd = destd
        self.clip = clip
        self.rs = RunningStat(self.shape)
        self.buffer = RunningStat(self.shape)

    def __call__(self, x: np.ndarray, update: bool = True) -> np.ndarray:
        """Filters one observation [*shape] or a batch [N, *shape]; keeps x's float dtype.

        Args:
          x: The observation(s).
          update: Add them to the running statistics and the buffer first (acting); False
            applies the filter as it is (evaluation, serving).
        """
        x = np.asarray(x)
        dtype = x.dtype if np.issubdtype(x.dtype, np.floating) else np.float32
        batch = x if x.ndim == len(self.shape) + 1 else x[None]
        if update:
            self.rs.push_batch(batch)
            self.buffer.push_batch(batch)
        out = batch.astype(np.float64)
        if self.demean:
            out = out - self.rs.mean
        if self.destd:
            out = out / (self.rs.std + _EPSILON)
        if self.clip:
            out = np.clip(out, -self.clip, self.clip)
        out = out.astype(dtype)
        return out if x.ndim == len(self.shape) + 1 else out[0]

    def apply_changes(self, other: Filter, with_buffer: bool = False) -> None:
        """Merges `other.buffer` into the running statistics (and copies it if `with_buffer`)."""
        if not isinstance(other, MeanStdFilter):
            raise TypeError(f"Cannot merge a {type(other).__name__} into a MeanStdFilter")
        self.rs.update(other.buffer)
        if with_buffer:
            self.buffer = other.buffer.copy()

    def sync(self, other: Filter) -> None:
        if not isinstance(other, MeanStdFilter):
            raise TypeError(f"Cannot sync a MeanStdFilter to a {type(other).__name__}")
        self.demean, self.destd, self.clip = other.demean, other.destd, other.clip
        self.rs = other.rs.copy()
        self.buffer = other.buffer.copy()

    def copy(self) -> MeanStdFilter:
        other = MeanStdFilter(self.shape, self.demean, self.destd, self.clip)
        other.sync(self)
        return other

    def reset_buffer(self) -> None:
        self.buffer = RunningStat(self.shape)

    def delta(self) -> MeanStdFilter:
        return self.copy()

    def get_state(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "demean": self.demean,
            "destd": self.destd,
            "clip": self.clip,
            "rs": self.rs.get_state(),
            "buffer": self.buffer.get_state(),
        }

    def serving_stats(self) -> tuple[np.ndarray, np.ndarray]:
        """(mean, std + 1e-6) as float32 arrays, with demean/destd folded in (for export)."""
        mean = self.rs.mean if self.demean else np.zeros(self.shape)
        scale = self.rs.std + _EPSILON if self.destd else np.ones(self.shape)
        return mean.astype(np.float32), scale.astype(np.float32)


def get_filter(name: str, shape: tuple[int, ...]) -> Filter:
    """The filter `observation_filter: name` builds for observations of `shape` (RLlib's).

    Raises:
      ValueError: an unknown name; the message names `observation_filter`.
    """
    if name == "NoFilter":
        return NoFilter()
    if name in ("MeanStdFilter", "ConcurrentMeanStdFilter"):
        # RLlib's `get_filter` builds both without clipping; actors here are single-threaded.
        return MeanStdFilter(shape, clip=None)
    raise ValueError(f"`observation_filter` must be one of {list(FILTER_NAMES)}, got {name!r}.")


def filter_from_state(state: dict[str, Any]) -> Filter:
    """Rebuilds a filter from its `get_state()`."""
    if state.get("name") == "NoFilter":
        return NoFilter()
    if state.get("name") != "MeanStdFilter":
        raise ValueError(f"Unknown observation filter state {state.get('name')!r}")
    out = MeanStdFilter(tuple(state["shape"]), state["demean"], state["destd"], state["clip"])
    out.rs = RunningStat.from_state(state["rs"])
    out.buffer = RunningStat.from_state(state["buffer"])
    return out
