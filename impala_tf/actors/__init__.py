"""Actors: env runners and the pools that run them (local processes by default, or Ray)."""

from impala_tf.actors.base import ActorFailure, ActorPool
from impala_tf.actors.env_runner import EnvContext, EnvRunner, Fragment, make_env

__all__ = ["ActorFailure", "ActorPool", "EnvContext", "EnvRunner", "Fragment", "make_env"]
