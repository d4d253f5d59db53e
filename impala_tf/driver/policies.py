"""`Policies`: an algorithm's policies to call from Python, and their weights.

B is batch. `Impala.get_policy`, `compute_single_action`, `compute_actions`, `get_weights` and
`set_weights` (RLlib's `Algorithm` API) come here. A policy is an
`impala_tf.acting.trained_policy.Policy`, built on first use and kept, in one of two ways:

* before the algorithm starts (`Impala.from_checkpoint`), from the checkpoint's weights and
  observation filter, in this process; weights set then are kept and handed to the learners
  when the algorithm starts;
* once it has started (`follow`), around its learner's model: it loads the learner's newest
  weights when an update changed them, takes the actors' observation filter, and `set_weights`
  sets the learners' weights between two updates and broadcasts them to the actors.

Either way the action sampler is seeded as the driver's evaluation runner seeds it
(`impala_tf.utils.seeds.sampler_seeds`), so a seeded policy acts as `impala-evaluate` does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from impala_tf.acting import filters as filter_lib
from impala_tf.acting.actions import ActionAdapter
from impala_tf.acting.trained_policy import Policy
from impala_tf.checkpoints import read_state, restore_model
from impala_tf.config.base import AlgorithmConfig
from impala_tf.config.policies import policy_config
from impala_tf.driver.broadcast import Broadcaster
from impala_tf.driver.learners import LearnerGroup
from impala_tf.driver.plan import RuntimePlan
from impala_tf.driver.sampling import EnvRunnerGroup
from impala_tf.models.catalog import build_model
from impala_tf.utils.seeds import sampler_seeds

__all__ = ["Policies"]


class Policies:
    """An algorithm's policies by id: from a checkpoint until it starts, its learners' after.

    Args:
      config: The algorithm's config.
      plan: The run's plan (policy ids, spaces, model specs).
    """

    def __init__(self, config: AlgorithmConfig, plan: RuntimePlan):
        self.config = config
        self.plan = plan
        self._policies: dict[str, Policy] = {}
        self._checkpoint: str | None = None
        self._pending: dict[str, list[np.ndarray]] = {}  # Set before the start.
        self._learners: LearnerGroup | None = None
        self._actors: EnvRunnerGroup | None = None
        self._broadcaster: Broadcaster | None = None

    def load(self, checkpoint_dir: str) -> None:
        """Builds the policies from `checkpoint_dir` from now on (until `follow`)."""
        self._checkpoint = checkpoint_dir
        self._policies = {}

    def follow(
        self, learners: LearnerGroup, actors: EnvRunnerGroup, broadcaster: Broadcaster
    ) -> None:
        """Makes the policies follow the started algorithm's learners from now on, and gives the
        learners (then the actors) the weights set before the start."""
        self._learners, self._actors, self._broadcaster = learners, actors, broadcaster
        self._policies = {}  # Policies from a checkpoint give way to the learners' own.
        pending, self._pending = self._pending, {}
        if pending:
            self.set_weights(pending)

    @property
    def first(self) -> str:
        """The first trained policy (the only one of a single-agent run)."""
        return (list(self.plan.trained) or self.plan.policy_ids)[0]

    def get(self, policy_id: str) -> Policy:
        """The policy `policy_id`, built on first use.

        Raises:
          KeyError: no such policy (the message lists them).
        """
        if policy_id not in self.plan.spaces.policies:
            raise KeyError(f"No policy {policy_id!r}; policies: {self.plan.policy_ids}.")
        policy = self._policies.get(policy_id)
        if policy is None:
            policy = self._policies[policy_id] = self._make(policy_id)
        return policy

    def _make(self, pid: str) -> Policy:
        obs_space, act_space = self.plan.spaces.policies[pid]
        pconfig = policy_config(self.config, pid)
        spec = self.plan.models[pid]
        # As the driver's evaluation runner (and so `impala-evaluate`) seeds its samplers.
        seed = sampler_seeds(self.config.seed, 0, self.plan.policy_ids, self.plan.multi_agent)[pid]
        if self._learners is not None:
            learners, actors = self._learners, self._actors
            learner = learners.learners[pid]

            def newer(version: int) -> tuple[list[np.ndarray], int] | None:
                if int(learner.num_grad_updates.numpy()) == version:
                    return None
                return learners.snapshot(pid, wait=True)

            return Policy(
                pid, learner.model, spec, obs_space, act_space, pconfig,
                lambda: actors.filters[pid], seed, newer,
                lambda weights: self.set_weights({pid: weights}),
            )  # fmt: skip
        model = build_model(obs_space, act_space, spec, precision=pconfig.acting_precision)
        restore_model(model, self._checkpoint, pid)
        saved = read_state(self._checkpoint)["observation_filters"].get(pid)
        if saved is not None:
            obs_filter = filter_lib.filter_from_state(saved)
        else:
            obs_filter = filter_lib.get_filter(self.config.observation_filter, obs_space.shape)
        return Policy(pid, model, spec, obs_space, act_space, pconfig, lambda: obs_filter, seed)

    def _check_ids(self, ids: Any) -> None:
        unknown = sorted(set(ids) - set(self.plan.policy_ids))
        if unknown:
            raise KeyError(f"No policies {unknown}; policies: {self.plan.policy_ids}.")

    def get_weights(self, policies: list[str] | None = None) -> dict[str, list[np.ndarray]]:
        """{policy_id: weights} of `policies` (None: all), as `Impala.get_weights`.

        Raises:
          KeyError: a policy id that is not one of the algorithm's.
        """
        ids = self.plan.policy_ids if policies is None else list(policies)
        self._check_ids(ids)
        if self._learners is not None:
            return {pid: self._learners.snapshot(pid, wait=True)[0] for pid in ids}
        return {pid: self.get(pid).get_weights() for pid in ids}

    def set_weights(self, weights: Mapping[str, list[np.ndarray]]) -> None:
        """Sets policies' weights, as `Impala.set_weights`.

        Raises:
          KeyError: a policy id that is not one of the algorithm's.
          ValueError: weights that do not fit the policy's model.
        """
        self._check_ids(weights)
        if self._learners is None:
            for pid, w in weights.items():
                self.get(pid).set_weights(w)
                self._pending[pid] = [np.asarray(a) for a in w]
            return
        with self._learners.locked():
            for pid, w in weights.items():
                self._learners.learners[pid].set_policy_weights([np.asarray(a) for a in w])
        self._broadcaster.send(self._actors.healthy_ids())

    def compute_single_action(
        self,
        observation: Any,
        state: list[Any] | None,
        *,
        prev_action: Any,
        prev_reward: Any,
        policy_id: str,
        full_fetch: bool,
        explore: bool | None,
        unsquash_action: bool | None,
        clip_action: bool | None,
    ) -> Any:
        """The action for one observation, as `Impala.compute_single_action` (whose arguments
        these are): `compute_actions` on a batch of one.

        Returns:
          The action; `(action, state out, extra fetches)` when `state` is given or
          `full_fetch`.

        Raises:
          ValueError: `prev_action` or `prev_reward` is given.
        """
        if prev_action is not None or prev_reward is not None:
            raise ValueError(
                "compute_single_action: prev_action / prev_reward are not supported (no model "
                "takes previous actions or rewards: lstm_use_prev_action is not supported)."
            )
        batch_state = None if state is None else [np.asarray(s)[None] for s in state]
        actions, state_out, extra = self.compute_actions(
            np.asarray(observation)[None],
            batch_state,
            policy_id=policy_id,
            full_fetch=True,
            explore=explore,
            unsquash_action=unsquash_action,
            clip_action=clip_action,
        )
        action = actions[0]
        if state is None and not full_fetch:
            return action
        return action, [s[0] for s in state_out], {k: v[0] for k, v in extra.items()}

    def compute_actions(
        self,
        observations: Any,
        state: list[Any] | None,
        *,
        policy_id: str,
        full_fetch: bool,
        explore: bool | None,
        unsquash_action: bool | None,
        clip_action: bool | None,
    ) -> Any:
        """Actions for observations as the env gives them, as the env takes them
        (`Impala.compute_actions`, whose arguments these are).

        The observations [B, ...] go through the policy's observation filter (not updated), the
        policy acts, and the actions [B, ...] are unsquashed to the env's bounds or clipped.

        Returns:
          The actions, [B, *action_shape] (or a dict with the keys of `observations`); with
          `state` or `full_fetch`, `(actions, state out, extra fetches)`.
        """
        policy = self.get(policy_id)
        keys = list(observations) if isinstance(observations, Mapping) else None
        obs = np.stack([observations[k] for k in keys]) if keys is not None else observations
        actions, state_out, extra = policy.compute_actions(policy.filter(obs), state, explore)
        config = policy.config
        adapter = ActionAdapter(
            policy.action_space,
            config.normalize_actions if unsquash_action is None else unsquash_action,
            config.clip_actions if clip_action is None else clip_action,
        )
        actions = adapter(actions)
        if keys is not None:
            actions = dict(zip(keys, actions))
        if state is None and not full_fetch:
            return actions
        return actions, state_out, extra
