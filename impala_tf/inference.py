"""Central inference (SEED RL style): the driver runs the policy for every actor.

With `inference: "central"` the actors only step their envs. For each batched env step an actor
sends its observations (and recurrent state) to the driver's `InferenceServer` through its own
pipe and gets back the logits, values, next state and the `num_grad_updates` of the weights that
computed them; it then samples the actions itself (`impala_tf.action_sampler`, seeded per actor
as with per-actor inference, so the same weights and seeds give the same actions). The server
thread waits on every actor's pipe at once and answers all the requests that are waiting with
one forward pass, so the model runs at a batch of up to `num_env_runners *
num_envs_per_env_runner` observations instead of `num_envs_per_env_runner`, and the actor
processes never import TensorFlow (lighter: about a quarter of the memory of a TensorFlow actor,
see `impala_tf.actors.memory`).

The server keeps its own copy of the model: the driver loads it at every weight broadcast from
the same consistent snapshot it would send the actors (`Impala._policy_snapshot`), so acting
never reads variables the learner is updating.

A request the server cannot serve (an observation of the wrong shape, a model error) is answered
with the error, which the actor raises like any env error; an actor whose server is gone (the
driver stopped) gets `EOFError` and exits. Neither side waits forever on the other.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import traceback
from multiprocessing import connection
from typing import Any

import gymnasium as gym
import numpy as np

from impala_tf.action_sampler import ActionSampler
from impala_tf.policy_step import PolicyStep

__all__ = ["INFERENCE_MODES", "InferenceServer", "RemotePolicy", "InferenceError"]

#: `inference` config values: each actor runs its policy, or the driver runs it for all.
INFERENCE_MODES = ("actor", "central")

_POLL_S = 0.5


class InferenceError(RuntimeError):
    """The inference server could not serve a request (raised in the actor)."""


class RemotePolicy:
    """An actor's policy whose forward pass runs in the driver's `InferenceServer`.

    Same interface as `impala_tf.numpy_policy.NumpyPolicy` and `impala_tf.policy.ActorPolicy`;
    it holds no weights (`set_weights` is a no-op: the server holds them) and each `PolicyStep`
    carries the version of the weights that computed it.

    Args:
      conn: This actor's end of its duplex pipe to the server.
      action_space: The env's action space.
      state_shapes: Shapes of the recurrent state arrays per env ([] if not recurrent).
      explore: Sample (True) or take the mode.
      seed: Seed of the action sampler.
    """

    def __init__(
        self,
        conn: connection.Connection,
        action_space: gym.Space,
        state_shapes: list[tuple[int, ...]],
        explore: bool = True,
        seed: int | None = None,
    ):
        self._conn = conn
        self.action_space = action_space
        self.sampler = ActionSampler(action_space, explore, seed)
        self._state_shapes = [tuple(s) for s in state_shapes]
        self.is_recurrent = bool(self._state_shapes)

    def initial_state(self, batch_size: int) -> tuple:
        return tuple(np.zeros((batch_size, *s), np.float32) for s in self._state_shapes)

    def step(self, obs: np.ndarray, state: tuple = ()) -> PolicyStep:
        """Sends the observations [B, ...] to the server and samples from its logits."""
        self._conn.send((np.ascontiguousarray(obs), tuple(state)))
        reply = self._conn.recv()
        if reply[0] == "error":
            raise InferenceError(f"the driver's inference server failed: {reply[1]}")
        _, logits, values, new_state, version = reply
        actions, logp = self.sampler(logits)
        return PolicyStep(actions, logits, logp, values, tuple(new_state), int(version))

    def set_weights(self, weights: list[np.ndarray] | None) -> None:
        """Nothing to load: the server holds the weights."""

    def get_weights(self) -> list[np.ndarray]:
        return []

    def get_rng_state(self) -> dict:
        return self.sampler.get_state()

    def set_rng_state(self, state: dict) -> None:
        self.sampler.set_state(state)

    def reseed(self, seed: int | None) -> None:
        self.sampler.reseed(seed)


class InferenceServer:
    """Runs the acting model in the driver for every attached actor (a daemon thread).

    Args:
      observation_space: The envs' observation space.
      action_space: Their action space.
      model_config: RLlib model keys (`impala_tf.models.build_model`).
    """

    def __init__(self, observation_space: gym.Space, action_space: gym.Space, model_config: dict):
        from impala_tf.policy import ActorPolicy  # TensorFlow: the driver has it already.

        self._policy = ActorPolicy(observation_space, action_space, model_config, explore=False)
        self._obs_shape = tuple(observation_space.shape)
        self._lock = threading.Lock()  # Weights and the set of pipes.
        self._conns: dict[int, connection.Connection] = {}
        self._version = 0
        self._wake_recv, self._wake_send = _pipe()
        self._stopped = False
        self.num_requests = 0
        self.num_batches = 0
        self.num_obs = 0
        self._thread = threading.Thread(target=self._run, name="impala-inference", daemon=True)
        self._thread.start()

    @property
    def state_shapes(self) -> list[tuple[int, ...]]:
        """Per-env shapes of the model's recurrent state ([] if it has none)."""
        return [tuple(s.shape[1:]) for s in self._policy.initial_state(1)]

    def get_weights(self) -> list[np.ndarray]:
        with self._lock:
            return self._policy.get_weights()

    def set_weights(self, weights: list[np.ndarray], policy_version: int) -> None:
        """Loads weights from a consistent snapshot; later requests use them."""
        with self._lock:
            self._policy.set_weights(weights)
            self._version = int(policy_version)

    def attach(self, actor_id: int) -> connection.Connection:
        """Opens a pipe for actor `actor_id` (replacing an old one); returns the actor's end."""
        mine, theirs = connection.Pipe(duplex=True)
        with self._lock:
            old = self._conns.pop(actor_id, None)
            self._conns[actor_id] = mine
        if old is not None:
            old.close()
        self._wake()
        return theirs

    def detach(self, actor_id: int) -> None:
        with self._lock:
            conn = self._conns.pop(actor_id, None)
        if conn is not None:
            conn.close()
        self._wake()

    def stop(self) -> None:
        self._stopped = True
        self._wake()
        self._thread.join(5.0)
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            conn.close()
        for end in (self._wake_recv, self._wake_send):
            end.close()

    def stats(self) -> dict[str, float]:
        """Requests served, forward passes and the mean batch (observations per pass)."""
        return {
            "num_requests": self.num_requests,
            "num_batches": self.num_batches,
            "mean_batch": self.num_obs / max(1, self.num_batches),
        }

    # The server thread ------------------------------------------------------------------------

    def _wake(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._wake_send.send_bytes(b"w")

    def _run(self) -> None:
        while not self._stopped:
            with self._lock:
                by_conn = {conn: i for i, conn in self._conns.items()}
            try:
                ready = connection.wait([*by_conn, self._wake_recv], _POLL_S)
            except (OSError, ValueError):  # A pipe closed under us by detach/attach.
                continue
            requests: list[tuple[connection.Connection, np.ndarray, tuple]] = []
            for conn in ready:
                if conn is self._wake_recv:
                    with contextlib.suppress(OSError, EOFError):
                        while conn.poll():
                            conn.recv_bytes()
                    continue
                try:
                    obs, state = conn.recv()
                except (EOFError, OSError):  # The actor is gone; the pool restarts it.
                    self._drop(by_conn.get(conn), conn)
                    continue
                requests.append((conn, obs, state))
            if requests:
                self._serve(requests)

    def _drop(self, actor_id: int | None, conn: connection.Connection) -> None:
        with self._lock:
            if actor_id is not None and self._conns.get(actor_id) is conn:
                del self._conns[actor_id]
        conn.close()

    def _serve(self, requests: list[tuple[connection.Connection, np.ndarray, tuple]]) -> None:
        try:
            for _, obs, _ in requests:
                if tuple(obs.shape[1:]) != self._obs_shape:
                    raise ValueError(
                        f"observations of shape {tuple(obs.shape[1:])}, the model takes "
                        f"{self._obs_shape}"
                    )
            sizes = [len(obs) for _, obs, _ in requests]
            obs = np.concatenate([obs for _, obs, _ in requests])
            num_states = len(requests[0][2])
            state = tuple(np.concatenate([s[i] for _, _, s in requests]) for i in range(num_states))
            with self._lock:
                logits, values, new_state = self._policy.forward(obs, state)
                version = self._version
        except Exception as e:  # noqa: BLE001 - answered to the actors, which raise it.
            message = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            for conn, _, _ in requests:
                with contextlib.suppress(OSError, ValueError):
                    conn.send(("error", message))
            return
        self.num_requests += len(requests)
        self.num_batches += 1
        self.num_obs += len(obs)
        start = 0
        for (conn, _, _), n in zip(requests, sizes):
            rows = slice(start, start + n)
            start += n
            try:
                conn.send(
                    ("ok", logits[rows], values[rows], tuple(s[rows] for s in new_state), version)
                )
            except (OSError, ValueError):  # Closed by the actor's end or by detach.
                logging.getLogger(__name__).debug("inference reply to a closed pipe dropped")


def _pipe() -> tuple[Any, Any]:
    return connection.Pipe(duplex=False)
