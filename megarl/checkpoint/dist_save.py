"""Writing a Megatron dist-checkpoint without keeping its host staging afterwards.

megatron-core's torch_dist save (``dist_checkpointing/strategies/filesystem_async.py``, 0.16 to
0.19, synchronous saves too) copies each rank's tensors to host memory before writing them, with
``tensor.to("cpu", non_blocking=True)``: torch allocates those copies from its pinned host
cache, which rounds every block up to a power of two and keeps the blocks after the tensors are
gone, for reuse. At 72B (tp 8, pp 4) that is a rank's weights and optimizer state, about 33 GB,
per rank, held from the first save on beside the offload buffers. :func:`save_dist_checkpoint`
hands the cached blocks back once the save has written them, so the staging is host memory only
while a save runs (``megarl plan`` counts it there: megarl/plan/host_memory.py).
"""

from __future__ import annotations

import gc
import logging
import os
from typing import Any

log = logging.getLogger(__name__)

def save_dist_checkpoint(state: dict[str, Any], path: str | os.PathLike) -> None:
    """``dist_checkpointing.save(state, path)`` (collective), then the host staging released."""
    from megatron.core import dist_checkpointing

    from megarl.checkpoint.results_queue import install_results_queue
    from megarl.process_signals import forks_die_with_this_process

    install_results_queue()  # megatron's own manager process would outlive a killed driver
    with forks_die_with_this_process():  # the writers the save forks would hold the driver's pipes past its death
        dist_checkpointing.save(state, str(path))
    try:
        release_pinned_staging()
    except Exception as err:  # noqa: BLE001 - the checkpoint is written; a kept cache only costs memory
        log.warning("a checkpoint was saved to %s, but torch's pinned host cache was not released: %s", path, err)


def release_pinned_staging() -> None:
    """Free torch's cached pinned host blocks that no tensor uses (what a save staged through).

    A no-op without CUDA: a CPU save stages nothing (its tensors are on the host already)."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    gc.collect()  # the save's staged copies may sit in reference cycles: free them first
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)  # torch >= 2.9
    if empty is None:
        empty = torch._C._host_emptyCache  # what torch.cuda.graphs calls in older releases
    empty()
