"""Ray Tune: RLlib's algorithms as Tune Trainables, and searches run from YAML files.

    from ray import tune
    from impala_tf import ImpalaConfig
    from impala_tf.tune import IMPALA

    config = ImpalaConfig().environment("CartPole-v1").training(lr=tune.grid_search([1e-3, 2e-3]))
    tune.Tuner(IMPALA, param_space=config.to_dict()).fit()

`trainable` holds the Trainables (`IMPALA`, `APPO`) and the resources a trial reserves;
importing this package registers them with Tune as `"impala_tf.IMPALA"` and `"impala_tf.APPO"`.
`search` runs a YAML's search space (`grid_search`, Tune's `eval` entries, `num_samples`, a
trial `scheduler`) as Tune trials for `impala-train`. Needs Ray Tune
(`pip install 'impala_tf[tune]'`); TensorFlow is imported only when a trial starts.
"""

from __future__ import annotations

from impala_tf.tune.search import SearchError, make_scheduler, run_search, summary_table
from impala_tf.tune.trainable import APPO, IMPALA, AlgorithmTrainable, trial_resources

__all__ = [
    "APPO",
    "IMPALA",
    "AlgorithmTrainable",
    "SearchError",
    "make_scheduler",
    "run_search",
    "summary_table",
    "trial_resources",
]
