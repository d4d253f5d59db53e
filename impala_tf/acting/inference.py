"""Central inference (SEED RL style): the driver runs the policies for every actor.

With `inference: "central"` the actors only step their envs. For each batched env step an actor
sends, for each policy it acts with, its observations [B, ...] (B is the number of the actor's
envs that policy acts in) and recurrent state to the driver's `InferenceServer`, and gets back
the logits [B, L], values [B], next state and the `num_grad_updates` of that policy's weights
that computed them; it then samples the actions itself (`impala_tf.acting.action_sampler`, seeded
per actor as with per-actor inference, so the same weights and seeds give the same actions). The
server serves several policies at once (a multi-agent config's "p0", "p1", ...; a single-agent
config is the one policy "default_policy"), each with its own spaces, model and weights.

The server thread waits on every actor's connection at once and answers all the requests that
are waiting with one forward pass per policy, so a model runs at a batch of up to
`num_env_runners * num_envs_per_env_runner` observations instead of `num_envs_per_env_runner`,
and the actors never import TensorFlow (lighter: no TensorFlow runtime or model in each actor;
`impala_tf.workers.memory` estimates both kinds, `tools.measure_actor_memory` prints them).

The actor's side (`connect`, `RemotePolicy`, `TcpEndpoint`) is `impala_tf.acting.remote_policy`,
re-exported here. An actor reaches the server through an endpoint that `connect` turns into a
`multiprocessing.connection.Connection`:
- a local actor process gets one end of a duplex pipe (`InferenceServer.attach`), passed to it
  when it starts;
- an actor that cannot receive a pipe end (a Ray actor, maybe on another machine) gets a
  `TcpEndpoint` (`InferenceServer.listen`): the server's address and a random authkey. It opens
  a TCP connection, proves it knows the key (multiprocessing's challenge-response
  authentication; a connection without the key is refused before anything is unpickled) and
  announces its actor id; reconnecting with the same id replaces its old connection.
All the policies of one actor share its connection, and its requests are sequential.

A policy whose env stacks frames (`frame_stacks`, from the env's `frame_stack`; Atari) has its
actors' stacks kept here, so that each frame travels once (`impala_tf.models.frames`). An actor's
request `(policy_id, obs, state, refills)` asks the server to keep them: with `refills` None,
`obs` are its B envs' whole stacks [B, H, W, k * s] (its first such request, and again after
its envs were reset or restored); then `obs` are the newest frames [B, H, W, s] and `refills`
bool [B] says which envs refilled their stacks (`BatchStep.stack_restarts`). Each env of a
connection owns a ring of its last k frames in a TensorFlow variable of the policy's; the
serving graph writes the new frames, gathers the stacks and runs the model on them, so the
policy sees exactly the stacks the env returned and the host copies no pixels. A connection's
rings are freed when it closes: a restarted actor's new connection holds none, and frames sent
before whole stacks are refused rather than read against another env's frames. A request
`(policy_id, obs, state)` is served as it is and keeps nothing (the final observations of
truncated episodes, and every request of a policy without frame stacks).

The server keeps its own copy of each model (with `explore=False`: it never samples): the driver
loads them at every weight broadcast from the same consistent snapshot it would send the actors
(`Impala._policy_snapshot`), so acting never reads variables the learner is updating, and a
request is served wholly with the weights from before a `set_weights` or wholly with those after.

A request the server cannot serve (an unknown policy id, an observation or state of the wrong
shape, a model error) is answered with the error, to the requesters concerned only, and the
actor raises it (`InferenceError`) like any env error; an actor whose server is gone (the driver
stopped) gets `EOFError` and exits. Neither side waits forever on the other.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import traceback
from collections.abc import Iterator, Mapping
from multiprocessing import connection
from typing import Any, NamedTuple

import gymnasium as gym
import numpy as np

from impala_tf.acting.remote_policy import (
    Endpoint,
    InferenceError,
    RemotePolicy,
    TcpEndpoint,
    connect,
)

__all__ = [
    "INFERENCE_MODES",
    "Endpoint",
    "InferenceError",
    "InferenceServer",
    "RemotePolicy",
    "TcpEndpoint",
    "connect",
    "node_ip_address",
]

#: `inference` config values: each actor runs its policy, or the driver runs it for all.
INFERENCE_MODES = ("actor", "central")

_POLL_S = 0.5
# A TCP peer gets this long per read to authenticate and announce its id; a silent one is
# dropped instead of holding a thread until `stop`.
_HANDSHAKE_S = 10.0
_JOIN_S = 5.0

_log = logging.getLogger(__name__)


class _Request(NamedTuple):
    conn: connection.Connection
    obs: np.ndarray
    state: tuple
    # None: `obs` served as they are. "stacks": whole stacks, kept for the connection's envs.
    # "frames": the newest frames, which update the kept stacks (`refills` where refilled).
    kept: str | None = None
    refills: np.ndarray | None = None


class InferenceServer:
    """Runs the acting models in the driver for every connected actor (a daemon thread).

    Args:
      policies: {policy_id: (observation_space, action_space, model)}, the model being the
        policy's resolved `ModelSpec` (or RLlib model keys; `impala_tf.models.build_model`).
      precisions: {policy_id: the policy's `precision` config key}, the Keras dtype policy its
        model is built under; a policy not in it is built in float32.
      frame_stacks: {policy_id: (k, s)} of the policies whose envs stack frames
        (`EnvSpaces.frame_stacks`): the server keeps their actors' stacks and takes each new
        frame once (see the module docstring). Other policies take whole observations only.
    """

    def __init__(
        self,
        policies: Mapping[str, tuple[gym.Space, gym.Space, Any]],
        precisions: Mapping[str, str] | None = None,
        frame_stacks: Mapping[str, tuple[int, int]] | None = None,
    ):
        from impala_tf.acting.tf_policy import ActorPolicy  # TensorFlow: the driver has it already.

        if not policies:
            raise ValueError("the inference server needs at least one policy")
        self._policies = {
            str(pid): ActorPolicy(
                obs_space,
                act_space,
                model_config,
                explore=False,
                precision=(precisions or {}).get(pid, "float32"),
            )
            for pid, (obs_space, act_space, model_config) in policies.items()
        }
        self._obs_shapes = {
            pid: tuple(int(d) for d in (p.observation_space.shape or ()))
            for pid, p in self._policies.items()
        }
        self._state_shapes = {
            pid: [tuple(int(d) for d in s.shape[1:]) for s in p.initial_state(1)]
            for pid, p in self._policies.items()
        }
        unknown = sorted(set(frame_stacks or {}) - set(self._policies))
        if unknown:
            raise ValueError(f"frame stacks for policies {unknown} that the server does not serve")
        self._kept = {
            str(pid): _KeptStacks(self._policies[str(pid)], (int(k), int(ch)))
            for pid, (k, ch) in (frame_stacks or {}).items()
        }
        self._versions = dict.fromkeys(self._policies, 0)
        # Held for each round of forward passes and by `set_weights`: one consistent snapshot.
        self._round_lock = threading.RLock()
        # The connection table, the listener and the handshakes in progress.
        self._lock = threading.Lock()
        self._conns: dict[int, connection.Connection] = {}
        self._closing: list[connection.Connection] = []  # Closed by the server thread.
        self._handshakes: dict[threading.Thread, connection.Connection] = {}
        self._listener: connection.Listener | None = None
        self._authkey = b""
        self._accept_thread: threading.Thread | None = None
        self._wake_recv, self._wake_send = connection.Pipe(duplex=False)
        self._stop_event = threading.Event()
        self.num_requests = 0
        self.num_batches = 0
        self.num_obs = 0
        self.num_frames = 0  # Observations that came as a new frame of a kept stack.
        self._thread = threading.Thread(target=self._run, name="impala-inference", daemon=True)
        self._thread.start()

    @property
    def state_shapes(self) -> dict[str, list[tuple[int, ...]]]:
        """{policy_id: per-env shapes of the model's recurrent state ([] if it has none)}."""
        return {pid: list(shapes) for pid, shapes in self._state_shapes.items()}

    @property
    def initial_states(self) -> dict[str, list[np.ndarray]]:
        """{policy_id: one env's recurrent state before its first step ([] if it has none)}:
        what each actor's `RemotePolicy` starts and restarts its envs from."""
        return {pid: [s[0] for s in p.initial_state(1)] for pid, p in self._policies.items()}

    # Weights ----------------------------------------------------------------------------------

    def get_weights(self) -> dict[str, list[np.ndarray]]:
        """{policy_id: the weights the server acts with}."""
        with self._round_lock:
            return {pid: p.get_weights() for pid, p in self._policies.items()}

    def set_weights(self, weights: Mapping[str, tuple[list[np.ndarray] | None, int]]) -> None:
        """Loads a consistent snapshot of some policies' weights; later requests use it.

        Args:
          weights: {policy_id: (weights or None, num_grad_updates)}. None keeps the policy's
            weights and only updates the version its replies carry; policies not in the
            mapping keep theirs. Checked before anything is loaded, so a bad entry changes
            nothing.

        Raises:
          ValueError: An unknown policy id, or weights that do not fit the policy's model.
        """
        unknown = sorted(set(weights) - set(self._policies))
        if unknown:
            raise ValueError(
                f"set_weights: no policies {unknown} on the inference server "
                f"(it serves {sorted(self._policies)})"
            )
        for pid, (values, _) in weights.items():
            if values is None:
                continue
            expected = [tuple(v.shape) for v in self._policies[pid].model.weights]
            got = [tuple(np.shape(v)) for v in values]
            if got != expected:
                raise ValueError(
                    f"set_weights: the weights of policy {pid!r} have shapes {got}, its model "
                    f"takes {expected}"
                )
        with self._round_lock:
            for pid, (values, version) in weights.items():
                if values is not None:
                    self._policies[pid].set_weights(list(values))
                self._versions[pid] = int(version)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Holds the server between two rounds; what arrives meanwhile is served together.

        The requests that arrive while paused are answered in one round when it ends (one
        forward pass per policy). `set_weights` may be called inside.
        """
        with self._round_lock:
            yield

    # Connections ------------------------------------------------------------------------------

    def attach(self, actor_id: int) -> connection.Connection:
        """Opens a pipe for local actor `actor_id` (replacing its old connection).

        Returns:
          The actor's end (picklable to a forkserver or spawn child; `connect` returns it).
        """
        mine, theirs = connection.Pipe(duplex=True)
        if not self._register(int(actor_id), mine):
            theirs.close()
            raise RuntimeError("the inference server is stopped")
        return theirs

    def listen(self, host: str = "0.0.0.0", advertise: str | None = None) -> TcpEndpoint:
        """Accepts actors over TCP (the first call starts listening); returns their endpoint.

        Args:
          host: The interface to bind (first call only); "0.0.0.0" binds all.
          advertise: The address actors connect to; None: `host`, or the driver's IP when
            `host` binds all interfaces.

        Returns:
          The endpoint to send the actors (address, port and authkey) for `connect`.
        """
        with self._lock:
            if self._stop_event.is_set():
                raise RuntimeError("the inference server is stopped")
            if self._listener is None:
                self._authkey = os.urandom(32)
                # No authkey here: the handshake threads authenticate, so that a peer that
                # connects and stays silent cannot hold up the others in `accept`.
                self._listener = connection.Listener((host, 0), "AF_INET", backlog=128)
                self._accept_thread = threading.Thread(
                    target=self._accept, name="impala-inference-accept", daemon=True
                )
                self._accept_thread.start()
            bound, port = self._listener.address
        return TcpEndpoint(advertise or _advertised_host(bound), int(port), self._authkey)

    def detach(self, actor_id: int) -> None:
        """Closes actor `actor_id`'s connection (it sees EOFError)."""
        with self._lock:
            conn = self._conns.pop(int(actor_id), None)
            if conn is not None:
                self._closing.append(conn)
        self._wake()

    def stop(self) -> None:
        """Closes the listener, every connection and the threads; waiting actors see EOFError."""
        with self._lock:
            if self._stop_event.is_set():
                return
            self._stop_event.set()
            # Ends the handshakes blocked in a read (under the lock: their sockets are open).
            for conn in self._handshakes.values():
                _shutdown(conn)
            handshakes = list(self._handshakes)
        self._wake()
        self._thread.join(_JOIN_S)
        if self._accept_thread is not None:
            self._unblock_accept()
            self._accept_thread.join(_JOIN_S)
        for thread in handshakes:
            thread.join(_JOIN_S)
        with self._lock:
            conns = [*self._conns.values(), *self._closing]
            self._conns, self._closing = {}, []
            listener, self._listener = self._listener, None
        for conn in conns:
            conn.close()
        if listener is not None:
            listener.close()
        for end in (self._wake_recv, self._wake_send):
            end.close()

    def stats(self) -> dict[str, float]:
        """Requests served, forward passes, the mean batch (observations per pass) and how many
        observations came as a new frame of a stack the server keeps."""
        return {
            "num_requests": self.num_requests,
            "num_batches": self.num_batches,
            "mean_batch": self.num_obs / max(1, self.num_batches),
            "num_frames": self.num_frames,
        }

    def _register(self, actor_id: int, conn: connection.Connection) -> bool:
        """Makes `conn` actor `actor_id`'s connection; False (and closes it) once stopped."""
        with self._lock:
            if self._stop_event.is_set():
                conn.close()
                return False
            old = self._conns.get(actor_id)
            self._conns[actor_id] = conn
            if old is not None:
                self._closing.append(old)
        self._wake()
        return True

    def _wake(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._wake_send.send_bytes(b"w")

    # TCP: the accept thread and one short thread per handshake --------------------------------

    def _accept(self) -> None:
        listener = self._listener
        assert listener is not None
        while not self._stop_event.is_set():
            try:
                conn = listener.accept()
            except OSError:  # Out of descriptors, say: try again shortly.
                self._stop_event.wait(0.1)
                continue
            with self._lock:
                if self._stop_event.is_set():
                    conn.close()
                    return
                thread = threading.Thread(
                    target=self._admit, args=(conn,), name="impala-inference-handshake"
                )
                thread.daemon = True
                self._handshakes[thread] = conn
                thread.start()  # Under the lock: `stop` joins only started threads.

    def _admit(self, conn: connection.Connection) -> None:
        """Authenticates a TCP peer and registers it under the actor id it announces."""
        thread = threading.current_thread()
        actor_id = None
        try:
            _set_read_timeout(conn, _HANDSHAKE_S)
            connection.deliver_challenge(conn, self._authkey)
            connection.answer_challenge(conn, self._authkey)
            actor_id = conn.recv()
            if not isinstance(actor_id, int) or isinstance(actor_id, bool):
                raise ValueError(f"expected an int actor id, got {actor_id!r}")
            _set_read_timeout(conn, 0.0)
        except Exception as e:  # noqa: BLE001 - any failure refuses this peer only.
            _log.warning("inference server refused a connection: %s: %s", type(e).__name__, e)
            actor_id = None
        with self._lock:
            del self._handshakes[thread]
        if actor_id is None:
            conn.close()
        else:
            self._register(actor_id, conn)

    def _unblock_accept(self) -> None:
        """Connects to the listener so that its blocking `accept` returns and sees the stop."""
        listener = self._listener
        if listener is None:
            return
        host, port = listener.address
        if host in ("0.0.0.0", ""):
            host = "127.0.0.1"
        with contextlib.suppress(OSError), socket.create_connection((host, port), 2.0):
            pass

    # The server thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop_event.is_set():
            with self._lock:
                by_conn = {conn: i for i, conn in self._conns.items()}
                closing, self._closing = self._closing, []
            # Closed here, never while this thread waits on them.
            for conn in closing:
                self._release(conn)
                conn.close()
            try:
                ready = connection.wait([*by_conn, self._wake_recv], _POLL_S)
            except (OSError, ValueError):
                continue
            if self._wake_recv in ready:
                with contextlib.suppress(OSError, EOFError):
                    while self._wake_recv.poll():
                        self._wake_recv.recv_bytes()
            if not any(conn is not self._wake_recv for conn in ready):
                continue
            with self._round_lock:
                # Everything waiting by now joins this round, on connections attached since the
                # wait too (`paused` relies on it).
                with self._lock:
                    by_conn = {conn: i for i, conn in self._conns.items()}
                try:
                    ready = connection.wait(list(by_conn), 0)
                except (OSError, ValueError):
                    continue
                groups = self._read(ready, by_conn)
                for policy_id, requests in groups.items():
                    self._serve(policy_id, requests)

    def _read(
        self, ready: list[Any], by_conn: dict[connection.Connection, int]
    ) -> dict[str, list[_Request]]:
        """Receives the waiting requests, grouped by policy; answers the invalid ones."""
        groups: dict[str, list[_Request]] = {}
        for conn in ready:
            try:
                message = conn.recv()
            except (EOFError, OSError):  # The actor is gone; its pool restarts it.
                self._drop(by_conn.get(conn), conn)
                continue
            except Exception as e:  # noqa: BLE001 - an unpicklable request.
                _reply(conn, ("error", f"{type(e).__name__}: {e}"))
                continue
            try:
                request = self._check(conn, message)
            except Exception as e:  # noqa: BLE001 - answered to this actor only.
                _reply(conn, ("error", f"{type(e).__name__}: {e}"))
                continue
            groups.setdefault(message[0], []).append(request)
        return groups

    def _check(self, conn: connection.Connection, message: Any) -> _Request:
        """The request in `message`; ValueError unless it is one, its policy is served, and its
        observations (or frames) and state fit the policy's model."""
        if not isinstance(message, tuple) or len(message) not in (3, 4):
            raise ValueError(
                "a request is (policy_id, obs, state) or (policy_id, obs, state, refills), "
                f"not {type(message).__name__}"
            )
        policy_id, obs, state = message[:3]
        if not isinstance(policy_id, str) or policy_id not in self._policies:
            raise ValueError(
                f"no policy {policy_id!r} on the inference server (it serves "
                f"{sorted(self._policies)})"
            )
        obs = np.asarray(obs)
        kept, refills = None, None
        if len(message) == 4:
            stacks = self._kept.get(policy_id)
            if stacks is None:
                raise ValueError(
                    f"policy {policy_id!r} keeps no frame stacks on the inference server (its "
                    "env declares no `frame_stack`): send whole observations"
                )
            refills = stacks.check(conn, obs, message[3])
            kept = "stacks" if refills is None else "frames"
        else:
            obs_shape = self._obs_shapes[policy_id]
            if obs.ndim != 1 + len(obs_shape) or tuple(obs.shape[1:]) != obs_shape:
                raise ValueError(
                    f"observations of shape {tuple(obs.shape[1:])} for policy {policy_id!r}, "
                    f"whose model takes {obs_shape}"
                )
        shapes = self._state_shapes[policy_id]
        state = tuple(np.asarray(s) for s in state)
        if [s.shape for s in state] != [(len(obs), *shape) for shape in shapes]:
            raise ValueError(
                f"a recurrent state of shapes {[s.shape for s in state]} for {len(obs)} "
                f"observations of policy {policy_id!r}, whose model's state per env has "
                f"shapes {shapes}"
            )
        return _Request(conn, obs, state, kept, refills)

    def _drop(self, actor_id: int | None, conn: connection.Connection) -> None:
        with self._lock:
            if actor_id is not None and self._conns.get(actor_id) is conn:
                del self._conns[actor_id]
        self._release(conn)
        conn.close()

    def _release(self, conn: connection.Connection) -> None:
        """Frees the stacks kept for a closed connection's envs (server thread only)."""
        for stacks in self._kept.values():
            stacks.release(conn)

    def _serve(self, policy_id: str, requests: list[_Request]) -> None:
        """One forward pass of `policy_id` for all its requests; answers each its rows."""
        stacks = self._kept.get(policy_id)
        if stacks is not None:  # Whole observations first, then frames: the graph's order.
            requests = sorted(requests, key=lambda r: r.kept == "frames")
        try:
            state = _concatenate([r.state for r in requests])
            if stacks is not None:
                logits, values, new_state = stacks.forward(requests, state)
            elif len(requests) == 1:
                logits, values, new_state = self._policies[policy_id].forward(
                    requests[0].obs, state
                )
            else:
                obs = np.concatenate([r.obs for r in requests])
                logits, values, new_state = self._policies[policy_id].forward(obs, state)
            version = self._versions[policy_id]
        except Exception as e:  # noqa: BLE001 - answered to the actors, which raise it.
            if stacks is not None:
                stacks.forget(requests)
            message = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            for r in requests:
                _reply(r.conn, ("error", message))
            return
        self.num_requests += len(requests)
        self.num_batches += 1
        self.num_obs += len(logits)
        self.num_frames += sum(len(r.obs) for r in requests if r.kept == "frames")
        start = 0
        for r in requests:
            rows = slice(start, start + len(r.obs))
            start = rows.stop
            new = tuple(s[rows] for s in new_state)
            _reply(r.conn, ("ok", logits[rows], values[rows], new, version))


def _concatenate(states: list[tuple]) -> tuple:
    """The requests' recurrent states, row after row (the one request's own, if one)."""
    if len(states) == 1:
        return tuple(states[0])
    return tuple(np.concatenate([s[i] for s in states]) for i in range(len(states[0])))


class _KeptStacks:
    """One policy's frame stacks, kept for the actors' envs inside TensorFlow.

    Each env of a connection owns a slot: a ring of its last k frames, rows `slot * k .. slot *
    k + k - 1` of one variable [slots * k, H, W, s]. A request's whole stacks are written as
    their k frames; a request's new frames are written once each, and the stacks the model acts
    on are gathered from the rings, in the same graph (`forward`). The host keeps each slot's
    ring position and frames since its refill (`impala_tf.models.frames.ring_step_np`): integers, no
    pixels. Only the server thread uses it.

    Args:
      policy: The policy's `ActorPolicy` (the server's own copy).
      frame_stack: (k, s): k frames of s channels per stack.
    """

    def __init__(self, policy: Any, frame_stack: tuple[int, int]):
        import tensorflow as tf  # The driver's: only a server with frame stacks builds this.

        from impala_tf.models import frames as frames_lib

        k, channels = frame_stack
        shape = tuple(int(d) for d in policy.observation_space.shape)
        if len(shape) != 3 or shape[-1] != k * channels:
            raise ValueError(
                f"a frame stack of {k} frames of {channels} channels does not fit observations "
                f"of shape {shape} ([H, W, k * s] expected)"
            )
        self.k = k
        self.shape = shape
        self.frame_shape = (*shape[:2], channels)
        self.dtype = np.dtype(policy.observation_space.dtype)
        # On a GPU uint8 frames are kept as float16, exactly (every uint8 value is a float16
        # integer): TensorFlow's GPU scatter for integer types copies the whole variable to the
        # host and back, its float16 one writes the rows in device memory.
        on_gpu = bool(tf.config.list_logical_devices("GPU"))
        wide = on_gpu and self.dtype == np.uint8
        storage = tf.float16 if wide else tf.as_dtype(self.dtype)
        self._tf, self._ring_step = tf, frames_lib.ring_step_np
        self._ring = tf.Variable(
            tf.zeros((0, *self.frame_shape), storage),
            shape=(None, *self.frame_shape),
            trainable=False,
        )
        self._regions: dict[connection.Connection, tuple[int, int]] = {}  # conn: (slot, B)
        self._loaded: set[connection.Connection] = set()  # Rings holding the actors' frames.
        self._free: list[tuple[int, int]] = []
        self._end = 0  # Slots given to regions so far.
        self._newest = np.zeros(0, np.int64)  # Per slot: its newest frame's ring position.
        self._age = np.zeros(0, np.int64)  # Per slot: frames since its refill (at most k - 1).
        model, obs_dtype = policy.model, tf.as_dtype(self.dtype)

        def step(whole, keep, load_rows, frames, write_rows, read_rows, state):
            loads = frames_lib.split_stacks(tf.boolean_mask(whole, keep), k)
            loads = tf.reshape(loads, (-1, *self.frame_shape))
            self._ring.scatter_update(tf.IndexedSlices(tf.cast(loads, storage), load_rows))
            self._ring.scatter_update(tf.IndexedSlices(tf.cast(frames, storage), write_rows))
            stacks = frames_lib.join_frames(tf.gather(self._ring, read_rows))
            obs = tf.concat([whole, tf.cast(stacks, obs_dtype)], axis=0)
            return model.step(obs, state)

        state_specs = tuple(
            tf.TensorSpec((None, *s.shape[1:]), s.dtype) for s in model.initial_state(1)
        )
        self._step = tf.function(
            step,
            input_signature=(
                tf.TensorSpec((None, *shape), obs_dtype),
                tf.TensorSpec((None,), tf.bool),
                tf.TensorSpec((None,), tf.int64),
                tf.TensorSpec((None, *self.frame_shape), obs_dtype),
                tf.TensorSpec((None,), tf.int64),
                tf.TensorSpec((None, k), tf.int64),
                state_specs,
            ),
            autograph=False,
        )

    def check(self, conn: connection.Connection, obs: np.ndarray, refills: Any) -> Any:
        """Raises ValueError unless `obs` are whole stacks (`refills` None) or the newest frames
        of the envs whose stacks `conn` had kept; returns `refills` as a bool array (or None)."""
        if obs.dtype != self.dtype:
            raise ValueError(f"frames of dtype {obs.dtype}; the env's are {self.dtype}")
        if refills is None:
            if tuple(obs.shape[1:]) != self.shape:
                raise ValueError(
                    f"stacks of shape {tuple(obs.shape[1:])} to keep, the env's are {self.shape}"
                )
            return None
        refills = np.asarray(refills)
        if refills.dtype != bool or refills.shape != obs.shape[:1]:
            raise ValueError(
                f"refills of dtype {refills.dtype} and shape {refills.shape} for {len(obs)} "
                "frames (bool, one per frame expected)"
            )
        if tuple(obs.shape[1:]) != self.frame_shape:
            raise ValueError(
                f"frames of shape {tuple(obs.shape[1:])}, the env's are {self.frame_shape}"
            )
        region = self._regions.get(conn)
        if conn not in self._loaded or region is None:
            raise ValueError(
                "frames before whole stacks: the server keeps no stacks for this connection "
                "(a new or restarted actor, or one whose request failed, sends its stacks whole "
                "first)"
            )
        if region[1] != len(obs):
            raise ValueError(f"{len(obs)} frames for the {region[1]} envs whose stacks are kept")
        return refills

    def forward(self, requests: list[_Request], state: tuple) -> tuple:
        """Updates the requests' kept stacks and runs the model on the stacks; numpy results.

        `requests` come whole observations first (kept or not), frames last.
        """
        k, tf = self.k, self._tf
        whole = [r for r in requests if r.kept != "frames"]
        framed = [r for r in requests if r.kept == "frames"]
        loads = [r for r in whole if r.kept == "stacks"]
        for r in loads:
            self._loaded.discard(r.conn)  # Until the graph has written them.
        load_slots = _rows_or_empty([self._slots(r.conn, len(r.obs)) for r in loads], (0,))
        self._newest[load_slots] = k - 1  # A whole stack fills its ring in order.
        self._age[load_slots] = k - 1
        slots = _rows_or_empty([self._slots(r.conn, len(r.obs)) for r in framed], (0,))
        newest, age, positions = self._ring_step(
            self._newest[slots],
            self._age[slots],
            _rows_or_empty([r.refills for r in framed], (0,), bool),
            k,
        )
        self._newest[slots], self._age[slots] = newest, age
        keep = [np.full(len(r.obs), r.kept == "stacks") for r in whole]
        logits, values, new_state = self._step(
            _rows_or_empty([r.obs for r in whole], (0, *self.shape), self.dtype),
            _rows_or_empty(keep, (0,), bool),
            (load_slots[:, None] * k + np.arange(k)).reshape(-1),
            _rows_or_empty([r.obs for r in framed], (0, *self.frame_shape), self.dtype),
            slots * k + newest,
            slots[:, None] * k + positions,
            tuple(tf.convert_to_tensor(s) for s in state),
        )
        self._loaded.update(r.conn for r in loads)
        return logits.numpy(), values.numpy(), tuple(s.numpy() for s in new_state)

    def forget(self, requests: list[_Request]) -> None:
        """After a failed pass: the requesters' kept stacks are unknown (refused until resent)."""
        for r in requests:
            if r.kept:
                self._loaded.discard(r.conn)

    def release(self, conn: connection.Connection) -> None:
        """Frees a closed connection's slots for the next connection that needs as many."""
        self._loaded.discard(conn)
        region = self._regions.pop(conn, None)
        if region is not None:
            self._free.append(region)

    def _slots(self, conn: connection.Connection, n: int) -> np.ndarray:
        """int64 [n]: the slots of `conn`'s n envs (allocated on its first whole stacks)."""
        region = self._regions.get(conn)
        if region is None or region[1] != n:
            self.release(conn)
            region = self._allocate(n)
            self._regions[conn] = region
        return np.arange(region[0], region[0] + n, dtype=np.int64)

    def _allocate(self, n: int) -> tuple[int, int]:
        for i, region in enumerate(self._free):
            if region[1] == n:
                return self._free.pop(i)
        first, self._end = self._end, self._end + n
        capacity = len(self._newest)
        if self._end > capacity:  # Grows by doubling: rare, outside the serving graph.
            more = max(capacity, self._end - capacity)
            tf = self._tf
            zeros = tf.zeros((more * self.k, *self.frame_shape), self._ring.dtype)
            self._ring.assign(tf.concat([self._ring, zeros], axis=0))
            self._newest = np.concatenate([self._newest, np.zeros(more, np.int64)])
            self._age = np.concatenate([self._age, np.zeros(more, np.int64)])
        return first, n


def _rows_or_empty(parts: list[np.ndarray], empty: tuple, dtype: Any = np.int64) -> np.ndarray:
    """The parts' rows one after the other; an empty array of shape `empty` when none."""
    if not parts:
        return np.zeros(empty, dtype)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _reply(conn: connection.Connection, message: tuple) -> None:
    try:
        conn.send(message)
    except (OSError, ValueError):  # Closed by the actor's end; the next read drops it.
        _log.debug("inference reply to a closed connection dropped")


def _set_read_timeout(conn: connection.Connection, seconds: float) -> None:
    """Bounds each blocking read of a TCP connection (0: no bound), via its socket."""
    whole = int(seconds)
    timeval = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)


def _shutdown(conn: connection.Connection) -> None:
    """Wakes a thread blocked reading `conn` (a TCP connection) with end of file."""
    with contextlib.suppress(OSError), socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.shutdown(socket.SHUT_RDWR)


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


def _advertised_host(bound: str) -> str:
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
