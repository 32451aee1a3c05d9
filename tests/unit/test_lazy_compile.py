"""megatron-core's import-time torch.compile made lazy (megarl/lazy_compile.py): a fresh process
that imports megarl then megatron.core loads no TorchDynamo, megatron's jit_fuser still compiles
at the first call and gives the eager result, and torch.compile is torch's own afterwards."""

import json
import subprocess
import sys

import torch

from megarl.lazy_compile import _lazy

PROBE = """
import json, sys
import megarl, megatron.core, torch
from megatron.core import jit
print(json.dumps({"dynamo": "torch._dynamo" in sys.modules, "fuser": jit.jit_fuser.__module__,
                  "compile": torch.compile.__module__}))
"""


def test_importing_megatron_core_after_megarl_loads_no_dynamo():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=300).stdout
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen == {"dynamo": False, "fuser": "megarl.lazy_compile", "compile": "torch"}


def test_the_first_call_compiles_and_gives_the_eager_result():
    calls = []

    def real(model, **options):
        calls.append(options)
        return torch.compile(model, **options)

    def gelu_bias(x, b):
        return torch.nn.functional.gelu(x + b)

    lazy = _lazy(real)(gelu_bias, backend="eager")
    assert calls == [] and lazy.__name__ == "gelu_bias"  # nothing compiled at decoration
    x, b = torch.randn(4, 8), torch.randn(8)
    assert torch.equal(lazy(x, b), gelu_bias(x, b)) and calls == [{"backend": "eager"}]
    assert torch.equal(lazy(x, b), gelu_bias(x, b)) and len(calls) == 1  # compiled once
    decorated = _lazy(real)(backend="eager")(gelu_bias)  # @torch.compile(backend=...) form
    assert torch.equal(decorated(x, b), gelu_bias(x, b)) and len(calls) == 2
    module = torch.nn.Linear(8, 8)
    assert isinstance(_lazy(real)(module, backend="eager"), torch.nn.Module)  # a module is compiled as before
