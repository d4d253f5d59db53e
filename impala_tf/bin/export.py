r"""impala-export: writes a checkpoint's policy as a TensorFlow SavedModel for serving.

  impala-export --checkpoint=runs/cartpole --out=exported/cartpole

B is batch. The SavedModel's `serving_default` signature takes `obs`, a batch of observations
[B, *obs_shape] in the observation space's dtype, and returns

* `actions`: the distribution's mode, the deterministic action [B, *action_shape] (int64 for
  Discrete / MultiDiscrete, float32 for Box);
* `logits`: float32 [B, A], the action distribution's inputs (RLlib's `action_dist_inputs`);
* `values`: float32 [B], V(x).

Recurrent models (`use_lstm`, or a custom recurrent model) also take `state_in_0`, `state_in_1`,
... (float32 [B, H] each; h and c for `use_lstm`) and return `state_out_0`, `state_out_1`, ...;
their `initial_state` signature maps `batch_size` (int32 scalar) to the state before the first
step (zeros for `use_lstm`). Set a row's state back to it when its episode ends.

With `observation_filter: MeanStdFilter` the run's merged filter (saved in the checkpoint) is part
of the SavedModel: `obs` is the raw observation, standardised inside by the filter's mean and
standard deviation as they were at the checkpoint (and clipped if the filter clips), exactly as the
actors and `impala-evaluate` apply it; the statistics are frozen.

Loading needs TensorFlow only (no impala_tf, no Keras):

    policy = tf.saved_model.load("exported/cartpole").signatures["serving_default"]
    action = policy(obs=tf.constant(obs[None]))["actions"][0]
"""

from __future__ import annotations

import logging
import sys

from absl import flags
from absl import logging as absl_logging

from impala_tf.bin import _common  # Defines --verbose.

__all__ = ["export_saved_model", "serving_module", "run"]

FLAGS = flags.FLAGS

flags.DEFINE_string("checkpoint", None, "Checkpoint directory, or a training logdir.")
flags.DEFINE_string(
    "policy_id", None, "The policy to export (needed for checkpoints of several policies)."
)
flags.DEFINE_string("out", None, "Directory to write the SavedModel to.")


def serving_module(model, action_space, obs_filter=None):
    """A `tf.Module` holding `model`'s variables with the serving functions described above.

    Args:
      model: An `impala_tf.models.ActorCritic`.
      action_space: The env's action space (it picks the action distribution).
      obs_filter: An `impala_tf.acting.filters.MeanStdFilter` applied to `obs` first (frozen), or
      None.

    Returns:
      `(module, signatures)`: the module to save and its signatures by name.
    """
    import numpy as np
    import tensorflow as tf

    from impala_tf.models import distributions

    module = tf.Module(name="impala_policy")
    # Tracked so that the SavedModel stores them; the functions below capture the same ones.
    module.model_variables = list(model.variables)
    obs_shape = tuple(int(d) for d in (model.observation_space.shape or ()))
    obs_spec = tf.TensorSpec(
        [None, *obs_shape], tf.as_dtype(np.dtype(model.observation_space.dtype)), name="obs"
    )

    if obs_filter is not None:
        mean, scale = (tf.constant(a) for a in obs_filter.serving_stats())
        clip = float(obs_filter.clip) if obs_filter.clip else None

    def act(obs, state):
        if obs_filter is not None:
            obs = (tf.cast(obs, tf.float32) - mean) / scale
            if clip is not None:
                obs = tf.clip_by_value(obs, -clip, clip)
        logits, values, new_state = model.step(obs, state)
        actions = distributions.make_distribution(action_space, logits).mode()
        out = {"actions": actions, "logits": logits, "values": values}
        for i, s in enumerate(new_state):
            out[f"state_out_{i}"] = s
        return out

    if not model.is_recurrent:

        @tf.function(input_signature=[obs_spec])
        def serve(obs):
            return act(obs, ())

        module.serve = serve
        return module, {"serving_default": serve}

    zero = model.initial_state(1)
    state_specs = [
        tf.TensorSpec([None, *s.shape[1:]], s.dtype, name=f"state_in_{i}")
        for i, s in enumerate(zero)
    ]

    @tf.function(input_signature=[obs_spec, *state_specs])
    def serve_recurrent(obs, *state):
        return act(obs, tuple(state))

    @tf.function(input_signature=[tf.TensorSpec([], tf.int32, name="batch_size")])
    def initial_state(batch_size):
        return {f"state_in_{i}": s for i, s in enumerate(model.initial_state(batch_size))}

    module.serve = serve_recurrent
    module.initial_state = initial_state
    return module, {"serving_default": serve_recurrent, "initial_state": initial_state}


def export_saved_model(model, action_space, out_dir: str, obs_filter=None) -> dict:
    """Writes `model` (after `obs_filter`, if given) as a SavedModel to `out_dir`.

    Returns:
      The signatures written, by name (`tf.function`s with input signatures).
    """
    import tensorflow as tf

    module, signatures = serving_module(model, action_space, obs_filter)
    tf.saved_model.save(module, out_dir, signatures=signatures)
    return signatures


def main(argv: list[str]) -> int:
    del argv
    from impala_tf.utils.quiet import import_tensorflow, quiet_start

    # Before anything imports TensorFlow; it is imported once --checkpoint checks out, so that
    # a wrong path is told at once.
    quiet_start(FLAGS.verbose, import_now=False)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not FLAGS["verbosity"].present:  # absl turns INFO on after parsing; TF logs much there.
        absl_logging.set_verbosity(absl_logging.WARNING)
    from impala_tf import checkpoints

    _common.import_from_cwd()  # The checkpoint's custom model may live in the user's module.
    try:
        checkpoint_dir = checkpoints.resolve_checkpoint_dir(FLAGS.checkpoint)
        import_tensorflow()  # Quietly, before the config imports a user's model module.
        config = checkpoints.load_config(checkpoint_dir)
        from impala_tf.driver.evaluation import load_policy_model

        model, action_space, obs_filter = load_policy_model(checkpoint_dir, config, FLAGS.policy_id)
    except (FileNotFoundError, ValueError) as e:
        print(f"impala-export: error: {e}", file=sys.stderr, flush=True)
        return 1
    import tensorflow as tf

    signatures = export_saved_model(model, action_space, FLAGS.out, obs_filter)
    serving = signatures["serving_default"].get_concrete_function()
    inputs = ", ".join(
        f"{spec.name}{spec.shape.as_list()} {spec.dtype.name}"
        for spec in tf.nest.flatten(serving.structured_input_signature)
    )
    outputs = ", ".join(sorted(serving.structured_outputs))
    print(
        f"impala-export: wrote {FLAGS.out} from {checkpoint_dir} ({config.env}); "
        f"serving_default: {inputs} -> {outputs}",
        flush=True,
    )
    return 0


def run() -> None:
    """Console-script entry point (also `python -m impala_tf.bin.export`)."""
    flags.mark_flag_as_required("checkpoint")
    flags.mark_flag_as_required("out")
    _common.run_binary(main, __name__, __doc__)


if __name__ == "__main__":
    run()
