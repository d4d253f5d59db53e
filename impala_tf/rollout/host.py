"""What an actor worker hosts: an env runner whose fragments are packed for transport.

The worker mechanism (`impala_tf.workers`) runs `make_runner_host` in each actor (a local process
or a Ray actor) and calls the host's methods: `sample` (one fragment; with RLlib's
`compress_observations` its observation column, `obs` or `obs_frames`, is zlib-compressed, and
the aggregation stage decompresses it), `set_weights` (sent coalesced: only
the newest weights are applied before a sample), `get_state`/`set_state` (exact resumes,
reseeding). With central inference the host first connects to the driver's inference server
(`impala_tf.acting.inference_protocol.connect`: a pipe end for local processes, a TCP endpoint
for Ray actors).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from typing import Any

from impala_tf.acting.inference_protocol import connect
from impala_tf.data.sample_batch import OBS, OBS_FRAMES, compress
from impala_tf.envs.faults import StepProgress
from impala_tf.rollout import make_env_runner
from impala_tf.rollout.fragment import Fragment
from impala_tf.rollout.spec import RunnerSpec

__all__ = ["RunnerHost", "make_runner_host"]


class RunnerHost:
    """An env runner as an actor worker serves it (see the module docstring).

    Args:
      actor_id: The actor's index (0-based); the runner is `worker_index = actor_id + 1`.
      spec: What the runner is built from (`impala_tf.driver.plan.RuntimePlan.runner`).
      endpoint: Central inference: where the driver's inference server listens (None: the
        actor runs its policies itself).
      state_shapes: Central inference: {policy_id: one env's initial recurrent state (or its
        shapes)}, `InferenceServer.initial_states`.
      progress: Shared progress array for hang reports (local processes only).
    """

    def __init__(
        self,
        actor_id: int,
        spec: RunnerSpec,
        endpoint: Any = None,
        state_shapes: Mapping[str, list] | None = None,
        progress: Any = None,
    ):
        remote = None
        if endpoint is not None:
            remote = (connect(endpoint, actor_id), dict(state_shapes or {}))
        self.actor_id = actor_id
        self.runner = make_env_runner(
            spec, worker_index=actor_id + 1, progress=StepProgress(progress), remote=remote
        )
        self._compress = (
            functools.partial(compress, columns=(OBS, OBS_FRAMES))
            if spec.compress_observations
            else None
        )

    def sample(self) -> Fragment:
        fragment = self.runner.sample()
        fragment.actor_id = self.actor_id
        return fragment if self._compress is None else fragment.map_batches(self._compress)

    def sample_parts(self) -> tuple[Fragment, dict]:
        """`sample()` as (the fragment without its batches, the batches): the second stays in
        the backend's store (Ray's object store, or shared memory on local processes) for an
        aggregation worker to read (`impala_tf.workers.WorkerGroup.call(..., parts=True)`)."""
        fragment = self.sample()
        return dataclasses.replace(fragment, batches={}), fragment.batches

    def set_weights(self, weights: Mapping, filters: Mapping | None = None) -> None:
        self.runner.set_weights(weights, filters)

    def get_state(self) -> dict:
        return self.runner.get_state()

    def set_state(self, state: dict) -> None:
        self.runner.set_state(state)

    def pid(self) -> int:
        return os.getpid()


def make_runner_host(
    actor_id: int,
    spec: RunnerSpec,
    endpoint: Any = None,
    state_shapes: Mapping[str, list] | None = None,
    progress: Any = None,
) -> RunnerHost:
    """The worker factory of actors (`impala_tf.workers.WorkerSpec.factory`)."""
    return RunnerHost(actor_id, spec, endpoint, state_shapes, progress)
