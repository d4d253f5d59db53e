"""Shared set-up of the Ray tests: a Ray session that writes nothing outside tmp paths.

`ray_environment(home)` keeps HOME and Ray's token in a temporary directory; `actor_state` reads
Ray's state of an actor. Configs come from `tests.support.configs.small_config(backend="ray")`.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator

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


def _reload_auth() -> None:
    """Makes Ray re-read RAY_AUTH_* (it caches them when first imported)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def actor_state(actor_id_hex: str) -> str:
    from ray._private import state

    return state.actors(actor_id=actor_id_hex)["State"]
