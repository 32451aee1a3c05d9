"""Move tensors' storage to host memory and back, keeping every view of it valid.

Colocated training and rollout share a GPU: while the engine generates, the trainer's params,
grad buffers and optimizer state go to host memory. Megatron's params and ``main_grad`` are
views into big contiguous buffers, and the optimizer holds references to them, so tensors are
not replaced: each distinct *storage* is copied to host and resized to zero bytes, then resized
back and refilled on onload. Every view (param, grad, optimizer state) sees its data again.

The mechanism is device-agnostic (tests run it on CPU storages); the workers only call it on
CUDA, where it frees device memory. Left out: partial offload, asynchronous prefetch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch


class StorageOffloader:
    """Holds host copies of the storages it offloaded until :meth:`onload` restores them."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, torch.Tensor]] = []  # (storage, host bytes)

    @property
    def offloaded(self) -> bool:
        return bool(self._saved)

    @property
    def host_bytes(self) -> int:
        return sum(host.numel() for _, host in self._saved)

    def offload(self, tensors: Iterable[torch.Tensor]) -> int:
        """Copy each distinct storage behind ``tensors`` to host and free it; returns bytes moved."""
        seen: set[int] = set()
        pin = torch.cuda.is_available()
        for t in tensors:
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if storage.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            whole = _bytes_view(storage)  # [nbytes] uint8
            host = torch.empty(whole.shape, dtype=torch.uint8, device="cpu", pin_memory=pin)
            host.copy_(whole)
            self._saved.append((storage, host))
        if pin:
            torch.cuda.synchronize()
        for storage, _ in self._saved:
            storage.resize_(0)
        return self.host_bytes

    def onload(self) -> None:
        """Re-allocate every offloaded storage and copy its bytes back."""
        for storage, host in self._saved:
            storage.resize_(host.numel())
            _bytes_view(storage).copy_(host, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._saved = []


def _bytes_view(storage: Any) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def model_tensors(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    """Params and their grads (``main_grad`` buffers of Megatron DDP included)."""
    for p in module.parameters():
        yield p.data
        for grad in (p.grad, getattr(p, "main_grad", None)):
            if grad is not None:
                yield grad


def optimizer_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    """Main params, their grads and state tensors of a Megatron (chained) optimizer."""
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    for opt in chained:
        inner = getattr(opt, "optimizer", opt)
        for group in inner.param_groups:
            for p in group["params"]:
                yield p.data
                if p.grad is not None:
                    yield p.grad
        for state in inner.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    yield value


def on_device(tensors: Iterable[torch.Tensor], device: torch.device) -> Iterator[torch.Tensor]:
    return (t for t in tensors if t.device.type == device.type)
