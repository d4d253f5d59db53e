"""Training from a user's side: the Keras-style `fit` loop and its callbacks, RLlib's
algorithm callbacks, results written to disk and TensorBoard, and evaluation videos.

`loop.fit`, `callbacks` (Keras callbacks), `algorithm_callbacks` (RLlib's `DefaultCallbacks`,
which run in the actors too), `reporting` and `video`. This package's `__init__` imports nothing.
"""
