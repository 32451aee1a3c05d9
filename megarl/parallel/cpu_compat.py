"""Let megatron-core run on a machine without CUDA (CI, laptops): the ONE place that knows how.

megatron-core hard-codes a few CUDA calls on paths that otherwise work on CPU with gloo
(see docs/megatron.md). When ``torch.cuda.is_available()`` is false,
:func:`enable_cpu_compat` redirects exactly those:

- ``torch.cuda.current_device()`` answers ``"cpu"`` (rotary embedding, global buffers);
- ``torch.cuda.synchronize()`` is a no-op (pipeline p2p communication);
- ``torch.cuda.current_stream()`` answers a stream whose waits and records do nothing
  (megatron-core >= 0.17 waits on CUDA-graph events of the current stream in DDP's
  ``start_grad_sync``; on the CPU every operation is already ordered);
- the CUDA RNG state is empty: ``torch.cuda.get_rng_state()`` answers an empty tensor and
  setting it is a no-op (activation recomputation and Megatron's RNG checkpointing save and
  restore it; there is no CUDA generator to save);
- a ``TorchFunctionMode`` rewrites a cuda ``device=`` argument of any torch function, and
  ``Tensor.cuda()`` / ``Tensor.to("cuda")``, to cpu (pipeline token counters, default masks);
- ``Tensor.type()`` with no argument answers the ``torch.cuda.*Tensor`` name and
  ``Tensor.type("torch.cuda.X")`` converts to the CPU type, because Megatron's optimizers, grad
  clipping and distributed optimizer accept parameters by comparing that string;
- ``torch.cuda.Stream`` is a class of null streams, ``torch.cuda.stream(s)`` a null context and
  ``torch.cuda.Event`` a null event: Megatron's alltoall MoE token dispatcher makes a side
  stream when it is built and copies its split sizes to the host on it, then waits on an event
  (megatron-core 0.16 and 0.19: "torch.cuda.Stream requires CUDA support" at model build).
  A class, not a function: transformers annotates ``torch.cuda.Stream | None``;
- two MoE fixes inside megatron-core (:func:`_patch_megatron_moe`): 0.16's router reads
  ``moe_utils.te_general_gemm``, a name only bound when transformer-engine imports (a NameError
  in every router without it), so it is bound to None; and ``maybe_move_tensor_to_cpu(x,
  as_numpy=True)`` leaves a tensor already on the CPU a tensor, which ``all_to_all_single``
  refuses as split sizes (a TypeError in the alltoall dispatcher at EP > 1), so a CPU tensor
  becomes numpy as a GPU one does;
- uneven gathers over a group (:func:`_patch_uneven_gathers`): with expert tensor parallelism
  (etp > 1) the alltoall dispatcher all-gathers each rank's routed tokens over the
  expert-tensor-parallel group and reduce-scatters them back, in pieces of different lengths,
  and gloo's ``all_gather`` / ``reduce_scatter`` take equal pieces only ("ProcessGroupGloo::
  allgather: invalid tensor size"). On the CPU the gather pads every piece to the longest and
  the reduce-scatter all-reduces the whole tensor and keeps this rank's piece: the same values.

Torch function modes live on a per-thread stack, so the mode is entered in the calling thread
and in every thread started afterwards (Megatron's checkpoint writers and Ray use threads). A
thread that already existed when the redirection was enabled gets it by calling
:func:`enable_cpu_compat` itself (cheap and idempotent): entry points that may run on another
thread than ``init_parallel`` (pipeline forward, export) do so.

Deliberately left out: anything on a machine with CUDA (the function does nothing there), and
CUDA memory statistics. The null streams only order nothing: CPU work is already in order, and
overlapped communication and offloading, the other users of side streams, stay off on the CPU.
Nothing else in megarl may rely on how this works; call :func:`enable_cpu_compat` and go.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_lock = threading.Lock()
_mode: _CudaToCpuMode | None = None


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False  # ints mean a cuda ordinal only to .cuda()/.to(); handled there


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites cuda placements to cpu and answers cuda type names (see module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type:
            return _tensor_type(args, kwargs)
        if func is torch.Tensor.to:
            args, kwargs = _rewrite_to(args, kwargs)
        elif "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def _tensor_type(args: tuple, kwargs: dict) -> Any:
    tensor, rest = args[0], args[1:]
    dtype = rest[0] if rest else kwargs.get("dtype")
    if dtype is None:  # the query form: answer as if the tensor lived on cuda
        name = torch.Tensor.type(tensor)
        return name.replace("torch.", "torch.cuda.", 1) if "cuda" not in name else name
    if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
        dtype = dtype.replace("torch.cuda.", "torch.", 1)
    return torch.Tensor.type(tensor, dtype, **{k: v for k, v in kwargs.items() if k != "dtype"})


def _rewrite_to(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``x.to("cuda")``, ``x.to(torch.device("cuda"), dtype)``, ``x.to(device="cuda")`` -> cpu."""
    if len(args) > 1 and _is_cuda(args[1]):
        args = (args[0], "cpu", *args[2:])
    if "device" in kwargs and _is_cuda(kwargs["device"]):
        kwargs = {**kwargs, "device": "cpu"}
    return args, kwargs


def _current_device() -> str:
    return "cpu"


def _synchronize(device: Any = None) -> None:
    return None


class _NullEvent:
    """``torch.cuda.Event`` without CUDA: everything before it has already happened."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        return None

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class _NullStream:
    """``torch.cuda.Stream`` and what ``torch.cuda.current_stream()`` answers without CUDA: CPU
    work is already in order, so waiting on or recording into a stream has nothing to do."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> Any:
        return _NullEvent() if event is None else event  # a caller may synchronize() what it gets

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


_NULL_STREAM = _NullStream()


def _current_stream(device: Any = None) -> _NullStream:
    return _NULL_STREAM


def _stream_context(stream: Any = None) -> contextlib.nullcontext:
    return contextlib.nullcontext()


def _patch_cuda_streams() -> None:
    torch.cuda.current_stream = _current_stream  # type: ignore[assignment]
    torch.cuda.Stream = _NullStream  # type: ignore[assignment,misc]
    torch.cuda.stream = _stream_context  # type: ignore[assignment]
    torch.cuda.Event = _NullEvent  # type: ignore[assignment,misc]


def _empty_rng_state(device: Any = "cuda") -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _ignore_rng_state(new_state: Any = None, device: Any = -1, graph_safe: bool = False) -> None:
    return None


def _patch_cuda_rng() -> None:
    import torch.cuda.random as cuda_random

    for module in (torch.cuda, cuda_random):  # (a plain ModuleType to mypy: a monkeypatch of torch's functions)
        module.get_rng_state = _empty_rng_state  # type: ignore[attr-defined]
        module.set_rng_state = _ignore_rng_state  # type: ignore[attr-defined]
        module.get_rng_state_all = lambda: []  # type: ignore[attr-defined]
        module.set_rng_state_all = lambda new_states: None  # type: ignore[attr-defined]
    try:  # Megatron's own setter queues a lazy CUDA call per use, a slow leak without CUDA
        from megatron.core.tensor_parallel import random as mcore_random
    except ImportError:
        return
    if hasattr(mcore_random, "_set_cuda_rng_state"):
        mcore_random._set_cuda_rng_state = _ignore_rng_state


def _patch_megatron_moe() -> None:
    """The two MoE fixes inside megatron-core (module docstring); each only where its target
    exists, so a megatron-core that changed them is left alone."""
    try:
        from megatron.core.transformer.moe import moe_utils, token_dispatcher
    except ImportError:
        return
    if not hasattr(moe_utils, "te_general_gemm"):  # 0.16 without transformer-engine: never bound
        moe_utils.te_general_gemm = None
    original = getattr(moe_utils, "maybe_move_tensor_to_cpu", None)
    if original is None or getattr(original, "megarl_cpu", False):
        return

    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()  # what the GPU path hands all_to_all_single as split sizes
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    maybe_move_tensor_to_cpu.megarl_cpu = True  # type: ignore[attr-defined]
    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    if hasattr(token_dispatcher, "maybe_move_tensor_to_cpu"):  # the dispatcher imported the name itself
        token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _patch_uneven_gathers() -> None:
    """Megatron's uneven first-dimension gather and reduce-scatter in equal-sized gloo collectives
    (module docstring); the even ones are left to Megatron."""
    try:
        from megatron.core.tensor_parallel import mappings
    except ImportError:
        return
    gather, scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim
    if getattr(gather, "megarl_cpu", False):
        return

    def gather_along_first_dim(input_: torch.Tensor, group: Any, output_split_sizes: Any = None,
                               use_global_buffer: bool = False) -> torch.Tensor:  # fmt: skip
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        width = max(sizes)
        padded = input_.new_zeros(width, *input_.shape[1:])  # [longest, ...]
        padded[: input_.shape[0]] = input_
        out = input_.new_empty(width * len(sizes), *input_.shape[1:])
        torch.distributed.all_gather_into_tensor(out, padded, group=group)
        return torch.cat([out[r * width : r * width + n] for r, n in enumerate(sizes)])

    def reduce_scatter_along_first_dim(input_: torch.Tensor, group: Any, input_split_sizes: Any = None,
                                       use_global_buffer: bool = False) -> torch.Tensor:  # fmt: skip
        if input_split_sizes is None or group.size() == 1:
            return scatter(input_, group, input_split_sizes, use_global_buffer)
        sizes = [int(n) for n in input_split_sizes]
        total = input_.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        start = sum(sizes[: group.rank()])
        return total[start : start + sizes[group.rank()]].clone()

    gather_along_first_dim.megarl_cpu = True  # type: ignore[attr-defined]
    mappings._gather_along_first_dim = gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = reduce_scatter_along_first_dim


def _patch_threads(mode: _CudaToCpuMode) -> None:
    """Enter the mode in every thread started from now on (the mode stack is per thread)."""
    bootstrap = getattr(threading.Thread, "_bootstrap_inner", None)
    if bootstrap is None:  # a Python without this hook: threads run without the mode
        return

    def bootstrap_with_mode(self: threading.Thread) -> None:
        with mode:
            bootstrap(self)

    threading.Thread._bootstrap_inner = bootstrap_with_mode  # type: ignore[attr-defined]


def enable_cpu_compat() -> bool:
    """Activate the CUDA -> CPU redirection when CUDA is absent; idempotent.

    Returns True when the redirection is active (no CUDA), False on a CUDA machine.
    """
    global _mode
    if torch.cuda.is_available():
        return False
    with _lock:
        if _mode is None:
            _mode = _CudaToCpuMode()
            torch.cuda.current_device = _current_device  # type: ignore[assignment]
            torch.cuda.synchronize = _synchronize
            _patch_cuda_streams()
            _patch_cuda_rng()
            _patch_megatron_moe()
            _patch_uneven_gathers()
            _patch_threads(_mode)
    if not is_active_in_this_thread():
        _mode.__enter__()  # threads that existed before enabling (e.g. the main thread)
    return True


def is_active_in_this_thread() -> bool:
    """Whether the redirection mode is on this thread's torch function mode stack."""
    from torch.overrides import _get_current_function_mode_stack

    return _mode is not None and any(m is _mode for m in _get_current_function_mode_stack())
