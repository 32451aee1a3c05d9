"""Process groups: torch.distributed + Megatron model-parallel state, and per-rank seeds.

:func:`init_parallel` is the one call a worker makes before building a Megatron model; it reads
the standard launcher variables (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK: set by
torchrun, Ray worker groups and tests/distributed/spawn.py alike), picks nccl on CUDA and gloo on
CPU, and returns the rank layout as a small dataclass so callers need not query Megatron.

Expert parallelism (MoE models): ``ep`` ranks split each MoE layer's experts, ``etp`` ranks split
each expert's weights (1: whole experts; Megatron's default would be ``tp``, so it is passed
explicitly). Megatron lays the expert groups over the same world: ``etp x ep x pp`` must divide
it, that is ``etp x ep`` must divide ``tp x dp``, and an expert-parallel group may span
data-parallel replicas (at tp 1, ep 2: ranks 0 and 1 are two DP replicas holding half the
experts each).

Left out: context and virtual-pipeline parallelism (refused by the planner for now).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megarl.parallel.cpu_compat import enable_cpu_compat
from megarl.parallel.mcore_version import require_megatron_core


@dataclass(frozen=True)
class ParallelInfo:
    """This process's place in the (tp, pp, dp) layout; ranks are 0-based within each group."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    device: torch.device
    ep_rank: int = 0  # the expert-parallel group: who holds which experts (MoE models)
    ep_size: int = 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_replica_leader(self) -> bool:
        """TP rank 0 of the first pipeline stage: the rank that feeds this DP replica's engine."""
        return self.tp_rank == 0 and self.pp_rank == 0


def _init_process_group(timeout_s: float) -> torch.device:
    """Initialise torch.distributed from the launcher's environment if nobody did yet. The device
    follows the backend: CUDA with NCCL, the CPU with gloo, whether this function picks it (NCCL
    where CUDA is available) or a caller's group already decided (e.g. gloo tests on a GPU box)."""
    use_cuda = torch.cuda.is_available() and not (dist.is_initialized() and dist.get_backend() == "gloo")
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if dist.is_initialized():
        return device
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"init_parallel: torch.distributed is not initialised and the environment lacks "
            f"{', '.join(missing)}; launch with torchrun (or set them) or call "
            f"torch.distributed.init_process_group first"
        )
    dist.init_process_group(
        backend="nccl" if use_cuda else "gloo",
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timedelta(seconds=timeout_s),
    )
    return device


def init_parallel(tp: int, pp: int, seed: int, *, ep: int = 1, etp: int = 1, timeout_s: float = 1800.0) -> ParallelInfo:
    """Set up torch.distributed, Megatron's TP/PP/DP (and expert) groups and per-rank RNG seeds.

    ``tp * pp`` must divide the world size; DP is the quotient. ``ep`` / ``etp``: expert
    (tensor) parallelism, see the module docstring. Seeds: Megatron's
    ``model_parallel_cuda_manual_seed`` (distinct per TP/PP rank where Megatron wants it).
    """
    require_megatron_core()  # before the first megatron import: a one-line error, not a deep one
    from megatron.core import parallel_state

    cpu = enable_cpu_compat()
    device = _init_process_group(timeout_s)
    world = dist.get_world_size()
    if tp < 1 or pp < 1 or world % (tp * pp) != 0:
        raise ValueError(
            f"parallel layout tp={tp} x pp={pp} must divide the world size ({world}); "
            f"choose tp and pp whose product divides {world}"
        )
    if ep < 1 or etp < 1 or world % (etp * ep * pp) != 0:  # Megatron's expert rank generator's rule
        raise ValueError(
            f"expert layout etp={etp} x ep={ep} x pp={pp} must divide the world size ({world}); "
            f"choose ep x etp dividing tp x dp = {world // pp}"
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        distributed_timeout_minutes=max(1, int(timeout_s // 60)),
    )
    torch.manual_seed(seed)
    _seed_model_parallel_rng(seed, cpu)
    return current_parallel_info(device)


def _seed_model_parallel_rng(seed: int, cpu: bool) -> None:
    """Megatron's per-TP-rank RNG tracker. On CPU the default tracker's fork() needs CUDA RNG
    states; the inference tracker's fork is a null context (dropout is off in RL training, so
    nothing draws from it). Feature-detected: the keyword exists in megatron-core 0.16-0.19."""
    import inspect

    from megatron.core import tensor_parallel

    seed_fn = tensor_parallel.model_parallel_cuda_manual_seed
    if cpu and "inference_rng_tracker" in inspect.signature(seed_fn).parameters:
        seed_fn(seed, inference_rng_tracker=True)
    elif cpu:
        raise RuntimeError(
            "this megatron-core's model_parallel_cuda_manual_seed has no inference_rng_tracker; "
            "megarl cannot seed Megatron's RNG tracker without CUDA"
        )
    else:
        seed_fn(seed)


def current_parallel_info(device: torch.device | None = None) -> ParallelInfo:
    """The layout of an already initialised process (see :func:`init_parallel`)."""
    from megatron.core import parallel_state as ps

    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return ParallelInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        device=device,
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
    )


def destroy_parallel() -> None:
    """Tear down Megatron's groups and the default process group (safe to call twice)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
