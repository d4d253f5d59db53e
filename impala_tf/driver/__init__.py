"""The driver: the collaborators `impala_tf.driver.algorithm.Impala` is a thin facade over.

Bottom up: `specs` (the config resolved into the frozen specs workers are built from: no worker
receives the config), `plan` (the run's modes, decided once), `metrics` (counters, episodes, the
result dict), `sampling` (the actors on the worker mechanism), `aggregation` (replay and batch
cutting, in the driver or in aggregation workers), `learners` (one learner and learner thread per
policy), `broadcast` (weights to the actors), `schedule` (the training step: asynchronous or
lockstep), `state` (checkpoints), `policies` (the policies to call: `get_policy`, weights), and
`factory` (`build_algorithm`, behind `ImpalaConfig.build()` and `impala-train`). This
package's `__init__` imports nothing, so aggregation workers can import
`impala_tf.driver.aggregation` without TensorFlow.
"""
