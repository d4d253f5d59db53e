"""The Ray backend on a two-node cluster on this machine that loses a node mid-run.

`ray.cluster_utils.Cluster`: a head (2 CPUs) and a second node carrying the custom resource
"node2"; the actors ask for it (`custom_resources_per_env_runner`), so they start on the second
node. The node is removed while training; the actors are restarted on the head (their resource
left with the node) and counted, and training goes on.
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
