"""Property tests of config parsing: `from_dict`, `validate()`, `from_yaml` and `--set`.

Generated keys (real, aliased, ignored and made up), types and values. Every rejection must be a
`ValueError`/`TypeError` naming the key; an accepted config must survive what training derives
from it without processes (schedules, batch layout, the tensor signature, the model on
CartPole's spaces) and round-trip through `to_dict`/`from_dict`. Accepted or not, `validate()`
leaves the config unchanged.
"""

from __future__ import annotations

import math
import os
import tempfile
import warnings

import gymnasium as gym
import pytest
import yaml
from absl import app
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from impala_tf.bin.train import parse_overrides
from impala_tf.config import MODEL_DEFAULTS, ImpalaConfig
from impala_tf.config.keys import ALIASES
from impala_tf.data import batching
from impala_tf.learning import pipeline
from impala_tf.models import build_model

_FIELDS = sorted(ImpalaConfig().to_dict())
_KEYS = st.one_of(
    st.sampled_from(_FIELDS),
    st.sampled_from(sorted(ALIASES)),
    st.sampled_from(["framework", "num_cpus_per_worker", "sgd_minibatch_size", "minibatch_size"]),
    st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12),
)
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(0, 1),
    st.text(max_size=6),
    st.sampled_from(["adam", "rmsprop", "truncate_episodes", "CartPole-v1", "relu", "tanh"]),
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=2)
    ),
    max_leaves=4,
)
_MODEL = st.dictionaries(
    st.sampled_from([*MODEL_DEFAULTS, "zero_mean", "lstm_use_prev_action_reward", "bogus"]),
    _VALUES,
    max_size=3,
)
_SETTINGS = st.dictionaries(_KEYS, _VALUES, max_size=3) | st.builds(
    lambda s, m: {**s, "model": m}, st.dictionaries(_KEYS, _VALUES, max_size=2), _MODEL
)

_CARTPOLE = gym.make("CartPole-v1")
_SPACES = (_CARTPOLE.observation_space, _CARTPOLE.action_space)
_PENDULUM = gym.make("Pendulum-v1")
_PENDULUM_SPACES = (_PENDULUM.observation_space, _PENDULUM.action_space)
_FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _names(settings_: dict) -> set[str]:
    """Every name a message may use for the keys of `settings_`."""
    names = set()
    for key in settings_:
        names.update({str(key), ALIASES.get(key, str(key))})
    for key in settings_.get("model", {}) if isinstance(settings_.get("model"), dict) else ():
        names.add(str(key))
    return names


def _assert_names_a_key(error: Exception, settings_: dict) -> None:
    assert isinstance(error, (ValueError, TypeError)), f"{type(error).__name__}: {error}"
    message = str(error)
    assert any(name in message for name in _names(settings_)), (
        f"{message!r} names none of {sorted(_names(settings_))}"
    )


def _check_accepted(config: ImpalaConfig) -> None:
    """What training derives from a config before it starts processes must work."""
    config.lr_schedule_points()
    config.entropy_coeff_schedule_points()
    replicas = config.num_learner_devices
    rows = batching.rows_per_batch(config, replicas)
    assert rows >= 1
    pipeline.microbatches_per_batch(config, replicas)
    pipeline.batch_signature(config, *_SPACES, replicas)
    config.get_evaluation_config()
    again = ImpalaConfig.from_dict(config.to_dict())
    assert again == config
    assert again.to_dict() == config.to_dict()


def _validate(settings_: dict) -> ImpalaConfig | None:
    """Builds and validates; checks the error or the accepted config. None if rejected.

    Either way `validate()` leaves the config as it was (it never adjusts a value).
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            config = ImpalaConfig.from_dict(settings_)
        except Exception as e:  # noqa: BLE001 - the assertion says what was raised.
            _assert_names_a_key(e, settings_)
            return None
        before = config.copy()
        try:
            config.validate()
        except Exception as e:  # noqa: BLE001 - the assertion says what was raised.
            _assert_names_a_key(e, settings_)
            return None
        finally:
            _assert_unchanged(config, before)
        _check_accepted(config)
        return config


def _assert_unchanged(config: ImpalaConfig, before: ImpalaConfig) -> None:
    """Every key as it was (NaN equal to NaN: a rejected lr=nan stays nan)."""
    for key, value in before.to_dict().items():
        now = getattr(config, key)
        same = now == value or (
            isinstance(value, float) and isinstance(now, float) and math.isnan(value)
        )
        assert same, f"validate() changed `{key}` from {value!r} to {now!r}"


@_FUZZ
@given(_SETTINGS)
def test_from_dict_and_validate(settings_):
    _validate(settings_)


# Valid values for a few keys, so that some generated configs are accepted and go deeper.
_VALID = st.fixed_dictionaries(
    {},
    optional={
        "lr": st.floats(0, 1),
        "train_batch_size": st.integers(1, 2000),
        "rollout_fragment_length": st.integers(1, 200),
        "microbatch_size": st.none() | st.integers(1, 400),
        "num_gpus": st.sampled_from([0, 1, 2, 0.5]),
        "_fake_gpus": st.booleans(),
        "num_env_runners": st.integers(0, 4),
        "num_aggregation_workers": st.integers(0, 2),
        "replay_proportion": st.floats(0, 4),
        "replay_buffer_num_slots": st.integers(0, 10),
        "lr_schedule": st.none()
        | st.lists(
            st.tuples(st.integers(0, 10**6), st.floats(0, 1)).map(list), min_size=1, max_size=3
        ),
        "entropy_coeff_schedule": st.none() | st.integers(0, 10**6),
        "model": st.fixed_dictionaries(
            {},
            optional={
                "fcnet_hiddens": st.lists(st.integers(1, 16), max_size=2),
                "fcnet_activation": st.sampled_from(["relu", "tanh", "elu", "swish", "linear"]),
                "vf_share_layers": st.booleans(),
                "free_log_std": st.booleans(),
                "use_lstm": st.booleans(),
                "lstm_cell_size": st.integers(1, 8),
                "max_seq_len": st.integers(1, 30),
                "lstm_use_prev_action": st.booleans(),
                "lstm_use_prev_reward": st.booleans(),
            },
        ),
        "evaluation_config": st.fixed_dictionaries({}, optional={"explore": st.booleans()}),
        "sample_timeout_s": st.none() | st.floats(0.01, 100),
    },
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_VALID)
def test_accepted_configs_build_their_model(settings_):
    config = _validate(settings_)
    if config is None or not settings_.get("model"):
        return
    # free_log_std is for Gaussian (Box) actions: the catalog refuses it with CartPole's.
    spaces = _PENDULUM_SPACES if config.model.get("free_log_std") else _SPACES
    model = build_model(*spaces, config.model)
    assert model.variables


def _yaml_safe(value):
    """YAML cannot hold NaN/inf as numbers portably: keep them, PyYAML writes .nan/.inf."""
    return value


@_FUZZ
@given(_SETTINGS, st.sampled_from(["entry", "config"]))
def test_from_yaml(settings_, env_at):
    entry = {"run": "IMPALA", "config": dict(settings_), "stop": {"training_iteration": 1}}
    if env_at == "entry" and "env" in settings_:
        entry["env"] = entry["config"].pop("env")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "x.yaml")
        try:
            text = yaml.safe_dump({"fuzz": entry})
        except yaml.YAMLError:
            return  # Not representable in YAML: nothing to read back.
        with open(path, "w") as f:
            f.write(text)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                config, stop = ImpalaConfig.from_yaml(path)
                config.validate()
            except Exception as e:  # noqa: BLE001 - the assertion says what was raised.
                _assert_names_a_key(e, settings_)
                return
    _check_accepted(config)
    assert stop == {"training_iteration": 1}


@_FUZZ
@given(
    st.recursive(
        _SCALARS,
        lambda inner: (
            st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=3), inner, max_size=2)
        ),
        max_leaves=3,
    )
)
def test_from_yaml_rejects_malformed_documents_by_path(document):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bad.yaml")
        with open(path, "w") as f:
            f.write(yaml.safe_dump(document))
        try:
            ImpalaConfig.from_yaml(path)
        except (ValueError, TypeError) as e:
            assert path in str(e) or any(str(k) in str(e) for k in _FIELDS), str(e)


_SET_KEYS = st.one_of(
    _KEYS,
    st.sampled_from(sorted(MODEL_DEFAULTS)).map(lambda k: f"model.{k}"),
    st.just("model.bogus"),
)


@_FUZZ
@given(st.lists(st.tuples(_SET_KEYS, st.text(max_size=12)), max_size=3))
def test_set_overrides(pairs):
    flags = [f"{key}={raw}" for key, raw in pairs]
    try:
        overrides = parse_overrides(flags)
    except app.UsageError as e:
        assert any(key in str(e) for key, _ in pairs), str(e)
        return
    _validate(overrides)


def test_set_model_then_a_model_key_is_a_usage_error():
    """Found by test_set_overrides: `--set model= --set model.x=1` raised a bare TypeError."""
    with pytest.raises(app.UsageError, match="--set model.bogus: an earlier --set model=None"):
        parse_overrides(["model=", "model.bogus="])


def test_fuzz_finds_what_it_should():
    """The properties can fail: a bad value that names no key, a changed config, and a round trip
    that differs."""
    try:
        _assert_names_a_key(ValueError("something is wrong"), {"lr": -1})
    except AssertionError:
        pass
    else:
        raise AssertionError("_assert_names_a_key accepted a message without the key")
    adjusted = ImpalaConfig(num_gpus=2, minibatch_buffer_size=1)
    before = adjusted.copy()
    adjusted.minibatch_buffer_size = 3  # What validate() used to do in multi-device mode.
    try:
        _assert_unchanged(adjusted, before)
    except AssertionError as e:
        assert "`minibatch_buffer_size` from 1 to 3" in str(e)
    else:
        raise AssertionError("_assert_unchanged missed a changed key")
    _assert_unchanged(ImpalaConfig(lr=float("nan")), ImpalaConfig(lr=float("nan")))
    config = ImpalaConfig(lr=0.1)
    assert ImpalaConfig.from_dict(config.to_dict()) == config
    assert ImpalaConfig.from_dict({**config.to_dict(), "lr": 0.2}) != config
    assert math.isnan(float("nan"))


@pytest.mark.parametrize(
    "model, key",
    [
        ({"use_lstm": True, "lstm_use_prev_action": True}, "model.lstm_use_prev_action"),
        ({"use_lstm": True, "lstm_use_prev_reward": True}, "model.lstm_use_prev_reward"),
    ],
)
def test_model_options_the_catalog_refuses_are_rejected_by_validate(model, key):
    # Found by test_accepted_configs_build_their_model: validate() accepted these, and the run
    # failed later, building the model.
    with pytest.raises(ValueError, match=key):
        ImpalaConfig(model=model).validate()
