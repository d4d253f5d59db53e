"""The wire protocol of central inference: how actors reach the driver's `InferenceServer`.

Both sides import it: the actors (`impala_tf.acting.remote_policy`) and the server
(`impala_tf.acting.inference`). numpy only: an actor that acts through the server never imports
TensorFlow.

Endpoints and the handshake. An actor reaches the server through an `Endpoint` that `connect`
turns into a `multiprocessing.connection.Connection`:
- a local actor process gets one end of a duplex pipe (`InferenceServer.attach`), passed to it
  when it starts;
- an actor that cannot receive a pipe end (a Ray actor, maybe on another machine) gets a
  `TcpEndpoint` (`InferenceServer.listen`): the server's address (`advertised_host`) and a
  random authkey. It opens a TCP connection, proves it knows the key (multiprocessing's
  challenge-response authentication; a connection without the key is refused before anything is
  unpickled) and announces its actor id (`connect`; the server's half is `accept_actor`);
  reconnecting with the same id replaces its old connection.
All the policies of one actor share its connection, and its requests are sequential.

Messages, pickled tuples (B is the number of the actor's envs the policy acts in):
- request `(policy_id, obs, state)`: observations [B, ...] and the recurrent state ([B, ...]
  arrays, () if none), served as they are; the server keeps nothing;
- request `(policy_id, obs, state, refills)`, for a policy whose frame stacks the server keeps
  (`impala_tf.acting.kept_stacks`): with `refills` None, `obs` are the B envs' whole stacks
  [B, H, W, k * s]; else `obs` are the newest frames [B, H, W, s] and `refills` bool [B] says
  which envs refilled their stacks;
- reply `("ok", logits [B, L], values [B], next state, num_grad_updates)`, the last being the
  version of the policy's weights that computed them;
- reply `("error", message)`: the request could not be served; the actor raises
  `InferenceError`.
The server reads each request into a `Request`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
from multiprocessing import connection
from typing import NamedTuple

import numpy as np

__all__ = [
    "Endpoint",
    "InferenceError",
    "Request",
    "TcpEndpoint",
    "accept_actor",
    "advertised_host",
    "connect",
    "node_ip_address",
    "send_reply",
    "shutdown",
    "unblock_accept",
]

# A TCP peer gets this long per read to authenticate and announce its id; a silent one is
# dropped instead of holding a thread until the server stops.
_HANDSHAKE_S = 10.0

_log = logging.getLogger(__name__)


class InferenceError(RuntimeError):
    """The inference server could not serve a request (raised in the actor)."""


class TcpEndpoint(NamedTuple):
    """Where a remote actor finds the inference server (picklable: sent to Ray actors).

    Attributes:
      host: The address the actor connects to (the driver's IP, `listen`'s `advertise`).
      port: The server's TCP port.
      authkey: The secret the actor authenticates with.
    """

    host: str
    port: int
    authkey: bytes

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)


#: What an actor is given to reach the server: a pipe end (local processes) or a TCP endpoint.
Endpoint = connection.Connection | TcpEndpoint


class Request(NamedTuple):
    """A request as the server holds it once read and checked.

    Attributes:
      conn: The connection it came on, which the reply goes to.
      obs: [B, ...] observations, whole stacks [B, H, W, k * s] or newest frames [B, H, W, s].
      state: The recurrent state, [B, ...] arrays (() if none).
      kept: None: `obs` served as they are. "stacks": whole stacks, kept for the connection's
        envs. "frames": the newest frames, which update the kept stacks (`refills` where
        refilled).
      refills: bool [B] with "frames", else None.
    """

    conn: connection.Connection
    obs: np.ndarray
    state: tuple
    kept: str | None = None
    refills: np.ndarray | None = None


def connect(endpoint: Endpoint, actor_id: int) -> connection.Connection:
    """Opens the actor's connection to the server (in the actor).

    Args:
      endpoint: A pipe end from `InferenceServer.attach` (returned as is) or a `TcpEndpoint`
        from `InferenceServer.listen` (connected, authenticated, and told `actor_id`).
      actor_id: The actor's id; a TCP connection announcing an id replaces the server's older
        connection of that id.

    Returns:
      The connection to give `RemotePolicy`.

    Raises:
      multiprocessing.AuthenticationError: The endpoint's authkey is not the server's.
      OSError: The server cannot be reached.
    """
    if not isinstance(endpoint, TcpEndpoint):
        return endpoint
    conn = connection.Client(endpoint.address, authkey=bytes(endpoint.authkey))
    try:
        conn.send(int(actor_id))
    except BaseException:
        conn.close()
        raise
    return conn


def accept_actor(conn: connection.Connection, authkey: bytes) -> int:
    """The server's half of `connect` over TCP: authenticates the peer and reads its actor id.

    Each read waits at most `_HANDSHAKE_S`, so a silent peer cannot hold the caller.

    Args:
      conn: A connection just accepted by the server's listener.
      authkey: The server's authkey (`TcpEndpoint.authkey`).

    Returns:
      The actor id the peer announced.

    Raises:
      multiprocessing.AuthenticationError: The peer does not know the authkey.
      ValueError: The peer announced something other than an int.
      OSError, EOFError: The peer went silent or away.
    """
    _set_read_timeout(conn, _HANDSHAKE_S)
    connection.deliver_challenge(conn, authkey)
    connection.answer_challenge(conn, authkey)
    actor_id = conn.recv()
    if not isinstance(actor_id, int) or isinstance(actor_id, bool):
        raise ValueError(f"expected an int actor id, got {actor_id!r}")
    _set_read_timeout(conn, 0.0)
    return actor_id


def send_reply(conn: connection.Connection, message: tuple) -> None:
    """Sends the server's reply; one to a connection the actor closed is dropped."""
    try:
        conn.send(message)
    except (OSError, ValueError):  # Closed by the actor's end; the next read drops it.
        _log.debug("inference reply to a closed connection dropped")


def shutdown(conn: connection.Connection) -> None:
    """Wakes a thread blocked reading `conn` (a TCP connection) with end of file."""
    with contextlib.suppress(OSError), socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.shutdown(socket.SHUT_RDWR)


def unblock_accept(address: tuple[str, int]) -> None:
    """Connects to the listener at `address` so that its blocking `accept` returns."""
    host, port = address
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    with contextlib.suppress(OSError), socket.create_connection((host, port), 2.0):
        pass


def node_ip_address() -> str:
    """This machine's IPv4 address on its default route: what other nodes reach it at.

    Found without the network and without waiting: connecting a UDP socket only picks the route
    and its source address, it sends nothing, and no name is resolved. Ray's
    `get_node_ip_address` finds a node's address the same way. "127.0.0.1" when the machine has
    no route to anywhere (offline).
    """
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("10.254.254.254", 1))
        return s.getsockname()[0]
    return "127.0.0.1"


def advertised_host(bound: str) -> str:
    """The address remote actors reach a listener bound to `bound` at."""
    if bound not in ("0.0.0.0", ""):
        return bound
    address = node_ip_address()
    if address != "127.0.0.1":
        return address
    try:  # No route: the hostname's address may still be one the peers reach.
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _set_read_timeout(conn: connection.Connection, seconds: float) -> None:
    """Bounds each blocking read of a TCP connection (0: no bound), via its socket."""
    whole = int(seconds)
    timeval = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
