"""How a setting finds its config key: RLlib's names, old names, ignored and refused keys.

Every setting given to an `AlgorithmConfig` (a builder's keyword, a dict, a YAML's `config`
block) goes through `apply_settings`, which resolves its key against four tables (the last
three, with the model defaults, live in `impala_tf.config.keys`):

* the config class's dataclass fields (each field's metadata names its builder group), and
  `MODEL_DEFAULTS` for the keys of the `model` dict;
* `ALIASES`: old RLlib names, applied to the new key with one `DeprecatedKeyWarning` per name;
* `IGNORED` (the class's `ignored_keys`): RLlib keys with no meaning here, accepted with one
  `ConfigWarning` per name;
* `UNSUPPORTED` (the class's `unsupported_keys`): RLlib keys whose behaviour we do not have and
  that no other key reproduces; a non-None value is an error that says what to use instead.

Anything else is an error naming the key, with a "did you mean" suggestion; so is a key set
through a builder it does not belong to, and two names of one key set to different values. A
Ray Tune search space as a value is refused (`impala_tf.config.experiments`). Values are not
checked here (`impala_tf.config.validation` does that).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from impala_tf.config.experiments import refuse_search_spaces
from impala_tf.config.keys import (
    ALIASES,
    IGNORED_MODEL,
    MODEL_ALIASES,
    MODEL_DEFAULTS,
    SYNONYMS,
    ConfigWarning,
    DeprecatedKeyWarning,
    suggest,
    warn_once,
)

__all__ = ["apply_settings", "merge_model"]


def apply_settings(config: Any, settings: Mapping[str, Any], group: str | None) -> None:
    """Sets `settings` on `config`, each key resolved against the tables above.

    `model` is merged into the config's model dict (`merge_model`); other values replace the
    current ones, deep-copied.

    Args:
      config: An `impala_tf.config.base.AlgorithmConfig` (of any algorithm), changed in place.
      settings: `{key: value}`, RLlib's current or old names, and RLlib's `multiagent` block.
      group: The builder the settings came through (`"training"`), whose keys alone it may
        set; None for a dict (any key).

    Raises:
      ValueError: for an unknown key (with a suggestion), an unsupported one, a search space,
        or two names of one key with different values.
      TypeError: for a key of another builder than `group`.
    """
    refuse_search_spaces(settings)
    set_by: dict[str, str] = {}
    if "multiagent" in settings or "replay_ratio" in settings:
        from impala_tf.config.policies import expand_rllib_keys

        settings = expand_rllib_keys(settings)
    for key, value in settings.items():
        name = key
        if key in ALIASES:
            name = ALIASES[key]
            if key not in SYNONYMS:
                warn_once(
                    key,
                    f"Config key `{key}` is deprecated; use `{name}` (value applied to it).",
                    DeprecatedKeyWarning,
                )
        ignored, unsupported = config.ignored_keys, config.unsupported_keys
        if name in ignored:
            warn_once(name, f"Config key `{name}` is ignored: {ignored[name]}.", ConfigWarning)
            continue
        if name in unsupported:
            if value is None:
                warn_once(name, f"Config key `{name}` is ignored (None).", ConfigWarning)
                continue
            raise ValueError(f"Config key `{name}` is not supported: {unsupported[name]}.")
        fields = _fields(type(config))
        field = fields.get(name)
        if field is None:
            known = [*fields, *ALIASES, *ignored, *unsupported]
            raise ValueError(f"Unknown {config.algo_name} config key `{key}`.{suggest(key, known)}")
        if group is not None and field.metadata["group"] != group:
            raise TypeError(
                f"`{key}` is not a setting of `.{group}()`; set it with "
                f"`.{field.metadata['group']}({key}=...)`."
            )
        if name in set_by and set_by[name] != key and getattr(config, name) != value:
            raise ValueError(
                f"Both `{set_by[name]}` and `{key}` set `{name}`, to different values; keep one."
            )
        set_by[name] = key
        if name == "model":
            merge_model(config.model, value)
        else:
            setattr(config, name, copy.deepcopy(value))


def merge_model(model_dict: dict[str, Any], model: Any) -> None:
    """Merges the settings `model` into a config's `model_dict`, resolving old and ignored keys.

    Args:
      model_dict: The config's `model` dict, changed in place.
      model: The `model` setting: `{model key: value}`.

    Raises:
      ValueError: `model` is not a mapping, or holds an unknown key (with a suggestion).
    """
    if not isinstance(model, Mapping):
        raise ValueError(f"`model` must be a dict of model settings, got {model!r}.")
    for key, value in model.items():
        if key in IGNORED_MODEL:
            message = f"Model key `{key}` is ignored: {IGNORED_MODEL[key]}."
            warn_once(f"model.{key}", message, ConfigWarning)
            continue
        if key in MODEL_ALIASES:
            targets = MODEL_ALIASES[key]
            warn_once(
                f"model.{key}",
                f"Model key `{key}` is deprecated; use {' and '.join(targets)}.",
                DeprecatedKeyWarning,
            )
        elif key in MODEL_DEFAULTS:
            targets = (key,)
        else:
            known = [*MODEL_DEFAULTS, *MODEL_ALIASES, *IGNORED_MODEL]
            raise ValueError(f"Unknown model key `{key}` in `model`.{suggest(key, known)}")
        for target in targets:
            model_dict[target] = copy.deepcopy(value)


@functools.cache
def _fields(cls: type) -> dict[str, dataclasses.Field]:
    """The config keys of a config class (`AlgorithmConfig` or a subclass), by name."""
    return {f.name: f for f in dataclasses.fields(cls)}
