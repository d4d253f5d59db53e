"""Tests for impala_tf.workers.memory: /proc reads, the pool estimate, and the refusal at start
(`impala_tf.driver.sampling.EnvRunnerGroup` applies it before any local actor starts)."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import time

import gymnasium as gym
import numpy as np
import pytest

from impala_tf.config import ImpalaConfig
from impala_tf.driver.counters import Counters
from impala_tf.driver.plan import make_plan
from impala_tf.driver.sampling import EnvRunnerGroup
from impala_tf.driver.specs import sampling_spec
from impala_tf.workers.memory import (
    ACTOR_BASE_BYTES,
    ActorMemoryError,
    check_actor_memory,
    estimate_pool_bytes,
    read_meminfo,
    read_smaps_rollup,
)

GIB = 2**30
PONG_OBS = gym.spaces.Box(0, 255, (84, 84, 4), np.uint8)


def _config(runners: int, envs: int = 1, **overrides) -> ImpalaConfig:
    config = ImpalaConfig().environment("CartPole-v1")
    config.env_runners(
        num_env_runners=runners, num_envs_per_env_runner=envs, rollout_fragment_length=50
    )
    return config.update_from_dict({"train_batch_size": 500, **overrides})


def test_proc_reads_of_this_process():
    mine = read_smaps_rollup(os.getpid())
    assert 0 < mine["Private"] <= mine["Rss"] and 0 < mine["Pss"] <= mine["Rss"]
    before = mine["Rss"]
    block = np.ones(64 * 2**20, np.uint8)  # Touched: 64 MiB more resident memory.
    assert read_smaps_rollup(os.getpid())["Rss"] - before > 60 * 2**20
    del block
    info = read_meminfo()
    assert 0 < info["MemAvailable"] <= info["MemTotal"]


def test_estimate_grows_with_runners_envs_and_observations():
    small = estimate_pool_bytes(_config(2), PONG_OBS, numpy_policy=False)
    more = estimate_pool_bytes(_config(4), PONG_OBS, numpy_policy=False)
    assert more["total"] - small["total"] == 2 * small["per_actor"]
    # A fragment of 50 steps x 5 envs of 84x84x4 bytes, held in 4 copies, plus 5 envs.
    wide = estimate_pool_bytes(_config(2, envs=5), PONG_OBS, numpy_policy=False)
    fragment = 50 * 5 * 84 * 84 * 4
    assert wide["per_actor"] - small["per_actor"] == 4 * (fragment - fragment // 5) + 4 * 4 * 2**20
    numpy = estimate_pool_bytes(_config(2), PONG_OBS, numpy_policy=True)
    assert small["per_actor"] - numpy["per_actor"] == (
        ACTOR_BASE_BYTES["tensorflow"] - ACTOR_BASE_BYTES["numpy"]
    )


def test_rllibs_128_worker_pong_is_refused_on_20_gib_naming_num_env_runners():
    meminfo = {"MemAvailable": 20 * GIB}
    with pytest.raises(ActorMemoryError, match=r"`num_env_runners`=128 needs about") as e:
        check_actor_memory(_config(128), PONG_OBS, numpy_policy=False, meminfo=meminfo)
    fits = int(re.search(r"fits about num_env_runners=(\d+)", str(e.value)).group(1))
    assert 0 < fits < 128
    # The figure the message gives is the largest pool that passes.
    check_actor_memory(_config(fits), PONG_OBS, numpy_policy=False, meminfo=meminfo)
    with pytest.raises(ActorMemoryError):
        check_actor_memory(_config(fits + 1), PONG_OBS, numpy_policy=False, meminfo=meminfo)
    # Numpy actors are light: 128 of them fit easily.
    fitted = check_actor_memory(_config(128), PONG_OBS, numpy_policy=True, meminfo=meminfo)
    assert fitted["total"] < 10 * GIB


def test_local_actors_are_refused_at_once_before_any_starts():
    config = _config(1_000_000)
    plan = make_plan(config)
    assert plan.backend == "process"
    start = time.perf_counter()
    with pytest.raises(ActorMemoryError, match="num_env_runners"):
        EnvRunnerGroup(sampling_spec(config, plan), plan, Counters())
    assert time.perf_counter() - start < 10
    assert not [p for p in mp.active_children() if p.name.startswith("impala-actor")]


def test_build_refuses_too_many_runners():
    with pytest.raises(ActorMemoryError, match="`num_env_runners`=1000000"):
        _config(1_000_000).build()
