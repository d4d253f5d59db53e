"""Algorithm callbacks of the tests (RLlib's `DefaultCallbacks`), in an importable module that
imports no TensorFlow: the actors that run their episode hooks load this module by its import
path, and a numpy-acting actor stays a process without TensorFlow (seconds of CPU each)."""

from __future__ import annotations

import os

import numpy as np

from impala_tf.config.callbacks import DefaultCallbacks


class EpisodeStats(DefaultCallbacks):
    """RLlib's custom-metrics example, generalised: per episode, the mean |first observation
    component| as `obs0`, the episode's length as `steps`, the observations as hist data."""

    def on_episode_start(self, *, worker, base_env, policies, episode, env_index, **kwargs):
        assert episode.length == 0
        episode.user_data["obs0"] = [abs(float(np.ravel(self._obs(episode))[0]))]

    def on_episode_step(self, *, worker, base_env, episode, env_index, **kwargs):
        episode.user_data["obs0"].append(abs(float(np.ravel(self._obs(episode))[0])))

    def on_episode_end(self, *, worker, base_env, policies, episode, env_index, **kwargs):
        episode.custom_metrics["obs0"] = float(np.mean(episode.user_data["obs0"]))
        episode.custom_metrics["steps"] = episode.length
        episode.hist_data["obs0"] = episode.user_data["obs0"]

    def on_train_result(self, *, algorithm, result, **kwargs):
        result["callback_ok"] = True

    @staticmethod
    def _obs(episode):
        agents = episode.get_agents()
        return episode.last_raw_obs_for(agents[0])


class FailingEpisodeEnd(DefaultCallbacks):
    def on_episode_end(self, **kwargs):
        raise KeyError("no such metric")


class ExitOnceAtIterationTwo(DefaultCallbacks):
    """Ends the run's process at its second result, once: a dead Tune trial for Tune's fault
    tolerance to restore from its last checkpoint. A marker file in the run's logdir (which a
    restored trial keeps) makes it once."""

    def on_train_result(self, *, algorithm, result, **kwargs):
        marker = os.path.join(algorithm.logdir, "exited-once")
        if result["training_iteration"] == 2 and not os.path.exists(marker):
            open(marker, "w").close()  # noqa: SIM115
            os._exit(1)


class NodesOfTheRun(DefaultCallbacks):
    """Puts the Ray node ids of the driver and of the actors (Ray backend) in each result, as
    `node_ids`: where a Tune trial's parts run on a cluster."""

    def on_train_result(self, *, algorithm, result, **kwargs):
        import ray

        result["node_ids"] = {
            "driver": ray.get_runtime_context().get_node_id(),
            "actors": sorted(set(algorithm.actors.workers.node_ids().values())),
        }
