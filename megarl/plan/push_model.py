"""A model of one weight push: the bytes each GPU moves on each link, and the time they take.

A push carries the policy's weights, ``W`` bytes in the model's dtype, to the engines in up to
three parts (megarl/parallel/stage_collection.py says who receives what):

1. **TP gather.** Each tensor's TP shards are all-gathered in its TP group: a rank receives
   ``(tp - 1) / tp`` of its stage's ``W / pp``. On NVLink when TP fits in a node. A
   mixture-of-experts model's experts (``X`` of the ``W`` bytes) are not TP shards: the TP gather
   moves ``(W - X) / pp``, and an **EP gather** collects the other expert-parallel ranks' experts
   of the stage, ``(ep - 1) / ep x X / pp`` per rank, on NVLink when the EP group fits in a node
   (Megatron places its ranks next to each other).
2. **PP collect**, the other stages' tensors, to the ranks that load them:
   - ``tensor`` (every GPU feeds one TP rank of a colocated engine, which loads whole tensors):
     TP rank t of each stage sends the t-th slice of its tensors over its PP group, so a GPU
     receives ``(pp - 1) / pp x W / tp`` over the PP link, then the TP group all-gathers the
     slices: ``(pp - 1) / pp x W x (tp - 1) / tp`` over the TP link;
   - ``in_process`` and ``disk``: only the replica's leader (the torch engine's rank, the disk
     writer) receives the other stages' ``(pp - 1) / pp x W``, point to point; the figure is
     the leader's (no other GPU receives any);
   - ``distributed``: none, each stage sends its own tensors.
   The PP link is NVLink when the whole policy fits in a node, else the network.
3. **To the engines.** ``in_process`` and ``tensor``: nothing crosses a link (the engine reads
   the bucket in the same process, or on the same GPU through CUDA IPC). ``distributed``: each
   stage's sender broadcasts its ``W / pp`` to the engine GPUs on other nodes, so an engine GPU
   receives ``W`` from the network. ``disk``: policy rank 0 copies ``W`` to host memory and
   writes it, then every engine reads ``W`` back (host link, at the filesystem's speed at
   best): ``W`` per GPU, twice one after the other in time.

With LoRA and ``rollout.weight_sync.lora: adapter`` a push carries the adapters only: ``W`` is
their bytes (:func:`push_bytes`), no experts, and the TP gather moves the TP-split halves of them
(B of a column-parallel linear, A of a row-parallel one); ``merged`` pushes the whole model, as
full fine-tuning does. The adapters do not go through the transport
(megarl/weight_sync/lora_adapter.py): every rank gathers the other stages' ``(pp - 1) / pp x W``
(an all-gather over the PP group), then policy rank 0 serves each SGLang server in turn
(:func:`adapter_sends`): for the servers on its node it writes one PEFT directory (``W``, host)
that each of them reads (``W`` each, host); a server on another node gets the request instead,
which carries one base64 copy per engine TP rank: ``W x 4/3 x rollout.tp`` over the network
per server (about 9 GB at 72B, rank 32, TP 8, against 0.84 GB of adapters).

Each part takes its bytes / the link's bandwidth (``cluster.nvlink_gb_per_s``,
``network_gb_per_s``, ``host_gb_per_s``: gigabytes, not gigabits, per second per GPU and
direction, as an all-gather bus bandwidth measures them). The export's parts (1 and 2) run one
after the other; the send (3) runs after them, or beside them with
``rollout.weight_sync.overlap`` (the slower of the two then sets the time); the engines' read of
a disk push comes last. It leaves out latency per collective and bucket, and the conversion
work, so it is a lower bound of what a push takes.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.config.architectures import ArchSpec
from megarl.config.sections import MegaRLConfig
from megarl.plan.gpu_memory import DTYPE_BYTES, lora_stage_params
from megarl.plan.issues import counted
from megarl.plan.role_layout import RoleLayout
from megarl.weight_sync.transport_base import (
    TRANSPORT_COLLECT,  # the run's transports follow it too
)

GB = 1e9
BASE64 = 4 / 3  # a base64 payload's bytes per byte it carries


def push_bytes(cfg: MegaRLConfig, arch: ArchSpec) -> tuple[float, float, float]:
    """(all, TP-split, expert) bytes of one push: the whole model (the experts are not TP-split),
    or with LoRA pushed as adapters, the adapters (module docstring)."""
    wbytes, lora = DTYPE_BYTES[cfg.model.dtype], cfg.actor.lora
    if lora is not None and cfg.rollout.weight_sync.lora == "adapter":
        replicated, split, experts = lora_stage_params(arch, lora.rank, lora.modules, 0, arch.num_layers)
        return wbytes * (replicated + split + experts), wbytes * split, wbytes * experts
    total = wbytes * arch.num_params
    experts = wbytes * arch.num_moe_layers * arch.num_experts * arch.expert_params
    return total, total - experts, experts


@dataclass(frozen=True)
class PushEstimate:
    """Bytes per GPU of one push by part, each with the link it crosses, and the time."""

    transport: str
    parts: tuple[tuple[str, float, str], ...]  # (part, bytes received per GPU, link)
    seconds: float


def push_estimate(cfg: MegaRLConfig, arch: ArchSpec, tp: int, pp: int, dp: int, ep: int = 1, *,
                  rollout: RoleLayout | None = None, writer_gpu: int = 0) -> PushEstimate:  # fmt: skip
    """The push of ``cfg``'s policy (layout ``tp x pp x dp``, experts over ``ep``) through its transport.
    ``rollout``: the SGLang engines' layout, which an adapter push needs (it serves each server by
    where it runs relative to policy rank 0's GPU, ``writer_gpu``)."""
    transport = cfg.weight_transport
    collect = TRANSPORT_COLLECT[transport]
    cl = cfg.cluster
    total, split, experts = push_bytes(cfg, arch)  # bytes, as every part counts them
    tp_link = "nvlink" if tp <= cl.gpus_per_node else "network"
    pp_link = "nvlink" if tp * pp * dp <= cl.gpus_per_node else "network"
    others = total * (pp - 1) / pp  # the other stages' bytes
    ep_link = "nvlink" if ep <= cl.gpus_per_node else "network"
    export = [("TP gather", split / pp * (tp - 1) / tp, tp_link),
              ("EP gather", experts / pp * (ep - 1) / ep, ep_link)]  # the export, one part after the other  # fmt: skip
    if cfg.actor.lora is not None and cfg.rollout.weight_sync.lora == "adapter":
        if rollout is None:
            raise ValueError("an adapter push's estimate needs the engines' layout (rollout)")
        export.append(("PP gather (every rank)", others, pp_link))
        # one part after the other: the gather, the directory, then each server's load in turn
        return _estimate(cfg, "adapter", export + adapter_sends(total, rollout, writer_gpu, cl.gpus_per_node), [], [])
    if collect == "all":
        export += [("PP collect (1/tp slices)", others / tp, pp_link),
                   ("TP gather of the PP slices", others * (tp - 1) / tp, tp_link)]  # fmt: skip
    elif collect == "leader":
        export.append(("PP collect to the leader", others, pp_link))
    send = {"distributed": [("to the engines", total, "network")],
            "disk": [("written by policy rank 0", total, "host")]}.get(transport, [])  # fmt: skip
    after = [("read by each engine GPU", total, "host")] if transport == "disk" else []  # once every bucket is written
    return _estimate(cfg, transport, export, send, after)


def adapter_sends(total: float, rollout: RoleLayout, writer_gpu: int, gpus_per_node: int) -> list[tuple[str, float, str]]:
    """What policy rank 0 (on ``writer_gpu``) moves to the servers of ``rollout`` for ``total``
    bytes of adapters: the PEFT directory for those on its node, the request (a base64 copy per
    engine TP rank) to each on another node (module docstring)."""
    node = writer_gpu // gpus_per_node
    server_nodes = [rollout.gpus[i * rollout.tp] // gpus_per_node for i in range(rollout.dp)]
    local = sum(n == node for n in server_nodes)
    remote = len(server_nodes) - local
    parts = []
    if local:
        parts += [("PEFT directory written by policy rank 0", total, "host"),
                  (f"read by the {counted(local, 'server')} on its node", local * total, "host")]  # fmt: skip
    if remote:
        parts.append((f"requests to the {counted(remote, 'server')} on other nodes (base64, a copy per engine TP rank: "
                      f"rollout.tp {rollout.tp})", remote * total * BASE64 * rollout.tp, "network"))  # fmt: skip
    return parts


def _estimate(cfg: MegaRLConfig, transport: str, export: list[tuple[str, float, str]],
              send: list[tuple[str, float, str]], after: list[tuple[str, float, str]]) -> PushEstimate:  # fmt: skip
    """The estimate of parts ``export``, then ``send`` (beside the export with overlap), then ``after``."""
    cl = cfg.cluster
    bandwidth = {"nvlink": cl.nvlink_gb_per_s, "network": cl.network_gb_per_s, "host": cl.host_gb_per_s}

    def seconds(parts: list[tuple[str, float, str]]) -> float:
        return sum(b / (bandwidth[link] * GB) for _, b, link in parts)

    # With overlap the send of bucket k runs beside the export of bucket k+1: the slower side sets the pace.
    export_s, send_s = seconds(export), seconds(send)
    both = max(export_s, send_s) if cfg.rollout.weight_sync.overlap else export_s + send_s
    parts = tuple(p for p in export + send + after if p[1] > 0)
    return PushEstimate(transport, parts, both + seconds(after))
