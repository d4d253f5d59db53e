"""The actor's side of central inference: an acting policy whose forward pass runs in the driver.

`RemotePolicy` is an acting policy whose forward pass runs in the driver's `InferenceServer`
(`impala_tf.acting.inference`), over the connection `connect` opened
(`impala_tf.acting.inference_protocol`, which defines the messages): it sends
`(policy_id, obs, state)` and samples the actions itself from the logits it gets back; for an
env that stacks frames it sends the stacks whole once and then each step's newest frames with
the refills, the server keeping the stacks. numpy only: an actor that acts through the server
never imports TensorFlow.
"""

from __future__ import annotations

from multiprocessing import connection

import gymnasium as gym
import numpy as np

from impala_tf.acting.action_sampler import ActionSampler, SamplerState
from impala_tf.acting.inference_protocol import InferenceError
from impala_tf.acting.policy_step import PolicyStep

__all__ = ["RemotePolicy"]


class RemotePolicy(SamplerState):
    """An actor's policy whose forward pass runs in the driver's `InferenceServer`.

    Same interface as `impala_tf.acting.numpy_policy.NumpyPolicy` and
    `impala_tf.acting.tf_policy.ActorPolicy`; it holds no weights (`set_weights` is a no-op: the
    server holds them) and each `PolicyStep` carries the version of the weights that computed it.

    Args:
      conn: The actor's connection to the server (`connect`), shared by all its policies.
      policy_id: The id of the policy on the server ("default_policy" for single-agent).
      action_space: The policy's action space.
      state_shapes: The recurrent state of one env before its first step ([] if not
        recurrent): its arrays (`InferenceServer.initial_states[policy_id]`), or their shapes
        for a state that starts at zeros (`InferenceServer.state_shapes[policy_id]`).
      explore: Sample (True) or take the mode.
      seed: Seed of the action sampler.
      frame_stack: (k, s) when the env stacks frames (`impala_tf.models.frames`) and the server
        keeps the stacks of this policy: `step` with `stack_restarts` then sends each env's
        newest frame only (the whole stacks on the first such step and after `forget_stacks`).
    """

    def __init__(
        self,
        conn: connection.Connection,
        policy_id: str,
        action_space: gym.Space,
        state_shapes: list[tuple[int, ...] | np.ndarray],
        explore: bool = True,
        seed: int | None = None,
        frame_stack: tuple[int, int] | None = None,
    ):
        self._conn = conn
        self.policy_id = str(policy_id)
        self.action_space = action_space
        self.sampler = ActionSampler(action_space, explore, seed)
        self._initial = [
            np.asarray(s, np.float32) if isinstance(s, np.ndarray) else np.zeros(s, np.float32)
            for s in state_shapes
        ]
        self.is_recurrent = bool(self._initial)
        self.frame_stack = None if frame_stack is None else tuple(int(d) for d in frame_stack)
        self._stacks_kept = False  # The server holds this policy's stacks of the actor's envs.

    def initial_state(self, batch_size: int) -> tuple:
        """The recurrent state of `batch_size` envs before their first step (() if none)."""
        return tuple(np.repeat(s[None], batch_size, axis=0) for s in self._initial)

    def step(
        self, obs: np.ndarray, state: tuple = (), stack_restarts: np.ndarray | None = None
    ) -> PolicyStep:
        """Sends the observations [B, ...] to the server and samples from its logits.

        Args:
          obs: [B, ...] observations; with a `frame_stack`, [B, H, W, k * s] stacks.
          state: The recurrent state, [B, ...] arrays (() if none).
          stack_restarts: With a `frame_stack` only: bool [B], where the env refilled the
            stack (`BatchStep.stack_restarts`). Given, `obs` are the actor's envs' next stacks
            and the server keeps them: once it holds them only the newest frames [B, H, W, s]
            travel. None: `obs` travel whole and the server keeps nothing (a truncated
            episode's final observations, say).

        Raises:
          InferenceError: The server could not serve the request.
          EOFError: The server is gone.
        """
        obs = np.asarray(obs)
        if self.frame_stack is None or stack_restarts is None:
            message: tuple = (self.policy_id, np.ascontiguousarray(obs), tuple(state))
        elif self._stacks_kept:
            newest = np.ascontiguousarray(obs[..., -self.frame_stack[1] :])
            restarts = np.asarray(stack_restarts, bool)
            message = (self.policy_id, newest, tuple(state), restarts)
        else:
            message = (self.policy_id, np.ascontiguousarray(obs), tuple(state), None)
        kept = len(message) == 4
        if kept:
            self._stacks_kept = False  # Until the server answers: a failed request loses them.
        self._conn.send(message)
        reply = self._conn.recv()
        if reply[0] == "error":
            raise InferenceError(f"the driver's inference server failed: {reply[1]}")
        if kept:
            self._stacks_kept = True
        _, logits, values, new_state, version = reply
        actions, logp = self.sampler(logits)
        return PolicyStep(actions, logits, logp, values, tuple(new_state), int(version))

    def forget_stacks(self) -> None:
        """The actor's envs were replaced or reset outside `step` (a restored snapshot, a
        reseed): the next step with `stack_restarts` sends the whole stacks again."""
        self._stacks_kept = False

    def set_weights(self, weights: list[np.ndarray] | None) -> None:
        """Nothing to load: the server holds the weights."""

    def get_weights(self) -> list[np.ndarray]:
        return []
