"""Run by test_engine.py with the SGLang venv's Python: megarl's tensor payload code where
SGLang is importable, so the bucket is SGLang's own FlattenedTensorBucket.

argv: the path of megarl/rollout_sglang/tensor_payload.py (loaded by path: the SGLang venv
has no megarl), a safetensors file. Prints the requests as JSON: [{load_format, payloads}].
"""

from __future__ import annotations

import importlib.util
import json
import sys

from safetensors.torch import load_file

spec = importlib.util.spec_from_file_location("megarl_tensor_payload", sys.argv[1])
payload = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = payload  # dataclasses look their module up there
spec.loader.exec_module(payload)
named = sorted(load_file(sys.argv[2]).items())
requests = payload.build_tensor_requests(named, tp=1)  # bucket class "auto": SGLang's
print(json.dumps([{"load_format": r.load_format, "payloads": r.payloads} for r in requests]))
