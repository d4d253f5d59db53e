"""Acting: the policies that choose actions, in the actors, the driver and user code.

`factory.make_policy` picks how a policy acts: `numpy_policy.NumpyPolicy` (the catalog's MLPs in
numpy), `traced_policy` (a custom model's traced step run in numpy) or `tf_policy.ActorPolicy`
(TensorFlow). `inference` is central inference (the driver acts for every actor),
`remote_policy` its actors' side, `inference_protocol` the messages and endpoints between them,
`kept_stacks` the frame stacks the server keeps; `trained_policy.Policy` is a trained policy
called from Python. `action_sampler`, `actions` and `filters` are the numpy pieces they share.
This package's `__init__` imports nothing, so actors load only what they use.
"""
