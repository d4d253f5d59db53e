"""The entropy of the vision net's first policy on Pong's frames, per seed (session 13).

Run from the repository root: `.venv/bin/python notes/probes/initial_entropy.py`. It builds
`pong-impala-small`'s model (`build_model`, the model actors and learner use) for each seed
and prints the entropy of its action distribution on 31 frames of random play (ln 6 = 1.79 is
uniform). With RLlib's Glorot logits head (before 72cbfbe) seeds 0-2 and 100-104 gave 0.29,
0.23, 0.002, 1.4e-6, 0.65, 0.29, 0.36, 0.009; with the normc(0.01) head, 1.78-1.79.
"""

import keras
import numpy as np
import tensorflow as tf

from impala_tf.config import ImpalaConfig
from impala_tf.envs.atari import ensure_registered, make_atari_env
from impala_tf.models.catalog import build_model

config = ImpalaConfig.from_yaml("configs/pong-impala-small.yaml")[0]
ensure_registered(config.env)
env = make_atari_env(config.env, config, training=True)
rng = np.random.default_rng(0)
obs, _ = env.reset(seed=0)
frames = [obs]
for _ in range(300):
    obs, _, terminated, truncated, _ = env.step(int(rng.integers(env.action_space.n)))
    frames.append(obs)
    if terminated or truncated:
        obs, _ = env.reset()
batch = tf.constant(np.stack(frames[::10]))
for seed in (0, 1, 2, 100, 101, 102, 103, 104):
    keras.utils.set_random_seed(seed)
    model = build_model(env.observation_space, env.action_space, config.model)
    p = tf.nn.softmax(model(batch)[0]).numpy()
    entropy = -(p * np.log(np.maximum(p, 1e-30))).sum(-1)
    print(f"seed {seed}: entropy mean {entropy.mean():.3g}, min {entropy.min():.3g}")
