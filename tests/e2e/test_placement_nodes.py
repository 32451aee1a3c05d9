"""place_roles refuses, before creating anything, a request for more nodes than a real Ray cluster
has: two raylets on this machine (Ray's own ``cluster_utils.Cluster``), 3 pretend GPUs each."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(180)

from ray.cluster_utils import Cluster  # noqa: E402
from ray.util import placement_group_table  # noqa: E402

from megarl.ray_cluster.placement import PlacementError, RolePlacement, place_roles, release  # noqa: E402


@pytest.fixture(scope="module")
def two_nodes():
    # Ray schedules declared GPUs as plain resources, so no device is needed.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 3})
    try:
        cluster.add_node(num_cpus=1, num_gpus=3)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_more_nodes_than_the_cluster_has(two_nodes):
    # 3 node-groups of 2 GPUs: 6 GPUs, as many as the cluster has, but each node holds one group.
    with pytest.raises(PlacementError) as info:
        place_roles([RolePlacement("policy", 3, 2, gpus_per_proc=1, cpus_per_proc=0.1)], timeout_s=5)
    line = str(info.value)
    assert "\n" not in line
    assert line.startswith("placement: policy needs 3 nodes with 2 GPUs each; the cluster has room for 2 (")
    assert line.count(" 3 GPUs") == 2  # both nodes listed with what they hold
    assert line.endswith("start Ray on 1 more node with 2 GPUs or lower nnodes")
    assert placement_group_table() == {}  # refused before any placement group was created
    # Two node-groups do fit, one on each node.
    placed = place_roles([RolePlacement("policy", 2, 2, gpus_per_proc=1, cpus_per_proc=0.1)], timeout_s=60)
    release(placed)
