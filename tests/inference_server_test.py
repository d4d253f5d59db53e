"""`impala_tf.acting.inference.InferenceServer`: many policies, pipe and TCP endpoints, errors,
stop.

Observations are [B, ...] with B the number of envs of a request. The module imports no
TensorFlow at the top, so that the spawned TCP actor (`_tcp_actor`) stays light.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys
import threading
import time

import gymnasium as gym
import numpy as np
import pytest

from impala_tf.acting.inference import InferenceServer
from impala_tf.acting.inference_protocol import InferenceError, TcpEndpoint, connect
from impala_tf.acting.remote_policy import RemotePolicy
from tests.support.envs import stacked_obs
from tests.support.inference import RecordingConnection

LSTM = {"use_lstm": True, "lstm_cell_size": 8, "fcnet_hiddens": [8]}
SPECS = {
    "p0": (gym.spaces.Box(-1.0, 1.0, (4,), np.float32), gym.spaces.Discrete(2), {}),
    "p1": (
        gym.spaces.Box(-1.0, 1.0, (3,), np.float32),
        gym.spaces.Discrete(5),
        {"fcnet_hiddens": [8]},
    ),
}
RNN = {"rnn": (gym.spaces.Box(-1.0, 1.0, (4,), np.float32), gym.spaces.Discrete(3), LSTM)}
#: A policy whose env stacks k = 4 frames of 10 x 10 x 1 (`impala_tf.models.frames`), and an MLP.
IMAGE = gym.spaces.Box(0, 255, (10, 10, 4), np.uint8)
FRAMED = {"img": (IMAGE, gym.spaces.Discrete(3), {"vf_share_layers": True}), "p0": SPECS["p0"]}


def _local(policy_id: str, specs: dict = SPECS, explore: bool = True, seed: int | None = None):
    """An `ActorPolicy` for `specs[policy_id]` (TensorFlow: imported here, not in the actor)."""
    from impala_tf.acting.tf_policy import ActorPolicy

    obs_space, action_space, model = specs[policy_id]
    return ActorPolicy(obs_space, action_space, model, explore=explore, seed=seed)


def _obs(policy_id: str, batch: int, seed: int, specs: dict = SPECS) -> np.ndarray:
    shape = specs[policy_id][0].shape
    return np.random.default_rng(seed).uniform(-1, 1, (batch, *shape)).astype(np.float32)


def _remote(conn, policy_id: str, server_or_shapes, seed: int = 7, specs: dict = SPECS):
    shapes = server_or_shapes
    if isinstance(server_or_shapes, InferenceServer):
        shapes = server_or_shapes.state_shapes[policy_id]
    return RemotePolicy(conn, policy_id, specs[policy_id][1], shapes, seed=seed)


def _served(specs: dict = SPECS, version: int = 3) -> tuple[InferenceServer, dict]:
    """A server loaded with fresh weights of `specs` (version `version`); and those weights."""
    server = InferenceServer(specs)
    weights = {pid: _local(pid, specs).get_weights() for pid in specs}
    server.set_weights({pid: (w, version) for pid, w in weights.items()})
    return server, weights


def _inference_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("impala-inference")]


def _tcp_actor(endpoint: TcpEndpoint, actor_id: int, steps: list, results) -> None:
    """A remote actor (spawned): acts with p0 and p1 over TCP, reports, waits for the stop."""
    conn = connect(endpoint, actor_id)
    policies = {pid: _remote(conn, pid, [], seed=11) for pid in SPECS}
    out = []
    for pid, obs in steps:
        step = policies[pid].step(obs)
        out.append((step.actions, step.logits, step.values, step.version))
    results.send((out, "tensorflow" in sys.modules))
    try:
        conn.recv()  # Nothing comes until the server stops.
        results.send("no EOFError")
    except EOFError:
        results.send("EOFError")


def test_two_policies_act_as_local_policies_with_the_same_weights_and_seed():
    server, weights = _served()
    try:
        assert server.state_shapes == {"p0": [], "p1": []}
        conn = server.attach(0)
        remotes = {pid: _remote(conn, pid, server) for pid in SPECS}  # One connection.
        for pid in SPECS:
            local = _local(pid, seed=7)
            local.set_weights(weights[pid])
            assert not remotes[pid].is_recurrent
            for i in range(3):
                obs = _obs(pid, 5, seed=i)
                got, want = remotes[pid].step(obs), local.step(obs)
                np.testing.assert_allclose(got.logits, want.logits, rtol=1e-5, atol=1e-6)
                np.testing.assert_allclose(got.values, want.values, rtol=1e-5, atol=1e-6)
                np.testing.assert_array_equal(got.actions, want.actions)
                np.testing.assert_allclose(got.logp, want.logp, rtol=1e-5, atol=1e-6)
                assert got.logits.shape == (5, SPECS[pid][1].n) and got.version == 3
        greedy = RemotePolicy(conn, "p1", SPECS["p1"][1], [], explore=False)
        obs = _obs("p1", 4, seed=9)
        step = greedy.step(obs)
        np.testing.assert_array_equal(step.actions, np.argmax(step.logits, axis=-1))
        # The server's own copy never samples: its model's logits are the local ones.
        got = server.get_weights()
        assert set(got) == {"p0", "p1"}
        for pid in SPECS:
            for a, b in zip(got[pid], weights[pid]):
                np.testing.assert_array_equal(a, b)
    finally:
        server.stop()


def test_waiting_requests_are_answered_with_one_forward_pass_per_policy():
    server, weights = _served()
    try:
        conns = [server.attach(i) for i in range(4)]
        requests = [("p0", _obs("p0", 2, 0)), ("p1", _obs("p1", 1, 1)), ("p0", _obs("p0", 3, 2))]
        requests.append(("p1", _obs("p1", 4, 3)))
        with server.paused():  # All four wait before any is read.
            for conn, (pid, obs) in zip(conns, requests):
                conn.send((pid, obs, ()))
        replies = [conn.recv() for conn in conns]
        assert server.stats() == {
            "num_requests": 4,
            "num_batches": 2,
            "mean_batch": 5.0,
            "num_frames": 0,
        }
        for (pid, obs), reply in zip(requests, replies):
            assert reply[0] == "ok" and reply[4] == 3
            local = _local(pid)
            local.set_weights(weights[pid])
            logits, values, _ = local.forward(obs)
            np.testing.assert_allclose(reply[1], logits, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(reply[2], values, rtol=1e-5, atol=1e-6)
    finally:
        server.stop()


def test_versions_follow_set_weights_per_policy_and_none_keeps_the_weights():
    server, weights = _served(version=3)
    try:
        conn = server.attach(0)
        p0, p1 = _remote(conn, "p0", server), _remote(conn, "p1", server)
        obs0, obs1 = _obs("p0", 2, 0), _obs("p1", 2, 1)
        before = p0.step(obs0)
        assert before.version == 3 and p1.step(obs1).version == 3
        server.set_weights({"p0": (None, 5)})
        after = p0.step(obs0)
        assert after.version == 5 and p1.step(obs1).version == 3
        np.testing.assert_array_equal(after.logits, before.logits)  # Weights kept.
        fresh = _local("p1")
        server.set_weights({"p1": (fresh.get_weights(), 8)})
        step = p1.step(obs1)
        assert step.version == 8 and p0.step(obs0).version == 5
        np.testing.assert_allclose(step.logits, fresh.forward(obs1)[0], rtol=1e-5, atol=1e-6)
        # A bad entry changes nothing, not even the valid entries beside it.
        with pytest.raises(ValueError, match=r"no policies \['p9'\]"):
            server.set_weights({"p0": (None, 6), "p9": (None, 1)})
        with pytest.raises(ValueError, match="weights of policy 'p1' have shapes"):
            server.set_weights({"p0": (None, 6), "p1": (weights["p0"], 9)})
        assert p0.step(obs0).version == 5
        step = p1.step(obs1)
        assert step.version == 8
        np.testing.assert_allclose(step.logits, fresh.forward(obs1)[0], rtol=1e-5, atol=1e-6)
    finally:
        server.stop()


def test_a_recurrent_policy_returns_the_next_state():
    specs = {**RNN, "p0": SPECS["p0"]}
    server, weights = _served(specs, version=1)
    try:
        assert server.state_shapes == {"rnn": [(8,), (8,)], "p0": []}
        conn = server.attach(0)
        remote = _remote(conn, "rnn", server, specs=specs)
        local = _local("rnn", specs)
        local.set_weights(weights["rnn"])
        assert remote.is_recurrent
        state, local_state = remote.initial_state(3), local.initial_state(3)
        assert [s.shape for s in state] == [s.shape for s in local_state] == [(3, 8), (3, 8)]
        for i in range(3):
            obs = _obs("rnn", 3, i, specs)
            step = remote.step(obs, state)
            logits, values, local_state = local.forward(obs, local_state)
            np.testing.assert_allclose(step.logits, logits, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(step.values, values, rtol=1e-5, atol=1e-6)
            assert len(step.state) == 2
            for got, want in zip(step.state, local_state):
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
            assert not np.allclose(step.state[0], state[0])  # The state moved on.
            state = step.state
        with pytest.raises(InferenceError, match="recurrent state of shapes"):
            remote.step(_obs("rnn", 2, 0, specs), state)  # 3 states for 2 observations.
        with pytest.raises(InferenceError, match="recurrent state of shapes"):
            remote.step(_obs("rnn", 3, 0, specs), ())
    finally:
        server.stop()


def test_bad_requests_are_answered_with_errors_while_others_are_served():
    server, _ = _served()
    try:
        conns = [server.attach(i) for i in range(5)]
        text = np.full((1, 4), "x")  # The right shape, but the model cannot take it.
        requests = [
            ("p7", _obs("p0", 1, 0)),
            ("p0", _obs("p1", 2, 0)),  # p1's observations sent to p0.
            ("p0", text),
            ("p1", _obs("p1", 2, 1)),
        ]
        with server.paused():
            for conn, (pid, obs) in zip(conns, requests):
                conn.send((pid, obs, ()))
            conns[4].send("not a request")
        replies = [conn.recv() for conn in conns]
        assert [r[0] for r in replies] == ["error", "error", "error", "ok", "error"]
        assert "no policy 'p7'" in replies[0][1] and "['p0', 'p1']" in replies[0][1]
        assert "observations of shape (3,) for policy 'p0'" in replies[1][1]
        assert replies[3][1].shape == (2, 5)
        assert server.stats()["num_requests"] == 1
        # The actor raises the error; its connection keeps working.
        remote = RemotePolicy(conns[0], "p7", SPECS["p0"][1], [])
        with pytest.raises(InferenceError, match="no policy 'p7'"):
            remote.step(_obs("p0", 1, 0))
        with pytest.raises(InferenceError, match=r"observations of shape \(3,\)"):
            _remote(conns[0], "p0", []).step(_obs("p1", 1, 0))
        assert _remote(conns[0], "p0", []).step(_obs("p0", 1, 0)).actions.shape == (1,)
        conns[1].close()  # An actor that leaves is dropped; the others are still served.
        assert _remote(conns[2], "p1", []).step(_obs("p1", 1, 0)).actions.shape == (1,)
    finally:
        server.stop()


def test_a_tcp_actor_gets_the_answers_a_pipe_actor_gets():
    server, _ = _served(version=4)
    spawn = multiprocessing.get_context("spawn")
    results, child_results = spawn.Pipe(duplex=False)
    try:
        steps = [("p0", _obs("p0", 3, 0)), ("p1", _obs("p1", 2, 1)), ("p0", _obs("p0", 3, 2))]
        conn = server.attach(0)
        policies = {pid: _remote(conn, pid, [], seed=11) for pid in SPECS}
        want = [policies[pid].step(obs) for pid, obs in steps]
        endpoint = server.listen("127.0.0.1")
        assert endpoint.address == ("127.0.0.1", endpoint.port) and len(endpoint.authkey) == 32
        assert server.listen("127.0.0.1") == endpoint  # Listening starts once.
        child = spawn.Process(target=_tcp_actor, args=(endpoint, 1, steps, child_results))
        child.start()
        child_results.close()
        assert results.poll(60), "the TCP actor did not report"
        got, child_has_tensorflow = results.recv()
        assert not child_has_tensorflow  # A central-inference actor stays light.
        for (actions, logits, values, version), w in zip(got, want):
            np.testing.assert_array_equal(actions, w.actions)
            np.testing.assert_allclose(logits, w.logits, rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(values, w.values, rtol=1e-6, atol=1e-7)
            assert version == w.version == 4
        server.stop()
        assert results.poll(30) and results.recv() == "EOFError"  # The waiting actor exits.
        child.join(30)
        assert child.exitcode == 0
        with pytest.raises((EOFError, BrokenPipeError)):  # And so does the pipe actor.
            policies["p0"].step(_obs("p0", 1, 0))
    finally:
        server.stop()
        results.close()


def test_tcp_refuses_a_wrong_authkey_and_a_reconnect_replaces_the_connection():
    server, _ = _served()
    try:
        endpoint = server.listen("127.0.0.1", advertise="127.0.0.1")
        with pytest.raises(multiprocessing.AuthenticationError):
            connect(endpoint._replace(authkey=os.urandom(32)), 3)
        first = connect(endpoint, 3)
        assert _remote(first, "p0", []).step(_obs("p0", 1, 0)).version == 3
        second = connect(endpoint, 3)
        assert first.poll(10)  # The server closed the old connection of actor 3.
        with pytest.raises(EOFError):
            first.recv()
        assert _remote(second, "p1", []).step(_obs("p1", 2, 0)).logits.shape == (2, 5)
        other = connect(endpoint, 4)  # Another actor's connection stays.
        server.detach(3)
        assert second.poll(10)
        with pytest.raises(EOFError):
            second.recv()
        assert _remote(other, "p0", []).step(_obs("p0", 1, 0)).actions.shape == (1,)
        for conn in (first, second, other):
            conn.close()
    finally:
        server.stop()


def test_stop_ends_every_thread_and_closes_every_descriptor():
    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    server, _ = _served()
    server.stop()  # TensorFlow's own threads and files are open from here on.
    before = fds()
    server, _ = _served()
    pipe_end = server.attach(0)
    endpoint = server.listen("127.0.0.1")
    tcp = connect(endpoint, 1)
    assert _remote(tcp, "p0", []).step(_obs("p0", 1, 0)).version == 3
    silent = socket.create_connection(endpoint.address)  # Never authenticates.
    deadline = time.monotonic() + 10
    while "impala-inference-handshake" not in _inference_threads():
        assert time.monotonic() < deadline, "no handshake started"
        time.sleep(0.01)
    started = time.monotonic()
    server.stop()
    assert time.monotonic() - started < 4  # Not held by the silent peer.
    assert _inference_threads() == []
    with pytest.raises(EOFError):
        tcp.recv()
    with pytest.raises(EOFError):
        pipe_end.recv()
    with pytest.raises(RuntimeError, match="stopped"):
        server.attach(2)
    with pytest.raises(RuntimeError, match="stopped"):
        server.listen()
    server.stop()  # Twice is fine.
    for end in (pipe_end, tcp, silent):
        end.close()
    assert fds() == before


def test_the_node_address_is_one_of_this_machines_own():
    from impala_tf.acting.inference_protocol import node_ip_address

    address = node_ip_address()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((address, 0))  # Only an address of this machine can be bound.


def test_offline_the_node_address_is_loopback_and_no_name_is_looked_up(monkeypatch):
    import impala_tf.acting.inference_protocol as protocol

    class NoRoute(socket.socket):
        def connect(self, address):
            raise OSError(101, "Network is unreachable")

    def no_lookup(*args):
        raise AssertionError("a name lookup can wait on DNS")

    monkeypatch.setattr(protocol.socket, "socket", NoRoute)
    monkeypatch.setattr(protocol.socket, "gethostbyname", no_lookup)
    assert protocol.node_ip_address() == "127.0.0.1"


# Frame stacks kept on the server ------------------------------------------------------------------


def _framed_server() -> tuple[InferenceServer, list]:
    server = InferenceServer(FRAMED, frame_stacks={"img": (4, 1)})
    weights = _local("img", FRAMED).get_weights()
    server.set_weights({"img": (weights, 2), "p0": (_local("p0").get_weights(), 2)})
    return server, weights


def _assert_acts_as(got, local, obs) -> None:
    """`got` (a served step) is `local`'s step on the whole stacks `obs`."""
    want = local.step(obs)
    np.testing.assert_allclose(got.logits, want.logits, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.values, want.values, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got.actions, want.actions)


def test_actors_send_each_new_frame_once_and_the_server_acts_on_the_env_stacks():
    """Three actors of 3 envs share the server; episodes of 4 steps refill stacks mid-stream;
    actor 1 restarts mid-episode (a new connection and policy: its stacks travel whole once,
    nothing of its predecessor's is read); a truncated episode's final observations travel
    whole without touching the kept stacks."""
    server, weights = _framed_server()
    try:
        steps, act = 10, FRAMED["img"][1]
        streams = {i: stacked_obs(3, steps, 4, size=10, episode_len=4, seed=i) for i in range(3)}

        def actor(i: int, seed: int) -> tuple:
            local = _local("img", FRAMED, seed=seed)
            local.set_weights(weights)
            conn = RecordingConnection(server.attach(i))
            return conn, RemotePolicy(conn, "img", act, [], seed=seed, frame_stack=(4, 1)), local

        actors = {i: actor(i, seed=i) for i in range(3)}
        restarted = None
        for t in range(steps):
            if t == 5:
                restarted = actors[1] = actor(1, seed=11)
            for i, (_, remote, local) in actors.items():
                obs, refills = streams[i][0][:, t], streams[i][1][:, t]
                _assert_acts_as(remote.step(obs, stack_restarts=refills), local, obs)
            if t == 6:  # Actor 0's env 1 was truncated: its final stack, not kept.
                _, remote, local = actors[0]
                final = np.concatenate(
                    [streams[0][0][1:2, t, ..., 1:], np.ones((1, 10, 10, 1), np.uint8)], -1
                )
                _assert_acts_as(remote.step(final), local, final)
        stack_bytes = 3 * 10 * 10 * 4
        for conn, expected in ((actors[0][0], 10), (actors[2][0], 10), (restarted[0], 5)):
            kept = conn.kept()
            assert len(kept) == expected
            # The stacks whole once, then the newest frames: a quarter of the bytes (k = 4).
            assert kept[0][1].nbytes == stack_bytes and kept[0][3] is None
            assert [m[1].nbytes for m in kept[1:]] == [stack_bytes // 4] * (expected - 1)
            assert all(m[3].shape == (3,) and m[3].dtype == bool for m in kept[1:])
        assert [m[1].shape for m in actors[0][0].sent if len(m) == 3] == [(1, 10, 10, 4)]
    finally:
        server.stop()


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "as-on-a-gpu"])
def test_kept_stacks_are_served_in_one_pass_and_frames_without_stacks_are_refused(gpu, monkeypatch):
    """One pass serves new frames, whole stacks to keep and observations not kept; frames the
    server holds no stacks for are refused. `gpu`: the rings as kept where TensorFlow sees a
    GPU (float16, exact for uint8 frames), here on the CPU."""
    if gpu:
        import tensorflow as tf

        seen = tf.config.list_logical_devices
        monkeypatch.setattr(
            tf.config,
            "list_logical_devices",
            lambda kind=None: [object()] if kind == "GPU" else seen(kind),
        )
    server, weights = _framed_server()
    # No public seam says how the rings are stored; this checks the branch was reached.
    assert server._kept["img"]._ring.dtype.name == ("float16" if gpu else "uint8")
    try:
        local = _local("img", FRAMED)
        local.set_weights(weights)
        conns = [server.attach(i) for i in range(4)]
        obs, refills = stacked_obs(2, 3, 4, size=10, episode_len=2)
        newest = np.ascontiguousarray(obs[..., -1:])
        conns[0].send(("img", obs[:, 0], (), None))  # Actor 0's stacks, kept.
        assert conns[0].recv()[0] == "ok"
        batches = server.stats()["num_batches"]
        with server.paused():  # Frames, whole stacks to keep, and observations not kept.
            conns[0].send(("img", newest[:, 1], (), refills[:, 1]))
            conns[1].send(("img", obs[:, 2], (), None))
            conns[2].send(("img", obs[:, 1], ()))
        for conn, stacks in zip(conns, (obs[:, 1], obs[:, 2], obs[:, 1])):
            reply = conn.recv()
            assert reply[0] == "ok", reply
            np.testing.assert_allclose(reply[1], local.forward(stacks)[0], rtol=1e-5, atol=1e-6)
        assert server.stats()["num_batches"] == batches + 1
        assert server.stats()["num_frames"] == 2  # Actor 0's; the others sent whole stacks.
        bad = [
            ("img", newest[:, 0], (), refills[:, 0]),  # No stacks kept for actor 3 yet.
            ("p0", _obs("p0", 2, 0), (), None),  # p0's env stacks no frames.
            ("img", newest[:1, 2], (), refills[:1, 2]),  # 1 frame for actor 0's 2 envs.
            ("img", obs[:, 2, ..., :2], (), refills[:, 2]),  # 2 channels, not 1.
            ("img", newest[:, 2].astype(np.float32), (), refills[:, 2]),
        ]
        errors = []
        for message in bad:
            conn = conns[3] if message is bad[0] else conns[0]
            conn.send(message)
            errors.append(conn.recv())
        assert [e[0] for e in errors] == ["error"] * len(bad)
        assert "frames before whole stacks" in errors[0][1]
        assert "keeps no frame stacks" in errors[1][1]
        assert "1 frames for the 2 envs" in errors[2][1]
        assert "frames of shape (10, 10, 2)" in errors[3][1]
        assert "dtype float32" in errors[4][1]
        # Actor 0 restarts: its new connection reads nothing its predecessor kept.
        again = server.attach(0)
        again.send(("img", newest[:, 2], (), refills[:, 2]))
        assert "frames before whole stacks" in again.recv()[1]
        again.send(("img", obs[:, 2], (), None))
        reply = again.recv()
        np.testing.assert_allclose(reply[1], local.forward(obs[:, 2])[0], rtol=1e-5, atol=1e-6)
    finally:
        server.stop()
