"""Workers: N hosted objects in other processes, called asynchronously, watched, restarted.

The driver runs its env runners ("actor") and aggregation workers ("aggregation worker") on one
mechanism. A `WorkerSpec` names a factory of the hosted object (opaque here) and how to place
it; a `WorkerGroup` starts N of them on a backend, `ProcessBackend` (local processes) or
`RayBackend` (Ray actors), and calls their methods asynchronously, each named by the hosted
class's function (`RunnerHost.sample`, not a string): `call` returns a call id,
`poll` returns the `Reply`s and the `WorkerFailure`s (a death, an exception, a call unanswered
for `WorkerSpec.timeout_s`). Inside every worker a `WorkerHost` runs the calls in order,
applying only the newest of each coalesced method (weights) before the next call.
`RestartPolicy` holds the rules for a failure: raise, or restart the worker (the caller
counts the restarts). The messages between a group and its backends are in
`impala_tf.workers.protocol`.

    group = WorkerGroup(ProcessBackend(), spec, num_workers=4)
    group.call(0, RunnerHost.set_weights, weights, coalesce=True, reply=False)
    group.call(0, RunnerHost.sample)
    replies, failures = group.poll(timeout_s=1.0)

Importing this package imports neither TensorFlow nor Ray.
"""

from __future__ import annotations

from impala_tf.workers.group import WorkerGroup
from impala_tf.workers.host import WorkerHost
from impala_tf.workers.process import ProcessBackend, prestart_fork_server
from impala_tf.workers.protocol import (
    Reply,
    StoredValue,
    WorkerFailure,
    WorkerSpec,
    release,
    resolve,
)
from impala_tf.workers.ray_backend import RayBackend
from impala_tf.workers.restarts import RestartPolicy

__all__ = [
    "ProcessBackend",
    "RayBackend",
    "Reply",
    "RestartPolicy",
    "StoredValue",
    "WorkerFailure",
    "WorkerGroup",
    "WorkerHost",
    "WorkerSpec",
    "prestart_fork_server",
    "release",
    "resolve",
]
