"""Host memory per node that megarl's own buffers take, for the plan (a lower bound: the
processes' own memory, Ray's object store and the data are not counted):

- offloaded copies: every state the residency table moves off the GPUs in some phase (with
  colocated SGLang, every trained model's at each launch) has a host buffer of its size, kept for
  the next offload (megarl/megatron_runtime/offload.py); gradients are freed, not copied.
  One per rank of its model on the node (the reference lives in the policy's ranks);
- SGLang's host copy of released weights (rollout.weights_cpu_backup): the engine's weights per GPU;
- a checkpoint of the distributed optimizer's fully_reshardable format: Megatron (without its
  memory-efficient variant) gathers each rank's whole stage of fp32 master params and Adam
  moments, 12 B x params on the stage / tp, into host memory on every data-parallel rank before
  writing (dp_reshardable writes each rank's shard as it is); the roles save one after the other;
- checkpoint staging: megatron-core's torch_dist writer copies every tensor a rank writes to
  host memory before writing it (``preload_tensors`` in
  dist_checkpointing/strategies/filesystem_async.py, 0.16 to 0.19), through torch's pinned
  host cache, which kept the blocks after the save until megarl released them
  (megarl/checkpoint/dist_save.py): so it is counted while a role saves. A rank writes its
  weights if it is the first of its data-parallel group (the others hold replicas, which
  Megatron writes once) and its optimizer state: with dp_reshardable its own shard; otherwise
  the first data-parallel rank writes the stage's whole state (fully_reshardable: a copy of the
  gathered state, which Megatron clones because its tensors are views). A lower bound: the
  pinned cache rounds each tensor's block up to a power of two (up to twice the bytes).
  A LoRA checkpoint (actor.lora) writes the adapters (in model.dtype) and their optimizer state,
  not the frozen base: that is what it stages. (It counts the adapters replicated over TP on
  every TP rank, which Megatron writes once: at most their bf16 bytes too many.)

Offloaded copies under LoRA are the residency table's as for any policy: the frozen base's
weights move to the host where the table moves the policy's weights (with colocated SGLang at
each launch, actor.offload or not; with actor.offload in the phases that do not use them).

- routing replay (actor.moe.routing_replay): the step's engine routing, on the controller (node 0)
  and in every policy rank (megarl/plan/routing_bytes.py), counted on top of the rest: the
  controller keeps the step's Batch through the update and the checkpoint after it.

The bytes per GPU of each state come from the planner (megarl/plan/gpu_memory.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from megarl.config.architectures import ArchSpec
from megarl.config.sections import ROLE_SECTIONS, MegaRLConfig
from megarl.memory.residency import Residency, owner_of
from megarl.plan.gpu_memory import DTYPE_BYTES, GIB, stage_params_per_gpu
from megarl.plan.lora_checks import policy_lora_params
from megarl.plan.role_layout import RoleLayout
from megarl.plan.routing_bytes import routing_bytes

# Whose ranks hold host buffers: (owner, the role whose GPUs it lives on).
_HOST_OWNERS = (("policy", "policy"), ("reference", "policy"), ("critic", "critic"), ("engine", "rollout"),
                ("reward_model", "policy"))  # a colocated reward model: an actor on each policy rank's device


@dataclass(frozen=True)
class HostMemory:
    """Host bytes of the busiest node that megarl's own buffers take (module docstring)."""

    node: int  # which node
    offloaded: dict[str, float]  # owner (policy, critic, reference) -> its host copies on the node
    engine_backup: float  # SGLang's host copies of released weights on the node
    save_gather: dict[str, float]  # role -> its fully_reshardable save's gathered state on the node (transient)
    save_staging: dict[str, float] = field(default_factory=dict)  # role -> its save's host copies of what it writes (transient)
    routing: float = 0.0  # the step's routing replay on the node: the controller's (node 0) and its policy ranks'

    @property
    def save(self) -> dict[str, float]:
        """Role -> host bytes on the node while it saves a checkpoint (the roles save one after the other)."""
        return {r: self.save_gather.get(r, 0.0) + self.save_staging.get(r, 0.0) for r in {*self.save_gather, *self.save_staging}}

    @property
    def peak(self) -> float:
        return sum(self.offloaded.values()) + self.engine_backup + max(self.save.values(), default=0.0) + self.routing


def save_gather_host_bytes(arch: ArchSpec, *, tp: int, pp: int, ep: int = 1, etp: int = 1, value_head: bool = False,
                           lora_params: float | None = None) -> float:  # fmt: skip
    """Host memory of one rank while a fully_reshardable checkpoint saves (module docstring): its
    shard's whole fp32 state (a mixture-of-experts model's experts: its ep x etp shard of them);
    under LoRA (``lora_params`` per GPU) the adapters' only, the base model having none."""
    if lora_params is not None:
        return 12.0 * lora_params
    return 12.0 * sum(stage_params_per_gpu(arch, tp=tp, pp=pp, ep=ep, etp=etp, value_head=value_head))


def save_staging_host_bytes(section: Any, layout: RoleLayout, sizes: Mapping[str, float], role: str,
                            written_weights: float | None = None) -> list[float]:  # fmt: skip
    """Host bytes each rank of ``role`` stages while it saves (module docstring), in rank order;
    ``section``: its config section (actor, critic); ``written_weights``: the bytes per GPU of
    the weights a checkpoint holds when not all of ``sizes``' (LoRA: the adapters alone, the
    frozen base is not saved)."""
    weights = sizes[f"{role}/weights"] if written_weights is None else written_weights
    optimizer = sizes[f"{role}/optimizer"]
    opt = section.optimizer
    sharded = opt.distributed and opt.checkpoint_format == "dp_reshardable"  # each rank writes its own shard
    whole = optimizer * (layout.dp if opt.distributed else 1)  # the stage's state, written by the first DP rank
    first = [(rank // layout.tp) % layout.dp == 0 for rank in range(len(layout.gpus))]  # Megatron's order: tp, dp, pp
    return [(weights if f else 0.0) + (optimizer if sharded else whole if f else 0.0) for f in first]


def host_memory(cfg: MegaRLConfig, arch: ArchSpec, roles: Mapping[str, RoleLayout], table: Residency,
                sizes: Mapping[str, float]) -> HostMemory:  # fmt: skip
    """The node where megarl's host buffers take most. ``roles``: the planner's layout per role;
    ``sizes``: bytes per GPU of each state of ``table``."""
    ranks = {owner: roles[role].gpus for owner, role in _HOST_OWNERS if role in roles}
    moved = {s for p in table.phases for s in table.states() if s not in table.resident(p)}
    per_rank = {owner: sum(sizes[s] for s in moved if owner_of(s) == owner and not s.endswith("/grads"))
                for owner in ("policy", "reference", "critic", "reward_model") if owner in ranks}  # fmt: skip
    backup = sizes["engine/weights"] if table.weights_cpu_backup and "engine/weights" in moved else 0.0
    adapters = {"policy": policy_lora_params(cfg, arch, roles["policy"])} if "policy" in roles else {}
    gather = {role: save_gather_host_bytes(arch, tp=roles[role].tp, pp=roles[role].pp, ep=roles[role].ep, etp=roles[role].etp,
                                           value_head=role == "critic", lora_params=adapters.get(role))
              for role in ("policy", "critic") if role in roles and _gathers(getattr(cfg, ROLE_SECTIONS[role]))}
    # a LoRA checkpoint writes the adapters (in model.dtype) and their optimizer state, not the base
    written = {role: n * DTYPE_BYTES[cfg.model.dtype] for role, n in adapters.items() if n is not None}
    staged = {role: save_staging_host_bytes(getattr(cfg, ROLE_SECTIONS[role]), roles[role], sizes, role, written.get(role))
              for role in ("policy", "critic") if role in roles}  # fmt: skip
    routing = routing_bytes(cfg, arch, roles["policy"].dp) if "policy" in roles else None
    nodes = []
    for node in range(cfg.cluster.nnodes):
        on = {gpu for gpu in range(node * cfg.cluster.gpus_per_node, (node + 1) * cfg.cluster.gpus_per_node)}
        count = {owner: sum(gpu in on for gpu in gpus) for owner, gpus in ranks.items()}
        staging = {r: sum(b for gpu, b in zip(roles[r].gpus, each) if gpu in on) for r, each in staged.items()}
        nodes.append(HostMemory(node, {o: count[o] * b for o, b in per_rank.items() if count[o] * b},
                                count.get("engine", 0) * backup, {r: count[r] * b for r, b in gather.items() if count[r]},
                                {r: b for r, b in staging.items() if b},
                                0.0 if routing is None else count.get("policy", 0) * routing.per_policy_rank
                                + (node == 0) * routing.controller))  # fmt: skip
    return max(nodes, key=lambda h: h.peak)


def _gathers(section: Any) -> bool:
    return section.optimizer.distributed and section.optimizer.checkpoint_format == "fully_reshardable"


def host_over(cfg: MegaRLConfig, host: HostMemory) -> str:
    """Why ``host`` is refused against cluster.host_memory_gib, naming what to change."""
    knobs = [f"set {ROLE_SECTIONS[role]}.optimizer.checkpoint_format=dp_reshardable" for role in host.save_gather]
    if host.save_staging:  # each rank stages its own part: more ranks, smaller parts; data parallelism shards the optimizer's
        knobs += [f"set {ROLE_SECTIONS[role]}.optimizer.distributed=true" for role in host.save_staging
                  if not getattr(cfg, ROLE_SECTIONS[role]).optimizer.distributed]  # fmt: skip
    if host.engine_backup:
        knobs.append("set rollout.weights_cpu_backup=false")
    if host.routing:
        knobs.append("lower data.max_prompt_length / rollout.sampling.max_new_tokens / prompts_per_step (routing replay's "
                     "bytes grow with them), or set actor.moe.routing_replay=none")  # fmt: skip
    trained = [o for o in host.offloaded if o != "reference"]
    if trained:  # a copy per data-parallel replica: fewer replicas, fewer copies
        knobs.append(" or ".join(f"raise {ROLE_SECTIONS[o]}.parallel.tp / pp" for o in trained))
    return (f"({cfg.cluster.host_memory_gib:g}) is less than the {host.peak / GIB:.1f} GiB of host memory node {host.node} "
            f"needs at least ({host_memory_text(host)}); " + ", ".join([*knobs, "raise the node count"]))


def host_memory_text(host: HostMemory) -> str:
    """The parts of ``host``, as the plan prints them: ``offloaded copies 20.0 (policy 14.0,
    reference 6.0) + SGLang weight backup 2.0 + checkpoint staging 16.0 (policy, while it saves)
    GiB``, or with a fully_reshardable save ``checkpoint save 30.0 (policy: staging 16.0 +
    fully_reshardable gather 14.0)``; a save is the heaviest role's (they save in turn)."""
    g = lambda b: f"{b / GIB:.1f}"  # noqa: E731
    parts = []
    if host.offloaded:
        each = ", ".join(f"{owner} {g(b)}" for owner, b in host.offloaded.items())
        parts.append(f"offloaded copies {g(sum(host.offloaded.values()))} ({each})")
    if host.engine_backup:
        parts.append(f"SGLang weight backup {g(host.engine_backup)}")
    if host.routing:
        parts.append(f"routing replay {g(host.routing)}")
    if host.save:
        role = max(host.save, key=lambda r: host.save[r])
        staging = f"staging {g(host.save_staging.get(role, 0.0))}"
        if role in host.save_gather:
            parts.append(f"checkpoint save {g(host.save[role])} ({role}: {staging} + fully_reshardable gather "
                         f"{g(host.save_gather[role])})")  # fmt: skip
        else:
            parts.append(f"checkpoint {staging} ({role}, while it saves)")
    return " + ".join(parts or ["nothing"]) + " GiB"
