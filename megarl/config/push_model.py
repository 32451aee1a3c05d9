"""A model of one weight push: the bytes each GPU moves on each link, and the time they take.

A push carries the policy's weights, ``W`` bytes in the model's dtype, to the engines in three
parts that run one after the other for each bucket (no overlap yet):

1. **TP gather.** Each tensor's TP shards are all-gathered in its TP group: a rank receives
   ``(tp - 1) / tp`` of its stage's ``W / pp``. On NVLink when TP fits in a node.
2. **PP collect** (transports ``in_process``, ``tensor``, ``disk``): every stage broadcasts its
   full tensors to the ranks of the other stages, so each rank receives ``(pp - 1) / pp x W``.
   On NVLink when the whole policy fits in a node, else on the network. The ``distributed``
   transport has none: each stage sends its own tensors.
3. **To the engines.** ``in_process`` and ``tensor``: nothing crosses a link (the engine reads
   the bucket in the same process, or on the same GPU through CUDA IPC). ``distributed``: each
   stage's sender broadcasts its ``W / pp`` to the engine GPUs on other nodes, so an engine GPU
   receives ``W`` from the network. ``disk``: policy rank 0 copies ``W`` to host memory and
   writes it, then every engine reads ``W`` back (host link, at the filesystem's speed at
   best): ``W`` per GPU, twice one after the other in time.

Time is the sum over the parts of bytes / the link's bandwidth (``cluster.nvlink_gb_per_s``,
``network_gb_per_s``, ``host_gb_per_s``: gigabytes, not gigabits, per second per GPU and direction, as an all-gather bus bandwidth
measures them). It leaves out latency per collective and bucket, and the conversion work,
so it is a lower bound of what a push takes.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.config.architectures import ArchSpec
from megarl.config.memory import DTYPE_BYTES
from megarl.config.sections import MegaRLConfig

GB = 1e9


@dataclass(frozen=True)
class PushEstimate:
    """Bytes per GPU of one push by part, each with the link it crosses, and the time."""

    transport: str
    parts: tuple[tuple[str, float, str], ...]  # (part, bytes received per GPU, link)
    seconds: float


def push_estimate(cfg: MegaRLConfig, arch: ArchSpec, tp: int, pp: int, dp: int) -> PushEstimate:
    """The push of ``cfg``'s policy (layout ``tp x pp x dp``) through its transport."""
    transport = cfg.weight_transport
    cl = cfg.cluster
    total = DTYPE_BYTES[cfg.model.dtype] * arch.num_params
    one_node = tp * pp * dp <= cl.gpus_per_node
    parts = [("TP gather", total / pp * (tp - 1) / tp, "nvlink" if tp <= cl.gpus_per_node else "network")]
    if transport != "distributed":
        parts.append(("PP collect", total * (pp - 1) / pp, "nvlink" if one_node else "network"))
    if transport == "distributed":
        parts.append(("to the engines", total, "network"))
    elif transport == "disk":
        parts += [("written by policy rank 0", total, "host"), ("read by each engine GPU", total, "host")]
    bandwidth = {"nvlink": cl.nvlink_gb_per_s, "network": cl.network_gb_per_s, "host": cl.host_gb_per_s}
    seconds = sum(b / (bandwidth[link] * GB) for _, b, link in parts)
    return PushEstimate(transport, tuple(p for p in parts if p[1] > 0), seconds)
