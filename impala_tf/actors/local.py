"""`LocalActorPool`: the embedded default, one local process per actor.

Each actor process runs an `EnvRunner`. The driver sends it commands through a
`multiprocessing.Queue` (sample requests, weights, stop), whose feeder thread never blocks the
driver, and the actor sends fragments back through its own pipe; the driver waits on all pipes
and process sentinels at once, so a dead actor is noticed immediately (its pipe closes). Actors
pack observations before sending (`impala_tf.frames.encode_observations`).

With central inference (`inference`, see `impala_tf.inference`) the pool also runs the driver's
`InferenceServer`: each actor gets a second, duplex pipe to it, weight broadcasts load the
server once (actors get only the version and the filter), and the actors never import
TensorFlow.

Processes are forked from a fork server that has imported what the actors need (TensorFlow
only for per-actor inference of non-MLP policies, and never run it), or spawned where there is
no fork server: TensorFlow is not fork-safe once it has run. An actor whose parent disappears
exits by itself within about a second.

An actor that has not answered a sample request for `sample_timeout_s` seconds (an env that
hangs) is killed and reported as failed, with where it hung (env, env index, step, read from a
small shared array the actor updates as it steps); the driver then restarts it or raises.
Errors that a restart cannot cure (`EnvError.fatal`: wrong observation shape or dtype,
non-finite data) are reported as fatal.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing as mp
import os
import queue
import time
import traceback
from multiprocessing import connection
from typing import Any

import numpy as np

from impala_tf.actors import main_guard
from impala_tf.actors.base import ActorFailure, ActorPool
from impala_tf.actors.env_runner import Fragment
from impala_tf.actors.memory import check_actor_memory
from impala_tf.actors.workers import CommandQueue, end_worker
from impala_tf.config import ImpalaConfig
from impala_tf.envs.faults import StepProgress, env_name
from impala_tf.filters import Filter
from impala_tf.frames import encode_observations

__all__ = ["LocalActorPool"]

logger = logging.getLogger(__name__)

_STOP_JOIN_S = 3.0
_STOP_GRACE_S = 0.5


def _actor_main(
    actor_id: int,
    config: ImpalaConfig,
    results: connection.Connection,
    commands: Any,
    weights: list[np.ndarray] | None,
    policy_version: int,
    progress: Any = None,
    remote: Any = None,
) -> None:
    """The body of one actor process: sample one fragment per credit, apply weights, stop."""
    parent = mp.parent_process()
    try:
        from impala_tf.actors.env_runner import EnvRunner
        from impala_tf.multi_agent import is_multi_agent

        if is_multi_agent(config):  # Per-policy fragments; its policies act in the actor.
            from impala_tf.multi_agent.runner import MultiAgentEnvRunner

            runner = MultiAgentEnvRunner(
                config, worker_index=actor_id + 1, progress=StepProgress(progress)
            )
        else:
            runner = EnvRunner(
                config, worker_index=actor_id + 1, progress=StepProgress(progress), remote=remote
            )
        if weights is not None:
            runner.set_weights(weights, policy_version)
        credits = 0
        while True:
            latest_weights = None
            while True:
                try:
                    msg = commands.get_nowait() if credits > 0 else commands.get(timeout=1.0)
                except queue.Empty:
                    if credits > 0:
                        break
                    if parent is not None and not parent.is_alive():
                        os._exit(0)
                    continue
                kind = msg[0]
                if kind == "stop":
                    results.close()
                    # Skips interpreter teardown, which takes seconds with TensorFlow loaded.
                    os._exit(0)
                if kind == "sample":
                    credits += msg[1]
                elif kind == "weights":
                    latest_weights = msg[1:]
                elif kind in ("get_state", "set_state"):
                    # Weights received before this command come first, as the driver sent them.
                    if latest_weights is not None:
                        runner.set_weights(*latest_weights)
                        latest_weights = None
                    if kind == "get_state":
                        results.send(("state", runner.get_state()))
                    else:
                        runner.set_state(msg[1])
            if latest_weights is not None:
                runner.set_weights(*latest_weights)
            fragment = runner.sample()
            fragment.actor_id = actor_id
            # Each frame of stacked images travels once; zlib on top with compress_observations.
            encode = functools.partial(
                encode_observations, compress_observations=config.compress_observations
            )
            # A multi-agent batch (impala_tf.multi_agent.batch) codes each policy's batch.
            batch = fragment.batch
            fragment.batch = batch.map(encode) if hasattr(batch, "map") else encode(batch)
            results.send(("fragment", fragment))
            credits -= 1
    except (KeyboardInterrupt, BrokenPipeError, EOFError):  # EOF: the inference server left.
        return
    except BaseException as e:  # noqa: BLE001 - reported to the driver, which decides.
        kind = "fatal" if getattr(e, "fatal", False) else "error"
        with contextlib.suppress(BrokenPipeError, OSError):
            results.send((kind, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise SystemExit(1) from e


#: Environment of the actor processes: one thread per numeric library. With several actors and
#: the learner on few cores, multi-threaded BLAS and TensorFlow pools spin against each other
#: (measured: a 16x256x256 numpy matmul went from 36 us to over 1 ms).
_ACTOR_ENV = {
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TF_NUM_INTRAOP_THREADS": "1",
    "TF_NUM_INTEROP_THREADS": "1",
    "CUDA_VISIBLE_DEVICES": "",
}
#: TensorFlow's C++ log level in the actors unless the user set one (`impala_tf.quiet`).
_ACTOR_TF_LOG_LEVEL = "3"


@contextlib.contextmanager
def _actor_environment():
    """Sets `_ACTOR_ENV` while child processes (or the fork server) are launched."""
    env = {"TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", _ACTOR_TF_LOG_LEVEL)}
    env.update(_ACTOR_ENV)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _spaces(config: ImpalaConfig) -> tuple[Any, Any]:
    """The env's (observation space, action space), from one env built here."""
    from impala_tf.actors.env_runner import make_env

    env = make_env(config, 0, 0)
    try:
        return env.observation_space, env.action_space
    finally:
        env.close()


def central_inference(
    config: ImpalaConfig,
    observation_space: Any,
    action_space: Any,
    meminfo: dict[str, int] | None = None,
) -> bool:
    """Whether the driver runs the policy for the actors (`inference`, `impala_tf.inference`).

    "auto" keeps inference in each actor while a pool of TensorFlow actors fits in memory: on an
    idle 2-core machine per-actor CNN inference trained 1.7x the env steps/s of central inference
    (`tools/bench_atari.py --compare_inference`, BENCHMARKS.md), since the driver also runs the
    learner. When TensorFlow actors would not fit (`impala_tf.actors.memory`: RLlib's
    128-worker Pong on a 24 GB machine), "auto" picks central inference, whose actors never
    import TensorFlow, rather than refusing the pool. MLP policies act in numpy in each actor.
    Ray actors (`actor_backend: ray`) and multi-agent actors always run their policies
    themselves.

    Args:
      config: The algorithm config (`inference`, `actor_backend`, `model`, pool sizes).
      observation_space: The env's observation space.
      action_space: The env's action space.
      meminfo: /proc/meminfo fields in bytes for the memory check (read now when None).
    """
    from impala_tf.actors.memory import ActorMemoryError
    from impala_tf.multi_agent import is_multi_agent
    from impala_tf.numpy_policy import supports

    if config.actor_backend == "ray" or is_multi_agent(config):
        return False
    if config.inference != "auto":
        return config.inference == "central"
    if supports(observation_space, action_space, config.model):
        return False
    try:
        check_actor_memory(config, observation_space, numpy_policy=False, meminfo=meminfo)
    except ActorMemoryError:
        return True
    return False


def _tensorflow_free(config: ImpalaConfig) -> tuple[bool, bool, Any, Any]:
    """(whether actors act without TensorFlow, whether inference is central, the spaces)."""
    from impala_tf.numpy_policy import supports

    observation_space, action_space = _spaces(config)
    central = central_inference(config, observation_space, action_space)
    light = central or supports(observation_space, action_space, config.model)
    return light, central, observation_space, action_space


def _preload(config: ImpalaConfig) -> list[str]:
    """Modules the fork server imports once for every actor: TensorFlow only if the actors run
    it (MLP policies act in numpy, see `impala_tf.numpy_policy`; central inference runs it in
    the driver), imported quietly."""
    light, _, _, _ = _tensorflow_free(config)
    if light:
        return ["impala_tf.actors.env_runner"]
    return ["impala_tf.actors._quiet_tf", "impala_tf.policy"]


def prestart_fork_server(config: ImpalaConfig) -> None:
    """Starts the fork server now, so that its imports overlap the caller's TensorFlow import.

    Cheap and non-blocking; a no-op where there is no fork server. `ImpalaConfig.build()` calls
    it before importing the algorithm (and with it TensorFlow).
    """
    if "forkserver" not in mp.get_all_start_methods():
        return
    from multiprocessing import forkserver

    mp.get_context("forkserver").set_forkserver_preload(_preload(config))
    with _actor_environment():
        forkserver.ensure_running()


class _Actor:
    """The driver's handle on one actor process."""

    def __init__(self, process, results, commands, progress):
        self.process = process
        self.results = results
        self.commands = commands
        self.healthy = True
        self.progress = StepProgress(progress)
        self.outstanding = 0  # Sample requests not yet answered.
        self.waiting_since: float | None = None  # Since when the oldest one is unanswered.


class LocalActorPool(ActorPool):
    """`num_env_runners` local actor processes (at least one).

    Before any process starts, `impala_tf.actors.memory.check_actor_memory` refuses a pool that
    would not fit in the machine's available memory (`ActorMemoryError`, naming
    `num_env_runners`).

    Args:
      config: The algorithm config; each actor builds its envs and policy from it.
      weights: Initial policy weights for every actor (None keeps their random init).
      policy_version: The learner's `num_grad_updates` that `weights` correspond to.
      start_method: multiprocessing start method: "forkserver" (the default where available:
        TensorFlow is imported once, by the fork server) or "spawn". Never "fork": TensorFlow
        is not fork-safe once it runs.
    """

    def __init__(
        self,
        config: ImpalaConfig,
        weights: list[np.ndarray] | None = None,
        policy_version: int = 0,
        start_method: str | None = None,
    ):
        light, central, observation_space, action_space = _tensorflow_free(config)
        check_actor_memory(config, observation_space, numpy_policy=light)
        if start_method is None:
            methods = mp.get_all_start_methods()
            start_method = "forkserver" if "forkserver" in methods else "spawn"
        self.config = config
        self.num_actors = max(1, int(config.num_env_runners))
        self._ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            # The fork server imports TensorFlow once; each actor forks from it.
            self._ctx.set_forkserver_preload(_preload(config))
        self._actors: dict[int, _Actor] = {}
        self._stopped = False
        # What arrived while `get_actor_states` waited for snapshots, for the next fetch_ready.
        self._held_fragments: list[Fragment] = []
        self._held_failures: list[ActorFailure] = []
        self._states: dict[int, dict] = {}
        # A script building at module level without a main guard must not re-run in children.
        self._unguarded_main = main_guard.unguarded_main_call()
        self.inference_server = None
        if central:
            from impala_tf.inference import InferenceServer

            self.inference_server = InferenceServer(observation_space, action_space, config.model)
            if weights is not None:
                self.inference_server.set_weights(weights, policy_version)
            weights = None  # The actors hold none.
        for i in range(self.num_actors):
            self._start(i, weights, policy_version)

    def _start(self, actor_id: int, weights, policy_version: int) -> None:
        recv_end, send_end = self._ctx.Pipe(duplex=False)
        commands = CommandQueue(self._ctx)
        progress = self._ctx.RawArray("q", 3)
        config = main_guard.by_value(self.config) if self._unguarded_main else self.config
        server, remote = self.inference_server, None
        if server is not None:
            remote = (server.attach(actor_id), server.state_shapes)
            weights = None
        process = self._ctx.Process(
            target=_actor_main,
            args=(actor_id, config, send_end, commands, weights, policy_version, progress, remote),
            name=f"impala-actor-{actor_id}",
            daemon=True,
        )
        with _actor_environment(), main_guard.without_main_preparation(self._unguarded_main):
            process.start()
        send_end.close()
        if remote is not None:
            remote[0].close()  # The actor's end: the server sees EOF when the actor dies.
        self._actors[actor_id] = _Actor(process, recv_end, commands, progress)

    def request_samples(self, actor_ids: list[int], count: int = 1) -> None:
        for i in actor_ids:
            actor = self._actors[i]
            if actor.healthy:
                actor.commands.put(("sample", count))
                if actor.outstanding == 0:
                    actor.waiting_since = time.monotonic()
                actor.outstanding += count

    def fetch_ready(self, timeout_s: float) -> tuple[list[Fragment], list[ActorFailure]]:
        healthy = [a for a in self._actors.values() if a.healthy]
        held = self._held_fragments or self._held_failures
        if timeout_s > 0 and healthy and not held:
            connection.wait(
                [a.results for a in healthy] + [a.process.sentinel for a in healthy], timeout_s
            )
        self._read_all()
        fragments, self._held_fragments = self._held_fragments, []
        failures, self._held_failures = self._held_failures, []
        return fragments, failures

    def _read_all(self) -> None:
        """Moves every message waiting in the actors' pipes into the held lists and `_states`."""
        timeout = self.config.sample_timeout_s
        for actor_id, actor in self._actors.items():
            if not actor.healthy:
                continue
            error, fatal = None, False
            try:
                while actor.results.poll():
                    kind, payload = actor.results.recv()
                    if kind == "fragment":
                        self._held_fragments.append(payload)
                        actor.outstanding = max(0, actor.outstanding - 1)
                        actor.waiting_since = time.monotonic() if actor.outstanding else None
                    elif kind == "state":
                        self._states[actor_id] = payload
                    else:
                        error, fatal = payload, kind == "fatal"
                        break
            except (EOFError, OSError):
                actor.process.join(0.5)
                error = f"actor process exited (exit code {actor.process.exitcode})"
            if error is None and not actor.process.is_alive():
                error = f"actor process exited (exit code {actor.process.exitcode})"
            if (
                error is None
                and timeout is not None
                and actor.waiting_since is not None
                and time.monotonic() - actor.waiting_since > timeout
            ):
                error = (
                    f"actor {actor_id} did not answer a sample request within "
                    f"sample_timeout_s={timeout:g} s: env {env_name(self.config.env)} hangs "
                    f"{actor.progress.describe()} (the actor was killed)"
                )
            if error is not None:
                actor.healthy = False
                self._terminate(actor)
                self._held_failures.append(ActorFailure(actor_id, error, fatal))

    def get_actor_states(self, actor_ids: list[int], timeout_s: float) -> dict[int, dict]:
        wanted = [i for i in actor_ids if self._actors[i].healthy]
        for i in wanted:
            self._states.pop(i, None)
            self._actors[i].commands.put(("get_state",))
        deadline = time.monotonic() + timeout_s
        while True:
            self._read_all()
            missing = [i for i in wanted if i not in self._states and self._actors[i].healthy]
            if not missing:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"actors {missing} sent no state within {timeout_s:g} s")
            actors = [self._actors[i] for i in missing]
            connection.wait(
                [a.results for a in actors] + [a.process.sentinel for a in actors], min(left, 1.0)
            )
        return {i: self._states.pop(i) for i in wanted if i in self._states}

    def set_actor_states(self, states: dict[int, dict]) -> None:
        for i, state in states.items():
            actor = self._actors[i]
            if actor.healthy:
                actor.commands.put(("set_state", state))

    def broadcast_weights(
        self,
        weights: list[np.ndarray],
        policy_version: int,
        actor_ids: list[int],
        obs_filter: Filter | None = None,
    ) -> None:
        if self.inference_server is not None:
            self.inference_server.set_weights(weights, policy_version)
            weights = None  # The actors get only the version and the filter.
        for i in actor_ids:
            actor = self._actors[i]
            if actor.healthy:
                actor.commands.put(("weights", weights, policy_version, obs_filter))

    def restart(self, actor_id: int, weights: list[np.ndarray], policy_version: int) -> None:
        old = self._actors.get(actor_id)
        if old is not None:
            self._terminate(old)
        if self.inference_server is not None and weights is not None:
            self.inference_server.set_weights(weights, policy_version)
        self._start(actor_id, weights, policy_version)

    def healthy_actor_ids(self) -> list[int]:
        return [i for i, a in self._actors.items() if a.healthy]

    def pids(self) -> list[int]:
        """Process ids of the live actors (for tests and monitoring)."""
        return [a.process.pid for a in self._actors.values() if a.process.is_alive()]

    @staticmethod
    def _terminate(actor: _Actor) -> None:
        end_worker(actor.process, actor.commands, actor.results, _STOP_JOIN_S)

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for actor in self._actors.values():
            if actor.process.is_alive():
                with contextlib.suppress(ValueError, OSError):
                    actor.commands.put(("stop",))
        if self.inference_server is not None:
            # Actors waiting for an answer see EOF and exit instead of finishing a fragment.
            self.inference_server.stop()
        # An actor blocked sending a fragment nobody reads never sees "stop": give all of them
        # one shared moment to exit cleanly (not one each: 128 actors took a minute), then
        # signal the rest together and reap them.
        deadline = time.monotonic() + _STOP_GRACE_S
        alive = [a for a in self._actors.values() if a.process.is_alive()]
        while alive and (left := deadline - time.monotonic()) > 0:
            connection.wait([a.process.sentinel for a in alive], left)
            alive = [a for a in alive if a.process.is_alive()]
        for actor in alive:
            with contextlib.suppress(ValueError, OSError):
                actor.process.terminate()
        for actor in self._actors.values():
            with contextlib.suppress(ValueError, OSError):
                self._terminate(actor)
