"""Let SGLang 0.5.23's LoRA layers run on a CPU-only torch (SGLang CPU servers only).

With ``--enable-lora`` SGLang builds small host tensors with ``pin_memory=True`` and calls
``.pin_memory()`` on others (lora/layers.py, e.g. ``ColumnParallelLinearWithLoRA.__init__``;
lora/backend/torch_backend.py ``prepare_lora_batch``), which a CPU-only torch refuses:
``RuntimeError: pin_memory=True requires a CUDA or other accelerator backend; no pinned memory
allocator is available on this system.`` Without an accelerator there is nothing to pin for:
when one of those modules is loaded on a torch without CUDA, its ``torch`` is replaced by a view
of torch whose tensor factories drop ``pin_memory``, and ``Tensor.pin_memory()`` returns the
tensor itself (a call that could only raise on such a torch). Nothing changes where CUDA is
available, and nothing is patched on disk. Installed with a ``.pth`` line by ``make sglang-cpu``,
as the other guards beside it.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import types

_MODULES = (
    "sglang.srt.lora.layers",
    "sglang.srt.lora.backend.torch_backend",
    "sglang.srt.lora.lora",
)
_FACTORIES = ("tensor", "empty", "zeros", "ones", "arange", "full")


def _unpinned(fn):  # noqa: ANN001, ANN202
    @functools.wraps(fn)
    def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    return call


def _torch_without_pinning():  # noqa: ANN202
    import torch

    view = types.ModuleType("torch")  # torch's attributes, its factories without pin_memory
    view.__dict__.update(torch.__dict__)
    for name in _FACTORIES:
        setattr(view, name, _unpinned(getattr(torch, name)))
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    return view


class _Guard(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201 - finder protocol
        if name not in _MODULES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)  # not through sys.meta_path
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):  # noqa: ANN001, ANN202
            load(module)
            import torch

            if not torch.cuda.is_available():
                module.torch = _torch_without_pinning()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _Guard())
