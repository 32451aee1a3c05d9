"""missing_capacity: the cluster check place_roles runs before creating placement groups, on node
records shaped as ``ray.nodes()`` returns them (keys and values copied from a real Ray 2.60 node)."""

from __future__ import annotations

import pytest

from megarl.ray_cluster.placement import RolePlacement, missing_capacity


def node(host: str, gpus: float, cpus: float = 16.0, *, alive: bool = True, node_id: str = "") -> dict:
    resources = {"CPU": cpus, f"node:{host}": 1.0, "memory": 17093498061.0, "object_store_memory": 7325784883.0}
    if gpus:
        resources |= {"GPU": gpus, "accelerator_type:H100": 1.0}
    return {
        "NodeID": node_id or f"{host}-id".ljust(56, "0"),
        "Alive": alive,
        "NodeManagerAddress": f"10.0.0.{len(host)}",
        "NodeManagerHostname": host,
        "NodeName": f"10.0.0.{len(host)}",
        "Resources": resources,
        "Labels": {"ray.io/node-id": node_id},
    }


def spec(role: str, nnodes: int, procs: int, gpus: float = 1.0, cpus: float = 1.0, roles: tuple[str, ...] = ()):
    """One pool as place_roles builds it: (roles, shape, bundle of one process)."""
    bundle = {"CPU": cpus} | ({"GPU": gpus} if gpus else {})
    return (roles or (role,), RolePlacement(role, nnodes, procs, gpus, cpus), bundle)


def test_too_few_nodes_with_the_gpus_of_a_node_group():
    nodes = [node("node-a", 8), node("node-b", 8), node("node-c", 4), node("node-d", 8)]
    nodes[3]["Alive"] = False  # a dead node's resources do not count
    # 4 x 8 GPUs: the totals (20 alive) already refuse it.
    assert "32 GPUs requested for policy, cluster has 20" in missing_capacity([spec("policy", 4, 8)], nodes)
    # 3 x 6 = 18 GPUs fit the 20 in total, but only node-a and node-b hold 6 at once.
    assert missing_capacity([spec("policy", 3, 6)], nodes) == (
        "placement: policy needs 3 nodes with 6 GPUs each; the cluster has room for 2 "
        "(node-a 8 GPUs, node-b 8 GPUs, node-c 4 GPUs); start Ray on 1 more node with 6 GPUs or lower nnodes"
    )
    assert missing_capacity([spec("policy", 2, 6)], nodes) is None


def test_one_big_node_holds_several_node_groups():
    # A 16-GPU node takes two node-groups of 8 (each STRICT_PACK on one node); 12 + 4 take none twice.
    assert missing_capacity([spec("policy", 2, 8)], [node("big", 16)]) is None
    refused = missing_capacity([spec("policy", 2, 8)], [node("a", 12), node("b", 4)])
    assert refused.startswith("placement: policy needs 2 nodes with 8 GPUs each; the cluster has room for 1 (a 12 GPUs, b 4 GPUs)")


def test_pools_compete_for_the_same_nodes():
    # Disaggregated: policy 1 x 8 and rollout 1 x 8 fit 16 GPUs in total, not nodes of 8, 4 and 4.
    specs = [spec("policy", 1, 8), spec("rollout", 1, 8)]
    nodes = [node("a", 8), node("b", 4), node("c", 4)]
    assert missing_capacity(specs, nodes).startswith(
        "placement: policy (1) and rollout (1) need 2 nodes with 8 GPUs each; the cluster has room for 1 (a 8 GPUs, b 4 GPUs, c 4 GPUs)"
    )
    # A smaller node-group may use what the larger ones leave.
    assert missing_capacity([spec("policy", 1, 8), spec("rollout", 2, 4)], nodes) is None
    assert missing_capacity([spec("policy", 1, 8), spec("rollout", 2, 4)], nodes[:2]) == (
        "placement: 16 GPUs requested in all (policy 8, rollout 8), cluster has 12"
    )


def test_cpu_node_groups_and_fractions():
    # CPU only (the demo's shape): 3 node-groups of 2 x 0.6 CPUs (3.6 of the 4 in total) on two 2-CPU nodes.
    nodes = [node("vm", 0, cpus=2.0, node_id="aaaaaa11"), node("vm", 0, cpus=2.0, node_id="bbbbbb22")]
    refused = missing_capacity([spec("policy", 3, 2, gpus=0, cpus=0.6)], nodes)
    assert refused == (
        "placement: policy needs 3 nodes with 1.2 CPUs each; the cluster has room for 2 "
        "(vm:aaaaaa 2 CPUs, vm:bbbbbb 2 CPUs); start Ray on 1 more node with 1.2 CPUs or lower nnodes"
    )
    # 2 / 0.5 is exactly 4 node-groups of one 0.5-CPU process: no rounding loss.
    assert missing_capacity([spec("policy", 8, 1, gpus=0, cpus=0.5)], nodes) is None


@pytest.mark.parametrize(
    ("specs", "text"),
    [
        ([spec("policy", 1, 8)], "placement: policy needs 8 GPUs on one node (8 procs per node x 1), the largest node has 4"),
        ([spec("policy", 1, 2, cpus=20)], "placement: policy needs 40 CPUs on one node"),
        ([spec("policy", 1, 1, gpus=0, cpus=50)], "placement: 50 CPUs requested for policy, cluster has 48"),
    ],
)
def test_totals_and_largest_node_come_first(specs, text):
    assert missing_capacity(specs, [node("a", 4), node("b", 4), node("c", 4)]).startswith(text)


def test_no_alive_node():
    assert missing_capacity([spec("policy", 1, 1)], [node("a", 8, alive=False)]) == (
        "placement: 1 GPUs requested for policy, cluster has 0"
    )
