"""Learner benchmarks: train-step throughput, devices, gradient-accumulation memory, GPU CNN.

    .venv/bin/python -m tools.bench_learner               # every part, into BENCHMARKS.md
    .venv/bin/python -m tools.bench_learner --parts keras devices
    .venv/bin/python -m tools.bench_learner --parts keras --no-write   # print only
    .venv/bin/python -m tools.bench_learner --parts memory --memory_batch 20000
    .venv/bin/python -m tools.bench_learner --parts xla --repeats 20 --rounds 5
    .venv/bin/python -m tools.bench_learner --parts conv
    .venv/bin/python -m tools.bench_learner --parts call

Run from the repository root (the memory cases run there as `python -m tools.bench_learner`).

Parts (each writes its own BENCHMARKS.md section):

* `keras` — samples/s of one `ImpalaLearner` update (V-trace loss, Adam, clipping) on the CartPole
  MLP [256, 256] at batch 500 (10 sequences of 50), next to a bare Keras update of the same model
  (the models catalog's, a shared torso by default: `vf_share_layers`) doing forward, backward and
  Adam on a plain loss (`tools.benchlib.bare_keras_step`), same batch, same run. Both are compiled
  `tf.function`s timed from Python with the results fetched.
* `devices` — the same update on 1 and on 2 logical CPU devices (`MirroredStrategy`, what
  `num_gpus=2, _fake_gpus=True` builds), at batch 500 and 2,000. The devices share the machine's
  cores, so no gain is expected on a small machine: this measures the cost of the split.
* `memory` — peak resident memory (Linux `VmHWM`) of one process that builds the learner thread
  and trains one train batch of 20,000 env steps, with and without `microbatch_size=1000`, for the
  CartPole MLP and the Nature CNN on 84x84x4 uint8 frames. Each case runs in a fresh subprocess.
  On a CPU the host is the device, so the figures include the host copy of the train batch
  (reported beside them).
* `gpu` — Nature CNN learner samples/s at batch 500 and 2,000 on one GPU; skipped with a note
  when no GPU is visible.
* `xla` — the update with `jit_compile_update` False and True, interleaved (the CartPole MLP at
  batch 500 and 2,000, on one and two logical CPU devices; the Nature CNN at batch 500), with
  each side's spread over the rounds. On a GPU, `python -m tools.bench_gpu` measures the same.
* `bf16` — the `precision` key, "float32" vs "mixed_bfloat16", interleaved: the learner update
  at batch 500 (CartPole MLP, Nature CNN 84x84, and `configs/pong-impala-small.yaml`'s RLlib
  vision net on 42x42 frames) on both cores, and an actor's inference (`ActorPolicy.step`) at
  that config's `num_envs_per_env_runner` on one TensorFlow thread, as actor processes run, in a
  fresh subprocess (this CPU has AVX512-BF16).
* `conv` — RLlib's last vision layer (256 filters of 11x11 on the 11x11x32 maps of 42x42 and
  84x84 frames; "valid" padding, so a 1x1 output) as `keras.layers.Conv2D` computes it (a
  convolution) and as the models' `CoveringConv2D` does (one matmul on the flattened input), in
  turn: forward at an actor's batch on one TensorFlow thread, and forward plus backward at the
  learner's batch 500 on both cores, each in a fresh subprocess.
* `call` — an actor's forward call (`ActorPolicy.forward`'s model step) through the
  `tf.function` as Python calls it and through `impala_tf.acting.tf_policy.TracedCall` (the traced
  graph called directly), in turn, at the config's `num_envs_per_env_runner` on one TensorFlow
  thread, in a fresh subprocess: `configs/pong-impala-small.yaml`'s vision net and
  `configs/stateless-cartpole-impala.yaml`'s LSTM. The difference is Python's per-call work.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from tools import benchlib, proclib

__all__ = [
    "bench_bf16",
    "bench_call",
    "bench_conv",
    "bench_devices",
    "bench_gpu",
    "bench_keras",
    "bench_memory",
    "bench_xla",
    "main",
]

# Inherited by the memory cases; TensorFlow is not imported up to here.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

T = 50  # rollout_fragment_length of every case
PARTS = ("keras", "devices", "memory", "gpu", "xla", "bf16", "conv", "call")
_PRECISIONS = ("float32", "mixed_bfloat16")  # The `precision` key's values, as bf16 compares them.
#: The Pong config whose model the `bf16` part measures (RLlib's vision net on 42x42 frames).
PONG_SMALL = os.path.join(ROOT, "configs", "pong-impala-small.yaml")
#: The configs whose actor calls the `call` part times (a vision net; an LSTM).
CALL_CONFIGS = (PONG_SMALL, os.path.join(ROOT, "configs", "stateless-cartpole-impala.yaml"))
_CALL_PATHS = ("tf.function", "TracedCall")


def _configure_two_cpus() -> None:
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    if tf.config.get_logical_device_configuration(cpus[0]) is None:
        tf.config.set_logical_device_configuration(
            cpus[0],
            [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()],
        )


def _spaces(kind: str):
    import gymnasium as gym
    import numpy as np

    if kind == "cnn":
        return gym.spaces.Box(0, 255, (84, 84, 4), np.uint8), gym.spaces.Discrete(6)
    if kind == "pong":
        return gym.spaces.Box(0, 255, (42, 42, 4), np.uint8), gym.spaces.Discrete(6)
    return gym.spaces.Box(-1.0, 1.0, (4,), np.float32), gym.spaces.Discrete(2)


def _pong_small():
    """`configs/pong-impala-small.yaml`'s config."""
    from impala_tf.config import ImpalaConfig

    return ImpalaConfig.from_yaml(PONG_SMALL)[0]


def _config(kind: str, batch: int, **overrides):
    from impala_tf.config import ImpalaConfig

    model = {"custom_model": "nature_cnn"} if kind == "cnn" else {"fcnet_hiddens": [256, 256]}
    if kind == "pong":
        model = _pong_small().model
    config = ImpalaConfig().environment("CartPole-v1")
    config.training(train_batch_size=batch, model=model)
    config.env_runners(rollout_fragment_length=T)
    return config.update_from_dict(overrides)


def _random_batch(kind: str, rows: int, seed: int = 0) -> dict:
    """Random [rows, T, ...] columns (the fakes of tests/ are too slow for 84x84 frames)."""
    import numpy as np

    from impala_tf.models import distributions

    obs_space, act_space = _spaces(kind)
    rng = np.random.default_rng(seed)
    shape = (rows, T)
    if kind in ("cnn", "pong"):
        obs = rng.integers(0, 256, (*shape, *obs_space.shape), dtype=np.uint8)
    else:
        obs = rng.uniform(-1, 1, (*shape, *obs_space.shape)).astype(np.float32)
    logits = distributions.logits_size(act_space)
    dones = rng.random(shape) < 0.02
    return {
        "obs": obs,
        "actions": rng.integers(0, act_space.n, shape).astype(np.int64),
        "rewards": rng.normal(size=shape).astype(np.float32),
        "terminateds": dones,
        "truncateds": np.zeros(shape, bool),
        "action_dist_inputs": rng.normal(scale=0.5, size=(*shape, logits)).astype(np.float32),
        "action_logp": np.zeros(shape, np.float32),
        "vf_preds": rng.normal(size=shape).astype(np.float32),
        "values_bootstrapped": np.where(dones, 0.0, rng.normal(size=shape)).astype(np.float32),
    }


def _learner_step(kind: str, batch: int, strategy, **overrides) -> Callable[[], None]:
    """One distributed learner update on a batch already on the devices, result fetched."""
    import numpy as np
    import tensorflow as tf

    from impala_tf.data.sample_batch import SampleBatch
    from impala_tf.learning import pipeline
    from impala_tf.learning.learner import ImpalaLearner

    config = _config(kind, batch, **overrides)
    obs_space, act_space = _spaces(kind)
    with strategy.scope():
        learner = ImpalaLearner(config, obs_space, act_space)
    n = strategy.num_replicas_in_sync
    signature = pipeline.batch_signature(config, obs_space, act_space, n)
    shards = pipeline.replica_shards(SampleBatch(_random_batch(kind, batch // T)), signature, n)
    if n == 1:
        data = {k: tf.constant(v) for k, v in shards[0].items()}
    else:
        data = strategy.experimental_distribute_values_from_function(
            lambda ctx: {k: tf.constant(v) for k, v in shards[ctx.replica_id_in_sync_group].items()}
        )

    @tf.function(autograph=False)
    def step(d):
        out = strategy.run(learner.train_step, args=(d,))
        return strategy.experimental_local_results(out)[0]["total_loss"]

    def once():
        np.asarray(step(data))

    return once


def _keras_step(batch: int) -> Callable[[], None]:
    """Forward + backward + Adam of a bare Keras update (`benchlib.bare_keras_step`) of the model
    the learner builds for the same config (the models catalog's), result fetched."""
    import keras
    import numpy as np
    import tensorflow as tf

    from impala_tf.models import build_model

    config = _config("mlp", batch)
    obs_space, act_space = _spaces("mlp")
    model = build_model(obs_space, act_space, config.model, name="bare_keras_model")
    optimizer = keras.optimizers.Adam(learning_rate=float(config.lr))
    optimizer.build(model.trainable_variables)
    rng = np.random.default_rng(0)
    obs = tf.constant(rng.uniform(-1, 1, (batch, *obs_space.shape)).astype(np.float32))
    actions = tf.constant(rng.integers(0, act_space.n, batch))
    targets = tf.constant(rng.normal(size=batch).astype(np.float32))
    return benchlib.bare_keras_step(
        model, optimizer, obs, actions, targets, float(config.grad_clip or 40.0)
    )


def _mlp_layout() -> str:
    """The CartPole MLP as the catalog builds it for `_config("mlp", ...)`: shared torso or not."""
    config = _config("mlp", 500)
    hidden = " x ".join(str(n) for n in config.model["fcnet_hiddens"])
    activation = config.model["fcnet_activation"]
    if config.model["vf_share_layers"]:
        return (
            f"one torso of {hidden} {activation} units with a policy and a value head "
            "(`vf_share_layers: True`, RLlib's default)"
        )
    return (
        f"separate policy and value towers of {hidden} {activation} units "
        "(`vf_share_layers: False`)"
    )


def _run_case(flag: str, case: dict):
    """Runs `python -m tools.bench_learner <flag> <case as JSON>` in a fresh process (its own
    TensorFlow threads and memory) and returns the JSON its last line prints."""
    args = [sys.executable, "-m", "tools.bench_learner", flag, json.dumps(case)]
    out = subprocess.run(args, capture_output=True, text=True, check=False, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"{flag} {json.dumps(case)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _interleaved_times(
    steps: dict[str, Callable[[], None]], repeats: int, rounds: int = 5
) -> dict[str, list[float]]:
    """Each step's median time in each of `rounds` rounds, the steps timed in turn each round
    (`benchlib.interleaved`)."""
    measures = {
        name: functools.partial(benchlib.median_seconds, step, repeats=repeats, warmup=3)
        for name, step in steps.items()
    }
    return benchlib.interleaved(measures, rounds)


def _interleaved_seconds(
    steps: dict[str, Callable[[], None]], repeats: int, rounds: int = 5
) -> dict[str, float]:
    """Median over `rounds` of each step's median time (`_interleaved_times`)."""
    times = _interleaved_times(steps, repeats, rounds)
    return {name: statistics.median(values) for name, values in times.items()}


def bench_keras(repeats: int) -> str:
    import tensorflow as tf

    batch = 500
    load_before = os.getloadavg()
    seconds = _interleaved_seconds(
        {
            "learner": _learner_step("mlp", batch, tf.distribute.get_strategy()),
            "keras": _keras_step(batch),
        },
        repeats,
    )
    load_after = os.getloadavg()
    keras_s = seconds["keras"]
    rows = [
        ("`ImpalaLearner.train_step` (V-trace, Adam, clip)", seconds["learner"]),
        ("bare Keras MLP: forward + backward + Adam", keras_s),
    ]
    lines = [
        "### Learner update vs a bare Keras MLP (CartPole MLP [256, 256], batch 500)",
        "",
        f"Machine: {benchlib.machine_line()}; load average (1 min) {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after",
        "",
        "| update | ms / update | samples/s | vs Keras |",
        "|---|---:|---:|---:|",
    ]
    for name, value in rows:
        lines.append(
            f"| {name} | {value * 1e3:.2f} | {batch / value:,.0f} | {value / keras_s:.2f}x |"
        )
    lines += [
        "",
        f"Median of 5 interleaved rounds, each the median of {repeats} calls of a compiled step "
        "on a batch already in memory, result fetched. Both update the same model, built by the "
        f"models catalog: {_mlp_layout()}. The bare Keras update is a cross-entropy on the "
        "actions plus a squared value loss, clipped, and Adam (`tools.benchlib.bare_keras_step`); "
        "the learner adds the V-trace targets (a scan over T=50), the distributions and the stats.",
    ]
    if benchlib.other_jobs_running(load_before):
        lines += ["", "Other jobs loaded the machine when this ran: the figures are noisy."]
    return "\n".join(lines)


def bench_devices(repeats: int) -> str:
    import tensorflow as tf

    devices = [d.name for d in tf.config.list_logical_devices("CPU")[:2]]
    mirrored = tf.distribute.MirroredStrategy(devices)
    lines = [
        "### Learner update on 1 vs 2 logical CPU devices (CartPole MLP [256, 256])",
        "",
        f"Machine: {benchlib.machine_line()}",
        "",
        "| batch | devices | ms / update | samples/s | vs 1 device |",
        "|---:|---:|---:|---:|---:|",
    ]
    for batch in (500, 2000):
        seconds = _interleaved_seconds(
            {
                "one": _learner_step("mlp", batch, tf.distribute.get_strategy()),
                "two": _learner_step("mlp", batch, mirrored),
            },
            repeats,
        )
        one, two = seconds["one"], seconds["two"]
        for n, seconds in ((1, one), (2, two)):
            lines.append(
                f"| {batch:,} | {n} | {seconds * 1e3:.2f} | {batch / seconds:,.0f} | "
                f"{one / seconds:.2f}x |"
            )
    lines += [
        "",
        "Two logical CPU devices are what `num_gpus: 2, _fake_gpus: true` trains on: each device "
        "computes the gradient of its half of the batch, the gradients are all-reduced, clipped "
        "and applied. Both devices run on the same cores, so on a CPU this costs the split and "
        "the all-reduce and gains nothing; it exists to test the multi-GPU code path. "
        f"Median of 5 interleaved rounds of {repeats} calls each.",
    ]
    return "\n".join(lines)


def bench_xla(repeats: int, rounds: int = 5) -> str:
    """`jit_compile_update` False vs True, interleaved, on the CPU devices of this machine."""
    import tensorflow as tf

    devices = [d.name for d in tf.config.list_logical_devices("CPU")[:2]]
    cases = [
        ("CartPole MLP [256, 256]", "mlp", 500, tf.distribute.get_strategy()),
        ("CartPole MLP [256, 256]", "mlp", 2000, tf.distribute.get_strategy()),
        (
            "CartPole MLP [256, 256], 2 devices",
            "mlp",
            2000,
            tf.distribute.MirroredStrategy(devices),
        ),
        ("Nature CNN 84x84x4", "cnn", 500, tf.distribute.get_strategy()),
    ]
    lines = [
        "### `jit_compile_update`: the learner update with and without XLA, on the CPU",
        "",
        f"Machine: {benchlib.machine_line()}",
        "",
        "| model | batch | ms / update, XLA off | ms, XLA on | spread off / on (min-max of "
        "rounds) | XLA on vs off |",
        "|---|---:|---:|---:|---|---:|",
    ]
    for name, kind, batch, strategy in cases:
        reps = max(3, repeats // 6) if kind == "cnn" else repeats
        steps = {
            "off": _learner_step(kind, batch, strategy, jit_compile_update=False),
            "on": _learner_step(kind, batch, strategy, jit_compile_update=True),
        }
        times = _interleaved_times(steps, reps, rounds)
        off, on = statistics.median(times["off"]), statistics.median(times["on"])
        spread = _spread_ms(times, ("off", "on"))
        lines.append(
            f"| {name} | {batch:,} | {off * 1e3:.2f} | {on * 1e3:.2f} | {spread} | "
            f"{off / on:.2f}x |"
        )
        print(lines[-1], flush=True)
    lines += [
        "",
        f"Median of {rounds} interleaved rounds, each the median of {repeats} calls (the CNN: "
        f"{max(3, repeats // 6)}) of a compiled update on a batch already in memory, result "
        "fetched; `XLA on vs off` above 1 means XLA is faster. XLA compiles each device's "
        "forward, V-trace and backward pass; the all-reduce, clipping and optimizer step stay "
        "outside it (`impala_tf.learning.learner`).",
    ]
    return "\n".join(lines)


#: (row name, model kind) of the `bf16` part's actor-inference rows.
_INFERENCE_CASES = (
    ("pong-impala-small: RLlib vision net, 42x42x4", "pong"),
    ("Nature CNN, 84x84x4", "cnn"),
)


def _inference_case(kind: str, batch: int, repeats: int, rounds: int) -> dict[str, list[float]]:
    """Runs in a fresh subprocess on one TensorFlow thread: `ActorPolicy.step` at `batch`, float32
    and mixed_bfloat16 interleaved; returns each precision's median seconds per round."""
    import numpy as np
    import tensorflow as tf

    # Before TensorFlow runs an op, as actor processes do (`impala_tf.workers.process`).
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from impala_tf.acting.tf_policy import ActorPolicy

    obs_space, act_space = _spaces(kind)
    model = _config(kind, 500).model
    rng = np.random.default_rng(0)
    obs = rng.integers(0, 256, (batch, *obs_space.shape), dtype=np.uint8)
    steps = {}
    for precision in _PRECISIONS:
        policy = ActorPolicy(obs_space, act_space, model, seed=0, precision=precision)
        steps[precision] = lambda p=policy: p.step(obs)
    times = _interleaved_times(steps, repeats, rounds)
    assert tf.config.threading.get_intra_op_parallelism_threads() == 1
    return times


def _spread_ms(times: dict[str, list[float]], names: Sequence[str]) -> str:
    """The min-max of each named side's per-round seconds, in ms: "a-b / c-d" for the table."""
    return " / ".join(f"{min(times[n]) * 1e3:.2f}-{max(times[n]) * 1e3:.2f}" for n in names)


def bench_bf16(repeats: int, rounds: int = 5) -> str:
    """The `precision` key: "float32" vs "mixed_bfloat16" (bfloat16 compute, float32 variables),
    interleaved, for the learner update and an actor's inference."""
    import tensorflow as tf

    load_before = os.getloadavg()
    strategy = tf.distribute.get_strategy()
    pong = _pong_small()
    envs = int(pong.num_envs_per_env_runner)
    cases = [
        ("CartPole MLP [256, 256]", "mlp", repeats),
        ("Nature CNN, 84x84x4", "cnn", max(3, repeats // 6)),
        ("pong-impala-small: RLlib vision net, 42x42x4", "pong", max(3, repeats // 3)),
    ]
    lines = [
        "### `precision`: mixed_bfloat16 vs float32 on the CPU (learner and actor inference)",
        "",
        f"Machine: {benchlib.machine_line()}; AVX512-BF16: {_has_avx512_bf16()}; load average "
        f"before: {load_before[0]:.2f} (1 min)",
        "",
        "| case | ms, float32 | ms, mixed_bfloat16 | spread float32 / bf16 (min-max of rounds) "
        "| bf16 vs float32 |",
        "|---|---:|---:|---|---:|",
    ]

    below: list[str] = []  # Rows under the adoption rule's 1.2x.

    def row(name: str, times: dict[str, list[float]]) -> None:
        f32, bf16 = (statistics.median(times[p]) for p in _PRECISIONS)
        if f32 / bf16 < _ADOPTION_GAIN:
            below.append(f"{name} ({f32 / bf16:.2f}x)")
        lines.append(
            f"| {name} | {f32 * 1e3:.2f} | {bf16 * 1e3:.2f} | {_spread_ms(times, _PRECISIONS)} | "
            f"{f32 / bf16:.2f}x |"
        )
        print(lines[-1], flush=True)

    for name, kind, reps in cases:
        steps = {p: _learner_step(kind, 500, strategy, precision=p) for p in _PRECISIONS}
        times = _interleaved_times(steps, reps, rounds)
        row(f"learner update, {name}, batch 500, both cores", times)
    for name, kind in _INFERENCE_CASES:
        case = {"kind": kind, "batch": envs, "repeats": repeats, "rounds": rounds}
        times = _run_case("--inference_case", case)
        row(f"actor inference (`ActorPolicy.step`), {name}, batch {envs}, 1 thread", times)
    load_after = os.getloadavg()
    loaded = benchlib.other_jobs_running(load_before)
    lines += [
        "",
        f"Median of {rounds} interleaved rounds (float32 and mixed_bfloat16 timed in turn each "
        f"round), each the median of {repeats} calls (the Nature CNN update: "
        f"{max(3, repeats // 6)}, the 42x42 update: {max(3, repeats // 3)}), on data already in "
        "memory, results fetched. The learner is `ImpalaLearner.train_step` (V-trace, Adam, "
        "clipping) built with the `precision` key, on both cores as the learner runs. The "
        "inference rows run in a fresh subprocess with one intra-op and one inter-op TensorFlow "
        "thread, as actor processes do, at the batch an actor of `configs/pong-impala-small.yaml` "
        f"acts on (`num_envs_per_env_runner` = {envs}), the call including the action sampling "
        "in numpy. Under mixed_bfloat16 the torsos compute in bfloat16; variables, heads, "
        "V-trace and the optimizer stay float32. The rule for a new default adopts it only "
        "if the learner and inference rows gain at least 1.2x and Pong reaches 0 in no more env "
        "steps (2 seeds). "
        + (
            f"Rows under 1.2x in this run: {'; '.join(below)}. The rule is not met, so float32 "
            "stays the default whatever Pong's learning with it. "
            if below
            else "Every row gains 1.2x or more; Pong learning with it decides (not measured "
            "here), and float32 stays the default until it is. "
        )
        + f"Load average after: {load_after[0]:.2f}"
        + (" (other jobs were running when it started: figures are noisy)." if loaded else "."),
    ]
    return "\n".join(lines)


#: The issue's rule: mixed_bfloat16 becomes the default only where every row gains this much.
_ADOPTION_GAIN = 1.2


def _has_avx512_bf16() -> str:
    """ "yes" or "no" from /proc/cpuinfo's flags, "unknown" where it cannot be read."""
    info = benchlib.read_cpuinfo()
    if info is None:
        return "unknown"
    return "yes" if "avx512_bf16" in info[1] else "no"


#: The two implementations the `conv` part compares, and the layer's shapes.
_CONV_LAYERS = ("keras.layers.Conv2D", "CoveringConv2D")
_CONV_INPUT, _CONV_FILTERS = (11, 11, 32), 256


def _conv_case(batch: int, threads: int, backward: bool, repeats: int, rounds: int) -> dict:
    """Runs in a fresh subprocess (`threads` TensorFlow threads; 0: TensorFlow's default): the
    last vision layer as a plain Keras convolution and as `CoveringConv2D`, in turn; returns
    each one's median seconds per round and the largest difference of their outputs, relative."""
    import keras
    import numpy as np
    import tensorflow as tf

    if threads:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    from impala_tf.models.vision import CoveringConv2D

    rng = np.random.default_rng(0)
    # What the layer sees in the Pong net: relu maps of uint8 pixels taken as 0..255.
    x = tf.constant(rng.uniform(0.0, 50.0, (batch, *_CONV_INPUT)).astype(np.float32))
    kernel = _CONV_INPUT[0]
    layers = {}
    for name, cls in zip(_CONV_LAYERS, (keras.layers.Conv2D, CoveringConv2D)):
        layer = cls(_CONV_FILTERS, kernel, padding="valid", activation="relu")
        layer.build(x.shape)
        layers[name] = layer
    layers[_CONV_LAYERS[1]].set_weights(layers[_CONV_LAYERS[0]].get_weights())

    def make(layer):
        @tf.function(autograph=False)
        def forward(inputs):
            return layer(inputs)

        @tf.function(autograph=False)
        def forward_backward(inputs):
            with tf.GradientTape() as tape:
                tape.watch(inputs)
                loss = tf.reduce_sum(tf.square(layer(inputs)))
            return tape.gradient(loss, [inputs, *layer.trainable_variables])

        fn = forward_backward if backward else forward
        return lambda: tf.nest.map_structure(np.asarray, fn(x))

    plain, covering = (np.asarray(layers[n](x)) for n in _CONV_LAYERS)
    difference = float(np.abs(plain - covering).max() / max(np.abs(plain).max(), 1e-30))
    times = _interleaved_times({n: make(layers[n]) for n in _CONV_LAYERS}, repeats, rounds)
    return {"times": times, "difference": difference}


def bench_conv(repeats: int, rounds: int = 5) -> str:
    """RLlib's last vision layer as a convolution and as one matmul (`CoveringConv2D`)."""
    load_before = os.getloadavg()
    envs = int(_pong_small().num_envs_per_env_runner)
    cases = [
        (f"forward, batch {envs} (an actor of pong-impala-small), 1 thread", envs, 1, False),
        ("forward + backward, batch 500 (the learner), both cores", 500, 0, True),
    ]
    h, w, c = _CONV_INPUT
    lines = [
        f"### RLlib's last vision layer ({_CONV_FILTERS} filters {h}x{w} on {h}x{w}x{c}, valid): "
        "convolution vs matmul",
        "",
        f"Machine: {benchlib.machine_line()}; load average before: {load_before[0]:.2f} (1 min)",
        "",
        "| case | ms, `keras.layers.Conv2D` | ms, `CoveringConv2D` | spread (min-max of rounds) "
        "| speed-up | largest difference (relative) |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for name, batch, threads, backward in cases:
        case = {"batch": batch, "threads": threads, "backward": backward}
        case.update(repeats=repeats, rounds=rounds)
        result = _run_case("--conv_case", case)
        times = result["times"]
        plain, covering = (statistics.median(times[n]) for n in _CONV_LAYERS)
        spread = _spread_ms(times, _CONV_LAYERS)
        lines.append(
            f"| {name} | {plain * 1e3:.2f} | {covering * 1e3:.2f} | {spread} | "
            f"{plain / covering:.2f}x | {result['difference']:.1e} |"
        )
        print(lines[-1], flush=True)
    loaded = benchlib.other_jobs_running(load_before)
    lines += [
        "",
        f"Median of {rounds} interleaved rounds (the two layers timed in turn each round), each "
        f"the median of {repeats} calls of a compiled `tf.function` on inputs already in memory, "
        "results fetched; same weights for both. `CoveringConv2D` (impala_tf/models/vision.py) "
        "is what `ConvStack` builds: a convolution whose kernel covers its whole input is one "
        "matmul of the flattened input and the reshaped kernel, with the same variables."
        + (" Other jobs were running when it started: figures are noisy." if loaded else ""),
    ]
    return "\n".join(lines)


def _call_case(path: str, repeats: int, rounds: int) -> dict:
    """Runs in a fresh subprocess on one TensorFlow thread: the config's actor forward call
    through the `tf.function` and through `TracedCall`, in turn; returns each one's median
    seconds per round, the batch, and whether the two gave equal results."""
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from impala_tf.acting.tf_policy import ActorPolicy
    from impala_tf.config import ImpalaConfig
    from impala_tf.driver.specs import env_spec
    from impala_tf.envs.make import make_env

    config = ImpalaConfig.from_yaml(path)[0]
    env = make_env(env_spec(config), worker_index=1)
    obs_space, act_space = env.observation_space, env.action_space
    env.close()
    policy = ActorPolicy(obs_space, act_space, config.model, seed=0)
    batch = int(config.num_envs_per_env_runner)
    rng = np.random.default_rng(0)
    obs = np.stack([obs_space.sample() for _ in range(batch)])
    state = tuple(s + rng.normal(size=s.shape).astype(s.dtype) for s in policy.initial_state(batch))
    traced = policy._forward  # The TracedCall ActorPolicy.forward calls.
    paths = dict(zip(_CALL_PATHS, (traced.fn, traced)))
    results = [tf.nest.map_structure(np.asarray, f(obs, state)) for f in paths.values()]
    equal = all(
        np.array_equal(a, b)
        for a, b in zip(tf.nest.flatten(results[0]), tf.nest.flatten(results[1]))
    )
    steps = {
        name: lambda f=f: tf.nest.map_structure(np.asarray, f(obs, state))
        for name, f in paths.items()
    }
    times = _interleaved_times(steps, repeats, rounds)
    return {"times": times, "batch": batch, "equal": equal, "direct": traced.direct}


def bench_call(repeats: int, rounds: int = 5) -> str:
    """An actor's forward call through `tf.function` and through `TracedCall`."""
    load_before = os.getloadavg()
    lines = [
        "### An actor's forward call: `tf.function` vs `TracedCall`",
        "",
        f"Machine: {benchlib.machine_line()}; load average before: {load_before[0]:.2f} (1 min)",
        "",
        "| config (model) | batch | ms, `tf.function` | ms, `TracedCall` | spread (min-max of "
        "rounds) | saved per call (ms) | equal results |",
        "|---|---:|---:|---:|---|---:|---|",
    ]
    for path in CALL_CONFIGS:
        result = _run_case("--call_case", {"path": path, "repeats": repeats, "rounds": rounds})
        if not result["direct"]:
            raise RuntimeError("TracedCall fell back to the tf.function: nothing to compare")
        if not result["equal"]:
            raise RuntimeError(f"TracedCall and the tf.function disagree on {path}")
        times = result["times"]
        public, traced = (statistics.median(times[n]) for n in _CALL_PATHS)
        spread = _spread_ms(times, _CALL_PATHS)
        name = os.path.relpath(path, ROOT)
        lines.append(
            f"| {name} | {result['batch']} | {public * 1e3:.2f} | {traced * 1e3:.2f} | {spread} "
            f"| {(public - traced) * 1e3:.2f} | yes |"
        )
        print(lines[-1], flush=True)
    loaded = benchlib.other_jobs_running(load_before)
    lines += [
        "",
        f"Median of {rounds} interleaved rounds (the two paths timed in turn each round), each "
        f"the median of {repeats} calls on the same numpy observations (and recurrent state), "
        "results fetched as numpy, as `ActorPolicy.forward` does. `TracedCall` "
        "(impala_tf/acting/tf_policy.py) looks the trace up once per input signature and then "
        "calls the "
        "traced graph; the `tf.function` binds its arguments and looks the trace up on every "
        "call."
        + (" Other jobs were running when it started: figures are noisy." if loaded else ""),
    ]
    return "\n".join(lines)


def _memory_case(kind: str, batch: int, microbatch: int | None) -> dict:
    """Runs in a fresh subprocess: one update through the learner thread; returns peak RSS."""
    import numpy as np
    import tensorflow as tf

    from impala_tf.data.sample_batch import SampleBatch
    from impala_tf.learning import pipeline
    from impala_tf.learning.learner import ImpalaLearner
    from impala_tf.learning.thread import LearnerThread, TrainBatch

    def vm_hwm_mb() -> float:
        return proclib.peak_rss_bytes(os.getpid()) / 2**20

    config = _config(kind, batch, microbatch_size=microbatch)
    obs_space, act_space = _spaces(kind)
    strategy = tf.distribute.get_strategy()
    with strategy.scope():
        learner = ImpalaLearner(config, obs_space, act_space)
    signature = pipeline.batch_signature(config, obs_space, act_space, 1)
    thread = LearnerThread(learner, strategy, signature)
    host = SampleBatch(_random_batch(kind, batch // T))
    host_mb = sum(np.asarray(v).nbytes for v in host.values()) / 2**20
    before = vm_hwm_mb()
    thread.start()
    start = time.perf_counter()
    thread.inqueue.put(TrainBatch(host))
    steps, _, stats = thread.outqueue.get(timeout=1800)
    seconds = time.perf_counter() - start
    thread.stop()
    if thread.error is not None:
        raise thread.error
    assert steps == batch and np.isfinite(stats["total_loss"])
    return {
        "peak_mb": vm_hwm_mb(),
        "before_mb": before,
        "host_batch_mb": host_mb,
        "update_s": seconds,
    }


def bench_memory(batch: int, microbatch: int) -> str:
    lines = [
        f"### Peak memory of one update on a train batch of {batch:,} env steps, with and "
        "without microbatches",
        "",
        f"Machine: {benchlib.machine_line()}",
        "",
        "| model | microbatch_size | peak RSS (MB) | before the update (MB) | added by the update "
        "(MB) | host batch (MB) | update (s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, name in (("mlp", "CartPole MLP [256, 256]"), ("cnn", "Nature CNN, 84x84x4 uint8")):
        for micro in (None, microbatch):
            case = {"kind": kind, "batch": batch, "microbatch": micro}
            result = _run_case("--memory_case", case)
            lines.append(
                f"| {name} | {micro or 'none'} | {result['peak_mb']:,.0f} | "
                f"{result['before_mb']:,.0f} | {result['peak_mb'] - result['before_mb']:,.0f} | "
                f"{result['host_batch_mb']:,.0f} | {result['update_s']:.1f} |"
            )
    lines += [
        "",
        "Each row is a fresh process that builds the learner and its learner thread (one device) "
        "and the train batch in host memory (`before the update`), puts the batch on the learner "
        "queue and waits for the update; peak RSS is the process's `VmHWM`. Without "
        "`microbatch_size` the loader converts and hands over the whole batch and the update "
        "holds the activations and gradients of every step at once; with it "
        "the loader hands over 1,000 steps at a time and the learner sums their gradients in "
        "accumulator variables before one update. On a CPU the device memory is the process's "
        "memory, so both rows include the host copy of the batch (the `host batch` column); on a "
        "GPU only the microbatch and the model live on the device. `update` is the wall time from "
        "queueing the batch to the update's stats.",
    ]
    return "\n".join(lines)


def bench_gpu(repeats: int) -> str:
    import tensorflow as tf

    gpus = tf.config.list_logical_devices("GPU")
    header = ["### Nature CNN learner on one GPU (84x84x4 uint8 frames)", ""]
    if not gpus:
        note = "No GPU was visible on this run's machine; this part was skipped."
        print(f"bench_learner gpu: {note}")
        return "\n".join([*header, f"Machine: {benchlib.machine_line()}", "", note])
    lines = [
        *header,
        f"Machine: {benchlib.machine_line()}, GPU {gpus[0].name}",
        "",
        "| batch | ms / update | samples/s |",
        "|---:|---:|---:|",
    ]
    for batch in (500, 2000):
        step = _learner_step("cnn", batch, tf.distribute.get_strategy())
        seconds = benchlib.median_seconds(step, repeats=repeats, warmup=5)
        lines.append(f"| {batch:,} | {seconds * 1e3:.2f} | {batch / seconds:,.0f} |")
    lines += ["", f"Median of {repeats} updates on a batch already on the GPU."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument(
        "--rounds", type=int, default=5, help="interleaved rounds (xla, bf16, conv, call)"
    )
    parser.add_argument("--memory_batch", type=int, default=20_000)
    parser.add_argument("--microbatch", type=int, default=1_000)
    parser.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    parser.add_argument("--memory_case", help=argparse.SUPPRESS)
    parser.add_argument("--inference_case", help=argparse.SUPPRESS)
    parser.add_argument("--conv_case", help=argparse.SUPPRESS)
    parser.add_argument("--call_case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_case:
        case = json.loads(args.memory_case)
        print(json.dumps(_memory_case(case["kind"], case["batch"], case["microbatch"])))
        return
    if args.inference_case:
        case = json.loads(args.inference_case)
        times = _inference_case(case["kind"], case["batch"], case["repeats"], case["rounds"])
        print(json.dumps(times))
        return
    if args.conv_case:
        case = json.loads(args.conv_case)
        print(json.dumps(_conv_case(**case)))
        return
    if args.call_case:
        print(json.dumps(_call_case(**json.loads(args.call_case))))
        return
    _configure_two_cpus()
    for part in args.parts:
        start = time.perf_counter()
        if part == "keras":
            markdown = bench_keras(args.repeats)
        elif part == "devices":
            markdown = bench_devices(args.repeats)
        elif part == "memory":
            markdown = bench_memory(args.memory_batch, args.microbatch)
        elif part == "xla":
            markdown = bench_xla(args.repeats, args.rounds)
        elif part == "bf16":
            markdown = bench_bf16(args.repeats, args.rounds)
        elif part == "conv":
            markdown = bench_conv(args.repeats, args.rounds)
        elif part == "call":
            markdown = bench_call(args.repeats, args.rounds)
        else:
            markdown = bench_gpu(args.repeats)
        if not args.no_write:
            benchlib.write_section(f"bench_learner_{part}", markdown)
        print(markdown, f"\n({part}: {time.perf_counter() - start:.0f} s)\n", flush=True)


if __name__ == "__main__":
    main()
