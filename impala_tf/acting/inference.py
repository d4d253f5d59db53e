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

The actor's side is `impala_tf.acting.remote_policy.RemotePolicy`; the endpoints (`attach`'s
pipe ends, `listen`'s TCP endpoints), the handshake and the messages are
`impala_tf.acting.inference_protocol`. The stacks of a policy whose env stacks frames are kept
here (`impala_tf.acting.kept_stacks`), so that each frame travels once.

The server keeps its own copy of each model (with `explore=False`: it never samples), loaded at
every weight broadcast from the snapshot the driver would send the actors
(`Impala._policy_snapshot`): acting never reads variables the learner is updating, and a request
is served wholly with the weights from before a `set_weights` or wholly with those after. A
request it cannot serve (an unknown policy id, an observation or state of the wrong shape, a
model error) is answered with the error, to the requesters concerned only, and the actor raises
it (`InferenceError`) like any env error; an actor whose server is gone (the driver stopped)
gets `EOFError` and exits. Neither side waits forever on the other.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import traceback
from collections.abc import Iterator, Mapping
from multiprocessing import connection
from typing import Any

import gymnasium as gym
import numpy as np

from impala_tf.acting.inference_protocol import (
    Request,
    TcpEndpoint,
    accept_actor,
    advertised_host,
    send_reply,
    shutdown,
    unblock_accept,
)
from impala_tf.acting.kept_stacks import KeptStacks

__all__ = ["INFERENCE_MODES", "InferenceServer"]

#: `inference` config values: each actor runs its policy, or the driver runs it for all.
INFERENCE_MODES = ("actor", "central")

_POLL_S = 0.5
_JOIN_S = 5.0

_log = logging.getLogger(__name__)


class InferenceServer:
    """Runs the acting models in the driver for every connected actor (a daemon thread).

    Args:
      policies: {policy_id: (observation_space, action_space, model)}, the model being the
        policy's resolved `ModelSpec` (or RLlib model keys; `impala_tf.models.build_model`).
      precisions: {policy_id: the policy's `precision` config key}, the Keras dtype policy its
        model is built under; a policy not in it is built in float32.
      frame_stacks: {policy_id: (k, s)} of the policies whose envs stack frames
        (`EnvSpaces.frame_stacks`): the server keeps their actors' stacks and takes each new
        frame once (`impala_tf.acting.kept_stacks`). Other policies take whole observations only.
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
            str(pid): KeptStacks(self._policies[str(pid)], (int(k), int(ch)))
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
        return TcpEndpoint(advertise or advertised_host(bound), int(port), self._authkey)

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
                shutdown(conn)
            handshakes = list(self._handshakes)
        self._wake()
        self._thread.join(_JOIN_S)
        if self._accept_thread is not None:
            if self._listener is not None:
                unblock_accept(self._listener.address)
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
            actor_id = accept_actor(conn, self._authkey)
        except Exception as e:  # noqa: BLE001 - any failure refuses this peer only.
            _log.warning("inference server refused a connection: %s: %s", type(e).__name__, e)
            actor_id = None
        with self._lock:
            del self._handshakes[thread]
        if actor_id is None:
            conn.close()
        else:
            self._register(actor_id, conn)

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
    ) -> dict[str, list[Request]]:
        """Receives the waiting requests, grouped by policy; answers the invalid ones."""
        groups: dict[str, list[Request]] = {}
        for conn in ready:
            try:
                message = conn.recv()
            except (EOFError, OSError):  # The actor is gone; its pool restarts it.
                self._drop(by_conn.get(conn), conn)
                continue
            except Exception as e:  # noqa: BLE001 - an unpicklable request.
                send_reply(conn, ("error", f"{type(e).__name__}: {e}"))
                continue
            try:
                request = self._check(conn, message)
            except Exception as e:  # noqa: BLE001 - answered to this actor only.
                send_reply(conn, ("error", f"{type(e).__name__}: {e}"))
                continue
            groups.setdefault(message[0], []).append(request)
        return groups

    def _check(self, conn: connection.Connection, message: Any) -> Request:
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
        return Request(conn, obs, state, kept, refills)

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

    def _serve(self, policy_id: str, requests: list[Request]) -> None:
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
                send_reply(r.conn, ("error", message))
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
            send_reply(r.conn, ("ok", logits[rows], values[rows], new, version))


def _concatenate(states: list[tuple]) -> tuple:
    """The requests' recurrent states, row after row (the one request's own, if one)."""
    if len(states) == 1:
        return tuple(states[0])
    return tuple(np.concatenate([s[i] for s in states]) for i in range(len(states[0])))
