"""Let PyPI's torchvision import beside a CPU-only torch (SGLang CPU test servers only).

SGLang imports ``torchvision`` while loading its model configs, even for text models. The
only torchvision wheels on PyPI are linked against CUDA torch, so on CPU torch their C++
ops library (``torchvision/_C.so``) does not load. torchvision copes with that everywhere
except two ``torch.library.register_fake`` calls (``torchvision::nms`` and ``::qnms``),
which raise because the operators were never defined, and the import fails.

This guard runs just before the first ``import torchvision``: if the ops library does not
load, it defines those two operator schemas (no kernels), so the fake registrations
succeed and torchvision imports with its ops missing, which it reports itself if anything
calls them. Nothing is patched on disk. Installed with a ``.pth`` line by
``make sglang-cpu``; where ``_C.so`` loads (a CUDA torch) it does nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_LIBRARIES: list[object] = []  # keeps the torch.library fragment alive


def _define_missing_ops() -> None:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    import torch

    so = os.path.join(list(spec.submodule_search_locations)[0], "_C.so")
    try:
        torch.ops.load_library(so)
        return  # the real ops are there: nothing to do
    except (OSError, RuntimeError):
        pass
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _SCHEMAS:
        lib.define(schema)
    _LIBRARIES.append(lib)


class _Guard(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201 - finder protocol
        if name == "torchvision":
            sys.meta_path.remove(self)  # once; find_spec below must not come back here
            _define_missing_ops()
        return None  # the normal finders import the real package


def install() -> None:
    if not any(isinstance(f, _Guard) for f in sys.meta_path):
        sys.meta_path.insert(0, _Guard())


install()
