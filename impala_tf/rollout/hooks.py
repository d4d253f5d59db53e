"""The callbacks' episodes: one `impala_tf.config.callbacks.Episode` per env of a runner, and
the episode hooks (`on_episode_start`, `on_episode_step`, `on_episode_end`) called on them.

Both env runners keep a `HookEpisodes` and feed it what each env step saw; the runners only say
what an agent saw and did (the single-agent runner has one agent, `"agent0"`, per env; the
multi-agent runner each agent that has an observation). It is used only when the callbacks
class overrides an episode hook (`Callbacks.episodes`); without one nothing here runs. Per env
and step the order is: `record` (actions, rewards, length), then `step` or `end`, then, after an
episode ended or was dropped, `start` of the env's next episode. The finished episode's
`custom_metrics` and `hist_data` (`end`'s result) travel with its record.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from impala_tf.config.callbacks import Episode as CallbackEpisode

__all__ = ["HookEpisodes", "Seen"]

#: What an agent saw: (agent id, raw observation, filtered observation, info or None, policy id
#: or None); `Episode.observe`'s arguments.
Seen = tuple[Any, Any, Any, Any, Any]


class HookEpisodes:
    """The callbacks' `Episode` of each env of `runner`, and the episode hooks called on them.

    Args:
      runner: The env runner (a `RunnerBase`): its `callbacks`, `worker_index`, `base_env` and
        `policy_map` are what the hooks get.
    """

    def __init__(self, runner: Any):
        self._runner = runner
        self._callbacks = runner.callbacks
        self._count = 0  # Episodes made so far: a unique id within the run.
        #: Each env's current `Episode`; None until `start` (and after `clear`).
        self.episodes: list[CallbackEpisode] | None = None

    @property
    def running(self) -> bool:
        """Whether the envs' episodes have been started (and not cleared since)."""
        return self.episodes is not None

    @property
    def wanted(self) -> bool:
        """An episode hook is overridden but the envs' episodes are not started yet."""
        return self._callbacks.episodes and self.episodes is None

    def clear(self) -> None:
        """Forgets every env's episode (the envs were reset or replaced): they start again."""
        self.episodes = None

    def _call(self, hook: str, episode: CallbackEpisode, j: int) -> None:
        runner = self._runner
        self._callbacks(
            hook,
            episode=episode,
            env_index=j,
            worker=runner,
            base_env=runner.base_env,
            policies=runner.policy_map,
        )

    def start(self, j: int, seen: Iterable[Seen]) -> None:
        """Starts env j's next episode: a new `Episode` that has `seen` its first observations;
        calls `on_episode_start`. Env j is the next env to start, or one already started."""
        self._count += 1
        episode_id = self._runner.worker_index * 1_000_000_000 + self._count
        episode = CallbackEpisode(episode_id, j, self._runner.worker_index)
        _observe(episode, seen)
        if self.episodes is None:
            self.episodes = []
        if j == len(self.episodes):
            self.episodes.append(episode)
        else:
            self.episodes[j] = episode
        self._call("on_episode_start", episode, j)

    def record(
        self, j: int, acted: Iterable[tuple[Any, Any, str]], rewards: Mapping[Any, float]
    ) -> None:
        """Records one step of env j: `acted` holds (agent id, action, policy id) of each agent
        that acted, `rewards` {agent id: reward}; the episode's length grows by one."""
        episode = self.episodes[j]
        for agent, action, pid in acted:
            episode.act(agent, action, pid)
        for agent, reward in rewards.items():
            episode.reward(agent, reward)
        episode.length += 1

    def step(self, j: int, seen: Iterable[Seen]) -> None:
        """Env j's recorded step did not end its episode: observes `seen`; `on_episode_step`."""
        episode = self.episodes[j]
        _observe(episode, seen)
        self._call("on_episode_step", episode, j)

    def end(self, j: int, seen: Iterable[Seen]) -> tuple[dict[str, float], dict[str, list]]:
        """Env j's recorded step ended its episode: observes `seen` (the final observations);
        calls `on_episode_end`. Returns the episode's (custom metrics, hist data)."""
        episode = self.episodes[j]
        _observe(episode, seen)
        self._call("on_episode_end", episode, j)
        return episode.finished()


def _observe(episode: CallbackEpisode, seen: Iterable[Seen]) -> None:
    for agent, raw, obs, info, pid in seen:
        episode.observe(agent, raw, obs, info, pid)
