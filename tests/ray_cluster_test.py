"""The Ray backend on a two-node cluster on this machine that loses a node mid-run.

`ray.cluster_utils.Cluster`: a head (2 CPUs) and a second node carrying the custom resource
"node2"; the actors ask for it (`custom_resources_per_env_runner`), so they start on the second
node. First a Ray Tune trial runs there: its placement group spans the nodes (its driver on the
head, its actors on the second node). Then the node is removed while an algorithm trains; the
actors are restarted on the head (their resource left with the node) and counted, and training
goes on.
"""

from __future__ import annotations

import pytest

from tests.support import ray as raylib
from tests.support.configs import small_config


@pytest.mark.slow
def test_a_lost_node_restarts_its_actors_on_the_head(tmp_path):
    import ray
    from ray.cluster_utils import Cluster

    with raylib.ray_environment(str(tmp_path)):
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 2,
                "include_dashboard": False,
                "object_store_memory": 80 * 2**20,
            },
        )
        try:
            node2 = cluster.add_node(
                num_cpus=2, resources={"node2": 2}, object_store_memory=80 * 2**20
            )
            cluster.wait_for_nodes()
            _a_tune_trial_puts_its_actors_on_the_cluster(cluster, node2.node_id, tmp_path)
            config = small_config(
                backend="ray",
                ray_address=cluster.address,
                custom_resources_per_env_runner={"node2": 1},
                num_cpus_per_env_runner=0.5,
                min_time_s_per_iteration=1,
            )
            algo = config.build()
            try:
                head_id = ray.get_runtime_context().get_node_id()
                placed = algo.actors.workers.node_ids()
                assert set(placed.values()) == {node2.node_id}, (placed, head_id)
                before = algo.train()
                assert before["num_env_steps_sampled"] > 0
                cluster.remove_node(node2)
                restarted = None
                for _ in range(40):  # Both actors were on the lost node.
                    restarted = algo.train()
                    if restarted["num_env_runner_restarts"] >= 2:
                        break
                assert restarted["num_env_runner_restarts"] >= 2, restarted
                assert set(algo.actors.workers.node_ids().values()) == {head_id}
                last = algo.train()
            finally:
                algo.stop()
            assert last["num_healthy_workers"] == 2
            assert last["num_env_steps_sampled"] > restarted["num_env_steps_sampled"]
            assert last["num_env_steps_trained"] > before["num_env_steps_trained"]
        finally:
            ray.shutdown()
            cluster.shutdown()


def _a_tune_trial_puts_its_actors_on_the_cluster(cluster, node2: str, tmp_path) -> None:
    import ray

    # Connected before Tune is imported: `Cluster` gives this process a GCS client of its own,
    # and a trainable registered (at import) over that client alone connects Ray in the
    # middle of Tune's registry flush, which then fails ("dictionary changed size").
    ray.init(address=cluster.address)
    try:
        tune = pytest.importorskip("ray.tune")
        from impala_tf.tune import IMPALA

        head = ray.get_runtime_context().get_node_id()
        # The trial's driver (1.5 CPUs) fits only on the head, its two actors (1 CPU and
        # "node2" each) only on the second node: one placement group across both.
        space = small_config(
            backend="ray",
            custom_resources_per_env_runner={"node2": 1},
            num_cpus_per_env_runner=1,
            num_cpus_for_main_process=1.5,
            callbacks="tests.support.callbacks:NodesOfTheRun",
        ).to_dict()
        results = tune.Tuner(
            IMPALA,
            param_space=space,
            run_config=tune.RunConfig(
                storage_path=str(tmp_path / "tune"), stop={"training_iteration": 2}, verbose=0
            ),
        ).fit()
        assert not results.errors
        (result,) = results
        assert result.metrics["node_ids"] == {"driver": head, "actors": [node2]}
        assert result.metrics["num_healthy_workers"] == 2
    finally:
        ray.shutdown()
