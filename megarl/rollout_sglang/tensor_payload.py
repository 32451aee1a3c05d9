"""Request payloads for SGLang's ``/update_weights_from_tensor`` (colocated, CUDA IPC).

A bucket of HF-named tensors becomes one or more requests. Each request holds one base64
string per engine TP rank: the tensors pickled with ``ForkingPickler``, so a CUDA tensor
travels as a CUDA IPC handle and SGLang maps the producer's memory instead of copying bytes
over HTTP. Serializing once per rank (rather than sending one string N times) lets each TP
rank open its own handle, which is what SGLang's own Engine does (a shared one leaked GPU
memory, sglang PR #4446).

Two payload formats, as SGLang's loader knows them:
- ``load_format="flattened_bucket"``: one flat tensor plus SGLang's own
  ``FlattenedTensorMetadata`` list (built with SGLang's ``FlattenedTensorBucket``; its
  metadata class is on the unpickling allowlist of recent servers). Buckets that
  ``supports_multi_dtypes`` (a uint8 view) take mixed dtypes; older ones are built one dtype
  at a time, so a mixed bucket becomes one request per dtype.
- ``load_format=None``: a pickled ``list[(name, tensor)]``, used when SGLang is not importable
  on the trainer side (and by the CPU tests).

CPU tensors (CPU tests, a CPU server) are pickled with their bytes; see
:func:`serialize_for_http`.

The producer must keep the tensors alive, and must not write into them, until the server
has answered (SGLang can reply before its copy kernels have run, so a reused buffer races:
slime PR #929), then drop them and call ``torch.cuda.ipc_collect()`` so the IPC handles are
released; the CUDA-IPC transport (megarl/weight_sync/cuda_ipc.py) does that (and gathers per-GPU payloads from several
trainer processes, slime's layout). Deliberately left out here: any HTTP or process group.
"""

from __future__ import annotations

import base64
import io
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

NamedTensors = Sequence[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class TensorRequest:
    """One ``/update_weights_from_tensor`` call: a payload per TP rank and what keeps the
    serialized memory alive until the reply."""

    payloads: list[str]
    load_format: str | None
    keepalive: tuple[Any, ...]
    names: tuple[str, ...]
    last: bool = False


def group_by_dtype(named: NamedTensors) -> list[list[tuple[str, torch.Tensor]]]:
    """Split into runs of one dtype, keeping every tensor's relative order (dtype order =
    first appearance)."""
    groups: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in named:
        groups.setdefault(tensor.dtype, []).append((name, tensor))
    return list(groups.values())


def _sglang_bucket_class() -> type | None:
    try:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    except ImportError:
        try:  # before weight_sync/ existed (0.4.x)
            from sglang.srt.model_executor.model_runner import FlattenedTensorBucket
        except ImportError:
            return None
    return FlattenedTensorBucket


def plan_requests(
    named: NamedTensors, bucket_class: type | None
) -> list[tuple[str | None, list[tuple[str, torch.Tensor]]]]:
    """(load_format, tensors) per request for one bucket, given SGLang's bucket class."""
    named = list(named)
    if not named:
        return []
    if bucket_class is None:
        return [(None, named)]
    if getattr(bucket_class, "supports_multi_dtypes", False):
        # SGLang rebuilds each tensor as flat_uint8[start:end].view(dtype), which needs start
        # to be a multiple of the dtype's size; it pads nothing. Widest dtypes first keeps
        # every start aligned (sizes are powers of two); the order of names does not matter
        # to the loader. E.g. a 3-element bf16 tensor before an fp32 one would put the fp32
        # one at byte 6 and the view would raise.
        return [("flattened_bucket", sorted(named, key=lambda nt: -nt[1].element_size()))]
    return [("flattened_bucket", group) for group in group_by_dtype(named)]


def _patch_cuda_reductions() -> None:
    """Make CUDA IPC handles name the GPU by UUID, so a receiver with another
    CUDA_VISIBLE_DEVICES opens the right device (SGLang's own patch; a no-op without it)."""
    try:
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    except ImportError:
        try:
            from sglang.srt.patch_torch import monkey_patch_torch_reductions
        except ImportError:
            return
    monkey_patch_torch_reductions()


def _sglang_serializer() -> Any:
    try:
        from sglang.srt.utils import MultiprocessingSerializer
    except ImportError:
        return None
    return MultiprocessingSerializer


def _has_cuda_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.is_cuda
    if isinstance(obj, dict):
        return any(_has_cuda_tensor(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return any(_has_cuda_tensor(v) for v in obj)
    return False


def serialize_for_http(obj: Any) -> str:
    """One base64 payload, as SGLang's ``MultiprocessingSerializer.deserialize`` reads it
    from an HTTP request (base64-decode, then unpickle with its allow-list).

    CUDA tensors go through ``ForkingPickler`` (SGLang's own
    ``MultiprocessingSerializer.serialize(obj, output_str=True)`` when SGLang is importable,
    the same format by hand otherwise), so they travel as CUDA IPC handles. A payload of CPU
    tensors is pickled plainly, bytes included: ForkingPickler would share CPU storage through
    a file descriptor handed over by ``multiprocessing.resource_sharer``, which only a process
    forked from the sender can fetch; a real SGLang server fails that handshake
    (AuthenticationError) and its scheduler dies (seen with 0.5.23 on CPU).
    """
    if not _has_cuda_tensor(obj):
        return base64.b64encode(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")
    _patch_cuda_reductions()
    serializer = _sglang_serializer()
    if serializer is not None:
        return serializer.serialize(obj, output_str=True)
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _check_device(named: NamedTensors) -> None:
    devices = {t.device for _, t in named}
    if any(d.type == "cuda" for d in devices) and len(devices) > 1:
        raise ValueError(
            f"a bucket mixes devices {sorted(map(str, devices))}; move it to one GPU first"
        )


def build_tensor_requests(
    named: NamedTensors,
    tp: int,
    bucket_class: type | None | str = "auto",
    serialize: Callable[[Any], str] = serialize_for_http,
) -> list[TensorRequest]:
    """The requests that load ``named`` into an engine with ``tp`` ranks."""
    _check_device(named)
    cls = _sglang_bucket_class() if bucket_class == "auto" else bucket_class
    plan = plan_requests(named, cls)  # type: ignore[arg-type]
    requests = []
    for i, (load_format, tensors) in enumerate(plan):
        if load_format == "flattened_bucket":
            bucket = cls(named_tensors=tensors)  # type: ignore[misc,operator]
            obj: Any = {
                "flattened_tensor": bucket.get_flattened_tensor(),
                "metadata": bucket.get_metadata(),
            }
            keep: tuple[Any, ...] = (obj["flattened_tensor"], tensors)
        else:
            obj = [(name, t.detach()) for name, t in tensors]
            keep = (obj,)
        requests.append(
            TensorRequest(
                payloads=[serialize(obj) for _ in range(tp)],
                load_format=load_format,
                keepalive=keep,
                names=tuple(n for n, _ in tensors),
                last=i == len(plan) - 1,
            )
        )
    return requests
