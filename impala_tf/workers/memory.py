"""A memory guard for the actor pool: refuse at start what would swap or be OOM-killed later.

RLlib's tuned Atari examples ask for 32 to 128 env runners. Each local actor is a process; the
guard estimates what the requested pool would occupy and, when that does not fit in the memory
the machine has available now, raises `ActorMemoryError` before any actor starts, naming
`num_env_runners`, the memory needed and the largest pool that fits.

The estimate (bytes, Linux /proc figures, no psutil):

    needed = fork_server + num_env_runners * per_actor + learner_reserve
    per_actor = base[kind] + num_envs_per_env_runner * per_env + fragment_copies * fragment_obs

* `base[kind]`: the private memory (Private_Clean + Private_Dirty of /proc/<pid>/smaps_rollup)
  of one running actor process forked from the fork server, measured on this machine with
  `tools/measure_actor_memory.py`: `numpy` actors (MLP policies acting in numpy) and
  `tensorflow` actors (CNN/LSTM policies; TensorFlow's runtime and the model's graph are
  private to each actor once it runs). Pages the actors share with the fork server (the
  imported modules) count once, in `fork_server`.
* `per_env`: one env instance (an emulator with its frame buffers for Atari).
* `fragment_obs`: the observation bytes of one fragment (T x B x obs); the actor holds a few
  copies while it cuts, packs and pickles a fragment.
* `learner_reserve`: what the learner process may still grow by: the learner queue and the
  batches in flight (a few train batches of observations) plus a fixed headroom.

The budget is `MemAvailable` of /proc/meminfo (swap is never counted: a run that swaps is
too slow to train and one that is OOM-killed mid-run loses its work).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import gymnasium as gym
import numpy as np

from impala_tf.config.base import AlgorithmConfig as ImpalaConfig

__all__ = [
    "ACTOR_BASE_BYTES",
    "ActorMemoryError",
    "check_actor_memory",
    "estimate_pool_bytes",
    "read_meminfo",
    "read_smaps_rollup",
]

_MIB = 2**20

#: Private memory of one running actor process, by policy kind (measured; see module docstring).
#: Measured (2 actors x 5 envs, 3 fragments each): numpy MLP actor 9.6 MiB private (33 MiB
#: Rss), TensorFlow actor with RLlib's 84x84 CNN 162 MiB private (373 MiB Rss); rounded up.
ACTOR_BASE_BYTES: dict[str, int] = {"numpy": 24 * _MIB, "tensorflow": 200 * _MIB}
#: Resident memory of the fork server that every actor is forked from, by policy kind
#: (measured 40 MiB with numpy only, 642 MiB with TensorFlow imported).
_FORK_SERVER_BYTES: dict[str, int] = {"numpy": 64 * _MIB, "tensorflow": 700 * _MIB}
#: One env instance (measured 1.1 MiB for ALE/Pong-v5; ale_py's import adds 5 MiB Rss).
_PER_ENV_BYTES = 4 * _MIB
#: Copies of a fragment's observations an actor holds at once (buffers, batch, packed, pickle).
_FRAGMENT_COPIES = 4
#: Growth the learner process is allowed beyond its size when the pool starts.
_LEARNER_HEADROOM_BYTES = 1024 * _MIB


class ActorMemoryError(RuntimeError):
    """The requested actor pool does not fit in the available memory (the message says why)."""


def read_smaps_rollup(pid: int) -> dict[str, int]:
    """Reads a process's memory from /proc/<pid>/smaps_rollup.

    Args:
        pid: a process id.

    Returns:
        Bytes for "Rss", "Pss", "Private" (Private_Clean + Private_Dirty) and "Swap".
    """
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return {
        "Rss": fields.get("Rss", 0),
        "Pss": fields.get("Pss", 0),
        "Private": fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0),
        "Swap": fields.get("Swap", 0),
    }


def read_meminfo() -> dict[str, int]:
    """Reads /proc/meminfo; returns bytes per field ("MemAvailable", "MemTotal", ...)."""
    out: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[name] = int(parts[0]) * (1024 if parts[-1] == "kB" else 1)
    return out


def _obs_bytes(space: gym.Space) -> int:
    shape = space.shape or ()
    return int(math.prod(shape)) * np.dtype(space.dtype or np.float32).itemsize


def estimate_pool_bytes(
    config: ImpalaConfig, observation_space: gym.Space, *, numpy_policy: bool
) -> dict[str, int]:
    """Estimates the memory a pool of `config.num_env_runners` actors will need.

    Args:
        config: the algorithm config (`num_env_runners`, `num_envs_per_env_runner`,
            `rollout_fragment_length`, `train_batch_size`, `learner_queue_size`).
        observation_space: the env's observation space (fragment sizes).
        numpy_policy: True when actors act in numpy (no TensorFlow in the actor).

    Returns:
        Bytes: "per_actor", "fork_server", "learner_reserve" and "total".
    """
    kind = "numpy" if numpy_policy else "tensorflow"
    envs = int(config.num_envs_per_env_runner)
    obs = _obs_bytes(observation_space)
    fragment_obs = obs * envs * int(config.rollout_fragment_length)
    per_actor = ACTOR_BASE_BYTES[kind] + envs * _PER_ENV_BYTES + _FRAGMENT_COPIES * fragment_obs
    # The learner queue holds train batches; the loader and the update hold a couple more.
    batches = int(config.learner_queue_size) + 2
    learner = _LEARNER_HEADROOM_BYTES + batches * obs * int(config.train_batch_size)
    actors = max(1, int(config.num_env_runners))
    total = _FORK_SERVER_BYTES[kind] + actors * per_actor + learner
    return {
        "per_actor": per_actor,
        "fork_server": _FORK_SERVER_BYTES[kind],
        "learner_reserve": learner,
        "total": total,
    }


def check_actor_memory(
    config: ImpalaConfig,
    observation_space: gym.Space,
    *,
    numpy_policy: bool,
    meminfo: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """Raises `ActorMemoryError` when the requested actor pool would not fit in memory.

    Args:
        config: the algorithm config.
        observation_space: the env's observation space.
        numpy_policy: True when actors act in numpy.
        meminfo: /proc/meminfo fields in bytes (read now when None); "MemAvailable" is the
            budget.

    Returns:
        The estimate (see `estimate_pool_bytes`) plus "available", when it fits.

    Raises:
        ActorMemoryError: naming `num_env_runners`, the memory needed and available, and the
            largest `num_env_runners` that fits.
    """
    info = read_meminfo() if meminfo is None else meminfo
    available = int(info["MemAvailable"])
    estimate = estimate_pool_bytes(config, observation_space, numpy_policy=numpy_policy)
    if estimate["total"] > available:
        spare = available - estimate["fork_server"] - estimate["learner_reserve"]
        fits = max(0, spare // estimate["per_actor"])
        kind = "numpy (MLP)" if numpy_policy else "TensorFlow (CNN/LSTM)"
        raise ActorMemoryError(
            f"`num_env_runners`={config.num_env_runners} needs about "
            f"{estimate['total'] / 2**30:.1f} GiB ({estimate['per_actor'] / _MIB:.0f} MiB per "
            f"{kind} actor with {config.num_envs_per_env_runner} envs, "
            f"{estimate['fork_server'] / _MIB:.0f} MiB shared, "
            f"{estimate['learner_reserve'] / _MIB:.0f} MiB for the learner to grow) but only "
            f"{available / 2**30:.1f} GiB is available; this machine fits about "
            f"num_env_runners={fits}. Lower `num_env_runners` (raise "
            "`num_envs_per_env_runner` to keep the env count) so the run neither swaps nor is "
            "OOM-killed mid-run."
        )
    return {**estimate, "available": available}
