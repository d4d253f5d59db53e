r"""impala-train: trains IMPALA from an RLlib tuned-example YAML (or the CartPole default).

  impala-train --config=configs/cartpole-impala.yaml --logdir=/tmp/run
  impala-train --set lr=0.001 --set model.fcnet_hiddens=[64,64] --stop_reward=150

Writes `<logdir>/result.json` (one RLlib result dict per line), TensorBoard event files and
checkpoints under the logdir, prints one progress line per iteration and exits 0 when a stop
criterion is met. Flags override the YAML's `stop:` section.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

_START = time.time()

from absl import app, flags  # noqa: E402

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
flags.DEFINE_bool("verbose", False, "Print the full result dict each iteration.")

_DEFAULT_NAME = "cartpole-impala"


def parse_overrides(pairs: list[str]) -> dict:
    """Parses `KEY=VALUE` strings (VALUE as YAML) into a config dict; `model.x` nests."""
    import yaml

    out: dict = {}
    for pair in pairs:
        if "=" not in pair:
            raise app.UsageError(f"--set expects KEY=VALUE, got {pair!r}")
        key, raw = pair.split("=", 1)
        value = yaml.safe_load(raw) if raw.strip() else None
        if key.startswith("model."):
            out.setdefault("model", {})[key[len("model.") :]] = value
        else:
            out[key.strip()] = value
    return out


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
    config.update_from_dict(parse_overrides(FLAGS.set))
    if FLAGS.seed is not None:
        config.debugging(seed=FLAGS.seed)
    for flag, key in (
        ("stop_reward", "episode_reward_mean"),
        ("stop_timesteps", "timesteps_total"),
        ("stop_iters", "training_iteration"),
        ("stop_time_s", "time_total_s"),
    ):
        value = getattr(FLAGS, flag)
        if value is not None:
            stop[key] = value
    return name, config, stop


def stop_reached(result: dict, stop: dict) -> str | None:
    """The first stop criterion `result` meets (value >= threshold), or None."""
    for key, threshold in stop.items():
        value = result.get(key)
        if value is not None and value == value and value >= threshold:
            return f"{key}={value:g} >= {threshold:g}"
    return None


def main(argv: list[str]) -> int:
    del argv
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    name, config, stop = load_config()
    logdir = FLAGS.logdir or os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(logdir, exist_ok=True)
    checkpoint_freq = (
        FLAGS.checkpoint_freq if FLAGS.checkpoint_freq is not None else config.checkpoint_freq
    )
    with open(os.path.join(logdir, "params.json"), "w", encoding="utf-8") as f:
        json.dump({"config": config.to_dict(), "stop": stop}, f, indent=2, default=str)

    from impala_tf.reporting import ResultWriter, progress_line

    print(f"impala-train: {name} on {config.env}, logdir {logdir}, stop {stop}", flush=True)
    algo = config.build()
    writer = ResultWriter(logdir)
    checkpoint_dir = os.path.join(logdir, "checkpoint")
    try:
        while True:
            result = algo.train()
            result["time_since_start_s"] = time.time() - _START
            writer.write(result)
            print(progress_line(result, stop.get("timesteps_total")), flush=True)
            if FLAGS.verbose:
                print(json.dumps(result, indent=2, default=str), flush=True)
            reason = stop_reached(result, stop)
            if checkpoint_freq and result["training_iteration"] % checkpoint_freq == 0:
                algo.save(checkpoint_dir)
            if reason:
                algo.save(checkpoint_dir)
                print(
                    f"impala-train: stopped at {reason} after {time.time() - _START:.1f} s "
                    f"({result['timesteps_total']:,d} env steps)",
                    flush=True,
                )
                return 0
    except KeyboardInterrupt:
        print("impala-train: interrupted; saving a checkpoint", file=sys.stderr, flush=True)
        algo.save(checkpoint_dir)
        return 130
    finally:
        algo.stop()
        writer.close()


def run() -> None:
    """Console-script entry point."""
    app.run(main)


if __name__ == "__main__":
    run()
