"""Ray placement groups for the worker roles (policy, critic, rollout, ...).

Input: one `RolePlacement` per role (the lead adapts the planner's output to it) and the
sets of roles that share devices (colocated). Output: one `PlacedRole` per role, which a
`WorkerGroup` uses to put rank r of that role on bundle r.

Layout: one bundle per process; one placement group per node-group of a role
(`procs_per_node` bundles, STRICT_PACK: a node-group never straddles nodes). Colocated
roles must have the same shape and share the very same bundles: a shared bundle holds the
GPUs of one process and the CPUs of all sharing roles; each sharing actor asks for
`gpus_per_proc / number of sharing roles` GPUs, so Ray puts them on the same device(s).

Before anything is created the request is checked against the cluster (`missing_capacity`:
totals, the largest node, and enough nodes to hold every node-group), so an impossible
request fails at once with a message that names the role and the numbers; a request that
is possible but blocked (resources held by others) fails after `timeout_s` naming the
node-group that could not be placed. Deliberately left out:
node affinity / labels, spreading node-groups over distinct nodes (Ray may pack two
node-groups on one big node; WorkerGroup computes LOCAL_RANK from where ranks really land).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from megarl.progress import still_waiting
from megarl.ray_cluster.session import wait_watching_the_node


class PlacementError(RuntimeError):
    """The requested placement cannot be (or was not) satisfied by the Ray cluster."""


class MissingCapacity(PlacementError):
    """The cluster can never hold the placement: too few GPUs, CPUs or nodes in it."""


@dataclass(frozen=True)
class RolePlacement:
    """How many processes a role runs and what each one holds.

    role: name used in errors and log files (policy | critic | rollout | ...).
    nnodes x procs_per_node processes in all; gpus_per_proc is 0 on CPU.
    """

    role: str
    nnodes: int
    procs_per_node: int
    gpus_per_proc: float = 0.0
    cpus_per_proc: float = 1.0

    def __post_init__(self) -> None:
        if self.nnodes < 1 or self.procs_per_node < 1:
            raise ValueError(
                f"placement of {self.role}: nnodes ({self.nnodes}) and procs_per_node "
                f"({self.procs_per_node}) must be >= 1"
            )
        if self.gpus_per_proc < 0 or self.cpus_per_proc < 0:
            raise ValueError(f"placement of {self.role}: gpus_per_proc and cpus_per_proc must be >= 0")
        if self.gpus_per_proc == 0 and self.cpus_per_proc == 0:
            raise ValueError(
                f"placement of {self.role}: a process needs some resource; set cpus_per_proc > 0 "
                "(e.g. 1) when gpus_per_proc is 0"
            )

    @property
    def world_size(self) -> int:
        return self.nnodes * self.procs_per_node

    def same_shape(self, other: RolePlacement) -> bool:
        return (self.nnodes, self.procs_per_node, self.gpus_per_proc) == (
            other.nnodes,
            other.procs_per_node,
            other.gpus_per_proc,
        )


# (roles sharing the pool, their common shape, the resources of one bundle = one process)
PoolSpec = tuple[tuple[str, ...], RolePlacement, dict[str, float]]


@dataclass
class BundlePool:
    """Placement groups (one per node-group) shared by one or more colocated roles."""

    roles: tuple[str, ...]
    shape: RolePlacement
    groups: list[PlacementGroup]
    removed: bool = False

    def bundle_of(self, rank: int) -> tuple[PlacementGroup, int]:
        """Rank r lives on bundle r % procs_per_node of node-group r // procs_per_node."""
        per_node = self.shape.procs_per_node
        return self.groups[rank // per_node], rank % per_node

    def remove(self) -> None:
        if self.removed:
            return
        for pg in self.groups:
            remove_placement_group(pg)
        self.removed = True


@dataclass
class PlacedRole:
    """One role's share of a BundlePool: what each of its actors asks Ray for."""

    placement: RolePlacement
    pool: BundlePool
    num_gpus: float  # per actor; a fraction when roles share a GPU
    num_cpus: float  # per actor
    owns_pool: bool = field(default=False)

    @property
    def role(self) -> str:
        return self.placement.role

    def scheduling(self, rank: int) -> dict[str, Any]:
        """Ray actor options that pin rank `rank` to its bundle."""
        pg, index = self.pool.bundle_of(rank)
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=pg,
            placement_group_bundle_index=index,
            placement_group_capture_child_tasks=True,
        )
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, "scheduling_strategy": strategy}


def place_roles(
    placements: Sequence[RolePlacement],
    colocate: Iterable[Sequence[str]] = (),
    *,
    timeout_s: float = 120.0,
) -> dict[str, PlacedRole]:
    """Create and wait for the placement groups of every role; returns role -> PlacedRole.

    colocate: sets of role names that share bundles, e.g. [("policy", "rollout")]. Roles in
    no set get a pool of their own (disaggregated). Raises PlacementError, having removed
    whatever it created, when the cluster cannot hold the request or it is not placed within
    timeout_s.
    """
    by_role = {p.role: p for p in placements}
    if len(by_role) != len(placements):
        raise ValueError(f"placement: role names must be unique, got {[p.role for p in placements]}")
    pool_specs = _pool_specs(by_role, colocate)
    _check_cluster(pool_specs)
    pools: list[BundlePool] = []
    try:
        for roles, shape, bundle in pool_specs:
            groups = [
                placement_group([dict(bundle)] * shape.procs_per_node, strategy="STRICT_PACK",
                                name=f"megarl-{'+'.join(roles)}-node{i}")
                for i in range(shape.nnodes)
            ]
            pools.append(BundlePool(roles=roles, shape=shape, groups=groups))
        _wait_ready(pools, timeout_s)
    except BaseException:
        for pool in pools:
            pool.remove()
        raise
    placed: dict[str, PlacedRole] = {}
    for pool in pools:
        for role in pool.roles:
            p = by_role[role]
            placed[role] = PlacedRole(
                placement=p, pool=pool, num_gpus=p.gpus_per_proc / len(pool.roles), num_cpus=p.cpus_per_proc
            )
    return placed


def release(placed: Mapping[str, PlacedRole]) -> None:
    """Remove the placement groups behind `placed` (each shared pool once)."""
    for item in placed.values():
        item.pool.remove()


def _pool_specs(by_role: Mapping[str, RolePlacement], colocate: Iterable[Sequence[str]]) -> list[PoolSpec]:
    """(roles, shape, bundle resources) for every pool to create."""
    specs = []
    grouped: set[str] = set()
    for names in colocate:
        names = tuple(n for n in names if n in by_role)
        if not names:
            continue
        overlap = grouped.intersection(names)
        if overlap:
            raise ValueError(f"placement: role(s) {sorted(overlap)} appear in two colocated sets")
        grouped.update(names)
        first = by_role[names[0]]
        for other in names[1:]:
            if not first.same_shape(by_role[other]):
                raise PlacementError(
                    f"placement: colocated roles must have the same shape; {first.role} has "
                    f"{_shape_text(first)} but {other} has {_shape_text(by_role[other])}"
                )
        cpus = sum(by_role[n].cpus_per_proc for n in names)
        specs.append((names, first, _bundle(first.gpus_per_proc, cpus)))
    for role, p in by_role.items():
        if role not in grouped:
            specs.append(((role,), p, _bundle(p.gpus_per_proc, p.cpus_per_proc)))
    return specs


def _bundle(gpus: float, cpus: float) -> dict[str, float]:
    bundle = {}
    if cpus > 0:
        bundle["CPU"] = cpus
    if gpus > 0:
        bundle["GPU"] = gpus
    return bundle


def _shape_text(p: RolePlacement) -> str:
    return f"{p.nnodes} node(s) x {p.procs_per_node} procs x {_num(p.gpus_per_proc)} GPU"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _check_cluster(specs: Sequence[PoolSpec]) -> None:
    """Refuse at once what the cluster can never hold (see missing_capacity)."""
    problem = missing_capacity(specs, ray.nodes())
    if problem:
        raise MissingCapacity(problem)


def missing_capacity(specs: Sequence[PoolSpec], nodes: Sequence[Mapping[str, Any]]) -> str | None:
    """What the cluster lacks for ``specs`` (one line naming the role, the numbers and a fix), or
    None when it could hold them.

    nodes: ``ray.nodes()`` as Ray returns it (dead nodes are skipped). Only necessary conditions
    are checked, so whatever is refused here could never be placed: totals, the largest node,
    then enough nodes for the node-groups (each is STRICT_PACK: all on one node).

    GPU memory is not compared with cluster.gpu_memory_gib: Ray's node resources carry a GPU
    count and an ``accelerator_type:<model>`` marker (``A100`` for the 40 and the 80 GB card
    alike), never the memory of a GPU, so there is nothing to compare the plan with.
    """
    alive = _alive_nodes(nodes)
    for resource, unit in (("GPU", "GPUs"), ("CPU", "CPUs")):
        problem = (
            _total_missing(specs, alive, resource, unit)
            or _largest_missing(specs, alive, resource, unit)
            or _nodes_missing(specs, alive, resource, unit)
        )
        if problem:
            return problem
    return None


def _total_missing(specs: Sequence[PoolSpec], nodes: list[tuple[str, Mapping[str, float]]],
                   resource: str, unit: str) -> str | None:
    have = sum(res.get(resource, 0.0) for _, res in nodes)
    asked = {"+".join(roles): bundle.get(resource, 0.0) * shape.world_size for roles, shape, bundle in specs}
    for name, amount in asked.items():
        if amount > have:
            return f"placement: {_num(amount)} {unit} requested for {name}, cluster has {_num(have)}"
    if sum(asked.values()) > have:
        parts = ", ".join(f"{k} {_num(v)}" for k, v in asked.items() if v)
        return f"placement: {_num(sum(asked.values()))} {unit} requested in all ({parts}), cluster has {_num(have)}"
    return None


def _largest_missing(specs: Sequence[PoolSpec], nodes: list[tuple[str, Mapping[str, float]]],
                     resource: str, unit: str) -> str | None:
    largest = max((res.get(resource, 0.0) for _, res in nodes), default=0.0)
    for roles, shape, bundle in specs:
        per_node = bundle.get(resource, 0.0) * shape.procs_per_node
        if per_node > largest:
            return (
                f"placement: {'+'.join(roles)} needs {_num(per_node)} {unit} on one node "
                f"({shape.procs_per_node} procs per node x {_num(bundle[resource])}), "
                f"the largest node has {_num(largest)}; lower procs_per_node and raise nnodes"
            )
    return None


def _nodes_missing(specs: Sequence[PoolSpec], nodes: list[tuple[str, Mapping[str, float]]],
                   resource: str, unit: str) -> str | None:
    """Enough nodes for the node-groups. A node with c of ``resource`` holds at most c // g
    node-groups that need g or more each, whichever pools they belong to: the totals can
    suffice while the nodes cannot (4 + 4 GPUs do not hold two node-groups of 8, nor 3 + 3
    three of 2)."""
    groups = [("+".join(roles), shape.nnodes, bundle.get(resource, 0.0) * shape.procs_per_node)
              for roles, shape, bundle in specs]
    for need in sorted({size for *_, size in groups}, reverse=True):  # the largest first: its fix comes first
        if need <= 0:
            continue
        rivals = [(name, count, size) for name, count, size in groups if size >= need]
        wanted = sum(count for _, count, _ in rivals)
        room = sum(int(res.get(resource, 0.0) / need + 1e-9) for _, res in nodes)  # 1e-9: 3 / 1.5
        if room >= wanted:
            continue
        who = (f"{rivals[0][0]} needs" if len(rivals) == 1
               else " and ".join(f"{name} ({count})" for name, count, _ in rivals) + " need")
        each = "each" if all(size == need for *_, size in rivals) else "or more each"
        ranked = sorted(nodes, key=lambda item: -item[1].get(resource, 0.0))
        listed = ", ".join(f"{label} {_num(res.get(resource, 0.0))} {unit}" for label, res in ranked[:8])
        more = f" and {len(ranked) - 8} more" if len(ranked) > 8 else ""
        missing = wanted - room
        return (
            f"placement: {who} {wanted} nodes with {_num(need)} {unit} {each}; the cluster has room for "
            f"{room} ({listed or 'no alive node'}{more}); start Ray on {missing} more node{'s' * (missing > 1)} "
            f"with {_num(need)} {unit} or lower nnodes"
        )
    return None


def _alive_nodes(nodes: Sequence[Mapping[str, Any]]) -> list[tuple[str, Mapping[str, float]]]:
    """(label, resources) of the alive nodes; the label is the host name, with the start of the
    node id when several nodes share a host (a test cluster on one machine)."""
    alive = [n for n in nodes if n.get("Alive")]
    hosts = [str(n.get("NodeManagerHostname") or n.get("NodeManagerAddress") or "?") for n in alive]
    return [
        (f"{host}:{str(n.get('NodeID', ''))[:6]}" if hosts.count(host) > 1 else host, n.get("Resources", {}))
        for host, n in zip(hosts, alive)
    ]


def _wait_ready(pools: Sequence[BundlePool], timeout_s: float) -> None:
    """Wait for every placement group, saying so when it lasts; the embedded raylet is looked at
    meanwhile: dead, Ray never places them and its one line ends the wait at once (ranks that
    started later would only wait for it in turn)."""
    deadline = time.monotonic() + timeout_s
    what = ", ".join(f"{'+'.join(pool.roles)} ({len(pool.groups)} node-group(s))" for pool in pools)
    with still_waiting(f"placement: waiting for Ray to place {what}"):
        for pool in pools:
            for index, pg in enumerate(pool.groups):
                if not wait_watching_the_node([pg.ready()], deadline, True, when="while Ray placed the workers"):
                    _not_placed(pool, index, pg, timeout_s)


def _not_placed(pool: BundlePool, index: int, pg: PlacementGroup, timeout_s: float) -> NoReturn:
    avail = ray.available_resources()
    bundle = pg.bundle_specs[0]
    raise PlacementError(
        f"placement: node-group {index} of {'+'.join(pool.roles)} ({pool.shape.procs_per_node} "
        f"bundles of {_resources_text(bundle)}, STRICT_PACK) was not placed within {timeout_s:g} s; "
        f"available now: {_resources_text(avail)}. Other placement groups or jobs may hold "
        "the resources, or no single node has them all"
    )


def _resources_text(res: Mapping[str, float]) -> str:
    keys = [k for k in ("CPU", "GPU") if k in res] or list(res)[:4]
    return "{" + ", ".join(f"{k}: {_num(res.get(k, 0.0))}" for k in keys) + "}"


def role_placements(cfg: Any, plan: Any) -> tuple[list[RolePlacement], list[tuple[str, ...]]]:
    """Ray placements of the Megatron roles of a checked config (``MegaRLConfig``, ``Plan``) and the
    roles that share devices. The reward model's role (``plan.reward_model``, one actor per device)
    shares the policy's bundles when colocated, else has a pool of its own: one bundle per device
    it keeps out of the other pools, node-groups of whole nodes as the training pool's (the planner
    gives it whole nodes on a multi-node cluster). SGLang servers are placed by megarl.rollout_sglang."""
    cl = cfg.cluster
    gpus = 1.0 if cl.device == "cuda" else 0.0
    placements = []
    for role in ("policy", "critic", "reward_model"):
        layout = plan.reward_model if role == "reward_model" else plan.roles.get(role)
        if layout is not None:
            n = len(layout.gpus)
            nnodes = max(1, n // cl.gpus_per_node)
            placements.append(RolePlacement(role, nnodes, n // nnodes, gpus_per_proc=gpus, cpus_per_proc=1.0))
    colocated = cfg.reward.model is not None and cfg.reward.model.placement == "colocated"
    return placements, [("policy", "critic", "reward_model") if colocated else ("policy", "critic")]
