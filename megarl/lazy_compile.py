"""megatron-core's import-time ``torch.compile`` made lazy: the first call compiles, as before.

megatron-core decorates its fused kernels with ``torch.compile`` when it is imported
(``megatron.core.jit.jit_fuser``, used by ``fusions/fused_bias_geglu.py`` and others), and
``torch.compile`` imports TorchDynamo and Inductor to build its wrapper: about 2.5 s of the 7 s
``import megatron.core`` takes on one CPU core, in every process that trains (each rank of each role,
each test that spawns one; bench/import_time.py). On CPU megarl never calls those kernels (the
models turn the fusions off: megarl/models/dense.py), and on GPU ``torch.compile`` compiles at the
first call anyway. So while the ``megatron.core`` package itself is imported, ``torch.compile(fn,
...)`` of a function returns a wrapper that calls ``torch.compile(fn, ...)`` the first time it is
called, and that compiled function afterwards (a module or other object is compiled at once, as
before). ``torch.compile`` is torch's own again once that import is done; ``megatron.core.jit.jit_fuser``,
taken during it, stays the lazy one for the process (megatron's ``enable_jit_fuser()`` puts
torch's back). What differs for a kernel: an error ``torch.compile`` raises when applied comes at
its first call, not at import.

:func:`install` (run by ``megarl/__init__.py``: importing megarl is enough) puts a finder first on
``sys.meta_path``; it answers only for ``megatron.core``, wraps the loading of that package, and
removes itself once it ran (a process that never imports megatron-core keeps it: a no-op then).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

_PACKAGE = "megatron.core"


def _lazy(real: Callable[..., Any]) -> Callable[..., Any]:
    """A stand-in for ``torch.compile``: the same arguments, compiled at the first call."""

    def compile_later(model: Any = None, **options: Any) -> Any:
        if model is None:  # @torch.compile(mode=...): the decorator form
            return lambda fn: compile_later(fn, **options)
        if not inspect.isfunction(model):  # a module or another callable object: compiled now, as it was
            return real(model, **options)
        compiled: list[Any] = []

        @functools.wraps(model)
        def first_call_compiles(*args: Any, **kwargs: Any) -> Any:
            if not compiled:
                compiled.append(real(model, **options))
            return compiled[0](*args, **kwargs)

        return first_call_compiles

    return compile_later


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self._finding = False  # (its own lookup of the real spec goes past it)

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if name != _PACKAGE or self._finding:
            return None
        self._finding = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._finding = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            import torch

            real = torch.compile
            torch.compile = _lazy(real)
            try:
                run(module)
            finally:
                torch.compile = real
                if self in sys.meta_path:
                    sys.meta_path.remove(self)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Before anything imports megatron.core (a no-op when it is already imported)."""
    if _PACKAGE not in sys.modules and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
