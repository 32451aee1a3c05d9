"""Stand-in for SGLang's CPU kernel package ``sgl_kernel``, for CPU test servers only.

With ``SGLANG_USE_CPU_ENGINE=1`` SGLang imports ``sgl_kernel`` (its CPU build,
``sglang-kernel-cpu``, exists only as source compiled with ``-march=native``; the PyPI
wheels of that name are CUDA builds). On a CPU without AMX SGLang takes its torch-native
fallbacks for the dense models megarl tests (RMSNorm, the ``torch_native`` attention
backend), so the import only has to succeed. Any kernel SGLang does call raises
NotImplementedError naming it, so a model that needs a real kernel fails loudly instead
of computing something wrong.

``make sglang-cpu`` copies this package into the SGLang venv's site-packages.
"""

from __future__ import annotations

from typing import Any, NoReturn

__version__ = "0.0.0+megarl.stub"


def _missing(name: str) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available: this is megarl's stub of SGLang's CPU "
            "kernel package (tests/sglang/sgl_kernel_stub); the model needs a real kernel, "
            "build sglang-kernel-cpu or use a model SGLang runs with torch-native layers"
        )

    kernel.__name__ = name
    return kernel


def __getattr__(name: str) -> Any:
    # Dunder lookups (copy, pickle, importlib probing) must see a plain missing attribute.
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
