"""The whole data path in one process: an env runner, an aggregator, a learner and its thread.

    python -m examples.one_process

Read this first (docs/architecture.md links it): it is what `impala-train` runs, without the
processes. The parts are the real ones, built from the specs the driver resolves once from the
config; two queues connect them:

    actor thread: EnvRunner.sample() -> Fragment --(fragments queue)--> main loop
    main loop:    Aggregator.process -> train batches --(learner inqueue)--> LearnerThread
    LearnerThread: ImpalaLearner.train_step (V-trace) -> outqueue, and the newest weights,
                   which the main loop hands the actor thread to apply before its next sample.

What the driver adds around the same parts: the actors are processes or Ray actors
(`impala_tf.workers`), several per run; aggregation may run in worker processes; a
`Broadcaster` decides when weights go out; `Metrics` turns counters and episodes into RLlib's
result dict; checkpoints, restarts, evaluation and callbacks sit on top.
"""

from __future__ import annotations

import argparse
import queue
import threading

import numpy as np
import tensorflow as tf

from impala_tf import ImpalaConfig
from impala_tf.data.train_batch import TrainBatch
from impala_tf.driver.aggregation import Aggregator
from impala_tf.driver.specs import aggregator_spec, probe_spaces, runner_spec
from impala_tf.learning import pipeline
from impala_tf.learning.learner import ImpalaLearner
from impala_tf.learning.spec import learner_spec
from impala_tf.learning.thread import LearnerThread
from impala_tf.rollout import make_env_runner

POLICY = "default_policy"


def make_config() -> ImpalaConfig:
    """The README's CartPole settings, for one actor."""
    config, _ = ImpalaConfig.from_yaml("cartpole-impala")
    config.env_runners(num_env_runners=1)
    config.validate()
    return config


def actor(runner, fragments: queue.Queue, weights: list, stop: threading.Event) -> None:
    """An actor: applies the newest weights handed over (only the newest, as a worker host
    does), samples a fragment, hands it to the main loop; until `stop`."""
    while not stop.is_set():
        newest = weights.pop() if weights else None
        if newest is not None:
            runner.set_weights(newest)
        fragment = runner.sample()
        while not stop.is_set():
            try:
                fragments.put(fragment, timeout=0.1)
                break
            except queue.Full:
                continue


def main(env_steps: int = 2_000_000, target: float = 450.0) -> dict:
    config = make_config()
    spaces = probe_spaces(config)  # One env, made here: every part's spaces.
    obs_space, act_space = spaces.policies[POLICY]

    # The parts, each from its spec.
    runner = make_env_runner(runner_spec(config, spaces), worker_index=1)
    rows = pipeline.rows_per_batch(config)  # Sequences of T steps per train batch.
    aggregator = Aggregator(aggregator_spec(config, {POLICY: rows}))
    spec = learner_spec(config)
    learner = ImpalaLearner(spec, obs_space, act_space)
    signature = pipeline.batch_signature(spec, obs_space, act_space)
    thread = LearnerThread(learner, tf.distribute.get_strategy(), signature)

    # The first weights, then the actor and learner threads.
    handover = [{POLICY: (learner.get_policy_weights(), 0)}]
    fragments: queue.Queue = queue.Queue(maxsize=1)
    stop = threading.Event()
    acting = threading.Thread(target=actor, args=(runner, fragments, handover, stop), daemon=True)
    thread.start()
    acting.start()

    sampled = trained = updates = dropped = 0
    returns: list[float] = []
    sent_version = 0
    try:
        while sampled < env_steps or not updates:  # At least one update, however slow.
            fragment = fragments.get(timeout=120)
            sampled += fragment.env_steps
            returns = (returns + [e.ret for e in fragment.episodes])[-100:]
            for _, batch, version in aggregator.process(fragment.batches, fragment.policy_versions):
                try:  # As the driver: a full queue drops the batch (`learner_queue_size`).
                    thread.inqueue.put_nowait(TrainBatch(batch, version))
                except queue.Full:
                    dropped += 1
            while not thread.outqueue.empty():
                steps, _, stats = thread.outqueue.get_nowait()
                trained += steps
                updates += 1
            snapshot = thread.policy_snapshot(wait=False)
            if snapshot is not None and snapshot[1] > sent_version:
                handover[:] = [{POLICY: snapshot}]  # The actor applies only the newest.
                sent_version = snapshot[1]
            if thread.error is not None:
                raise RuntimeError("The learner thread died") from thread.error
            if returns and updates and np.mean(returns) >= target:
                break
    finally:
        stop.set()
        acting.join(10)
        thread.stop()
        runner.close()
    mean = float(np.mean(returns)) if returns else float("nan")
    print(
        f"{sampled:,} env steps sampled, {trained:,} trained in {updates} updates "
        f"({dropped} train batches dropped: the learner queue was full)"
    )
    print(f"mean return of the last {len(returns)} episodes: {mean:.1f}")
    return {"sampled": sampled, "trained": trained, "updates": updates, "return": mean}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env-steps", type=int, default=2_000_000)
    parser.add_argument("--target", type=float, default=450.0)
    args = parser.parse_args()
    main(args.env_steps, args.target)
