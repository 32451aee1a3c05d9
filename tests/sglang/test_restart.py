"""A real SGLang server launched with random weights (``--load-format dummy``, as a trainer
that pushes its own weights would launch it): a disk push, a restart, and the re-push.

It starts a server of its own (not the shared one): the restart and the load format are
part of what is tested.
"""

from __future__ import annotations

import pytest
import torch

from megarl.engines.base import SamplingParams
from megarl.rollout_sglang.engine import SGLangEngine
from megarl.rollout_sglang.tensor_payload import build_tensor_requests

pytestmark = pytest.mark.sglang

PROMPT = list(b"Hello, ")


def greedy(engine: SGLangEngine):
    (result,) = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_new_tokens=6))
    return result


def matches(result, hf, state=None) -> bool:
    ref, argmax = hf.logprobs(PROMPT, result.response_ids, state)
    got = torch.tensor(result.logprobs, dtype=torch.float64)
    return result.response_ids == argmax.tolist() and bool(torch.allclose(got, ref, atol=1e-4))


def test_dummy_launch_disk_push_restart_and_repush(launch_server, tiny_model, hf):
    server = launch_server(load_format="dummy")
    engine = SGLangEngine(server, max_running_requests=16)
    try:
        assert not matches(greedy(engine), hf)  # random weights, not the model's

        # Left out, load_format is the server's ("dummy") and SGLang refuses the load; megarl
        # always sends "auto".
        refused = engine.client.post("/update_weights_from_disk",
                                     {"model_path": str(tiny_model), "weight_version": "1"})  # fmt: skip
        assert refused.status == 400 and "DummyModelLoader" in refused.body["message"]
        engine.load_weights_from_disk(tiny_model, 1)
        assert engine.weight_version == 1 and matches(greedy(engine), hf)

        port = server.port
        engine.restart(timeout=600)
        assert server.port == port and engine.url == server.url  # clients keep their URL
        assert engine.weight_version == 0 and engine.server_weight_version() == 0
        assert not matches(greedy(engine), hf)  # the relaunch has random weights again

        (request,) = build_tensor_requests(list(hf.base.items()), tp=1, bucket_class=None)
        engine.pause_generation()
        engine.flush_cache()
        engine.begin_weight_update()  # the server version is read again after a restart
        engine.update_from_tensor(request.payloads, request.load_format, 2)
        engine.end_weight_update()
        engine.continue_generation()
        engine.check_weight_version(2)
        result = greedy(engine)
        assert result.weight_version == 2 and matches(result, hf)
    finally:
        engine.shutdown()
    assert not server.alive()
