"""Where the SGLang servers run: one small Ray actor per engine, on the node that owns the
engine's GPUs, hosting an :class:`~megarl.rollout_sglang.server.SGLangServer` there.

Mapping engines to GPUs (pure functions, tested on CPU): the planner gives the rollout pool
as global GPU indices (``Plan.roles["rollout"].gpus``); engine k takes the contiguous slice
``gpus[k * tp : (k + 1) * tp]``. Each of those GPUs is held by a process whose Ray node
info (``ip``, ``node_id``, ``gpu_ids``) says where it is:

- colocated: the policy rank on that GPU (``WorkerGroup.node_infos``);
- disaggregated: a bundle of the rollout placement group (one placement group per engine,
  ``tp`` one-GPU bundles, STRICT_PACK), read by short-lived probe actors.

The host actor asks Ray for no GPU (the GPUs are the policy's, or reserved by the rollout
placement group); it is pinned to the node with NodeAffinitySchedulingStrategy and gives the
server its physical GPU ids through ``ServerSpec.gpu_ids`` (-> CUDA_VISIBLE_DEVICES).

Deliberately left out: engines spanning nodes (the planner keeps ``rollout.tp`` within one
node), routers, killing a server whose host actor was SIGKILLed (``shutdown`` must run).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from megarl.rollout_sglang.server import ServerSpec, SGLangServer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSlot:
    """Where engine ``index`` runs: a node and the physical GPU ids (on that node) of its TP ranks,
    as Ray reports them: indices or UUIDs (``GPU-...``, when the node's CUDA_VISIBLE_DEVICES holds
    UUIDs), kept as strings for CUDA_VISIBLE_DEVICES.

    ``holders``: for each TP rank, the index of the process holding that GPU in the list the
    slot was computed from (colocated: the policy rank, in engine TP order).
    """

    index: int
    node_id: str
    ip: str
    gpu_ids: tuple[str, ...]
    holders: tuple[int, ...]


def engine_slots(rollout_gpus: Sequence[int], tp: int, holder_of: dict[int, int],
                 infos: Sequence[dict[str, Any]], device: str = "cuda", key: str = "rollout.tp") -> list[EngineSlot]:  # fmt: skip
    """One slot per engine: ``rollout_gpus`` cut into contiguous ``tp``-sized slices.

    ``holder_of[g]`` is the index into ``infos`` of the process on global GPU ``g``;
    ``infos[i]`` has ``node_id``, ``ip`` and ``gpu_ids`` (physical ids, one per process; on
    ``device`` cpu the "GPUs" are process slots and hold no GPU id). ``key``: the config key of
    ``tp`` the errors name (the LLM judge's servers: reward.judge.tp).
    Raises ValueError when an engine's GPUs are on two nodes or a GPU has no holder.
    """
    if tp < 1 or len(rollout_gpus) % tp:
        raise ValueError(f"{key} ({tp}) must divide the {len(rollout_gpus)} GPUs of its pool")
    slots = []
    for k in range(len(rollout_gpus) // tp):
        gpus = list(rollout_gpus[k * tp : (k + 1) * tp])
        missing = [g for g in gpus if g not in holder_of]
        if missing:
            raise ValueError(f"engine {k}: GPUs {missing} are held by no process (rollout GPUs {gpus})")
        holders = [holder_of[g] for g in gpus]
        nodes = {infos[h]["node_id"] for h in holders}
        if len(nodes) != 1:
            raise ValueError(
                f"engine {k} (global GPUs {gpus}) would span {len(nodes)} nodes; {key} ({tp}) must "
                "fit in one node and engines must not straddle nodes (check cluster.gpus_per_node)"
            )
        first = infos[holders[0]]
        if device == "cpu":
            slots.append(EngineSlot(k, first["node_id"], first["ip"], (), tuple(holders)))
            continue
        without = [h for h in holders if len(infos[h]["gpu_ids"]) != 1]
        if without:
            raise ValueError(f"engine {k}: processes {without} do not hold exactly one GPU "
                             f"({[infos[h]['gpu_ids'] for h in without]}); SGLang needs cluster.device=cuda")
        local = tuple(str(infos[h]["gpu_ids"][0]) for h in holders)  # a UUID is no int
        slots.append(EngineSlot(k, first["node_id"], first["ip"], local, tuple(holders)))
    return slots


def colocated_slots(plan: Any, policy_infos: Sequence[dict[str, Any]]) -> list[EngineSlot]:
    """Engines on the policy's GPUs: global GPU g is held by the policy rank at g's position
    in ``plan.roles["policy"].gpus`` (the planner lists GPUs in rank order)."""
    rollout = plan.roles["rollout"]
    holder_of = {g: rank for rank, g in enumerate(plan.roles["policy"].gpus)}
    return engine_slots(rollout.gpus, rollout.tp, holder_of, policy_infos, plan.device)


def disaggregated_slots(plan: Any, bundle_infos: Sequence[dict[str, Any]]) -> list[EngineSlot]:
    """Engines on the rollout pool: bundle b (rank order of the rollout placement) holds
    ``plan.roles["rollout"].gpus[b]``."""
    rollout = plan.roles["rollout"]
    return pool_slots(rollout.gpus, rollout.tp, bundle_infos, plan.device)


def pool_slots(gpus: Sequence[int], tp: int, bundle_infos: Sequence[dict[str, Any]], device: str,
               key: str = "rollout.tp") -> list[EngineSlot]:  # fmt: skip
    """Servers on a pool of devices of their own, reserved as :func:`pool_placement` lays them out:
    bundle b (rank order) holds ``gpus[b]`` (the disaggregated rollout pool, the LLM judge's)."""
    holder_of = {g: b for b, g in enumerate(gpus)}
    return engine_slots(gpus, tp, holder_of, bundle_infos, device, key)


def pool_placement(role: str, gpus: int, tp: int, device: str) -> Any:
    """A pool of servers of ``tp`` devices each: one placement group per server (``tp`` one-GPU
    bundles, STRICT_PACK: one node), so Ray gives those GPUs to nothing else while the servers
    use them; on cpu a CPU slot per "GPU" (the CPU server's processes)."""
    from megarl.ray_cluster.placement import RolePlacement

    on_gpu = device != "cpu"
    return RolePlacement(role, nnodes=gpus // tp, procs_per_node=tp, gpus_per_proc=float(on_gpu), cpus_per_proc=float(not on_gpu))


def slot_spec(spec: ServerSpec, slot: EngineSlot, log_path: str | None) -> ServerSpec:
    """``spec`` for one engine: its GPUs, listening on the node's address (the controller and
    the policy ranks may be on other nodes)."""
    return replace(spec, gpu_ids=slot.gpu_ids, host=slot.ip, log_path=log_path)


# ---- the Ray side (needs a running Ray; exercised by the GPU test) --------------------------


class SGLangHost:
    """Runs one SGLang server on this node; the controller calls it through Ray."""

    def __init__(self, spec: ServerSpec, command: Sequence[str] | None = None) -> None:
        from megarl.terminal import worker_logging

        worker_logging()  # megarl's loggers at the driver's --log-level
        if spec.log_path:  # the run's log folder may not exist on this node yet
            Path(spec.log_path).parent.mkdir(parents=True, exist_ok=True)
        self.server = SGLangServer(spec, command)  # command: a stand-in process (CPU tests)

    def start(self, timeout: float = 900.0) -> str:
        self.server.start(timeout)
        return self.server.url

    def url(self) -> str:
        return self.server.url

    def healthy(self) -> bool:
        return self.server.healthy()

    def restart(self, timeout: float = 900.0) -> str:
        self.server.restart(timeout)
        return self.server.url

    def shutdown(self) -> None:
        self.server.shutdown()

    def log_tail(self, max_lines: int = 40) -> str:
        return self.server.log_tail(max_lines)


def start_servers(slots: Sequence[EngineSlot], specs: Sequence[ServerSpec], timeout: float,
                  hosts: list[Any]) -> list[str]:  # fmt: skip
    """Launch one server per slot on its node through an SGLangHost actor each (appended to
    ``hosts`` as they start, so a caller's close stops them even when a launch fails) and wait
    until every one is healthy; their URLs."""
    import ray

    hosts.extend(start_hosts(slots, specs))
    return list(ray.get([h.start.remote(timeout) for h in hosts]))


def stop_servers(hosts: list[Any]) -> None:
    """Stop each host's server (its process group: killing the actor alone would leave the server,
    in a session of its own, holding the GPUs), then the actor; empties ``hosts``."""
    import ray

    for host in hosts:
        try:
            ray.get(host.shutdown.remote(), timeout=120)
        except Exception as err:  # noqa: BLE001 - keep closing the others
            log.warning("shutting down an SGLang host failed: %s", err)
        ray.kill(host)
    hosts.clear()


def start_hosts(slots: Sequence[EngineSlot], specs: Sequence[ServerSpec],
                command: Sequence[str] | None = None) -> list[Any]:  # fmt: skip
    """One SGLangHost actor per slot, pinned to the slot's node (no CPU, no GPU asked)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # Two calls at once: a shutdown must not queue behind a start that waits for a server that
    # never gets healthy (the server is in a session of its own: killing the actor leaves it).
    actor: Any = ray.remote(SGLangHost)
    return [
        actor.options(
            max_restarts=0, max_task_retries=0, max_concurrency=2, num_cpus=0, num_gpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=slot.node_id, soft=False),
        ).remote(spec, command)
        for slot, spec in zip(slots, specs, strict=True)
    ]  # fmt: skip


class HostHandle:
    """The ServerHandle (megarl.rollout_sglang.engine) of a server inside an SGLangHost actor,
    so a controller-side SGLangEngine can restart it and quote its log."""

    def __init__(self, actor: Any, url: str, spec: ServerSpec) -> None:
        self.actor, self._url, self.spec = actor, url, spec

    @property
    def url(self) -> str:
        return self._url

    def restart(self, timeout: float = 900.0) -> None:
        import ray

        self._url = ray.get(self.actor.restart.remote(timeout))

    def shutdown(self) -> None:
        import ray

        ray.get(self.actor.shutdown.remote())

    def log_tail(self, max_lines: int = 40) -> str:
        import ray

        return str(ray.get(self.actor.log_tail.remote(max_lines)))


class _BundleProbe:
    def info(self) -> dict[str, Any]:
        import ray

        return {"ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}  # fmt: skip


def probe_bundles(placed: Any) -> list[dict[str, Any]]:
    """Node and physical GPU of every bundle of a PlacedRole (rank order): a probe actor per
    bundle asks for the bundle's GPU, reports, and exits; the reservation stays."""
    import ray

    probe = ray.remote(_BundleProbe)
    # Handles as Any, as everywhere in megarl: Ray types one as ActorHandle | the class, whose
    # methods have no .remote to mypy, and ray.kill takes the handle only.
    actors: list[Any] = [probe.options(**placed.scheduling(r)).remote() for r in range(placed.placement.world_size)]
    try:
        return list(ray.get([a.info.remote() for a in actors]))
    finally:
        for a in actors:
            ray.kill(a)
