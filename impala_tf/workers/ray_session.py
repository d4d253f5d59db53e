"""The driver's connection to Ray, shared by the Ray actor and aggregator pools.

`acquire(address, num_cpus, resources)` connects once per process: to a Ray already initialised
in this process (a user's or a test's own `ray.init`, left as it is), to a running cluster
(`address` "auto" or "HOST:PORT", the config's `ray_address`), or to a Ray started here
(`address=None`: `ray.init` with exactly `num_cpus` CPUs and the custom `resources` the caller
asks for, an explicit small object store and no dashboard). Each user (a group of Ray workers,
`impala_tf.workers.ray_backend`) calls `release()` when it stops; the last one shuts down a Ray
that `acquire` started.

Token authentication (Ray 2.60): `ray.init()` of a new local Ray turns it on and writes a token
to `~/.ray/auth_token` (or `RAY_AUTH_TOKEN_PATH`) if none exists. A cluster started with
`RAY_AUTH_MODE=token ray start --head` refuses a driver without its token; joining an explicit
`HOST:PORT`, Ray itself reads the token only when `RAY_AUTH_MODE=token` is set; `acquire` turns
token mode on when a token is found (as Ray does for "auto"). A refused driver gets
`RayAuthenticationError`, which says how to pass the token.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

__all__ = ["RayAuthenticationError", "acquire", "release", "require_ray"]

logger = logging.getLogger(__name__)

#: Object store of a Ray started here: fragments and weights are small and short-lived, and
#: Ray's default (30% of RAM) would claim /dev/shm that the learner may need.
LOCAL_OBJECT_STORE_BYTES = 256 * 1024 * 1024

_INSTALL = "pip install -e '.[ray]'"

_lock = threading.Lock()
_users = 0
_started_here = False


class RayAuthenticationError(ConnectionError):
    """The Ray cluster at `ray_address` refused this driver: its auth token is missing/wrong."""


def require_ray() -> Any:
    """Imports and returns `ray`, or raises ImportError with the install command."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            f"`actor_backend='ray'` needs Ray, which is not installed here: run `{_INSTALL}` "
            "(or `pip install ray==2.60.0`), or set `actor_backend='local'`."
        ) from e
    return ray


def _auth_hint(address: str) -> str:
    mode = os.environ.get("RAY_AUTH_MODE")
    where = (
        "RAY_AUTH_TOKEN" if os.environ.get("RAY_AUTH_TOKEN") else
        os.environ.get("RAY_AUTH_TOKEN_PATH") or "~/.ray/auth_token"
    )  # fmt: skip
    return (
        f"The Ray cluster at ray_address={address!r} refused this driver: token authentication "
        f"is on there and this driver has no valid token (RAY_AUTH_MODE={mode!r}, token looked "
        f"up in {where}). Copy the head node's token (`ray get-auth-token` on the head, or its "
        "~/.ray/auth_token) to this machine's ~/.ray/auth_token, or export RAY_AUTH_TOKEN=<token>, "
        "and set RAY_AUTH_MODE=token before starting the driver."
    )


def _is_auth_failure(ray: Any, error: BaseException) -> bool:
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, ray.exceptions.AuthenticationError):
            return True
        text = str(error).lower()
        if any(w in text for w in ("unauthenticated", "invalidauthtoken", "authentication")):
            return True
        error = error.__cause__ or error.__context__
    return False


def _use_token_if_available() -> None:
    """Token mode for a driver joining an explicit HOST:PORT when a token is found.

    Ray 2.60 reads an existing token by itself only for `address="auto"`; with an explicit
    address and RAY_AUTH_MODE unset it connects without one and is refused. Ray's own rule for
    "auto" (token mode when a token exists in RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or
    ~/.ray/auth_token; an explicit RAY_AUTH_MODE always wins) is applied here too.
    """
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # Another Ray version: its own rules apply.
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def acquire(
    address: str | None, num_cpus: float, resources: Mapping[str, float] | None = None
) -> Any:
    """Connects this process to Ray; returns the `ray` module.

    Args:
      address: "auto" or "HOST:PORT" of a running cluster (the config's `ray_address`), or
        None: a Ray already initialised in this process, else a new local one.
      num_cpus: CPUs of a new local Ray (ignored otherwise).
      resources: Custom resources of a new local Ray (ignored otherwise).

    Raises:
      ImportError: Ray is not installed (with the install command).
      RayAuthenticationError: the cluster refused the driver's (missing) auth token.
      ConnectionError: no Ray cluster answers at `address`.
    """
    global _users, _started_here
    ray = require_ray()
    with _lock:
        if not ray.is_initialized():
            if address is None:
                ray.init(
                    address="local",  # A new Ray, never one `ray start` left on this machine.
                    num_cpus=num_cpus,
                    resources=dict(resources or {}) or None,
                    object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                    include_dashboard=False,
                    logging_level=logging.WARNING,
                )
                _started_here = True
            else:
                _use_token_if_available()
                try:
                    ray.init(address=address, logging_level=logging.WARNING)
                except Exception as e:
                    if _is_auth_failure(ray, e):
                        raise RayAuthenticationError(_auth_hint(address)) from e
                    raise
        _users += 1
    return ray


def release() -> None:
    """Drops one pool's use of Ray; shuts down a Ray that `acquire` started after the last."""
    global _users, _started_here
    ray = require_ray()
    with _lock:
        _users = max(0, _users - 1)
        if _users == 0 and _started_here:
            _started_here = False
            ray.shutdown()
