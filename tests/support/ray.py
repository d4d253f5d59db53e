"""Shared set-up of the Ray tests: a Ray session that writes nothing outside tmp paths.

`ray_environment(home)` keeps HOME and Ray's token in a temporary directory; `local_ray(home)`
starts a local Ray inside it for a test module (the runtime reuses an initialised Ray);
`actor_state` reads Ray's state of an actor. Configs come from
`tests.support.configs.small_config(backend="ray")`.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

#: One token for every Ray started by these tests (Ray caches the first it reads per process).
TOKEN = secrets.token_hex(32)


@contextlib.contextmanager
def ray_environment(home: str) -> Iterator[None]:
    """HOME and Ray's token kept in `home` (Ray writes ~/.ray/auth_token when it starts)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", home)
        mp.setenv("RAY_AUTH_MODE", "token")
        mp.setenv("RAY_AUTH_TOKEN", TOKEN)
        mp.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
        mp.delenv("RAY_ADDRESS", raising=False)
        mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
        _reload_auth()
        try:
            yield
        finally:
            mp.undo()
            _reload_auth()


@contextlib.contextmanager
def local_ray(
    home: str, num_cpus: int = 8, resources: Mapping[str, float] | None = None
) -> Iterator[Any]:
    """A local Ray (128 MiB object store, no dashboard) under `ray_environment(home)`; yields
    the `ray` module and shuts Ray down on exit."""
    import ray

    with ray_environment(home):
        ray.init(
            address="local",
            num_cpus=num_cpus,
            resources=dict(resources or {}),
            include_dashboard=False,
            object_store_memory=128 * 2**20,
            logging_level=logging.WARNING,
        )
        try:
            yield ray
        finally:
            ray.shutdown()


def _reload_auth() -> None:
    """Makes Ray re-read RAY_AUTH_* (it caches them when first imported)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def actor_state(actor_id_hex: str) -> str:
    from ray._private import state

    return state.actors(actor_id=actor_id_hex)["State"]
