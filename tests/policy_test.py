"""`TracedCall`: the traced graph called directly gives the `tf.function`'s results."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import tensorflow as tf

from impala_tf.acting.tf_policy import ActorPolicy, TracedCall


class CountingFunction:
    """A `tf.function` stand-in that counts the calls that go through its `__call__`."""

    def __init__(self, fn):
        self.fn = fn
        self.calls = 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)

    def get_concrete_function(self, *args):
        return self.fn.get_concrete_function(*args)


def _policy(obs_space, model_config, seed=0):
    policy = ActorPolicy(obs_space, gym.spaces.Discrete(3), model_config, seed=seed)
    rng = np.random.default_rng(seed)
    policy.set_weights(
        [rng.normal(scale=0.1, size=w.shape).astype(np.float32) for w in policy.get_weights()]
    )
    return policy


CASES = [
    (gym.spaces.Box(-1.0, 1.0, (5,), np.float32), {"fcnet_hiddens": [8]}),
    (gym.spaces.Box(-1.0, 1.0, (5,), np.float32), {"fcnet_hiddens": [8], "use_lstm": True}),
    (
        gym.spaces.Box(0, 255, (10, 10, 2), np.uint8),
        {"conv_filters": [[4, [3, 3], 2], [8, [5, 5], 1]], "post_fcnet_hiddens": [16]},
    ),
]


@pytest.mark.parametrize("obs_space, model_config", CASES, ids=["mlp", "lstm", "conv"])
def test_the_direct_call_equals_the_function_and_skips_its_dispatch(obs_space, model_config):
    policy = _policy(obs_space, model_config)
    counting = CountingFunction(policy._forward.fn)
    traced = TracedCall(counting)
    rng = np.random.default_rng(1)
    state = policy.initial_state(4)
    for step in range(3):
        obs = np.asarray([obs_space.sample() for _ in range(4)])
        logits, values, new_state = traced(obs, state)
        want_logits, want_values, want_state = policy._forward.fn(obs, state)
        np.testing.assert_array_equal(logits.numpy(), want_logits.numpy())
        np.testing.assert_array_equal(values.numpy(), want_values.numpy())
        assert len(new_state) == len(want_state) == len(state)
        for got, want in zip(new_state, want_state):
            np.testing.assert_array_equal(got.numpy(), want.numpy())
        state = tuple(s.numpy() + rng.normal(size=s.shape).astype(np.float32) for s in new_state)
        if step == 1:  # New weights reach the traced graph: it captured the variables.
            policy.set_weights([w * 0.5 for w in policy.get_weights()])
    assert counting.calls == 0
    assert len(traced._traces) == 1


def test_a_new_shape_gets_its_own_trace_and_tensors_go_through_the_function():
    obs_space, model_config = CASES[0]
    policy = _policy(obs_space, model_config)
    counting = CountingFunction(policy._forward.fn)
    traced = TracedCall(counting)
    for batch in (2, 3, 2):
        obs = np.asarray([obs_space.sample() for _ in range(batch)])
        logits, _, _ = traced(obs, ())
        assert logits.shape == (batch, 3)
        np.testing.assert_array_equal(logits.numpy(), policy._forward.fn(obs, ())[0].numpy())
    assert len(traced._traces) == 2 and counting.calls == 0
    tensors = tf.constant(np.asarray([obs_space.sample()]))
    logits, _, _ = traced(tensors, ())
    assert counting.calls == 1 and logits.shape == (1, 3)


def test_the_actor_policy_steps_through_the_direct_call():
    obs_space, model_config = CASES[2]
    policy = _policy(obs_space, model_config)
    obs = np.asarray([obs_space.sample() for _ in range(4)])
    first = policy.step(obs)
    assert policy._forward.direct and len(policy._forward._traces) == 1
    np.testing.assert_array_equal(first.logits, policy._forward.fn(obs, ())[0].numpy())
