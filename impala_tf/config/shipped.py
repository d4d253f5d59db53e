"""The configs shipped inside the package (`impala_tf/configs/*.yaml`), found by name.

`impala-train --config=cartpole-impala` and `ImpalaConfig.from_yaml("cartpole-impala")` run a
shipped config from any install (a wheel, `pip install .`), not only from a clone; a clone's
top-level `configs/` is the same directory.
"""

from __future__ import annotations

import os

__all__ = ["SHIPPED_DIR", "resolve_config", "shipped_names"]

#: Where the shipped YAMLs are installed: package data of `impala_tf`.
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def shipped_names() -> list[str]:
    """The names of the shipped configs (file names without `.yaml`), sorted."""
    if not os.path.isdir(SHIPPED_DIR):
        return []
    return sorted(n[: -len(".yaml")] for n in os.listdir(SHIPPED_DIR) if n.endswith(".yaml"))


def resolve_config(path_or_name: str | os.PathLike) -> str:
    """The YAML file `path_or_name` means: the path itself if it exists, else the shipped config
    of that name (`cartpole-impala` or `cartpole-impala.yaml`).

    Raises:
      FileNotFoundError: neither exists; the message lists the shipped names.
    """
    path = os.fspath(path_or_name)
    if os.path.exists(path):
        return path
    name = os.path.basename(path)
    name = name[: -len(".yaml")] if name.endswith(".yaml") else name
    # A bare name, or a clone's `configs/<name>.yaml` run from elsewhere.
    if os.path.dirname(path) in ("", "configs") and name in shipped_names():
        return os.path.join(SHIPPED_DIR, f"{name}.yaml")
    raise FileNotFoundError(
        f"No config file {path!r}, and no shipped config of that name "
        f"(shipped: {', '.join(shipped_names()) or 'none found'})."
    )
