"""RLlib's tuned-example files (Ray Tune's experiment format), read into an `Experiment`.

A tuned example is a YAML file with exactly one top entry:

    cartpole-impala:
      env: CartPole-v1
      run: IMPALA
      stop: {episode_reward_mean: 450, timesteps_total: 2000000}
      pass_criteria: {episode_reward_mean: 450, timesteps_total: 2000000}
      config: {num_env_runners: 2, lr: 0.002, ...}

`read_experiment_file` reads one (`AlgorithmConfig.from_yaml` and `read_experiment` call it):
`run` picks the config class (`impala_tf.config.registry`), the entry-level `env`,
`checkpoint_freq` and `keep_checkpoints_num` join the config, and `stop` and `pass_criteria` are
normalised to our result keys (`impala_tf.config.keys`).

Tune's search spaces (`lr: {grid_search: [...]}`, `{eval: "..."}`) are refused by
`refuse_search_spaces`, which every config update runs: a config is one trial. A file with
search spaces is a search: `read_search_file` reads it as a `Search` (the settings as a dict,
search spaces kept) and `impala-train` runs it as Tune trials (`impala_tf.tune.search`).

This module imports no config class (the registry resolves `run` by name), so that
`impala_tf.config.base` can import it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, NamedTuple

from impala_tf.config.keys import (
    load_yaml,
    normalize_pass_criteria,
    normalize_stop_criteria,
)

__all__ = [
    "SEARCH_SPACE_KEYS",
    "Experiment",
    "Search",
    "read_experiment_file",
    "read_search_file",
    "refuse_search_spaces",
    "search_space_paths",
]

#: Ray Tune's search spaces as a YAML writes them: a dict of one of these keys alone
#: (`lr: {grid_search: [...]}`, `num_envs_per_env_runner: {eval: "..."}`), as Tune reads them.
SEARCH_SPACE_KEYS = ("grid_search", "eval")

#: The keys of a tuned example's entry.
_ENTRY_KEYS = frozenset(
    {
        "env",
        "run",
        "stop",
        "pass_criteria",
        "config",
        "checkpoint_freq",
        "keep_checkpoints_num",
        "scheduler",  # Ours: a Tune trial scheduler (`impala_tf.tune.search.make_scheduler`).
    }
)


class Experiment(NamedTuple):
    """One tuned-example YAML entry, as `AlgorithmConfig.read_experiment` reads it.

    Attributes:
      name: The entry's name (`cartpole-impala`).
      config: The config (not validated): an `impala_tf.config.base.AlgorithmConfig` of the
        class the entry's `run` names.
      stop: The stop criteria, canonical keys (`normalize_stop_criteria`).
      pass_criteria: The learning suite's criteria, canonical keys (`normalize_pass_criteria`);
        empty when the entry has none.
    """

    name: str
    config: Any
    stop: dict[str, float]
    pass_criteria: list[dict[str, float]]


class Search(NamedTuple):
    """A tuned-example entry read as a search (`read_search_file`).

    Attributes:
      name: The entry's name.
      algo_name: The entry's `run` (`IMPALA`, `APPO`).
      settings: The config as a dict (with the entry's `env`, `checkpoint_freq` and
        `keep_checkpoints_num`), Tune's search spaces kept.
      stop: The stop criteria, canonical keys.
      scheduler: The entry's `scheduler` block (a Tune trial scheduler, e.g. population-based
        training), or None.
    """

    name: str
    algo_name: str
    settings: dict[str, Any]
    stop: dict[str, float]
    scheduler: dict[str, Any] | None = None


def _is_search_space(value: Any) -> bool:
    if isinstance(value, Mapping):
        return len(value) == 1 and next(iter(value)) in SEARCH_SPACE_KEYS
    return type(value).__module__.startswith("ray.tune.")  # tune.uniform(...) and friends.


def search_space_paths(settings: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The dotted paths (`lr`, `model.fcnet_hiddens`) of the Tune search spaces in `settings`."""
    paths = []
    for key, value in settings.items():
        name = f"{prefix}{key}"
        if _is_search_space(value):
            paths.append(name)
        elif isinstance(value, Mapping):
            paths += search_space_paths(value, prefix=f"{name}.")
    return paths


def refuse_search_spaces(settings: Mapping[str, Any], prefix: str = "") -> None:
    """Raises a ValueError naming the first key whose value is a Tune search space.

    A config is one trial; a grid would otherwise fail later as a wrong value, or not at all
    inside a free-form dict.

    Args:
      settings: Config settings, nested dicts searched too.
      prefix: The dotted path of `settings` in the whole config (`"model."`), for the message.
    """
    paths = search_space_paths(settings, prefix)
    if paths:
        raise ValueError(
            f"Config key `{paths[0]}` is a Ray Tune search space: a config is one trial. Run the "
            "search with `impala-train --config=FILE` (one Tune trial per point) or "
            "`tune.Tuner(impala_tf.tune.IMPALA, param_space=...)`; both need Ray Tune "
            "(`pip install 'impala_tf[tune]'`). Or give the key one value."
        )


def read_experiment_file(path: str | os.PathLike) -> Experiment:
    """Reads a tuned example: `name: {env, run, stop, pass_criteria, config}`.

    Args:
      path: Path of the YAML file, or the name of a shipped config (`cartpole-impala`:
        `impala_tf.config.shipped`).

    Returns:
      An `Experiment`: the entry's name, the config of the class `run` names (not validated),
      the stop criteria and the pass criteria (empty when the file has none).

    Raises:
      ValueError: for a malformed file, a `run` that names no algorithm, a bad key, or a
        malformed `pass_criteria` block (the message names the file).
    """
    name, algorithm, settings, entry = _read_entry(path)
    return Experiment(
        name=name,
        config=algorithm.from_dict(settings),
        stop=normalize_stop_criteria(entry.get("stop")),
        pass_criteria=normalize_pass_criteria(entry.get("pass_criteria")),
    )


def read_search_file(path: str | os.PathLike) -> Search:
    """Reads a tuned example as a search: its config as a dict, search spaces kept.

    Args:
      path: Path of the YAML file, or the name of a shipped config.

    Raises:
      ValueError: as `read_experiment_file`, except that search spaces are allowed.
    """
    name, algorithm, settings, entry = _read_entry(path)
    scheduler = entry.get("scheduler")
    if scheduler is not None and not isinstance(scheduler, Mapping):
        raise ValueError(f"{path}: `scheduler` of entry `{name}` must be a mapping.")
    return Search(
        name=name,
        algo_name=algorithm.algo_name,
        settings=settings,
        stop=normalize_stop_criteria(entry.get("stop")),
        scheduler=dict(scheduler) if scheduler is not None else None,
    )


def _read_entry(path: str | os.PathLike) -> tuple[str, type, dict[str, Any], Mapping[str, Any]]:
    """(name, config class, settings with the entry-level keys merged, the entry)."""
    from impala_tf.config.shipped import resolve_config

    path = resolve_config(path)  # A shipped config may be named: `cartpole-impala`.
    with open(path, encoding="utf-8") as f:
        document = load_yaml(f)
    if not isinstance(document, Mapping) or len(document) != 1:
        raise ValueError(
            f"{path}: expected exactly one top-level experiment entry "
            "(`name: {env: ..., run: IMPALA, stop: {...}, config: {...}}`)."
        )
    ((name, entry),) = document.items()
    if not isinstance(entry, Mapping):
        raise ValueError(f"{path}: entry `{name}` must be a mapping.")
    unknown = set(entry) - _ENTRY_KEYS
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)} in entry `{name}`.")
    from impala_tf.config.registry import ALGORITHMS, config_class

    run = entry.get("run")
    try:
        algorithm = config_class(run)
    except ValueError:
        raise ValueError(
            f"{path}: `run` must be one of {', '.join(ALGORITHMS)}, got {run!r}."
        ) from None
    if not isinstance(entry.get("config") or {}, Mapping):
        raise ValueError(f"{path}: `config` of entry `{name}` must be a mapping.")
    try:
        normalize_pass_criteria(entry.get("pass_criteria"))
    except ValueError as e:
        raise ValueError(f"{path}: entry `{name}`: {e}") from e
    settings = dict(entry.get("config") or {})
    if "env" in entry:
        if "env" in settings and settings["env"] != entry["env"]:
            raise ValueError(
                f"{path}: `env` is {entry['env']!r} in entry `{name}` but "
                f"{settings['env']!r} in its config; keep one."
            )
        settings["env"] = entry["env"]
    for key in ("checkpoint_freq", "keep_checkpoints_num"):
        if key in entry:
            settings[key] = entry[key]
    return str(name), algorithm, settings, entry
