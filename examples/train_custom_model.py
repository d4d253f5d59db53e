"""Trains CartPole with your own model: a Keras model or an RLlib TFModelV2.

    python -m examples.train_custom_model                       # the functional Keras model
    python -m examples.train_custom_model --model=rllib_style   # the TFModelV2, by name

Run from the repository root (`examples` must be importable, for the actor processes too).
docs/custom-models.md walks through it.
"""

from __future__ import annotations

import argparse

from examples.custom_models import RLlibStyleMLP, keras_mlp
from impala_tf import ImpalaConfig
from impala_tf.models import ModelCatalog

# RLlib's way: register the class under a name, then configs name it.
ModelCatalog.register_custom_model("rllib_style_mlp", RLlibStyleMLP)

MODELS = {
    # A function that builds a functional keras.Model, with a keyword argument.
    "keras_mlp": {"custom_model": keras_mlp, "custom_model_config": {"hiddens": [64, 64]}},
    # A subclassed keras.Model, by import path.
    "keras_subclassed": {"custom_model": "examples.custom_models:KerasMLP"},
    # A registered TFModelV2.
    "rllib_style": {"custom_model": "rllib_style_mlp"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="keras_mlp")
    parser.add_argument("--stop-reward", type=float, default=450.0)
    parser.add_argument("--stop-iters", type=int, default=100)
    args = parser.parse_args()

    config = (
        ImpalaConfig()
        .environment("CartPole-v1")
        .env_runners(num_env_runners=2, num_envs_per_env_runner=32, rollout_fragment_length=50)
        .training(train_batch_size=1000, lr=0.0005, model=MODELS[args.model])
        .resources(num_gpus=0)
        .reporting(min_time_s_per_iteration=1)
    )
    algo = config.build()  # Builds and checks the model once, then starts the actors.
    try:
        for _ in range(args.stop_iters):
            result = algo.train()
            print(
                f"iter {result['training_iteration']}: return {result['episode_reward_mean']:.1f}"
                f" after {result['timesteps_total']:,} env steps"
            )
            if result["episode_reward_mean"] >= args.stop_reward:
                break
        print(f"custom model {type(algo.get_policy().model.net).__name__} trained")
    finally:
        algo.stop()


if __name__ == "__main__":
    main()
