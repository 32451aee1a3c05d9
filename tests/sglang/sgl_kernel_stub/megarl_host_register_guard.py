"""Let SGLang 0.5.23's routed-experts capture start on a CPU-only torch (SGLang CPU servers only).

``--enable-return-routed-experts`` keeps the experts in a host buffer that SGLang pins with
``cudaHostRegister`` (mem_cache/pool_host/common.py ``_cuda_host_register``), which a CPU torch
cannot call. Without CUDA there is nothing to pin for: this makes the register / unregister
calls no-ops there, as the module is loaded (state_capturer/base.py imports them by name), and
changes nothing where CUDA is available. Nothing is patched on disk. Installed with a ``.pth``
line by ``make sglang-cpu``, as the torchvision guard beside it.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

_MODULE = "sglang.srt.mem_cache.pool_host.common"


class _Guard(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201 - finder protocol
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)  # once; find_spec below must not come back here
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):  # noqa: ANN001, ANN202
            load(module)
            import torch

            if not torch.cuda.is_available():
                module._cuda_host_register = lambda *args, **kwargs: None
                module._cuda_host_unregister = lambda *args, **kwargs: None

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _Guard())
