"""RLlib's algorithm callbacks: `DefaultCallbacks`, the episodes they see, custom metrics.

The `callbacks` config key (RLlib's; `config.callbacks(MyCallbacks)`) takes a subclass of
`DefaultCallbacks`, an import path to one (`"package.module:MyCallbacks"`), or a list of them
(`make_multi_callbacks`). Each hook runs where RLlib runs it:

* in every env runner (the actors, local processes or Ray workers, and the driver's
  evaluation runner), one instance per runner: `on_episode_start` after an env's reset,
  `on_episode_step` after each step that does not end the episode, `on_episode_end` after the
  step that ends it (a multi-agent episode, or the whole game of an Atari env with episodic
  life), `on_sample_end` with each fragment's batch before it is sent;
* in the driver, one instance: `on_algorithm_init` once the algorithm is built,
  `on_train_result` with each `train()` result (it may add keys), `on_evaluate_start` and
  `on_evaluate_end` around each evaluation.

An episode hook gets the `Episode` of its env: `custom_metrics` (name -> number, summarised in
the result dict's `custom_metrics` as `<name>_mean`, `_min` and `_max` over the smoothing window
of episodes, as RLlib's), `hist_data` (name -> list of numbers, concatenated over the window in
`hist_stats`), `user_data` (anything, kept for the episode), and what the env returned last
(`last_observation_for`, `last_raw_obs_for`, `last_info_for`, `last_action_for`,
`last_reward_for`). Hooks receive their arguments by keyword; write `**kwargs` for the rest.

A hook that raises stops the run: `CallbackError` names the hook and the callbacks class (an
actor's error is fatal, so it is not restarted). A class that defines a hook of RLlib's that
impala_tf never calls (`on_learn_on_batch`, `on_postprocess_trajectory`, ...) is refused when
the algorithm is built, rather than silently ignored.

This module imports numpy only.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from impala_tf.config.portable import Portable, portable

__all__ = [
    "CallbackError",
    "Callbacks",
    "DefaultCallbacks",
    "Episode",
    "HOOKS",
    "MultiCallbacks",
    "custom_metric_stats",
    "hist_stats",
    "make_multi_callbacks",
    "resolve_callbacks",
    "AGENT_ID",
]

#: The single-agent env's agent id in an `Episode` (RLlib's `_DUMMY_AGENT_ID`).
AGENT_ID = "agent0"

#: The hooks that run in the env runners.
EPISODE_HOOKS = ("on_episode_start", "on_episode_step", "on_episode_end")
RUNNER_HOOKS = (*EPISODE_HOOKS, "on_sample_end")
#: The hooks that run in the driver.
DRIVER_HOOKS = ("on_algorithm_init", "on_train_result", "on_evaluate_start", "on_evaluate_end")
#: Every hook `DefaultCallbacks` defines and impala_tf calls.
HOOKS = (*RUNNER_HOOKS, *DRIVER_HOOKS)
#: RLlib hooks (old API stack) that have no place here: refused when a class defines them.
UNCALLED_HOOKS = (
    "on_sub_environment_created",
    "on_episode_created",
    "on_postprocess_trajectory",
    "on_learn_on_batch",
    "on_create_policy",
    "on_workers_recreated",
    "on_env_runners_recreated",
    "on_checkpoint_loaded",
)


class CallbackError(RuntimeError):
    """A callback hook raised: the message names the hook, the class and the error.

    `fatal`: an actor whose hook raised is not restarted (`impala_tf.workers.RestartPolicy`);
    the same hook would raise again.
    """

    fatal = True


class DefaultCallbacks:
    """RLlib's `DefaultCallbacks`: override the hooks you need (see the module docstring).

    Every hook takes keyword arguments only and returns nothing.
    """

    def on_algorithm_init(self, *, algorithm: Any, **kwargs: Any) -> None:
        """The algorithm was built (`algorithm`: the `impala_tf.Impala`)."""

    def on_episode_start(
        self, *, worker: Any, base_env: Any, policies: Mapping, episode: Episode,
        env_index: int | None = None, **kwargs: Any,
    ) -> None:  # fmt: skip
        """An env was reset; `episode` has its first observation and length 0."""

    def on_episode_step(
        self, *, worker: Any, base_env: Any, policies: Mapping | None = None, episode: Episode,
        env_index: int | None = None, **kwargs: Any,
    ) -> None:  # fmt: skip
        """An env stepped and its episode goes on."""

    def on_episode_end(
        self, *, worker: Any, base_env: Any, policies: Mapping, episode: Episode,
        env_index: int | None = None, **kwargs: Any,
    ) -> None:  # fmt: skip
        """An env's episode ended; set `episode.custom_metrics` here."""

    def on_sample_end(self, *, worker: Any, samples: Any, **kwargs: Any) -> None:
        """An env runner cut a fragment: `samples` is its `SampleBatch` (a `MultiAgentBatch`
        for multi-agent envs), before it is sent."""

    def on_train_result(self, *, algorithm: Any, result: dict, **kwargs: Any) -> None:
        """`train()` produced `result` (changes to it are returned)."""

    def on_evaluate_start(self, *, algorithm: Any, **kwargs: Any) -> None:
        """`evaluate()` is about to run."""

    def on_evaluate_end(self, *, algorithm: Any, evaluation_metrics: dict, **kwargs: Any) -> None:
        """`evaluate()` produced `evaluation_metrics`."""


class MultiCallbacks(DefaultCallbacks):
    """Runs each hook of several callbacks classes in turn (`make_multi_callbacks`)."""

    classes: tuple[type, ...] = ()

    def __init__(self) -> None:
        self.callbacks = [cls() for cls in self.classes]

    def _each(self, hook: str, kwargs: dict[str, Any]) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(**kwargs)

    def on_algorithm_init(self, **kwargs: Any) -> None:
        self._each("on_algorithm_init", kwargs)

    def on_episode_start(self, **kwargs: Any) -> None:
        self._each("on_episode_start", kwargs)

    def on_episode_step(self, **kwargs: Any) -> None:
        self._each("on_episode_step", kwargs)

    def on_episode_end(self, **kwargs: Any) -> None:
        self._each("on_episode_end", kwargs)

    def on_sample_end(self, **kwargs: Any) -> None:
        self._each("on_sample_end", kwargs)

    def on_train_result(self, **kwargs: Any) -> None:
        self._each("on_train_result", kwargs)

    def on_evaluate_start(self, **kwargs: Any) -> None:
        self._each("on_evaluate_start", kwargs)

    def on_evaluate_end(self, **kwargs: Any) -> None:
        self._each("on_evaluate_end", kwargs)


def make_multi_callbacks(classes: Sequence[type]) -> type:
    """RLlib's `make_multi_callbacks`: one class whose hooks call those of `classes` in order."""
    return type("MultiCallbacks", (MultiCallbacks,), {"classes": tuple(classes)})


class Episode:
    """An ongoing episode as the episode hooks see it (RLlib's `Episode`).

    Attributes:
      episode_id: Unique within the run (worker index and a counter).
      env_id: The env's index within its runner (`env_index`).
      worker_index: The runner's index (0: the driver's evaluation runner).
      length: Env steps taken in this episode.
      total_reward: The sum of its rewards (all agents; unclipped).
      agent_rewards: {(agent_id, policy_id): sum of that agent's rewards}.
      custom_metrics: {name: number}, summarised in the result dict.
      hist_data: {name: list of numbers}, concatenated in the result dict's `hist_stats`.
      user_data: Anything the hooks keep for the episode.
      media: {name: object}, kept for the hooks' own use.
    """

    def __init__(self, episode_id: int, env_id: int, worker_index: int):
        self.episode_id = int(episode_id)
        self.env_id = int(env_id)
        self.worker_index = int(worker_index)
        self.length = 0
        self.total_reward = 0.0
        self.agent_rewards: dict[tuple[Any, str], float] = collections.defaultdict(float)
        self.custom_metrics: dict[str, Any] = {}
        self.hist_data: dict[str, list] = {}
        self.user_data: dict[str, Any] = {}
        self.media: dict[str, Any] = {}
        self._obs: dict[Any, Any] = {}
        self._raw_obs: dict[Any, Any] = {}
        self._infos: dict[Any, Any] = {}
        self._actions: dict[Any, Any] = {}
        self._rewards: dict[Any, float] = {}
        self._policies: dict[Any, str] = {}

    # What the env returned ------------------------------------------------------------------

    def last_observation_for(self, agent_id: Any = AGENT_ID) -> Any:
        """The agent's last observation, after the observation filter."""
        return self._obs.get(agent_id)

    def last_raw_obs_for(self, agent_id: Any = AGENT_ID) -> Any:
        """The agent's last observation as the env returned it."""
        return self._raw_obs.get(agent_id)

    def last_info_for(self, agent_id: Any = AGENT_ID) -> dict | None:
        """The agent's last info dict."""
        return self._infos.get(agent_id)

    def last_action_for(self, agent_id: Any = AGENT_ID) -> Any:
        """The agent's last action (as the policy chose it), None before its first."""
        return self._actions.get(agent_id)

    def last_reward_for(self, agent_id: Any = AGENT_ID) -> float:
        """The agent's last reward (0.0 before its first step)."""
        return self._rewards.get(agent_id, 0.0)

    def policy_for(self, agent_id: Any = AGENT_ID) -> str | None:
        """The policy the agent acts with."""
        return self._policies.get(agent_id)

    def get_agents(self) -> list:
        """The agents seen so far in this episode."""
        return list(self._raw_obs)

    # Recording (the runners) ----------------------------------------------------------------

    def observe(
        self, agent_id: Any, raw_obs: Any, obs: Any, info: Any = None, policy_id: Any = None
    ) -> None:
        self._raw_obs[agent_id] = raw_obs
        self._obs[agent_id] = obs
        if info is not None:
            self._infos[agent_id] = info
        if policy_id is not None:
            self._policies[agent_id] = policy_id

    def act(self, agent_id: Any, action: Any, policy_id: str) -> None:
        self._actions[agent_id] = action
        self._policies[agent_id] = policy_id

    def reward(self, agent_id: Any, reward: float) -> None:
        reward = float(reward)
        self._rewards[agent_id] = reward
        self.total_reward += reward
        self.agent_rewards[(agent_id, self._policies.get(agent_id))] += reward

    def finished(self) -> tuple[dict[str, float], dict[str, list]]:
        """What the episode's record carries: (custom metrics, hist data), as plain data."""
        metrics = {str(k): _number(v) for k, v in self.custom_metrics.items()}
        hist = {str(k): [float(x) for x in np.ravel(v)] for k, v in self.hist_data.items()}
        return metrics, hist


def _number(value: Any) -> float:
    array = np.asarray(value, np.float64)
    return float(array) if array.ndim == 0 else float(np.mean(array))


def resolve_callbacks(value: Any) -> Portable | None:
    """The `callbacks` setting as a `Portable` class (None: no callbacks).

    Raises:
      ValueError: naming `callbacks_class`, for a value that is not a `DefaultCallbacks` subclass
        (or an import path or list of them), or a class that defines a hook impala_tf does not
        call.
    """
    if value is None or value is DefaultCallbacks:
        return None
    if isinstance(value, (list, tuple)):
        members = [resolve_callbacks(v) for v in value]
        value = make_multi_callbacks([m.obj for m in members if m is not None])
    resolved = portable(value, "callbacks_class")
    cls = resolved.obj
    if not (isinstance(cls, type) and issubclass(cls, DefaultCallbacks)):
        raise ValueError(
            f"`callbacks_class` (RLlib's `callbacks`) must be a subclass of "
            f"impala_tf.DefaultCallbacks, or an import path to one; got {cls!r}."
        )
    members = cls.classes if issubclass(cls, MultiCallbacks) else (cls,)
    for member in members:
        uncalled = [h for h in UNCALLED_HOOKS if hasattr(member, h)]
        if uncalled:
            raise ValueError(
                f"`callbacks_class` {member.__name__} defines {', '.join(uncalled)}, which "
                f"impala_tf does not call (it calls {', '.join(HOOKS)}). Remove them, or do "
                "their work in one of those."
            )
    return resolved


class Callbacks:
    """One callbacks instance and the hooks it overrides, called with errors named.

    Args:
      spec: The resolved `callbacks` class (None: no callbacks; every call is a no-op).
      where: Where the instance runs ("actor 2", "the driver"), for messages.
    """

    def __init__(self, spec: Portable | None, where: str = "the driver"):
        self.cls = spec.obj if spec is not None else None
        self.where = where
        self.instance = self.cls() if self.cls is not None else None
        overridden = set()
        if self.cls is not None:
            multi = issubclass(self.cls, MultiCallbacks)
            members = self.cls.classes if multi else (self.cls,)
            for hook in HOOKS:
                if any(getattr(m, hook) is not getattr(DefaultCallbacks, hook) for m in members):
                    overridden.add(hook)
        self.hooks = frozenset(overridden)

    @property
    def episodes(self) -> bool:
        """Some episode hook is overridden: the runner keeps `Episode`s."""
        return bool(self.hooks & set(EPISODE_HOOKS))

    def __contains__(self, hook: str) -> bool:
        return hook in self.hooks

    def __call__(self, hook: str, **kwargs: Any) -> None:
        """Calls `hook` if overridden.

        Raises:
          CallbackError: the hook raised; names the hook, the class and where it ran.
        """
        if hook not in self.hooks:
            return
        try:
            getattr(self.instance, hook)(**kwargs)
        except Exception as e:
            raise CallbackError(
                f"callbacks {self.cls.__name__}.{hook} raised in {self.where}: "
                f"{type(e).__name__}: {e}"
            ) from e


# The result dict ----------------------------------------------------------------------------


def custom_metric_stats(episodes: Iterable[Any]) -> dict[str, float]:
    """RLlib's `custom_metrics` of finished episodes: `<name>_mean`, `_min`, `_max` per metric.

    NaN values are left out, as RLlib's; a metric whose values are all NaN gives a NaN mean
    and NaN min and max.
    """
    values: dict[str, list[float]] = collections.defaultdict(list)
    for episode in episodes:
        for name, value in (episode.custom_metrics or {}).items():
            values[name].append(value)
    out: dict[str, float] = {}
    for name in sorted(values):
        kept = [v for v in values[name] if not math.isnan(v)]
        out[f"{name}_mean"] = float(np.mean(kept)) if kept else math.nan
        out[f"{name}_min"] = float(np.min(kept)) if kept else math.nan
        out[f"{name}_max"] = float(np.max(kept)) if kept else math.nan
    return out


def hist_stats(episodes: Sequence[Any], policy_ids: Iterable[str] = ()) -> dict[str, list]:
    """RLlib's `hist_stats` of finished episodes: `episode_reward`, `episode_lengths`,
    `policy_<id>_reward` per policy in `policy_ids` (multi-agent), and each `hist_data` name
    concatenated over the episodes."""
    out: dict[str, list] = {
        "episode_reward": [float(e.ret) for e in episodes],
        "episode_lengths": [int(e.length) for e in episodes],
    }
    for pid in policy_ids:
        out[f"policy_{pid}_reward"] = [
            float(r) for e in episodes for r in e.policy_returns.get(pid, ())
        ]
    for episode in episodes:
        for name, values in (episode.hist_data or {}).items():
            out.setdefault(name, []).extend(values)
    return out
