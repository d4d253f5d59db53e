"""Reading checkpoints written before the one-runtime layout (`impala_tf.checkpoints.store`).

Two older layouts exist: the single-agent driver's (learner at the top, one `"observation_filter"`,
a `runtime_state.pkl` pickling the driver's `Aggregator` object) and the multi-agent driver's
(`"multi_agent": true`, `"policy_ids"`, `"observation_filters"`, one complete single-policy
checkpoint per policy under `policies/`). `normalize_state` gives their `driver_state.json` this
layout's keys; `load_runtime_state` unpickles a `runtime_state.pkl` of any age into plain data,
reading the objects older files pickled (whose classes have since changed) by their fields.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import IO, Any

from impala_tf.config.policies import DEFAULT_POLICY_ID

__all__ = ["load_runtime_state", "normalize_state"]


def normalize_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """A `driver_state.json` of any layout with `"policy_ids"` and `"observation_filters"`."""
    out = dict(state)
    if "policy_ids" not in out:  # The single-agent layout.
        out["policy_ids"] = [DEFAULT_POLICY_ID]
    if "observation_filters" not in out:
        out["observation_filters"] = {DEFAULT_POLICY_ID: out.get("observation_filter")}
    return out


class _Fields:
    """Stands in for a class an older checkpoint pickled: keeps the pickled fields."""

    def __setstate__(self, state: Any) -> None:
        self.__dict__.update(state if isinstance(state, dict) else state[1] or {})


#: Classes that older `runtime_state.pkl` files pickled, read back as `_Fields`.
_PICKLED_CLASSES = {
    ("impala_tf.actors.aggregation", "Aggregator"),
    ("impala_tf.data.batching", "BatchBuilder"),
    ("impala_tf.data.replay", "MixInReplayBuffer"),
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _PICKLED_CLASSES:
            return _Fields
        return super().find_class(module, name)


def load_runtime_state(file: IO[bytes]) -> dict[str, Any]:
    """Unpickles a `runtime_state.pkl` into plain data (see `store.read_runtime_state`)."""
    state = dict(_Unpickler(file).load())
    aggregator = state.get("aggregator")
    if isinstance(aggregator, _Fields):
        state["aggregator"] = {DEFAULT_POLICY_ID: _aggregator_state(aggregator)}
    return state


def _aggregator_state(aggregator: _Fields) -> dict[str, Any]:
    builder = aggregator._builder
    replay = getattr(aggregator, "_replay", None)
    out: dict[str, Any] = {
        "pending": {
            "pending": [dict(b) for b in builder._pending],
            "versions": list(builder._versions),
        },
        "replay": None,
    }
    if replay is not None:
        out["replay"] = {
            "slots": [dict(b) for b in replay._slots],
            "next_slot": replay._next_slot,
            "new": [dict(b) for b in replay._new],
            "rng": replay._rng.getstate(),
            "added_count": replay._added_count,
            "replayed_count": replay._replayed_count,
        }
    return out
