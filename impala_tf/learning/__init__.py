"""Learning: the V-trace learner and the thread that feeds it (TensorFlow).

`vtrace` and `losses` are the maths as pure tensor ops; `learner.ImpalaLearner` is one update as
a `keras.Model.train_step` (`gradients`, `schedules`, `nonfinite`, `sequences` are its parts);
`spec.LearnerSpec` is what it is built from; `thread.LearnerThread` trains it on queued batches
that `loader` and `pipeline` bring onto its devices (`devices`). This package's `__init__`
imports nothing.
"""
