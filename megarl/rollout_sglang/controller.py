"""The controller's side of ``rollout.engine: sglang``: where the servers go, starting them
there, and generating over them.

Chosen once by build.py (the RL step never asks which engine it has):

- :class:`SGLangEngines` (the trainer's ``Engines``): prompts spread over the engines with
  ``generate_across`` (contiguous slices, global prompt indices and seeds kept).
- :func:`prepare_sglang` -> :class:`SGLangRollout`: where each engine runs and how it starts;
  ``start()`` launches the servers and waits until all are healthy (the trainer calls it
  through the run's memory hand-over, megarl/memory/, so that a colocated server starts with
  nothing of the trained models on its GPUs and sizes its KV cache for the memory it will
  have), ``connect()`` connects the policy's transports, ``close()`` stops everything.

The engine side of the memory hand-over (release / resume / restart of SGLang's memory tags)
is megarl/memory/sglang_memory.py.

Deliberately left out: recovering from an engine that dies *during* a generation (the step
fails; resume from the last checkpoint), partial rollouts, routers.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megarl.engines.base import GenerationResult, SamplingParams
from megarl.engines.routing import routing_replay
from megarl.progress import still_waiting
from megarl.rollout_sglang.engine import (
    EngineEndpoint,
    SGLangEngine,
    generate_across,
)

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


@dataclass
class SGLangRollout:
    """The run's SGLang engines: where each one runs (``slots``, ``specs``), what was started
    (host actors, engines, the rollout placement group) and the policy's connection to them."""

    slots: list[Any]
    specs: list[Any]
    connect: PolicyConnection
    timeout: float = 900.0
    hosts: list[Any] = field(default_factory=list)
    placed: dict[str, Any] | None = None

    @property
    def engines(self) -> list[SGLangEngine]:
        return list(self.connect.engines)

    def generator(self) -> SGLangEngines:
        """The trainer's Engines over these servers (the same engine objects across restarts)."""
        return SGLangEngines(self.connect.engines)

    def start(self) -> list[SGLangEngine]:
        """Launch one server per slot on its node and wait until every one is healthy."""
        from megarl.rollout_sglang.hosts import HostHandle, start_servers

        logs = sorted({str(Path(s.log_path).parent) for s in self.specs if s.log_path})
        with still_waiting(f"starting {len(self.specs)} SGLang server(s) (logs: {', '.join(logs) or 'none'})"):
            urls = start_servers(self.slots, self.specs, self.timeout, self.hosts)
        self.connect.engines = [SGLangEngine(HostHandle(h, u, s), tp=s.tp, max_running_requests=s.max_running_requests)
                                for h, u, s in zip(self.hosts, urls, self.specs, strict=True)]  # fmt: skip
        where = [f"{e.url} ({f'GPUs {s.gpu_ids}' if s.gpu_ids else 'CPU'} on {s.ip})"
                 for e, s in zip(self.connect.engines, self.slots, strict=True)]  # fmt: skip
        log.info("SGLang engines up: %s", ", ".join(where))
        return self.engines

    def close(self) -> None:
        from megarl.ray_cluster.placement import release
        from megarl.rollout_sglang.hosts import stop_servers

        stop_servers(self.hosts)
        if self.placed:
            release(self.placed)
            self.placed = None


def rollout_placement(plan: Any) -> Any:
    """Disaggregated pool: one placement group per engine (megarl/rollout_sglang/hosts.py pool_placement)."""
    from megarl.rollout_sglang.hosts import pool_placement

    rollout = plan.roles["rollout"]
    return pool_placement("rollout", len(rollout.gpus), rollout.tp, plan.device)


def prepare_sglang(cfg: Any, plan: Any, policy: Any, log_dir: Path, *, weights_cpu_backup: bool,
                   timeout: float = 900.0) -> SGLangRollout:  # fmt: skip
    """Where each engine runs and how it is launched (nothing starts yet; a disaggregated pool
    gets its placement group). ``policy``: the policy's client (colocated engines run on its
    ranks' GPUs; the connection calls its ``connect_engines``); ``weights_cpu_backup``: the
    residency table's (whether SGLang keeps a CPU copy of released weights)."""
    from megarl.ray_cluster.placement import place_roles
    from megarl.rollout_sglang.hosts import (
        colocated_slots,
        disaggregated_slots,
        probe_bundles,
        slot_spec,
    )
    from megarl.rollout_sglang.server import spec_from_config

    colocated = cfg.cluster.placement == "colocated"
    # weights_pushed: the trainer pushes before it generates (and the hand-over after a restart),
    # so the servers load no checkpoint (--load-format dummy).
    base = spec_from_config(cfg.model.path, cfg.rollout, cfg.cluster, seed=cfg.trainer.seed, dtype=cfg.model.dtype,
                            weights_pushed=True, weights_cpu_backup=weights_cpu_backup, lora=cfg.actor.lora,
                            return_routed_experts=routing_replay(cfg) != "none")  # fmt: skip
    rollout = SGLangRollout([], [], PolicyConnection(policy, []), timeout)
    try:  # from the reservation on, close() undoes what is there
        if colocated:
            slots = colocated_slots(plan, policy.group.node_infos)  # where the policy ranks run
        else:
            rollout.placed = place_roles([rollout_placement(plan)])
            slots = disaggregated_slots(plan, probe_bundles(rollout.placed["rollout"]))
        rollout.slots = list(slots)
        rollout.specs = [slot_spec(base, s, str(Path(log_dir) / f"sglang_engine{s.index}.log")) for s in slots]
        rollout.connect.holders = [list(s.holders) for s in slots] if colocated else []
    except BaseException:
        rollout.close()
        raise
    return rollout
