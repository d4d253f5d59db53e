"""Multi-agent config: policies (`PolicySpec`), the policy mapping function, `policies_to_train`.

RLlib's `config.multi_agent(policies=..., policy_mapping_fn=..., policies_to_train=...)` and the
YAML `multiagent:` block. What each accepts:

* `policies`: a list/set/tuple of policy ids (each gets the algorithm's config and the env's
  spaces), or a dict `{policy_id: spec}` where spec is None, a `PolicySpec`, RLlib's old tuple
  `(policy_class, observation_space, action_space, config)` or a dict with those keys.
  `policy_class` must be None (every policy is the V-trace TF policy); a spec's `config` holds
  per-policy overrides of any IMPALA key (`lr`, `model`, `entropy_coeff`, ...), applied on top of
  the algorithm's config as RLlib merges them.
* `policy_mapping_fn`: a callable `fn(agent_id, episode, worker=None, **kwargs) -> policy_id`, an
  import path `"package.module.name"` (or `"package.module:name"`), or RLlib's YAML form
  `{"type": "package.module.Name", **constructor_kwargs}`; a class is instantiated (RLlib's
  `from_config`). A callable must be picklable (a module-level function or class), since actor
  processes receive it. `episode` has `episode_id`, `env_index` and `worker_index`. The mapping is
  asked once per agent and episode. Default: every agent maps to `"default_policy"`.
* `policies_to_train`: a list of policy ids the learner updates (default: all). The others act
  with the weights they were built with (or restored).

RLlib's own example paths used by its tuned YAMLs resolve to the equivalents shipped here
(`_IMPORT_ALIASES`), so an RLlib tuned example runs unchanged.

Other `multiagent` keys: `count_steps_by` ("env_steps" only: fragments and `train_batch_size`
count env steps per fragment and agent steps per policy batch), `replay_mode` ("independent"
only), `policy_map_capacity`/`policy_map_cache` (ignored: every policy stays in memory),
`observation_fn` (unsupported).
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from impala_tf.config.keys import ConfigWarning

__all__ = [
    "DEFAULT_POLICY_ID",
    "EpisodeInfo",
    "PolicyMappingFn",
    "PolicySpec",
    "default_policy_mapping_fn",
    "expand_rllib_keys",
    "import_object",
    "multiagent_settings",
    "normalize_policies",
    "policy_config",
    "policy_ids_to_train",
    "resolve_mapping_fn",
    "validate_multi_agent",
]

DEFAULT_POLICY_ID = "default_policy"

#: RLlib import paths (in its tuned examples) -> the object shipped here that does the same.
_IMPORT_ALIASES = {
    # Where this package kept it before (configs saved in older checkpoints name it).
    "impala_tf.multi_agent.spec.PolicyMappingFn": "impala_tf.config.policies.PolicyMappingFn",
    "impala_tf.multi_agent.spec:PolicyMappingFn": "impala_tf.config.policies.PolicyMappingFn",
    "ray.rllib.examples.multi_agent_and_self_play.policy_mapping_fn.PolicyMappingFn": (
        "impala_tf.config.policies.PolicyMappingFn"
    ),
    "ray.rllib.examples.env.multi_agent.MultiAgentCartPole": (
        "impala_tf.multi_agent.env.MultiAgentCartPole"
    ),
    "ray.rllib.examples.envs.classes.multi_agent.MultiAgentCartPole": (
        "impala_tf.multi_agent.env.MultiAgentCartPole"
    ),
}

_MULTIAGENT_KEYS = ("policies", "policy_mapping_fn", "policies_to_train")
_IGNORED_KEYS = {
    "policy_map_capacity": "every policy stays in memory",
    "policy_map_cache": "every policy stays in memory",
}


@dataclasses.dataclass
class PolicySpec:
    """One policy: its spaces (None: the env's) and its config overrides (RLlib's `PolicySpec`).

    Attributes:
      policy_class: Must be None: every policy is the V-trace TF policy.
      observation_space: The policy's observation space; None takes the space of the first agent
        mapped to it.
      action_space: Likewise for actions.
      config: Overrides of IMPALA keys for this policy (e.g. `{"lr": 1e-3}`).
    """

    policy_class: Any = None
    observation_space: Any = None
    action_space: Any = None
    config: dict | None = None


@dataclasses.dataclass(frozen=True)
class EpisodeInfo:
    """What a policy mapping function receives as `episode`.

    Attributes:
      episode_id: A number unique within the env runner.
      env_index: Index of the env within its runner.
      worker_index: 1-based index of the runner (0: the driver).
    """

    episode_id: int
    env_index: int = 0
    worker_index: int = 0


class PolicyMappingFn:
    """Maps agent `i` to policy `"p{i}"` (RLlib's example `PolicyMappingFn` for its YAMLs)."""

    def __call__(
        self, agent_id: Any, episode: Any = None, worker: Any = None, **kwargs: Any
    ) -> str:
        return f"p{agent_id}"


def default_policy_mapping_fn(agent_id: Any, episode: Any = None, worker: Any = None, **kw) -> str:
    """RLlib's default: every agent acts with `"default_policy"`."""
    return DEFAULT_POLICY_ID


def import_object(path: str) -> Any:
    """Imports `"package.module.name"` or `"package.module:name"` (RLlib aliases resolved).

    Raises:
      ValueError: naming the path when the module or the name cannot be found.
    """
    path = _IMPORT_ALIASES.get(path, path)
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{path!r} is not an import path (`package.module.name`).")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"Cannot import {path!r}: {e}") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(
            f"Cannot import {path!r}: module {module_name!r} has no {attr!r}."
        ) from None


def resolve_mapping_fn(spec: Any) -> Callable[..., Any]:
    """The callable a `policy_mapping_fn` setting names (see the module docstring).

    Raises:
      ValueError: naming `policy_mapping_fn` for anything else.
    """
    if spec is None:
        return default_policy_mapping_fn
    kwargs: dict[str, Any] = {}
    if isinstance(spec, Mapping):
        if "type" not in spec:
            raise ValueError(
                f"`policy_mapping_fn` as a dict needs a `type` (an import path), got {spec!r}."
            )
        kwargs = {k: v for k, v in spec.items() if k != "type"}
        spec = spec["type"]
    if isinstance(spec, str):
        try:
            spec = import_object(spec)
        except ValueError as e:
            raise ValueError(f"`policy_mapping_fn`: {e}") from e
    if isinstance(spec, type):
        spec = spec(**kwargs)
    elif kwargs:
        raise ValueError(f"`policy_mapping_fn`: constructor arguments {kwargs} for a non-class.")
    if not callable(spec):
        raise ValueError(f"`policy_mapping_fn` must be callable or an import path, got {spec!r}.")
    return spec


def normalize_policies(policies: Any) -> dict[str, PolicySpec]:
    """`policies` as `{policy_id: PolicySpec}` (None: `{"default_policy": PolicySpec()}`).

    Raises:
      ValueError: naming `policies` for a malformed entry.
    """
    if policies is None:
        return {DEFAULT_POLICY_ID: PolicySpec()}
    if isinstance(policies, (list, set, tuple)):
        ids = list(policies)
        if not all(isinstance(p, str) for p in ids):
            raise ValueError(f"`policies` as a list must hold policy ids (str), got {ids!r}.")
        if not ids:
            raise ValueError("`policies` is empty: name at least one policy.")
        if len(set(ids)) != len(ids):
            raise ValueError(f"`policies` lists a policy id twice: {ids!r}.")
        return {p: PolicySpec() for p in sorted(ids)}
    if not isinstance(policies, Mapping):
        raise ValueError(
            f"`policies` must be a list of policy ids or a dict {{id: PolicySpec}}, got "
            f"{policies!r}."
        )
    out: dict[str, PolicySpec] = {}
    for pid in sorted(policies):
        if not isinstance(pid, str):
            raise ValueError(f"`policies`: policy ids must be str, got {pid!r}.")
        value = policies[pid]
        if value is None:
            spec = PolicySpec()
        elif isinstance(value, PolicySpec):
            spec = dataclasses.replace(value)
        elif isinstance(value, (list, tuple)) and len(value) == 4:
            spec = PolicySpec(*value)
        elif isinstance(value, Mapping):
            unknown = set(value) - {f.name for f in dataclasses.fields(PolicySpec)}
            if unknown:
                raise ValueError(f"`policies[{pid!r}]`: unknown PolicySpec keys {sorted(unknown)}.")
            spec = PolicySpec(**value)
        else:
            raise ValueError(
                f"`policies[{pid!r}]` must be None, a PolicySpec, a dict or a "
                f"(policy_class, observation_space, action_space, config) tuple; got {value!r}."
            )
        if spec.policy_class is not None:
            raise ValueError(
                f"`policies[{pid!r}]`: policy_class must be None (every policy is IMPALA's "
                f"V-trace TF policy), got {spec.policy_class!r}."
            )
        if spec.config is not None and not isinstance(spec.config, Mapping):
            raise ValueError(f"`policies[{pid!r}]`: config must be a dict, got {spec.config!r}.")
        out[pid] = spec
    if not out:
        raise ValueError("`policies` is empty: name at least one policy.")
    return out


def policy_ids_to_train(config: Any) -> list[str]:
    """The ids of the policies the learner updates (`policies_to_train`, default all)."""
    ids = list(normalize_policies(config.policies))
    if config.policies_to_train is None:
        return ids
    return [p for p in ids if p in set(config.policies_to_train)]


def policy_config(config: Any, policy_id: str) -> Any:
    """The config of one policy: `config` with the spec's overrides, multi-agent keys cleared.

    Raises:
      ValueError: naming the policy for a bad override.
    """
    spec = normalize_policies(config.policies)[policy_id]
    out = config.copy()
    out.policies = out.policy_mapping_fn = out.policies_to_train = None
    if spec.config:
        if set(spec.config) & {"multiagent", *_MULTIAGENT_KEYS, "env", "env_config"}:
            raise ValueError(
                f"`policies[{policy_id!r}].config` may not set the env or multi-agent keys."
            )
        try:
            out.update_from_dict(spec.config)
        except (TypeError, ValueError) as e:
            raise ValueError(f"`policies[{policy_id!r}].config`: {e}") from e
    return out


def multiagent_settings(block: Mapping[str, Any]) -> dict[str, Any]:
    """The config fields a `multiagent` block (or `multi_agent(**kwargs)`) sets.

    Raises:
      ValueError: naming the key for an unknown or unsupported one.
    """
    if not isinstance(block, Mapping):
        raise ValueError(f"`multiagent` must be a dict, got {block!r}.")
    out = {}
    for key, value in block.items():
        if key in _MULTIAGENT_KEYS:
            out[key] = value
        elif key in _IGNORED_KEYS:
            warnings.warn(
                f"multiagent key `{key}` is ignored: {_IGNORED_KEYS[key]}.", ConfigWarning, 3
            )
        elif key == "count_steps_by":
            if value != "env_steps":
                raise ValueError(
                    f"multiagent `count_steps_by` must be 'env_steps' (fragments count env "
                    f"steps, policy batches agent steps), got {value!r}."
                )
        elif key == "replay_mode":
            if value != "independent":
                raise ValueError(
                    f"multiagent `replay_mode` must be 'independent' (each policy replays its "
                    f"own batches), got {value!r}."
                )
        elif key == "observation_fn":
            if value is not None:
                raise ValueError("multiagent `observation_fn` is not supported.")
        else:
            raise ValueError(
                f"Unknown multiagent key `{key}`; known: {sorted(_MULTIAGENT_KEYS)} (and "
                "count_steps_by, replay_mode, policy_map_capacity, policy_map_cache)."
            )
    return out


def expand_rllib_keys(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Flattens a YAML `multiagent:` block into its keys and handles RLlib's `replay_ratio`.

    `replay_ratio` is RLlib's newer form of `replay_proportion` (1 / ratio): 0 (no replay) is
    accepted with a warning; other values must be given as `replay_proportion`.
    """
    out = dict(settings)
    if "multiagent" in out:
        block = out.pop("multiagent")
        if block is not None:
            for key, value in multiagent_settings(block).items():
                if key in out and out[key] != value:
                    raise ValueError(f"`{key}` is set both in `multiagent` and outside it.")
                out[key] = value
    if "replay_ratio" in out:
        ratio = out.pop("replay_ratio")
        if ratio not in (0, 0.0, None):
            raise ValueError(
                f"`replay_ratio={ratio!r}` is not supported; set `replay_proportion` "
                "(replayed batches per new batch) instead."
            )
        warnings.warn(
            "Config key `replay_ratio` is ignored: 0 means no replay, the default "
            "(`replay_proportion=0`).",
            ConfigWarning,
            4,
        )
    return out


def validate_multi_agent(config: Any) -> None:
    """Checks the multi-agent keys and every policy's config; raises ValueError naming the key."""
    specs = normalize_policies(config.policies)
    resolve_mapping_fn(config.policy_mapping_fn)
    train = config.policies_to_train
    if train is not None:
        if callable(train) or not isinstance(train, (list, tuple, set)):
            raise ValueError(
                f"`policies_to_train` must be a list of policy ids (a callable is not "
                f"supported), got {train!r}."
            )
        unknown = sorted(set(train) - set(specs))
        if unknown:
            raise ValueError(f"`policies_to_train` names unknown policies {unknown}.")
    for pid in specs:
        pconfig = policy_config(config, pid)
        for key in ("rollout_fragment_length", "num_envs_per_env_runner", "num_gpus"):
            if getattr(pconfig, key) != getattr(config, key):
                raise ValueError(f"`policies[{pid!r}].config` may not change `{key}`.")
        try:
            pconfig.validate(require_env=False)
        except ValueError as e:
            raise ValueError(f"`policies[{pid!r}].config`: {e}") from e
