"""Multi-agent environments: RLlib's `MultiAgentEnv` interface, `MultiAgentCartPole`, PettingZoo.

A `MultiAgentEnv` speaks in dicts keyed by agent id (RLlib's convention):

* `reset(seed=None, options=None) -> (obs, infos)`: the agents that act first;
* `step(action_dict) -> (obs, rewards, terminateds, truncateds, infos)`: `action_dict` holds an
  action for each agent that received an observation; the returned dicts hold the agents that
  acted (their reward and done flags) and those that act next (their observation).
  `terminateds["__all__"]` / `truncateds["__all__"]` end the episode; an agent whose own flag is
  set acts no more in this episode. An agent done by a truncation (its own flag or `__all__`)
  is bootstrapped from its final observation (the one returned with the flag); a terminated one
  is not.

It subclasses `gym.Env` so that env creators and registered ids work as for single-agent envs.
`observation_space`/`action_space` are the agents' common space when all agents share one
(else the first agent's); `get_observation_space(agent_id)` / `get_action_space(agent_id)` are
per agent.

Shipped:

* `MultiAgentCartPole`: `num_agents` independent CartPole-v1 envs, agents `0..n-1`; RLlib's
  `make_multi_agent("CartPole-v1")` (episode over when every agent is done). Registered under the
  gymnasium ids `impala_tf/MultiAgentCartPole` and RLlib's class paths, so RLlib's YAML
  (`env: ray.rllib.examples.env.multi_agent.MultiAgentCartPole`) runs. `num_agents` is read from
  `env_config` or, as that YAML nests it, from `env_config["config"]`; `render_mode` is passed to
  its CartPole envs, and `render()` (with `"rgb_array"`) returns their frames side by side,
  uint8 [H, W * num_agents, 3] (`impala-evaluate --video`).
* `PettingZooParallelEnv`: wraps a PettingZoo `ParallelEnv` (the optional `pettingzoo` package);
  `render()` is the wrapped env's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import gymnasium as gym
import numpy as np

__all__ = [
    "MULTI_AGENT_CARTPOLE_IDS",
    "MultiAgentCartPole",
    "MultiAgentEnv",
    "PettingZooParallelEnv",
    "register_envs",
]

ALL = "__all__"


class MultiAgentEnv(gym.Env):
    """RLlib's multi-agent env interface (see the module docstring).

    Subclasses set `possible_agents` (list of agent ids) and `observation_spaces` /
    `action_spaces` (dicts keyed by agent id) before calling `_set_common_spaces()`.
    """

    possible_agents: list = []
    observation_spaces: dict = {}
    action_spaces: dict = {}

    def _set_common_spaces(self) -> None:
        first = self.possible_agents[0]
        self.observation_space = self.observation_spaces[first]
        self.action_space = self.action_spaces[first]

    def get_observation_space(self, agent_id: Any) -> gym.Space:
        """The observation space of `agent_id`."""
        return self.observation_spaces[agent_id]

    def get_action_space(self, agent_id: Any) -> gym.Space:
        """The action space of `agent_id`."""
        return self.action_spaces[agent_id]


class MultiAgentCartPole(MultiAgentEnv):
    """`num_agents` independent CartPole-v1 envs, one per agent (ids `0 .. num_agents-1`).

    Args:
      config: RLlib's env config: `{"num_agents": n}` (RLlib's tuned YAML nests it one level
        deeper, under `"config"`; both are read), and optionally `"render_mode"` (gymnasium's:
        None, `"rgb_array"` or `"human"`), passed to every CartPole env.
      **kwargs: Also accepted as settings (`gym.make(id, **env_config)` passes them so).
    """

    metadata = {"render_modes": ["human", "rgb_array"], "render_fps": 50}

    def __init__(self, config: Mapping[str, Any] | None = None, **kwargs: Any):
        settings = dict(config or {})
        if isinstance(settings.get("config"), Mapping):
            settings.update(settings.pop("config"))
        settings.update(kwargs)
        if isinstance(settings.get("config"), Mapping):
            settings.update(settings.pop("config"))
        num = settings.pop("num_agents", 1)
        if not isinstance(num, int) or isinstance(num, bool) or num < 1:
            raise ValueError(f"MultiAgentCartPole: `num_agents` must be an int >= 1, got {num!r}.")
        render_mode = settings.pop("render_mode", None)
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(
                f"MultiAgentCartPole: `render_mode` must be None or one of "
                f"{self.metadata['render_modes']}, got {render_mode!r}."
            )
        if settings:
            raise ValueError(f"MultiAgentCartPole: unknown env_config keys {sorted(settings)}.")
        self.render_mode = render_mode
        self.envs = [gym.make("CartPole-v1", render_mode=render_mode) for _ in range(num)]
        self.possible_agents = list(range(num))
        self.observation_spaces = {i: e.observation_space for i, e in enumerate(self.envs)}
        self.action_spaces = {i: e.action_space for i, e in enumerate(self.envs)}
        self._set_common_spaces()
        self._done: set[int] = set()

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        self._done = set()
        obs, infos = {}, {}
        for i, env in enumerate(self.envs):
            obs[i], infos[i] = env.reset(seed=None if seed is None else seed + i, options=options)
        return obs, infos

    def step(self, action_dict: Mapping[Any, Any]):
        if not action_dict:
            raise ValueError("MultiAgentCartPole.step: no action for any agent.")
        obs, rewards, terminateds, truncateds, infos = {}, {}, {}, {}, {}
        for i, action in action_dict.items():
            if i in self._done:
                raise ValueError(f"MultiAgentCartPole.step: agent {i} is done but got an action.")
            obs[i], rewards[i], terminateds[i], truncateds[i], infos[i] = self.envs[i].step(action)
            if terminateds[i] or truncateds[i]:
                self._done.add(i)
        all_done = len(self._done) == len(self.envs)
        terminateds[ALL] = all_done
        truncateds[ALL] = False
        return obs, rewards, terminateds, truncateds, infos

    def render(self) -> np.ndarray | None:
        """The agents' frames side by side (uint8 [H, W * num_agents, 3]) with `"rgb_array"`.

        Returns None without a render mode and with `"human"` (each CartPole draws its own
        window). As any gymnasium env, it raises `gymnasium.error.ResetNeeded` before `reset`.
        """
        if self.render_mode is None:
            return None
        frames = [env.render() for env in self.envs]
        if self.render_mode != "rgb_array":
            return None
        return np.concatenate(frames, axis=1)

    def close(self) -> None:
        for env in self.envs:
            env.close()


class PettingZooParallelEnv(MultiAgentEnv):
    """A PettingZoo `ParallelEnv` as a `MultiAgentEnv` (RLlib's `ParallelPettingZooEnv`).

    The episode ends when PettingZoo's `agents` list is empty after a step; `__all__` is a
    termination unless every agent that was still active was truncated.

    Args:
      env: A `pettingzoo.ParallelEnv`.
    """

    def __init__(self, env: Any):
        try:
            from pettingzoo import ParallelEnv
        except ImportError as e:  # pragma: no cover - depends on the optional extra.
            raise ImportError(
                "PettingZoo envs need the `pettingzoo` package "
                "(pip install 'impala_tf[pettingzoo]')."
            ) from e
        if not isinstance(env, ParallelEnv):
            raise TypeError(
                f"PettingZooParallelEnv wraps a pettingzoo.ParallelEnv, got {type(env).__name__} "
                "(convert an AEC env with pettingzoo.utils.conversions.aec_to_parallel)."
            )
        self.par_env = env
        self.metadata = {**self.metadata, **(getattr(env, "metadata", None) or {})}
        self.render_mode = getattr(env, "render_mode", None)
        self.possible_agents = list(env.possible_agents)
        self.observation_spaces = {a: env.observation_space(a) for a in self.possible_agents}
        self.action_spaces = {a: env.action_space(a) for a in self.possible_agents}
        self._set_common_spaces()

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        obs, infos = self.par_env.reset(seed=seed, options=options)
        return dict(obs), dict(infos or {})

    def step(self, action_dict: Mapping[Any, Any]):
        obs, rewards, terms, truncs, infos = self.par_env.step(dict(action_dict))
        terminateds, truncateds = dict(terms), dict(truncs)
        ended = not self.par_env.agents
        stepped = list(action_dict)
        all_truncated = bool(stepped) and all(truncateds.get(a, False) for a in stepped)
        terminateds[ALL] = ended and not all_truncated
        truncateds[ALL] = ended and all_truncated
        # Agents done by this step get no further observation to act on.
        obs = {a: o for a, o in obs.items() if a in stepped or a in self.par_env.agents}
        return obs, dict(rewards), terminateds, truncateds, dict(infos or {})

    def render(self) -> Any:
        """The wrapped env's `render()` (a frame with its `render_mode` "rgb_array")."""
        return self.par_env.render()

    def close(self) -> None:
        self.par_env.close()


#: Gymnasium ids under which `MultiAgentCartPole` is registered (RLlib's class paths included).
MULTI_AGENT_CARTPOLE_IDS = (
    "impala_tf/MultiAgentCartPole",
    "ray.rllib.examples.env.multi_agent.MultiAgentCartPole",
    "ray.rllib.examples.envs.classes.multi_agent.MultiAgentCartPole",
)


def register_envs() -> None:
    """Registers `MultiAgentCartPole` under `MULTI_AGENT_CARTPOLE_IDS` (no wrappers added)."""
    for env_id in MULTI_AGENT_CARTPOLE_IDS:
        if env_id not in gym.registry:
            gym.register(
                env_id,
                entry_point="impala_tf.multi_agent.env:MultiAgentCartPole",
                disable_env_checker=True,
                order_enforce=False,
            )
