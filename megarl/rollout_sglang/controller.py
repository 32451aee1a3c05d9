"""The controller's side of ``rollout.engine: sglang``: start the servers where they belong,
generate over them, hand GPU memory back and forth (colocated), restart dead engines.

Three objects, chosen once by build.py (the RL step never asks which engine it has):

- :class:`SGLangEngines` (the trainer's ``Engines``): prompts spread over the engines with
  ``generate_across`` (contiguous slices, global prompt indices and seeds kept).
- :class:`SGLangHandover` (the trainer's ``Handover``): the fixed points of one step.
  Colocated, the engines' memory is owned here (the policy ranks' own engine clients never
  release or resume, so there is one view of what is released)::

      before_push     restart dead engines (+ reconnect the policy); resume "weights"
      push            PolicyRank.push_weights (pause, flush, buckets, continue, version check)
      after_push      remember the version
      scoring         (the post-push log-prob check, after the trainer computed its side)
                      offload the policy, resume "kv_cache"/"cuda_graph"; afterwards release
                      them again (the pushed weights stay) and onload the policy, so the
                      policy's states and SGLang's KV cache never hold the GPU together
      before_generate restart dead engines (+ reconnect, re-push the last version);
                      offload the policy (actor.offload); resume "kv_cache"/"cuda_graph"
      generate
      after_generate  release all SGLang memory; onload the policy

  Disaggregated, only the restart checks run.
- :class:`SGLangRollout`: what was started (host actors, engines, the rollout placement
  group), for shutdown.

Deliberately left out: recovering from an engine that dies *during* a generation (the step
fails; resume from the last checkpoint), partial rollouts, routers.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megarl.rollout.engine import GenerationResult, SamplingParams
from megarl.rollout_sglang.engine import (
    CUDA_GRAPH,
    KV_CACHE,
    WEIGHTS,
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


def engine_descriptors(engines: Sequence[SGLangEngine]) -> list[dict[str, Any]]:
    """What a policy rank needs to build its own client of each engine (plain data for Ray)."""
    return [{"url": e.url, "tp": e.tp, "max_running_requests": e.max_running_requests} for e in engines]


@dataclass
class PolicyConnection:
    """Connects every policy rank to the engines (collective ``PolicyRank.connect_sglang``);
    called at start and again after a restart (URLs and groups change)."""

    group: Any  # WorkerGroup of PolicyRank
    engines: Sequence[SGLangEngine]
    transport: str  # "tensor" (colocated, CUDA IPC) | "distributed" (disaggregated, NCCL)
    holders: list[list[int]] = field(default_factory=list)  # tensor: policy ranks per engine, TP order

    def __call__(self) -> None:
        self.group.call("connect_sglang", engine_descriptors(self.engines), self.transport, self.holders)


class SGLangHandover:
    """The Handover of SGLang engines (see the module docstring for the order of calls).

    ``policy``: the policy WorkerGroup (``push_weights`` after a restart); ``reconnect``:
    re-runs the policy's connection after a restart; ``offload``: the groups whose states
    leave the GPUs while SGLang generates (colocated; each has ``offload_states`` /
    ``onload_states``, e.g. the policy with actor.offload).
    """

    def __init__(self, engines: Sequence[SGLangEngine], policy: Any, reconnect: Any, *, colocated: bool,
                 offload: Sequence[Any] = (), restart_timeout: float = 900.0):  # fmt: skip
        self.engines, self.policy, self.reconnect = list(engines), policy, reconnect
        self.colocated, self.offload = colocated, list(offload)
        self.restart_timeout = restart_timeout
        self.version: int | None = None  # last version pushed to every engine
        self.restarts = 0

    # ---- generation ---------------------------------------------------------------------
    def before_generate(self) -> None:
        if self.recover() and self.version is not None:
            # The restarted engines hold the initial weights: push what the others hold.
            self.policy.call("push_weights", self.version)
        if self.colocated:
            for group in self.offload:
                group.call("offload_states")
            for engine in self.engines:
                engine.resume_memory([KV_CACHE, CUDA_GRAPH])

    def after_generate(self) -> None:
        if self.colocated:
            for engine in self.engines:
                engine.release_memory()
            for group in self.offload:
                group.call("onload_states")

    # ---- weight pushes ------------------------------------------------------------------
    def before_push(self, version: int) -> None:
        self.recover()  # the push that follows brings the restarted engines up to date
        if self.colocated:
            for engine in self.engines:
                engine.resume_memory([WEIGHTS])

    def after_push(self, version: int) -> None:
        self.version = version

    @contextlib.contextmanager
    def scoring(self) -> Iterator[None]:
        """The engines score the post-push probes: the same hand-over as a generation."""
        if not self.colocated:
            yield
            return
        for group in self.offload:
            group.call("offload_states")
        for engine in self.engines:
            engine.resume_memory([KV_CACHE, CUDA_GRAPH])
        try:
            yield
        finally:
            # Only the KV cache goes: the weights just pushed stay (a released "weights" tag
            # comes back empty without --enable-weights-cpu-backup), ready for the next rollout.
            for engine in self.engines:
                engine.release_memory([KV_CACHE, CUDA_GRAPH])
            for group in self.offload:
                group.call("onload_states")

    # ---- restarts -----------------------------------------------------------------------
    def recover(self) -> list[SGLangEngine]:
        """Restart every engine whose health check fails and reconnect the policy ranks;
        returns the restarted engines (their weights are the initial ones until a push)."""
        dead = []
        for engine in self.engines:
            health = engine.health()
            if not health.alive:
                dead.append(engine)
                tail = engine.server.log_tail() if engine.server is not None else ""
                log.warning("SGLang engine %s is not healthy (%s); restarting it. Last log lines:\n%s",
                            engine.url, health.detail, tail)  # fmt: skip
        for engine in dead:
            engine.restart(self.restart_timeout)
            self.restarts += 1
        if dead:
            self.reconnect()
        return dead


@dataclass
class SGLangRollout:
    """Everything ``start_sglang`` started; ``close`` stops it (servers, actors, placement)."""

    engines: SGLangEngines
    handover: SGLangHandover
    hosts: list[Any]
    placed: dict[str, Any] | None = None

    def close(self) -> None:
        import ray

        from megarl.actors.ray_groups.placement import release

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
    from megarl.actors.ray_groups.placement import RolePlacement

    rollout = plan.roles["rollout"]
    return RolePlacement("rollout", nnodes=rollout.dp, procs_per_node=rollout.tp, gpus_per_proc=1.0, cpus_per_proc=0.0)


def start_sglang(cfg: Any, plan: Any, policy: Any, log_dir: Path, timeout: float = 900.0, critic: Any = None) -> SGLangRollout:
    """Start one server per engine on its node, wait until all are healthy, connect the policy.

    Colocated: the policy offloads (actor.offload) while the servers start and profile memory;
    the servers then release all their memory and the policy comes back. A colocated critic
    with critic.offload goes to host memory around every generation too.
    """
    import ray

    from megarl.actors.ray_groups.placement import place_roles
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
    base = spec_from_config(cfg.model.path, cfg.rollout, cfg.cluster.placement, seed=cfg.trainer.seed, dtype=cfg.model.dtype)
    offload = colocated and cfg.actor.offload
    placed: dict[str, Any] | None = None
    hosts: list[Any] = []
    try:
        if colocated:
            slots = colocated_slots(plan, policy.node_infos)
        else:
            placed = place_roles([rollout_placement(plan)])
            slots = disaggregated_slots(plan, probe_bundles(placed["rollout"]))
        specs = [slot_spec(base, s, str(Path(log_dir) / f"sglang_engine{s.index}.log")) for s in slots]
        if offload:
            policy.call("offload_states")
        hosts = start_hosts(slots, specs)
        urls = ray.get([h.start.remote(timeout) for h in hosts])
        engines = [SGLangEngine(HostHandle(h, u, s), tp=s.tp, max_running_requests=s.max_running_requests)
                   for h, u, s in zip(hosts, urls, specs, strict=True)]  # fmt: skip
        if colocated:
            for engine in engines:
                engine.release_memory()
        if offload:
            policy.call("onload_states")
        connect = PolicyConnection(policy, engines, "tensor" if colocated else "distributed",
                                   [list(s.holders) for s in slots] if colocated else [])  # fmt: skip
        connect()
    except BaseException:
        SGLangRollout(SGLangEngines([]), None, hosts, placed).close()  # type: ignore[arg-type]
        raise
    offloaded = ([policy] if offload else []) + ([critic] if colocated and critic is not None and cfg.critic.offload else [])
    handover = SGLangHandover(engines, policy, connect, colocated=colocated, offload=offloaded)
    log.info("SGLang engines up: %s", ", ".join(f"{e.url} (GPUs {s.gpu_ids} on {s.ip})" for e, s in zip(engines, slots)))
    return SGLangRollout(SGLangEngines(engines), handover, hosts, placed)
