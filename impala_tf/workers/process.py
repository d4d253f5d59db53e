"""`ProcessBackend`: each worker a local process (the embedded default).

The driver sends a worker its calls through a `CommandQueue` (a `multiprocessing.Queue` whose
feeder thread never blocks the driver); the worker sends replies back through its own one-way
pipe. The driver waits on every pipe and process sentinel at once, so a dead worker is noticed
at once (its pipe closes, its sentinel fires) and reported with its exit code.

Every worker runs `worker_main`, whatever it hosts: it drains its command queue into a
`impala_tf.workers.host.WorkerHost` (so coalesced calls sent meanwhile are applied before the
next call runs), runs the oldest queued call and sends its reply if one is wanted. A hosted
object's exception is sent back with its traceback ("fatal" when its `fatal` attribute is true)
and ends the worker; a worker whose driver disappeared exits by itself within about a second.

A call with `parts` returns (head, body): the worker writes the body into a shared memory segment
the driver named, and the reply carries the head and a handle
(`impala_tf.workers.shared_values`); the driver's `SegmentStore` of the group removes the
segments, those of a worker that died with calls unanswered included.

Processes are forked from a fork server that has imported what the workers need once
(`WorkerSpec.preload`: TensorFlow, for actors that run it) or spawned where there is none: never
plain-forked, as TensorFlow is not fork-safe once it has run. `prestart_fork_server` starts the
fork server early, so its imports overlap the driver's own TensorFlow import. Workers (and the
fork server) run with `WORKER_ENV`: one thread per numeric library, no GPU.

Scripts that build the algorithm at module level, without `if __name__ == "__main__":`, are
handled as `impala_tf.workers.main_guard` describes: their children do not re-run the script.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from multiprocessing import connection
from typing import Any

import impala_tf.workers.main_guard as main_guard
from impala_tf.workers.host import WorkerHost
from impala_tf.workers.pipes import CommandQueue, end_worker
from impala_tf.workers.protocol import Answer, Death, Up, WorkerSpec
from impala_tf.workers.shared_values import SegmentStore, ValueWriter, warn_no_room

__all__ = [
    "WORKER_ENV",
    "ProcessBackend",
    "prestart_fork_server",
    "stop_helper_processes",
    "worker_env_vars",
    "worker_environment",
    "worker_main",
]

#: Environment of every worker process (and Ray actor): one thread per numeric library. With
#: several workers and the learner on few cores, multi-threaded BLAS and TensorFlow pools spin
#: against each other (measured: a 16x256x256 numpy matmul went from 36 us to over 1 ms). The
#: GPUs are the learner's.
WORKER_ENV = {
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TF_NUM_INTRAOP_THREADS": "1",
    "TF_NUM_INTEROP_THREADS": "1",
    "CUDA_VISIBLE_DEVICES": "",
}
#: TensorFlow's C++ log level in the workers unless the user set one (`impala_tf.utils.quiet`).
_WORKER_TF_LOG_LEVEL = "3"
#: How long a worker that is being ended gets for each step (SIGTERM, SIGKILL).
_JOIN_S = 3.0
#: One grace period shared by all workers on `stop` (one each: 128 actors took a minute). An
#: idle worker exits on "stop" within milliseconds; one busy in a call or blocked sending a
#: reply gets SIGTERM after it (its clean exit saves nothing: it is `_exit_now` either way).
_STOP_GRACE_S = 0.05


def worker_env_vars() -> dict[str, str]:
    """`WORKER_ENV` plus the TensorFlow C++ log level (the driver's, else quiet)."""
    env = {"TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", _WORKER_TF_LOG_LEVEL)}
    env.update(WORKER_ENV)
    return env


@contextlib.contextmanager
def worker_environment() -> Iterator[None]:
    """Sets `worker_env_vars()` while child processes (or the fork server) are launched."""
    env = worker_env_vars()
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


def _default_start_method() -> str:
    return "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


def prestart_fork_server(preload: tuple[str, ...]) -> None:
    """Starts the fork server now, importing `preload`, so that it overlaps the caller's work.

    Cheap and non-blocking; a no-op where there is no fork server. Call it before importing
    TensorFlow in the driver: the workers then fork from a server that imported it once.

    Args:
      preload: Modules the fork server imports (e.g. "impala_tf.workers._quiet_tf").
    """
    if "forkserver" not in mp.get_all_start_methods():
        return
    from multiprocessing import forkserver

    mp.get_context("forkserver").set_forkserver_preload(list(preload))
    with worker_environment():
        forkserver.ensure_running()


def stop_helper_processes(timeout_s: float = 2.0) -> None:
    """Ends multiprocessing's fork server and resource tracker, and waits until they have.

    Left alone, each ends only after its parent has exited (it reads the end of a pipe), so a
    binary's prompt came back while they still ran. For a process's last moments, once its
    workers have stopped: a later worker would start a new fork server. Each gets `timeout_s`
    after its pipe closes, then SIGKILL; the resource tracker goes last, after it has removed
    whatever shared memory a killed worker left registered.
    """
    from multiprocessing import forkserver, resource_tracker

    helpers = (
        (forkserver._forkserver, "_forkserver_alive_fd", "_forkserver_pid"),
        (resource_tracker._resource_tracker, "_fd", "_pid"),
    )
    for helper, fd_name, pid_name in helpers:
        fd, pid = getattr(helper, fd_name, None), getattr(helper, pid_name, None)
        if fd is None or pid is None:
            continue
        setattr(helper, fd_name, None)
        setattr(helper, pid_name, None)
        with contextlib.suppress(OSError):
            os.close(fd)  # Its end of file asks it to stop.
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(pid, os.WNOHANG) == (0, 0):
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    break
                time.sleep(0.005)


def _exit_now(code: int) -> None:
    """Exits without interpreter teardown, which takes seconds with TensorFlow loaded."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _drain(
    host: WorkerHost, commands: Any, results: Any, parent: Any, segments: dict[int, str]
) -> None:
    """Submits every command waiting (blocking while no call is queued) to `host`; the segment
    names of `parts` calls go into `segments`."""
    while True:
        try:
            msg = commands.get_nowait() if host.has_pending() else commands.get(timeout=1.0)
        except queue.Empty:
            if host.has_pending():
                return
            if parent is not None and not parent.is_alive():
                _exit_now(0)
            continue
        if msg[0] == "stop":
            results.close()
            _exit_now(0)
        _, call_id, method, args, coalesce, reply, segment = msg
        if segment is not None:
            segments[call_id] = segment
        host.submit(call_id, method, args, coalesce, reply)


def worker_main(
    worker_id: int,
    payload: tuple[Any, tuple, dict[str, Any]],
    env: dict[str, str],
    results: connection.Connection,
    commands: Any,
) -> None:
    """The body of every worker process: build the hosted object, run calls until "stop".

    Args:
      worker_id: The worker's index (0-based), first argument of the factory.
      payload: (factory, args, kwargs): the hosted object is `factory(worker_id, *args,
        **kwargs)`.
      env: Environment variables set before the factory runs (`worker_env_vars()`).
      results: Where ("up",) once the hosted object is built, replies ("reply", call id,
        value), the replies of `parts` calls ("parts", call id, head, handle or body), a note
        ("no room", why: bodies go by value from now on) and errors ("error" or "fatal",
        traceback text) go.
      commands: The driver's ("call", call id, method, args, coalesce, reply, segment name of a
        `parts` call or None) and ("stop",).
    """
    parent = mp.parent_process()
    try:
        os.environ.update(env)  # The fork server may have been started by someone else.
        factory, args, kwargs = payload
        host = WorkerHost(factory(worker_id, *args, **kwargs))
        results.send(("up",))
        writer, segments = ValueWriter(), {}
        while True:
            _drain(host, commands, results, parent, segments)
            call_id, reply, value = host.run_next()
            segment = segments.pop(call_id, None)
            if segment is not None:
                head, body = value
                body, no_room = writer.share(segment, body)
                if no_room is not None:
                    results.send(("no room", no_room))
                results.send(("parts", call_id, head, body))
            elif reply:
                results.send(("reply", call_id, value))
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group; the driver ends.
        _exit_now(0)
    except BaseException as e:  # noqa: BLE001 - reported to the driver, which decides.
        kind = "fatal" if getattr(e, "fatal", False) else "error"
        with contextlib.suppress(BrokenPipeError, OSError):
            results.send((kind, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        _exit_now(1)


class _Process:
    """The driver's handle on one worker process."""

    def __init__(self, process: Any, results: Any, commands: CommandQueue, progress: Any):
        self.process = process
        self.results = results
        self.commands: CommandQueue | None = commands  # None once the driver ended it.
        self.progress = progress

    @property
    def live(self) -> bool:
        """Not yet ended by the driver."""
        return self.commands is not None


class ProcessBackend:
    """Workers as local processes; one instance may serve several groups."""

    def open(self, spec: WorkerSpec) -> _ProcessGroup:
        """The process side of a new group of `spec` workers."""
        return _ProcessGroup(spec)


class _ProcessGroup:
    """The processes of one `WorkerGroup` (see `impala_tf.workers.protocol.BackendGroup`)."""

    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        method = spec.start_method or _default_start_method()
        self._ctx = mp.get_context(method)
        if method == "forkserver" and spec.preload:
            # Only matters if the fork server is not running yet: it is one per driver.
            self._ctx.set_forkserver_preload(list(spec.preload))
        # A script building at module level without a main guard must not re-run in children.
        self._unguarded_main = main_guard.unguarded_main_call()
        self._procs: dict[int, _Process] = {}
        self._stopped = False
        self._segments = SegmentStore()  # Of the `parts` calls' bodies.
        self._warned = False

    def _by_value(self, obj: Any) -> Any:
        return main_guard.by_value(obj) if self._unguarded_main else obj

    def start(self, worker_id: int, args: tuple) -> None:
        if self._stopped:
            raise RuntimeError(f"{self.spec.role} {worker_id}: the group was stopped")
        recv_end, send_end = self._ctx.Pipe(duplex=False)
        commands = CommandQueue(self._ctx)
        progress = self._ctx.RawArray("q", 3) if self.spec.shared_progress else None
        kwargs = {"progress": progress} if self.spec.shared_progress else {}
        process = self._ctx.Process(
            target=worker_main,
            args=(
                worker_id,
                self._by_value((self.spec.factory, args, kwargs)),
                worker_env_vars(),
                send_end,
                commands,
            ),
            name=f"impala-{self.spec.role.replace(' ', '-')}-{worker_id}",
            daemon=True,
        )
        try:
            with worker_environment(), main_guard.without_main_preparation(self._unguarded_main):
                process.start()
        except BaseException:
            recv_end.close()
            commands.discard(0.0)
            raise
        finally:
            send_end.close()
        for arg in args:
            if isinstance(arg, connection.Connection):
                arg.close()  # Handed over: its peer sees EOF when the worker dies.
        self._procs[worker_id] = _Process(process, recv_end, commands, progress)

    def send(
        self,
        worker_id: int,
        call_id: int,
        method: str,
        args: tuple,
        coalesce: bool,
        reply: bool,
        parts: bool = False,
    ) -> None:
        proc = self._procs[worker_id]
        if proc.live:
            segment = self._segments.expect(worker_id, call_id) if parts else None
            message = ("call", call_id, method, self._by_value(args), coalesce, reply, segment)
            with contextlib.suppress(ValueError, OSError):  # Closed: its death is reported.
                proc.commands.put(message)

    def collect(self, timeout_s: float) -> list[Up | Answer | Death]:
        live = {i: p for i, p in self._procs.items() if p.live}
        if timeout_s > 0:
            if live:
                waitables = [p.results for p in live.values()]
                connection.wait(waitables + [p.process.sentinel for p in live.values()], timeout_s)
            else:
                time.sleep(timeout_s)
        events: list[Answer | Death] = []
        for i, proc in live.items():
            death = self._read(i, proc, events)
            if death is None and not proc.process.is_alive():
                # Read again: what it sent just before it exited is in the pipe by now.
                death = self._read(i, proc, events) or Death(i, self._exited(proc))
            if death is not None:
                self._end(i)
                events.append(death)
        return events

    def _read(
        self, worker_id: int, proc: _Process, events: list[Up | Answer | Death]
    ) -> Death | None:
        """Moves the worker's waiting events into `events`; its `Death` if it reported one."""
        try:
            while proc.results.poll():
                msg = proc.results.recv()
                if msg[0] == "up":
                    events.append(Up(worker_id))
                elif msg[0] == "reply":
                    events.append(Answer(worker_id, msg[1], msg[2]))
                elif msg[0] == "parts":
                    body = self._segments.received(worker_id, msg[1], msg[3])
                    events.append(Answer(worker_id, msg[1], (msg[2], body)))
                elif msg[0] == "no room":
                    if not self._warned:
                        self._warned = True
                        warn_no_room(self.spec.role, msg[1])
                else:
                    return Death(worker_id, msg[1], msg[0] == "fatal")
        except (EOFError, OSError):
            proc.process.join(0.5)
            return Death(worker_id, self._exited(proc))
        return None

    def _exited(self, proc: _Process) -> str:
        code = proc.process.exitcode
        how = f"exit code {code}"
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                how += f", {signal.Signals(-code).name}"
        return f"{self.spec.role} process exited ({how})"

    def _end(self, worker_id: int) -> None:
        """Ends the worker, then removes the segments of its unanswered `parts` calls."""
        proc = self._procs[worker_id]
        if proc.live:
            with contextlib.suppress(ValueError, OSError):
                end_worker(proc.process, proc.commands, proc.results, _JOIN_S)
            # Freed now, not with the group: the queue's semaphores are unregistered from
            # Python's resource tracker while it runs. (A Ray actor that exits gracefully, a
            # Tune trial's process say, kills its child processes, the tracker among them,
            # before the interpreter's finalizers run; each semaphore freed then restarted the
            # tracker with a warning and a KeyError traceback.)
            proc.commands = None
        self._segments.lost(worker_id)

    def kill(self, worker_id: int) -> None:
        self._end(worker_id)

    def restart(self, worker_id: int, args: tuple) -> None:
        old = self._procs.get(worker_id)
        if old is not None and old.live:
            self._end(worker_id)
        self.start(worker_id, args)

    def progress(self, worker_id: int) -> Any:
        return self._procs[worker_id].progress

    def pids(self, worker_ids: list[int]) -> dict[int, int]:
        return {i: self._procs[i].process.pid for i in worker_ids if self._procs[i].live}

    def node_ids(self, worker_ids: list[int]) -> dict[int, str]:
        return {i: "local" for i in worker_ids if self._procs[i].live}

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        live = {i: p for i, p in self._procs.items() if p.live}
        for proc in live.values():
            with contextlib.suppress(ValueError, OSError):
                proc.commands.put(("stop",))
        # A worker busy in a long call, or blocked sending a reply nobody reads, never sees
        # "stop": all of them share one moment to exit cleanly, then the rest are signalled
        # together and reaped.
        deadline = time.monotonic() + _STOP_GRACE_S
        alive = [p for p in live.values() if p.process.is_alive()]
        while alive and (left := deadline - time.monotonic()) > 0:
            connection.wait([p.process.sentinel for p in alive], left)
            alive = [p for p in alive if p.process.is_alive()]
        for proc in alive:
            with contextlib.suppress(ValueError, OSError):
                proc.process.terminate()
        for worker_id in live:
            self._end(worker_id)
        self._segments.close()  # Held handles too: the workers are gone, nothing reads them.
