"""Shared set-up of the Ray tests: a Ray session that writes nothing outside tmp paths."""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Iterator

import pytest

from impala_tf.config import ImpalaConfig

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


def small_config(**overrides) -> ImpalaConfig:
    config = (
        ImpalaConfig()
        .environment("CartPole-v1")
        .env_runners(num_env_runners=2, num_envs_per_env_runner=4, rollout_fragment_length=10)
        .training(train_batch_size=80, model={"fcnet_hiddens": [16]})
        .resources(actor_backend="ray")
        .reporting(min_time_s_per_iteration=0.5)
        .debugging(seed=0)
    )
    return config.update_from_dict(overrides)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def wait_until(predicate, timeout_s: float = 60.0, interval_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def actor_state(actor_id_hex: str) -> str:
    from ray._private import state

    return state.actors(actor_id=actor_id_hex)["State"]
