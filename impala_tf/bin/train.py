r"""impala-train: trains IMPALA from an RLlib tuned-example YAML (or the CartPole default).

  impala-train --config=configs/cartpole-impala.yaml --logdir=runs/cartpole
  impala-train --set lr=0.001 --set model.fcnet_hiddens=[64,64] --stop_reward=150
  impala-train --logdir=runs/cartpole --stop_iters=200      # resumes runs/cartpole

Writes to the logdir: `result.json` (one RLlib result dict per line), TensorBoard event files
(tags in `impala_tf.training.reporting`), `params.json` (the config, stop criteria and these flags)
and `checkpoints/checkpoint_<iteration>/` every `checkpoint_freq` iterations and at the end, keeping
the newest `keep_checkpoints_num`. Prints one progress line per iteration (`--verbose`: also the
whole result and TensorFlow's C++ start-up log) and exits 0 when a stop criterion is met. Flags
override the YAML's `stop:`. SIGINT, SIGTERM and SIGHUP save a checkpoint, stop every child
process and exit with 128 + the signal's number; a second one exits at once
(`impala_tf.utils.shutdown`).

Resuming: a `--logdir` that holds checkpoints is resumed from the newest one (`--noresume`
refuses instead). The run's stored config and flags are used; `--set`, `--seed`, `--stop_*` and
flags given on the command line override them. Weights, optimizer state, counters, schedules and
result numbering continue; results logged after that checkpoint are moved to
`result.discarded.json`. With `--deterministic`, a resumed run matches an uninterrupted one
exactly (see `impala_tf.driver.algorithm`).

Searches: a YAML (or a `--set`) with Ray Tune's search spaces (`lr: {grid_search: [...]}`,
`env: {grid_search: [...]}`, `{eval: "..."}`), or `--num_samples` above 1, runs as RLlib runs it:
one Tune trial per point (`impala_tf.tune.search`), each in `<logdir>/<trial name>/`, on the
Ray at `ray_address` or a local Ray with `--ray_num_cpus` CPUs, and a table of every trial at
the end. A `--logdir` that holds a search (one interrupted with Ctrl-C, or a trial that
failed) is continued with Tune's `Tuner.restore`: unfinished and failed trials go on from
their latest checkpoints (`--noresume` refuses instead). Needs Ray Tune
(`pip install 'impala_tf[tune]'`).

Trackers: `--wandb_project=P` and `--mlflow_experiment=E` (with `--mlflow_tracking_uri`) log
every iteration to Weights & Biases or MLflow (`impala_tf.training.trackers`; Ray Tune's own
logger callbacks in a search).

Callbacks: `--callbacks=package.module:factory` (repeatable) adds Keras callbacks to the driver
loop, one epoch per iteration (`impala_tf.training.callbacks`); `--learner_callbacks` adds them to
the learner thread, called around each update. `factory` is a `keras.callbacks.Callback`, or a
callable (a class) returning one or a list. RLlib's callbacks (`DefaultCallbacks`, with episode
hooks and custom metrics) are the YAML's `callbacks` key instead
(`impala_tf.config.callbacks`). The current directory is importable: a YAML's import
paths (`custom_model`, `callbacks`, an env creator) may name the user's own modules.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

_START = time.time()

from absl import app, flags  # noqa: E402
from absl import logging as absl_logging  # noqa: E402

from impala_tf.bin import _common  # noqa: E402 - defines --verbose.
from impala_tf.bin import _search as _search_lib  # noqa: E402
from impala_tf.utils import timeline  # noqa: E402

FLAGS = flags.FLAGS

flags.DEFINE_string("config", None, "RLlib tuned-example YAML; default: CartPole-v1 defaults.")
flags.DEFINE_multi_string(
    "set", [], "Override a config key: KEY=VALUE (YAML value); model keys as model.KEY=VALUE."
)
flags.DEFINE_string("logdir", None, "Output directory (default: ./runs/<name>-<time>).")
flags.DEFINE_float("stop_reward", None, "Stop at this episode_reward_mean.")
flags.DEFINE_integer("stop_timesteps", None, "Stop after this many env steps sampled.")
flags.DEFINE_integer("stop_iters", None, "Stop after this many iterations.")
flags.DEFINE_float("stop_time_s", None, "Stop after this many seconds of training.")
flags.DEFINE_integer("seed", None, "Random seed (config key `seed`).")
flags.DEFINE_integer("checkpoint_freq", None, "Iterations between checkpoints (0: only at end).")
flags.DEFINE_bool("resume", True, "Continue from the newest checkpoint in --logdir if it has one.")
flags.DEFINE_bool(
    "deterministic",
    False,
    "Sample and train in lockstep so that a seeded run (and its resumption) is reproducible "
    "exactly; needs one actor and min_time_s_per_iteration=0. Slow: for debugging and tests.",
)
flags.DEFINE_multi_string(
    "callbacks", [], "module.path:factory of Keras callbacks for the driver loop (repeatable)."
)
flags.DEFINE_multi_string(
    "learner_callbacks", [], "module.path:factory of Keras callbacks for the learner thread."
)
flags.DEFINE_integer("histogram_freq", 0, "Iterations between weight histograms (0: none).")
flags.DEFINE_integer("num_samples", 1, "Tune trials per grid point (a search: see above).")
flags.DEFINE_float("ray_num_cpus", None, "CPUs of the local Ray a search starts (default: all).")
flags.DEFINE_string("wandb_project", None, "Log every iteration to this W&B project.")
flags.DEFINE_string("mlflow_experiment", None, "Log every iteration to this MLflow experiment.")
flags.DEFINE_string("mlflow_tracking_uri", None, "MLflow's store (default: ./mlruns).")
flags.DEFINE_string(
    "save_best",
    None,
    "Keep the checkpoint with the best value of this result key in <logdir>/best, e.g. "
    "episode_reward_mean or evaluation/episode_reward_mean.",
)

_DEFAULT_NAME = "cartpole-impala"
_PARAMS_FILE = "params.json"
#: Flags stored in params.json and reused when a run is resumed without them.
_STORED_FLAGS = (
    "deterministic",
    "checkpoint_freq",
    "callbacks",
    "learner_callbacks",
    "histogram_freq",
    "save_best",
)


#: The --stop_* flags and the result keys they stop at.
_STOP_FLAGS = (
    ("stop_reward", "episode_reward_mean"),
    ("stop_timesteps", "timesteps_total"),
    ("stop_iters", "training_iteration"),
    ("stop_time_s", "time_total_s"),
)

#: The signal handlers of this run (installed by `main`).
_SHUTDOWN = None


class TrainError(Exception):
    """A problem with the flags or the logdir, reported without a traceback."""


def parse_overrides(pairs: list[str]) -> dict:
    """Parses `KEY=VALUE` strings (VALUE as YAML) into a config dict; `model.x` nests."""
    import yaml

    out: dict = {}
    for pair in pairs:
        if "=" not in pair:
            raise app.UsageError(f"--set expects KEY=VALUE, got {pair!r}")
        key, raw = pair.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            raise app.UsageError(f"--set {key}: the value {raw!r} is not valid YAML ({e})") from e
        if key.startswith("model."):
            model = out.setdefault("model", {})
            if not isinstance(model, dict):
                raise app.UsageError(
                    f"--set {key}: an earlier --set model={model!r} is not a dict of model keys"
                )
            model[key[len("model.") :]] = value
        else:
            out[key.strip()] = value
    return out


def _apply_flags(config, stop: dict) -> None:
    """Applies --set, --seed and --stop_* to a config and stop dict (in place)."""
    config.update_from_dict(parse_overrides(FLAGS.set))
    if FLAGS.seed is not None:
        config.debugging(seed=FLAGS.seed)
    for flag, key in _STOP_FLAGS:
        value = getattr(FLAGS, flag)
        if value is not None:
            stop[key] = value


def load_config():
    """Builds (name, config, stop) from the flags."""
    from impala_tf.config import ImpalaConfig, normalize_stop_criteria

    if FLAGS.config:
        config, stop = ImpalaConfig.from_yaml(FLAGS.config)
        name = os.path.splitext(os.path.basename(FLAGS.config))[0]
    else:
        config = ImpalaConfig().environment("CartPole-v1")
        stop = normalize_stop_criteria({"episode_reward_mean": 450, "timesteps_total": 2_000_000})
        name = _DEFAULT_NAME
    _apply_flags(config, stop)
    return name, config, stop


def load_resumed_config(logdir: str, checkpoint_dir: str):
    """Builds (name, config, stop, stored flags) of a run to resume, with the flags applied.

    The config is the checkpoint's; `--config`, if given, must describe the same run (a
    restarted job repeats its command line) or it is ignored with a warning.
    """
    from impala_tf import checkpoints

    params_path = os.path.join(logdir, _PARAMS_FILE)
    params = {}
    if os.path.isfile(params_path):
        with open(params_path, encoding="utf-8") as f:
            params = json.load(f)
    config = checkpoints.load_config(checkpoint_dir)
    stop = dict(params.get("stop") or {})
    _apply_flags(config, stop)
    if FLAGS.config:
        _, wanted, _ = load_config()
        stored, given = config.to_dict(), wanted.to_dict()
        changed = sorted(k for k in set(stored) | set(given) if stored.get(k) != given.get(k))
        if changed:
            print(
                f"impala-train: warning: resuming {logdir} with its stored config; --config "
                f"differs in {changed} and is ignored (use --set to change keys).",
                file=sys.stderr,
                flush=True,
            )
    name = params.get("name") or os.path.basename(os.path.normpath(logdir))
    return name, config, stop, dict(params.get("flags") or {})


def load_callbacks(specs: list[str]) -> list:
    """`impala_tf.training.callbacks.load_callbacks`, with the current directory importable."""
    from impala_tf.training.callbacks import load_callbacks as load

    _common.import_from_cwd()
    try:
        return load(specs)
    except ValueError as e:
        raise TrainError(str(e)) from e


def _make_wall_clock(offset_s: float):
    import keras

    from impala_tf.training.callbacks import result_of

    class WallClock(keras.callbacks.Callback):
        """Adds `time_since_start_s` (wall time, continued across resumes) to each result."""

        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                timeline.mark("iteration 1")  # The first includes the learner's first trace.
            value = offset_s + time.time() - _START
            result_of(logs)["time_since_start_s"] = value
            if logs is not None:
                logs["time_since_start_s"] = value

    return WallClock()


def _stored(name: str, stored_flags: dict):
    """A flag's value: given on the command line, else stored by the resumed run, else default."""
    if FLAGS[name].present or name not in stored_flags:
        return getattr(FLAGS, name)
    return stored_flags[name]


def main(argv: list[str]) -> int:
    del argv
    timeline.mark("flags")  # The interpreter, absl and this module's imports, the flags parsed.
    from impala_tf.utils.quiet import quiet_start

    # Before anything imports TensorFlow; `_train` imports it once the fork server starts.
    quiet_start(FLAGS.verbose, import_now=False)
    from impala_tf.utils.shutdown import GracefulShutdown, Interrupted

    global _SHUTDOWN
    _SHUTDOWN = GracefulShutdown("impala-train").install()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not FLAGS["verbosity"].present:  # absl turns INFO on after parsing; TF logs much there.
        absl_logging.set_verbosity(absl_logging.WARNING)
    try:
        return _train()
    except TrainError as e:
        print(f"impala-train: error: {e}", file=sys.stderr, flush=True)
        return 1
    except Interrupted as e:  # Before training started: nothing to save.
        print(f"impala-train: {e}; exiting", file=sys.stderr, flush=True)
        return e.exit_code


def _search() -> tuple | None:
    """(name, algorithm, settings, stop, scheduler) when the flags ask for a Tune search."""
    stop_flags = {key: getattr(FLAGS, flag) for flag, key in _STOP_FLAGS}
    return _search_lib.search_request(
        FLAGS.config, parse_overrides(FLAGS.set), FLAGS.seed, stop_flags, FLAGS.num_samples
    )


def _train_search(
    name: str, algo_name: str, settings: dict, stop: dict, scheduler: dict | None
) -> int:
    logdir = FLAGS.logdir or os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        return _search_lib.run(
            name, algo_name, settings, stop, scheduler,
            logdir=logdir,
            num_samples=FLAGS.num_samples,
            ray_num_cpus=FLAGS.ray_num_cpus,
            checkpoint_freq=FLAGS.checkpoint_freq,
            wandb_project=FLAGS.wandb_project,
            mlflow_experiment=FLAGS.mlflow_experiment,
            mlflow_tracking_uri=FLAGS.mlflow_tracking_uri,
            verbose=FLAGS.verbose,
            resume=FLAGS.resume,
        )  # fmt: skip
    except (ImportError, ValueError) as e:
        raise TrainError(str(e)) from e


def _trackers(name: str) -> list:
    from impala_tf.training import trackers

    out = []
    if FLAGS.wandb_project:
        out.append(trackers.WandbLogger(FLAGS.wandb_project, name=name))
    if FLAGS.mlflow_experiment:
        out.append(
            trackers.MLflowLogger(
                FLAGS.mlflow_experiment, tracking_uri=FLAGS.mlflow_tracking_uri, run_name=name
            )
        )
    return out


def _train() -> int:
    from impala_tf import checkpoints
    from impala_tf.training.reporting import stop_reached, truncate_results

    _common.import_from_cwd()  # Before the plan imports a config's custom model or callbacks.
    try:
        search = _search()
    except (FileNotFoundError, ValueError) as e:
        raise TrainError(str(e)) from e
    if search is not None:
        return _train_search(*search)
    resume_from = checkpoints.latest_checkpoint(FLAGS.logdir) if FLAGS.logdir else None
    if resume_from and not FLAGS.resume:
        raise TrainError(
            f"--logdir={FLAGS.logdir} holds checkpoints ({resume_from}); pass --resume to "
            "continue that run, or another --logdir."
        )
    try:
        if resume_from:
            name, config, stop, stored_flags = load_resumed_config(FLAGS.logdir, resume_from)
        else:
            (name, config, stop), stored_flags = load_config(), {}
    except (FileNotFoundError, ValueError) as e:
        raise TrainError(str(e)) from e
    logdir = FLAGS.logdir or os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(logdir, exist_ok=True)
    last = None
    if resume_from:
        state = checkpoints.read_driver_state(resume_from)
        last = truncate_results(logdir, int(state["iteration"]))
        steps = int(state["counters"].get("num_env_steps_sampled", 0))
        print(
            f"impala-train: resuming from {resume_from} (iteration {state['iteration']}, "
            f"{steps:,d} env steps)",
            flush=True,
        )
        reached = stop_reached(last, stop) if last is not None else None
        if reached:
            print(f"impala-train: already stopped at {reached}", flush=True)
            return 0
    else:  # Results of an earlier start that never saved a checkpoint belong to no run now.
        truncate_results(logdir, 0)
    run_flags = {key: _stored(key, stored_flags) for key in _STORED_FLAGS}
    checkpoint_freq = run_flags["checkpoint_freq"]  # None (stored so): the config's key.
    if checkpoint_freq is None:
        checkpoint_freq = config.checkpoint_freq
    with open(os.path.join(logdir, _PARAMS_FILE), "w", encoding="utf-8") as f:
        params = {"name": name, "config": config.to_dict(), "stop": stop, "flags": run_flags}
        json.dump(params, f, indent=2, default=str)

    print(f"impala-train: {name} on {config.env}, logdir {logdir}, stop {stop}", flush=True)
    if run_flags["deterministic"]:
        # A process-wide switch, so the binary (which owns the process) makes it, not the
        # library: an algorithm built in a notebook must not change every later one.
        from impala_tf.utils.quiet import import_tensorflow

        import_tensorflow()
        import tensorflow as tf

        tf.config.experimental.enable_op_determinism()
    from impala_tf.driver.factory import build_algorithm
    from impala_tf.workers.memory import ActorMemoryError

    try:
        algo = build_algorithm(  # The factory behind ImpalaConfig.build().
            config,
            # Loaded once TensorFlow is imported: after the actors' fork server started.
            callbacks=lambda: load_callbacks(run_flags["learner_callbacks"]),
            deterministic=run_flags["deterministic"],
            logdir=logdir,  # Batches of skipped non-finite updates go to <logdir>/nonfinite.
        )
    except ValueError as e:  # An invalid config, or one that cannot run deterministically.
        raise TrainError(str(e)) from e
    except ActorMemoryError as e:  # The pool would not fit: refused before any actor started.
        raise TrainError(str(e)) from e
    except ConnectionError as e:  # actor_backend=ray: no cluster at ray_address, or refused.
        raise TrainError(f"{type(e).__name__}: {e}") from e
    from impala_tf.training import callbacks as cb
    from impala_tf.training.loop import fit

    try:
        user_callbacks = load_callbacks(run_flags["callbacks"])
        if resume_from:
            algo.restore(resume_from)
        stopper = cb.StopOnCriteria(stop)
        offset = float((last or {}).get("time_since_start_s", 0.0))
        periodic = cb.PeriodicCheckpoint(
            os.path.join(logdir, checkpoints.CHECKPOINTS_DIR),
            every_n_iterations=checkpoint_freq,
            keep=config.keep_checkpoints_num,
        )
        callbacks = [
            _make_wall_clock(offset),
            cb.ResultLogger(logdir, histogram_freq=run_flags["histogram_freq"]),
            cb.ProgressLogger(stop.get("timesteps_total"), verbose=FLAGS.verbose),
            *user_callbacks,
            *_trackers(name),
            periodic,
        ]
        if run_flags["save_best"]:
            best_dir = os.path.join(logdir, "best")
            callbacks.append(cb.BestCheckpoint(best_dir, run_flags["save_best"]))
        callbacks.append(stopper)
        try:
            result = fit(algo, callbacks)
        except KeyboardInterrupt as e:
            # SIGINT, SIGTERM or SIGHUP (`impala_tf.utils.shutdown`); a second one exits at once.
            if _SHUTDOWN is not None:
                _SHUTDOWN.shutting_down()
            print(
                f"impala-train: interrupted ({e or 'SIGINT'}); saving a checkpoint",
                file=sys.stderr,
                flush=True,
            )
            path = periodic.save_now()
            print(f"impala-train: saved {path}", file=sys.stderr, flush=True)
            return getattr(e, "exit_code", 130)
        reason = stopper.reason or "a callback's request"
        print(
            f"impala-train: stopped at {reason} after {time.time() - _START:.1f} s "
            f"({result['timesteps_total']:,d} env steps); checkpoint {periodic.last_checkpoint}",
            flush=True,
        )
        timeline.mark("stop line")  # The final checkpoint is saved before it.
        return 0
    finally:
        if _SHUTDOWN is not None:
            _SHUTDOWN.shutting_down()
        algo.stop()
        if FLAGS.verbose:  # What is left after this: atexit handlers, then `os._exit`.
            summary = timeline.summary()
            print(f"impala-train: timeline (s since process start): {summary}", flush=True)


def run() -> None:
    """Console-script entry point (also `python -m impala_tf.bin.train`)."""
    _common.run_binary(main, __name__, __doc__)


if __name__ == "__main__":
    run()
