"""Atari: detection, lazy registration and RLlib's DeepMind preprocessing (`preprocessor_pref`).

RLlib's old API stack wraps every Atari env in `wrap_deepmind` when `preprocessor_pref` is
"deepmind" (its default) and switches `clip_rewards` on when the user left it None. impala_tf does
the same, on one of two paths that give the same observations:

* `AtariVectorEnv` (ale-py's native, threaded vector env; `impala_tf.envs.atari_vector`) when
  its options cover the config (`vector_env_kwargs`), and
* `DeepMindPreprocessing`, a gymnasium wrapper (numpy and OpenCV) around one `gym.make` env,
  everywhere else (evaluation, v5 ids that skip frames themselves, env creators, ...).

The wrapper reproduces the vector env's C++ preprocessing step for step, so the two paths agree
bit for bit given the same number of reset no-ops (`tests/atari_test.py`). What one agent step is,
for an env that does not skip frames itself (`*NoFrameskip-v4`, `ALE/*-v5` with `frameskip: 1`):

* action repeat 4, reward summed over the 4 frames, observation = pixel-wise max of the last two
  frames (DeepMind's flicker fix; RLlib's `MaxAndSkipEnv`); an env that already skips frames
  (`ALE/*-v5` defaults to 4) is stepped once per agent step, without max-pooling, as RLlib does;
* frames in ALE's grayscale palette (RLlib's `WarpFrame` always grays, with OpenCV's `RGB2GRAY`,
  which gave the same bytes as ALE's palette on the Breakout frames we compared), resized to
  `model.dim` x `model.dim` with OpenCV's `INTER_AREA` (as RLlib's `resize`);
* `model.framestack` True (RLlib's default) stacks the last 4 frames on the channel axis
  (`[dim, dim, 4]`, RLlib's `FrameStack(env, 4)`); False gives one frame `[dim, dim, 1]`;
  a reset fills the stack with copies of the first frame;
* reset: `reset_game`, then 1 to `noop_max`=30 single-frame NOOPs (RLlib's `NoopResetEnv`); in
  games whose minimal action set has FIRE, the last of them is replaced by one frame of FIRE
  (RLlib's `FireResetEnv` presses FIRE and then action 2 for a whole agent step each; the vector
  env's single FIRE frame is what both our paths do);
* episodic life, for training only (env runners with `worker_index >= 1`; evaluation sees whole
  games): a lost life ends the *training* episode (`terminated=True`, so V-trace does not
  bootstrap through it) while the game goes on. In games with FIRE and lives (Breakout, Space
  Invaders, ...) the game then goes on as in RLlib: a NOOP step (`EpisodicLifeEnv`), then FIRE
  and action 2 (`FireResetEnv`), hidden from the agent, and a refilled frame stack, so that the
  next ball is served whatever the policy does. ale-py's vector env cannot do that (its own
  `episodic_life` option restarts the game; its `life_loss_info` continues with the next frame),
  so those games train on the wrapper path; in the others (no FIRE, or no lives, like Pong) the
  next observation simply continues the game on both paths.
  `info["game_over"]` tells a real game end from a life loss; the env runner reports episode
  returns and lengths per game (all lives, unclipped rewards), as RLlib's `MonitorEnv` does, so
  `episode_reward_mean` compares with published Atari scores;
* rewards come out unclipped; the env runner clips them for training, to their sign by default
  (`clip_rewards=None` means True for Atari, as in RLlib).

Observations are uint8 `[dim, dim, k]` (channels last, as RLlib's) from the env to the fragment.
`model.grayscale` is not used here: RLlib's DeepMind path always grays (the key belongs to its
"rllib" preprocessor, which impala_tf does not implement); `DeepMindPreprocessing(grayscale=False)`
gives colour `[dim, dim, 3k]` frames to code that asks for them.
"""

from __future__ import annotations

import collections
import os
from typing import Any

import gymnasium as gym
import numpy as np

__all__ = [
    "DEEPMIND",
    "PREPROCESSOR_PREFS",
    "DeepMindPreprocessing",
    "ensure_registered",
    "is_atari",
    "make_atari_env",
    "vector_env_kwargs",
    "wrap_deepmind",
]

DEEPMIND = "deepmind"
#: Values of `preprocessor_pref`: "deepmind" wraps Atari envs; "rllib" and None leave them raw.
PREPROCESSOR_PREFS = (DEEPMIND, "rllib", None)
#: Action repeat applied to envs that do not skip frames themselves (DeepMind's and RLlib's 4).
FRAME_SKIP = 4
NOOP_MAX = 30
#: Frames stacked when `model.framestack` is True (RLlib's `FrameStack(env, 4)`).
STACK = 4
_ATARI_ENTRY_POINT = "ale_py.env:AtariEnv"


def ensure_registered(env_id: str) -> None:
    """Registers ale-py's envs with gymnasium when `env_id` may be one of them.

    Registration is lazy so that CartPole runs never import ale-py: it happens for `ALE/...`
    ids and for ids gymnasium does not know yet (`PongNoFrameskip-v4` and the other v0/v4 ids).
    """
    if not env_id.startswith("ALE/") and env_id in gym.registry:
        return
    try:
        import ale_py
    except ImportError:
        return
    gym.register_envs(ale_py)


def is_atari(env: str | gym.Env, env_config: dict | None = None) -> bool:
    """Whether `env` is an ale-py Atari env with image observations.

    Args:
      env: A gymnasium id (registered lazily, see `ensure_registered`) or an env object.
      env_config: The `gym.make` kwargs for an id; `obs_type: ram` makes it not an image env.

    Returns:
      True for ale-py `AtariEnv`s whose observations are images (RLlib's `is_atari`: an ALE env
      whose observation rank is above 2).
    """
    if isinstance(env, str):
        ensure_registered(env)
        spec = gym.registry.get(env)
        if spec is None or spec.entry_point != _ATARI_ENTRY_POINT:
            return False
        obs_type = (env_config or {}).get("obs_type", spec.kwargs.get("obs_type", "rgb"))
        return obs_type != "ram"
    if isinstance(env, gym.Env):
        shape = getattr(env.observation_space, "shape", None)
        if shape is None or len(shape) <= 2:
            return False
        return hasattr(env.unwrapped, "ale")
    raise TypeError(f"`is_atari` takes a gymnasium id or a gym.Env, got {env!r}.")


def _can_serve(meanings: list[str]) -> bool:
    """Whether RLlib's `FireResetEnv` applies: FIRE and at least 3 actions (FIRE, then action 2)."""
    return "FIRE" in meanings and len(meanings) >= 3


def _serves_after_life_loss(env_id: str, env_config: dict | None) -> bool:
    """Whether the game can serve and has lives: the wrapper serves after each lost life."""
    env = gym.make(env_id, **{**(env_config or {}), "obs_type": "grayscale"})
    try:
        ale = env.unwrapped
        return _can_serve(ale.get_action_meanings()) and ale.ale.lives() > 0
    finally:
        env.close()


def make_atari_env(env_id: str, spec: Any, training: bool) -> gym.Env:
    """`gym.make(env_id, **env_config)`, wrapped in `DeepMindPreprocessing` when enabled.

    With preprocessing, the raw env is asked for ALE's grayscale screen (`obs_type="grayscale"`,
    a third of the RGB bytes and the same palette as the vector env) unless `env_config` sets
    `obs_type` itself (RGB screens are then grayed with OpenCV's luma weights).

    Args:
      env_id: A registered ale-py id.
      spec: The run's `impala_tf.envs.make.EnvSpec` (`env_config`, `deepmind`, `dim`,
        `frame_stack`).
      training: Episodic life on (env runners) or off (evaluation).
    """
    kwargs = dict(spec.env_config)
    if not spec.deepmind:
        return gym.make(env_id, **kwargs)
    kwargs.setdefault("obs_type", "grayscale")
    return wrap_deepmind(gym.make(env_id, **kwargs), spec.dim, spec.frame_stack, training)


def wrap_deepmind(env: gym.Env, dim: int, stack: int, training: bool) -> DeepMindPreprocessing:
    """RLlib's `wrap_deepmind(env, dim=model["dim"], framestack=model["framestack"])`, our way.

    Action repeat 4 with max-pooling applies only when the env does not skip frames itself
    (its `frameskip` is 1), as RLlib's `noframeskip` argument says.
    """
    frameskip = getattr(env.unwrapped, "_frameskip", 1)
    skip = FRAME_SKIP if frameskip == 1 else 1
    return DeepMindPreprocessing(
        env,
        dim=int(dim),
        stack=int(stack),
        frame_skip=skip,
        noop_max=NOOP_MAX,
        episodic_life=training,
    )


class DeepMindPreprocessing(gym.Wrapper):
    """DeepMind Atari preprocessing of one ale-py env, identical to ale-py's vector env.

    Observations are uint8 `[dim, dim, stack]` (gray) or `[dim, dim, 3 * stack]` (colour).
    `info["game_over"]` is True when the game itself ended (or was truncated), False when only a
    life was lost (`episodic_life`). After a life loss, `reset()` continues the game: it returns
    the current observation without stepping or, in games with FIRE (`fire_after_life_loss`),
    after RLlib's NOOP, FIRE and action-2 steps, which serve the next ball. Without episodic life
    (whole games, evaluation) the same steps follow a lost life inside `step`.

    Args:
      env: An ale-py `AtariEnv` (any wrappers) with `obs_type` "grayscale" or "rgb".
      dim: Output height and width (`model.dim`).
      stack: Frames stacked on the channel axis (4 when `model.framestack` is True, else 1).
      frame_skip: Action repeat per agent step (4 when the env does not skip frames itself).
      noop_max: Resets take 1 to `noop_max` NOOP frames (one fewer, plus FIRE, in FIRE games).
      episodic_life: End the episode (`terminated`) at each life loss, for training.
      grayscale: Gray frames (RLlib's DeepMind path); False keeps RGB.
      fire_reset: Press FIRE on reset in games whose action set has FIRE.
      fire_after_life_loss: With `fire_reset`, also serve again after a lost life, as RLlib's
        `FireResetEnv` does (it wraps `EpisodicLifeEnv`). ale-py's vector env cannot, so False
        gives its observations (`vector_env_kwargs`).
    """

    def __init__(
        self,
        env: gym.Env,
        *,
        dim: int = 84,
        stack: int = STACK,
        frame_skip: int = FRAME_SKIP,
        noop_max: int = NOOP_MAX,
        episodic_life: bool = False,
        grayscale: bool = True,
        fire_reset: bool = True,
        fire_after_life_loss: bool = True,
    ):
        super().__init__(env)
        for name, value, low in (
            ("dim", dim, 1), ("stack", stack, 1), ("frame_skip", frame_skip, 1),
            ("noop_max", noop_max, 1),
        ):  # fmt: skip
            if not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}.")
        if not hasattr(env.unwrapped, "ale"):
            raise TypeError(f"DeepMindPreprocessing needs an ale-py Atari env, got {env!r}.")
        raw_shape = env.observation_space.shape
        if raw_shape is None or len(raw_shape) not in (2, 3):
            raise ValueError(
                f"DeepMindPreprocessing needs image observations (obs_type 'grayscale' or "
                f"'rgb'), got observation shape {raw_shape}."
            )
        self.dim, self.stack, self.frame_skip = int(dim), int(stack), int(frame_skip)
        self.noop_max, self.episodic_life, self.grayscale = int(noop_max), episodic_life, grayscale
        self._rgb_input = len(raw_shape) == 3
        if not grayscale and not self._rgb_input:
            raise ValueError("grayscale=False needs an env made with obs_type='rgb'.")
        meanings = env.unwrapped.get_action_meanings()
        self._fire = meanings.index("FIRE") if fire_reset and "FIRE" in meanings else None
        # Whether a lost life is followed by a serve (needs `fire_reset`, as in RLlib).
        self._serves = bool(fire_after_life_loss and fire_reset) and _can_serve(meanings)
        channels = self.stack if grayscale else 3 * self.stack
        self.observation_space = gym.spaces.Box(0, 255, (self.dim, self.dim, channels), np.uint8)
        frame_shape = raw_shape[:2] if grayscale else raw_shape
        # The last two raw frames of a step; [0] also keeps the previous max, as ale-py's does.
        self._raw = np.zeros((2, *frame_shape), np.uint8)
        self._frames: collections.deque[np.ndarray] = collections.deque(maxlen=self.stack)
        self._lives = 0
        self._game_over = True
        # Whether the last reset or step refilled the stack (`impala_tf.models.frames`).
        self.stack_refilled = True

    @property
    def frame_stack(self) -> tuple[int, int] | None:
        """(k, s): k frames of s channels per observation (`impala_tf.models.frames`); None for
        k = 1."""
        return (self.stack, 1 if self.grayscale else 3) if self.stack > 1 else None

    # Frames -----------------------------------------------------------------------------------

    def _screen(self, obs: np.ndarray) -> np.ndarray:
        if self.grayscale and self._rgb_input:
            import cv2

            return cv2.cvtColor(np.asarray(obs, np.uint8), cv2.COLOR_RGB2GRAY)
        return np.asarray(obs, np.uint8)

    def _push(self, pool: bool) -> None:
        import cv2

        frame = np.maximum(self._raw[0], self._raw[1], out=self._raw[0]) if pool else self._raw[1]
        if frame.shape[:2] != (self.dim, self.dim):
            frame = cv2.resize(frame, (self.dim, self.dim), interpolation=cv2.INTER_AREA)
        self._frames.append(np.array(frame, np.uint8))

    def _observation(self) -> np.ndarray:
        if self.grayscale:
            return np.stack(self._frames, axis=-1)
        return np.concatenate(self._frames, axis=-1)

    # gym.Env ----------------------------------------------------------------------------------

    def reset(
        self, *, seed: int | None = None, options: dict | None = None
    ) -> tuple[np.ndarray, dict]:
        """Starts a new game, or after a life loss (`episodic_life`) continues the current one."""
        self.stack_refilled = False
        if not self._game_over and seed is None:
            if self._serves:
                self._serve_again()
            if not self._game_over:
                return self._observation(), {"game_over": False, "lives": self._lives}
        obs, info = self.env.reset(seed=seed, options=options)
        noops = int(self.env.unwrapped.np_random.integers(0, self.noop_max)) + 1
        noops -= self._fire is not None
        for _ in range(noops):
            obs, _, terminated, truncated, info = self.env.step(0)
            if terminated or truncated:
                obs, info = self.env.reset()
        if self._fire is not None:
            obs, _, terminated, truncated, info = self.env.step(self._fire)
            if terminated or truncated:
                obs, info = self.env.reset()
        self._raw[0] = 0
        self._raw[1] = self._screen(obs)
        self._frames.clear()
        self._push(pool=self.frame_skip > 1)
        while len(self._frames) < self.stack:
            self._frames.append(self._frames[-1])
        self._lives = self.env.unwrapped.ale.lives()
        self._game_over = False
        self.stack_refilled = True
        return self._observation(), {**info, "game_over": False}

    def _serve_again(self) -> None:
        """After a lost life: RLlib's NOOP step (`EpisodicLifeEnv`), then FIRE and action 2
        (`FireResetEnv`), each a whole agent step hidden from the agent; the stack is refilled
        with the last frame (`FrameStack` on reset). Without it a policy that never presses FIRE
        (a near-deterministic start) waits forever for the next ball in games like Breakout.
        Their rewards are dropped, as RLlib drops them from training (they are 0 in the games we
        know: no ball is in play)."""
        for action in (0, self._fire, 2):
            self._act(action)
            if self._game_over:
                return
        self._frames.extend([self._frames[-1]] * (self.stack - 1))
        self.stack_refilled = True

    def _act(self, action: Any) -> tuple[float, bool, bool, dict, bool]:
        """`frame_skip` frames of `action`: (reward sum, terminated, truncated, info, life lost)."""
        total = 0.0
        terminated = truncated = False
        info: dict = {}
        for i in range(self.frame_skip):
            obs, reward, terminated, truncated, info = self.env.step(action)
            total += float(reward)
            if i >= self.frame_skip - 2:
                self._raw[i - self.frame_skip + 2] = self._screen(obs)
            if terminated or truncated:
                break
        self._push(pool=self.frame_skip > 1)
        lives = self.env.unwrapped.ale.lives()
        life_lost = lives < self._lives
        self._lives = lives
        self._game_over = bool(terminated or truncated)
        return total, bool(terminated), bool(truncated), info, life_lost

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        """One agent step: `frame_skip` frames of `action`; the reward is their sum, unclipped."""
        self.stack_refilled = False
        total, terminated, truncated, info, life_lost = self._act(action)
        if self._serves and life_lost and not self.episodic_life and not self._game_over:
            # A whole game (evaluation): serve again inside this step (training serves in reset).
            self._serve_again()
            terminated, truncated = self._game_over, False
        info = {**info, "game_over": self._game_over}
        terminated = terminated or (self.episodic_life and life_lost)
        return self._observation(), total, terminated, truncated, info


def vector_env_kwargs(
    spec: Any, training: bool, num_envs: int, fire_after_life_loss: bool = True
) -> dict[str, Any] | None:
    """`AtariVectorEnv` arguments equivalent to `make_atari_env` of `spec` (an
    `impala_tf.envs.make.EnvSpec`), or None.

    The vector env is used only where it gives the wrapper's observations: a registered ale-py
    id, DeepMind preprocessing on, an env that does not skip frames itself (its `frameskip`,
    from the id or `env_config`, is 1), and `env_config` keys among `frameskip`,
    `repeat_action_probability`, `full_action_space`, `max_num_frames_per_episode`,
    `obs_type` ("grayscale"/"rgb"). Anything else (modes, difficulties, render modes, v5's
    built-in frame skip, whose frames the vector env pools differently) takes the wrapper path.

    For training (`training`, episodic life), games with FIRE and lives take the wrapper path too:
    after a lost life the wrapper serves again as RLlib does (`DeepMindPreprocessing`'s
    `fire_after_life_loss`), which the vector env cannot. `fire_after_life_loss=False` asks for
    the vector env's behaviour instead (the paths-agree test).

    Truncation: gym's `max_num_frames_per_episode` counts emulator frames; the vector env counts
    agent steps, so it gets that number divided by the action repeat.
    """
    env = spec.env
    if not isinstance(env, str) or not spec.deepmind:
        return None
    if not is_atari(env, spec.env_config):
        return None
    registered = gym.registry[env]
    kwargs = {**registered.kwargs, **spec.env_config}
    allowed = {
        "game", "frameskip", "repeat_action_probability", "full_action_space",
        "max_num_frames_per_episode", "obs_type",
    }  # fmt: skip
    if set(kwargs) - allowed or kwargs.get("frameskip", 1) != 1:
        return None
    if registered.max_episode_steps is not None or kwargs.get("obs_type", "rgb") not in (
        "rgb",
        "grayscale",
    ):
        return None
    if training and fire_after_life_loss and _serves_after_life_loss(env, spec.env_config):
        return None
    max_frames = int(kwargs.get("max_num_frames_per_episode", 108_000))
    threads = max(1, (os.cpu_count() or 1) // max(1, int(spec.num_workers)))
    return {
        "game": kwargs["game"],
        "num_envs": int(num_envs),
        "num_threads": min(threads, int(num_envs)),
        "repeat_action_probability": float(kwargs.get("repeat_action_probability", 0.25)),
        "full_action_space": bool(kwargs.get("full_action_space", False)),
        "max_num_frames_per_episode": max(1, max_frames // FRAME_SKIP),
        "img_height": int(spec.dim),
        "img_width": int(spec.dim),
        "grayscale": True,
        "stack_num": int(spec.frame_stack),
        "frameskip": FRAME_SKIP,
        "maxpool": True,
        "noop_max": NOOP_MAX,
        "use_fire_reset": True,
        "episodic_life": False,
        "life_loss_info": bool(training),
        "reward_clipping": False,
    }
