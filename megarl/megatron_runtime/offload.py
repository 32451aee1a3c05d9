"""Move a model's states (weights, grads, optimizer state) off its device and back, keeping
every view of them valid.

Megatron's params and ``main_grad`` are views into big contiguous buffers and the optimizer
holds references to them, so tensors are never replaced: each distinct *storage* is resized to
zero bytes and resized back on onload; every view (param, grad, optimizer state) sees its data
again. The memory hand-over (megarl/memory/handover.py) says which states move when, from the
residency table (megarl/memory/residency.py); this module only moves them.

- Weights and optimizer state: their bytes go to one host buffer per state, allocated at the
  exact size (and pinned with ``cudaHostRegister`` on CUDA: torch's pinned allocator rounds
  every block up to a power of two, nearly doubling the host memory of a 70B model), and
  reused by the next offload of that state.
- Grads are stale after ``optimizer.step()`` (every update zeroes them first): they are freed
  without a copy and come back zeroed.
- Frozen states (the reference's weights: nothing writes them) are copied to their host buffer
  at their first offload only; later offloads free the device memory without a copy, and every
  onload copies back from that one host copy (a 72B reference is 35 GiB per node of
  device-to-host traffic saved at each offload).
- On CUDA every offload ends with ``torch.cuda.empty_cache()``: freed blocks otherwise stay in
  this process's caching allocator, where another process (SGLang) cannot get them.

Device-agnostic: on CPU the same storages are resized and their bytes copied to another host
buffer, which frees nothing but is what CI runs and what the residency test measures
(:meth:`ModelStates.device_bytes`). Left out: asynchronous prefetch.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

ALIGN = 512  # bytes: each storage's copy starts aligned in the host buffer


class HostBuffer:
    """One host copy of several storages, exactly ``nbytes`` long, pinned on CUDA."""

    def __init__(self) -> None:
        self.data: torch.Tensor | None = None
        self._unpin: Any = None

    def get(self, nbytes: int) -> torch.Tensor:
        """A ``[nbytes]`` uint8 host tensor; the previous one when it has that size."""
        if self.data is not None and self.data.numel() == nbytes:
            return self.data
        self.free()
        self.data = torch.empty(nbytes, dtype=torch.uint8)
        if torch.cuda.is_available() and nbytes:
            ptr = self.data.data_ptr()
            error = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))
            if error:
                raise RuntimeError(f"cudaHostRegister of a {nbytes}-byte offload buffer failed (cudaError {error})")
            self._unpin = weakref.finalize(self.data, torch.cuda.cudart().cudaHostUnregister, ptr)
        return self.data

    @property
    def nbytes(self) -> int:
        return 0 if self.data is None else self.data.numel()

    def free(self) -> None:
        if self._unpin is not None:
            self._unpin()  # unregister before the memory goes back to the host allocator
            self._unpin = None
        self.data = None


def _bytes_view(storage: Any) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class StateMover:
    """The storages of one state while they are off the device (``copy``: keep their bytes;
    ``frozen``: the bytes never change, so the host copy of the first offload serves every onload)."""

    def __init__(self, copy: bool, frozen: bool = False) -> None:
        self.copy, self.frozen = copy, frozen
        self.host = HostBuffer()
        self.moved: list[tuple[Any, int, int]] = []  # (storage, offset in the host buffer, nbytes)
        self.held: list[tuple[int, int]] | None = None  # frozen: (offset, nbytes) of each storage the host buffer holds

    @property
    def offloaded(self) -> bool:
        return bool(self.moved)

    def offload(self, storages: Sequence[Any]) -> int:
        """Free ``storages`` (their bytes to the host buffer when ``copy``, unless a frozen state's
        host buffer holds them already); returns bytes freed."""
        offsets, total = [], 0
        for storage in storages:
            offsets.append(total)
            total += _aligned(storage.nbytes())
        layout = [(offset, storage.nbytes()) for storage, offset in zip(storages, offsets)]
        # A frozen state's storages are the same ones every time; another layout (never seen) is copied anew.
        kept = self.frozen and self.held == layout and self.host.nbytes == total
        host = self.host.get(total) if self.copy and not kept else None
        for storage, offset in zip(storages, offsets):
            if host is not None:
                host[offset : offset + storage.nbytes()].copy_(_bytes_view(storage), non_blocking=True)
            self.moved.append((storage, offset, storage.nbytes()))
        if self.frozen and host is not None:
            self.held = layout
        if storages and storages[0].device.type == "cuda":
            torch.cuda.synchronize()  # the copies are done before the memory is reused
        for storage in storages:
            storage.resize_(0)
        return sum(n for _, _, n in self.moved)

    def onload(self) -> None:
        """Re-allocate every freed storage: its bytes back, or zeros (grads)."""
        host = self.host.data
        for storage, offset, nbytes in self.moved:
            storage.resize_(nbytes)
            view = _bytes_view(storage)
            if self.copy and host is not None:
                view.copy_(host[offset : offset + nbytes], non_blocking=True)
            else:
                view.zero_()
        if self.moved and self.moved[0][0].device.type == "cuda":
            torch.cuda.synchronize()  # the host buffer may be overwritten by the next offload
        self.moved = []


class ModelStates:
    """A model's states by name, each a source of tensors (e.g. ``{"weights": params, "grads":
    grads, "optimizer": optimizer state}``) on ``device``. A storage belongs to the first state
    that names it, so an fp32 optimizer's main params (views of the weights) are weights."""

    def __init__(self, device: torch.device, sources: Mapping[str, Callable[[], Iterable[torch.Tensor]]],
                 copied: Iterable[str], frozen: Iterable[str] = ()) -> None:  # fmt: skip
        """``copied``: the states whose bytes an offload keeps (not grads); ``frozen``: those of
        them that never change on the device, copied at their first offload only."""
        self.device, self.sources = device, dict(sources)
        copied, frozen = set(copied), set(frozen)
        if frozen - copied:
            raise ValueError(f"frozen states {sorted(frozen - copied)} must be copied states too")
        self.movers = {name: StateMover(copy=name in copied, frozen=name in frozen) for name in self.sources}

    def storages(self) -> dict[str, list[Any]]:
        """The distinct device storages that hold bytes now, per state."""
        seen: set[int] = set()
        out: dict[str, list[Any]] = {}
        for name, source in self.sources.items():
            out[name] = []
            for tensor in source():
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                if tensor.device.type != self.device.type or storage.nbytes() == 0 or key in seen:
                    continue
                seen.add(key)
                out[name].append(storage)
        return out

    def offload(self, states: Iterable[str]) -> int:
        """Free ``states`` that are on the device; returns the bytes freed."""
        todo = [s for s in self._known(states) if not self.movers[s].offloaded]
        if not todo:
            return 0
        storages = self.storages()
        freed = sum(self.movers[s].offload(storages[s]) for s in todo)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # to the driver, where another process can take it
        return freed

    def onload(self, states: Iterable[str]) -> None:
        for s in self._known(states):
            self.movers[s].onload()

    def offloaded(self) -> set[str]:
        return {s for s, m in self.movers.items() if m.offloaded}

    def device_bytes(self) -> dict[str, int]:
        """Bytes each state keeps allocated on the device now."""
        return {name: sum(s.nbytes() for s in storages) for name, storages in self.storages().items()}

    def host_bytes(self) -> dict[str, int]:
        """Bytes of each state's host buffer (kept from its last offload for the next; grads have none)."""
        return {name: mover.host.nbytes for name, mover in self.movers.items()}

    def _known(self, states: Iterable[str]) -> list[str]:
        states = list(states)
        unknown = [s for s in states if s not in self.sources]
        if unknown:
            raise ValueError(f"unknown model states {unknown}; this model has {', '.join(self.sources)}")
        return states


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (what they keep allocated)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def model_weights(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    for p in module.parameters():
        yield p.data


def model_grads(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    """Grads of the params (``main_grad`` buffers of Megatron DDP included)."""
    for p in module.parameters():
        for grad in (p.grad, getattr(p, "main_grad", None)):
            if grad is not None:
                yield grad


def optimizer_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    """Main params, their grads and state tensors of a Megatron (chained) optimizer."""
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    for opt in chained:
        inner = getattr(opt, "optimizer", opt)
        if inner is None:  # a rank without parameters
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                yield p.data
                if p.grad is not None:
                    yield p.grad
        for state in inner.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    yield value
