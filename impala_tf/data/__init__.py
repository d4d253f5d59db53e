"""Data: the numpy batches between the actors and the learner (no TensorFlow here).

`sample_batch.SampleBatch` (RLlib's columns), `layouts` (its flat and time-major views),
`batching` (fragments cut into train batches), `train_batch` (`TrainBatch`, what the learner
thread queues, and RLlib's `MinibatchBuffer`) and `replay` (mix-in replay). This package's
`__init__` imports nothing.
"""
