"""The controller's side of ``rollout.engine: sglang``: start the servers where they belong,
generate over them, and give the memory hand-over its engine side.

Chosen once by build.py (the RL step never asks which engine it has):

- :class:`SGLangEngines` (the trainer's ``Engines``): prompts spread over the engines with
  ``generate_across`` (contiguous slices, global prompt indices and seeds kept).
- :class:`SGLangMemory`: the engine side of the run's memory hand-over
  (megarl/memory/handover.py, the only caller of its release / resume / restart): the
  residency table's ``engine/weights | kv_cache | cuda_graph`` are SGLang's memory tags, on
  every engine at once (the policy ranks' own engine clients never release or resume);
  health checks, and restarts that reconnect the policy's transports.
- :func:`start_sglang`: the servers launched through the hand-over (colocated: with nothing of
  the trained models on the GPUs, so SGLang sizes its KV cache for the memory it will have).
- :class:`SGLangRollout`: what was started (host actors, engines, the rollout placement
  group), for shutdown.

Deliberately left out: recovering from an engine that dies *during* a generation (the step
fails; resume from the last checkpoint), partial rollouts, routers.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megarl.memory.residency import residency_of
from megarl.engines.base import GenerationResult, SamplingParams
from megarl.memory.handover import Handover
from megarl.rollout_sglang.engine import (
    CUDA_GRAPH,
    KV_CACHE,
    WEIGHTS,
    SGLangEngine,
    generate_across,
)
from megarl.weight_sync.sglang_transports import EngineEndpoint

log = logging.getLogger(__name__)


class SGLangEngines:
    """The trainer's Engines over SGLang servers: results grouped by prompt, in prompt order."""

    def __init__(self, engines: Sequence[SGLangEngine]):
        self.engines = list(engines)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[GenerationResult]:
        return generate_across(self.engines, prompts, params)


def engine_endpoints(engines: Sequence[SGLangEngine], holders: Sequence[Sequence[int]] = ()) -> list[EngineEndpoint]:
    """What a policy rank needs to reach each engine (plain data for Ray); ``holders[k]``: the
    policy ranks on engine k's GPUs in engine TP order (colocated), else empty."""
    held = list(holders) or [() for _ in engines]
    return [EngineEndpoint(e.url, e.tp, e.max_running_requests, tuple(h)) for e, h in zip(engines, held, strict=True)]


@dataclass
class PolicyConnection:
    """Connects every policy rank's transport to the engines (collective); called at start and
    again after a restart (URLs and groups change)."""

    policy: Any  # megarl.actors.clients.PolicyClient
    engines: Sequence[SGLangEngine]
    holders: list[list[int]] = field(default_factory=list)  # colocated: policy ranks per engine, TP order

    def __call__(self) -> None:
        self.policy.connect_engines(engine_endpoints(self.engines, self.holders))


# The residency table's engine states (megarl/memory/residency.py) are SGLang's memory tags.
TAG_OF_STATE = {"engine/weights": WEIGHTS, "engine/kv_cache": KV_CACHE, "engine/cuda_graph": CUDA_GRAPH}


class SGLangMemory:
    """The engine side of the memory hand-over (megarl/memory/handover.py ``EngineMemory``).

    ``reconnect`` re-runs the policy's connection after a restart (URLs and groups change).
    """

    def __init__(self, engines: Sequence[SGLangEngine], reconnect: Any, restart_timeout: float = 900.0) -> None:
        self.engines, self.reconnect, self.restart_timeout = list(engines), reconnect, restart_timeout

    def release(self, states: Collection[str], engines: Sequence[SGLangEngine] | None = None) -> None:
        """Release the tags of ``states`` on ``engines`` (None: all); each engine flushes first
        and refuses while it has requests in flight (SGLangEngine.release_memory)."""
        tags = [TAG_OF_STATE[s] for s in states]
        for engine in self.engines if engines is None else engines:
            engine.release_memory(tags)

    def resume(self, states: Collection[str]) -> None:
        tags = [TAG_OF_STATE[s] for s in states]
        for engine in self.engines:
            engine.resume_memory(tags)

    def dead(self) -> list[SGLangEngine]:
        """The engines whose health check fails (each logged with its server's last lines)."""
        dead = []
        for engine in self.engines:
            health = engine.health()
            if not health.alive:
                dead.append(engine)
                tail = engine.server.log_tail() if engine.server is not None else ""
                log.warning("SGLang engine %s is not healthy (%s); restarting it. Last log lines:\n%s",
                            engine.url, health.detail, tail)  # fmt: skip
        return dead

    def restart(self, engines: Sequence[SGLangEngine]) -> None:
        """Relaunch ``engines`` (they come up holding all their memory, with the initial
        weights) and reconnect the policy's transports."""
        for engine in engines:
            engine.restart(self.restart_timeout)
        self.reconnect()


@dataclass
class SGLangRollout:
    """Everything ``start_sglang`` started; ``close`` stops it (servers, actors, placement)."""

    engines: SGLangEngines
    handover: Handover | None
    hosts: list[Any]
    placed: dict[str, Any] | None = None

    def close(self) -> None:
        import ray

        from megarl.ray_cluster.placement import release

        # Each host kills its server's process group; killing the actor alone would leave the
        # server (its own session) holding the GPUs.
        for host in self.hosts:
            try:
                ray.get(host.shutdown.remote(), timeout=120)
            except Exception as err:  # noqa: BLE001 - keep closing the others
                log.warning("shutting down an SGLang host failed: %s", err)
            ray.kill(host)
        if self.placed:
            release(self.placed)


def rollout_placement(plan: Any) -> Any:
    """Disaggregated pool: one placement group per engine (``tp`` one-GPU bundles, one node),
    so Ray gives those GPUs to nothing else while the servers use them."""
    from megarl.ray_cluster.placement import RolePlacement

    rollout = plan.roles["rollout"]
    if plan.device == "cpu":  # the CPU server's processes: a CPU slot per "GPU" of the pool
        return RolePlacement("rollout", nnodes=rollout.dp, procs_per_node=rollout.tp, gpus_per_proc=0.0, cpus_per_proc=1.0)
    return RolePlacement("rollout", nnodes=rollout.dp, procs_per_node=rollout.tp, gpus_per_proc=1.0, cpus_per_proc=0.0)


def start_sglang(cfg: Any, plan: Any, models: dict[str, Any], log_dir: Path, timeout: float = 900.0) -> SGLangRollout:
    """Start one server per engine on its node through the run's memory hand-over, wait until
    all are healthy, connect the policy. ``models``: the trained models' clients by role."""
    import ray

    from megarl.ray_cluster.placement import place_roles
    from megarl.rollout_sglang.hosts import (
        HostHandle,
        colocated_slots,
        disaggregated_slots,
        probe_bundles,
        slot_spec,
        start_hosts,
    )
    from megarl.rollout_sglang.server import spec_from_config

    colocated = cfg.cluster.placement == "colocated"
    table = residency_of(cfg)  # the planner refuses weights_cpu_backup but with colocated SGLang
    base = spec_from_config(cfg.model.path, cfg.rollout, cfg.cluster, seed=cfg.trainer.seed, dtype=cfg.model.dtype,
                            weights_cpu_backup=table.weights_cpu_backup)  # fmt: skip
    handover = Handover(table, models)
    placed: dict[str, Any] | None = None
    hosts: list[Any] = []
    try:
        if colocated:
            slots = colocated_slots(plan, models["policy"].group.node_infos)  # where the policy ranks run
        else:
            placed = place_roles([rollout_placement(plan)])
            slots = disaggregated_slots(plan, probe_bundles(placed["rollout"]))
        specs = [slot_spec(base, s, str(Path(log_dir) / f"sglang_engine{s.index}.log")) for s in slots]
        connect = PolicyConnection(models["policy"], [], [list(s.holders) for s in slots] if colocated else [])

        def start() -> SGLangMemory:
            hosts.extend(start_hosts(slots, specs))
            urls = ray.get([h.start.remote(timeout) for h in hosts])
            connect.engines = [SGLangEngine(HostHandle(h, u, s), tp=s.tp, max_running_requests=s.max_running_requests)
                               for h, u, s in zip(hosts, urls, specs, strict=True)]  # fmt: skip
            return SGLangMemory(connect.engines, connect, restart_timeout=timeout)

        handover.launch(start)
        connect()
    except BaseException:
        SGLangRollout(SGLangEngines([]), None, hosts, placed).close()
        raise
    engines = connect.engines
    where = [f"{e.url} ({f'GPUs {s.gpu_ids}' if s.gpu_ids else 'CPU'} on {s.ip})" for e, s in zip(engines, slots, strict=True)]
    log.info("SGLang engines up: %s", ", ".join(where))
    return SGLangRollout(SGLangEngines(engines), handover, hosts, placed)
