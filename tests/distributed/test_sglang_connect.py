"""PolicyRank's SGLang transports on 2 gloo processes (TP=1 x DP=2) against the stand-in SGLang
server of tests/unit/rollout_sglang/conftest.py, running in this (the parent) process:

- "tensor" (colocated): one engine of tp=2 on both ranks' "GPUs"; each rank serializes its
  own copy, rank 0 gathers and posts one payload per engine TP rank;
- "distributed" (disaggregated): rank 0 (stage 0's tp 0 / dp 0 rank) joins a group with the
  engine and broadcasts; rank 1 only exports.
Either way the server must end up with exactly the model's HF tensors at the pushed version.
Also the payload gather's order (engine TP order, not rank order).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import actor_cases as ac
import pytest
import torch
from spawn import run_distributed

ROOT = Path(__file__).resolve().parents[2]


def _fake_server_class():
    """The unit tests' FakeServer (loaded from its conftest by path: one stand-in server)."""
    path = ROOT / "tests" / "unit" / "rollout_sglang" / "conftest.py"
    spec = importlib.util.spec_from_file_location("megarl_test_fake_sglang", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses in it look their module up by name
    spec.loader.exec_module(module)
    return module.FakeServer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megarl.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("sglang_connect") / "m", **ac.TINY))


def _connect_and_push(rank: int, world: int, model_path: str, url: str, tp: int, transport: str, holders) -> dict:
    from megarl.actors.policy_rank import PolicyRank
    from megarl.config.loading import load_config
    from megarl.rollout_sglang.engine import EngineEndpoint

    cfg = load_config(ROOT / "configs" / "tiny_grpo.yaml", [
        f"model.path={model_path}", "rollout.engine=sglang", "reference.enabled=false",
        "rollout.weight_sync.bucket_mb=1", f"rollout.weight_sync.transport={transport}",
    ])  # fmt: skip
    policy = PolicyRank(cfg, total_optimizer_steps=1)
    policy.connect_engines([EngineEndpoint(url, tp, 8, tuple(holders))])
    metrics = policy.push_weights(4)
    return {"posts": len(policy.transport.engines), "metrics": metrics}


def _hf_state(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(model_dir) / "model.safetensors"))


@pytest.mark.parametrize("transport,tp,holders,posters", [
    ("tensor", 2, [0, 1], [1, 0]),
    ("distributed", 1, [], [1, 0]),
])  # fmt: skip
def test_push_from_policy_ranks_reaches_the_engine(model_dir, transport, tp, holders, posters):
    server = _fake_server_class()(tp=tp)
    try:
        results = run_distributed(_connect_and_push, 2, model_dir, server.url, tp, transport, holders, timeout_s=240)
        fake = server.fake
        assert [r["posts"] for r in results] == posters
        assert results[0]["metrics"]["weight_sync/buckets"] >= 1
        assert results[0]["metrics"]["weight_sync/bytes"] == results[1]["metrics"]["weight_sync/bytes"]
        assert fake.weight_version == "4"
        want = _hf_state(model_dir)
        assert sorted(fake.weights) == sorted(want)
        for name, tensor in want.items():
            assert torch.equal(fake.weights[name].to(tensor.dtype), tensor), name
        control = fake.control_calls()
        updates = [i for i, c in enumerate(control) if c.startswith("/update_weights")]
        assert control.index("/pause_generation") < control.index("/flush_cache") < updates[0]
        assert control.index("/continue_generation") > updates[-1]
        assert "/release_memory_occupation" not in control  # memory is the controller's business
    finally:
        server.shutdown()


def _gather_order(rank: int, world: int) -> list:

    from megarl.weight_sync.cuda_ipc import GlooPayloadGathers

    gathers = GlooPayloadGathers()
    out = []
    for ranks in ([1, 0], [0, 1]):  # engine TP order; the first one posts
        gather = gathers(ranks)
        out.append(gather.gather(f"payload of rank {rank}"))
        gather.barrier()
    return out


def test_payload_gather_is_in_engine_tp_order():
    results = run_distributed(_gather_order, 2, timeout_s=60)
    assert results[1] == [["payload of rank 1", "payload of rank 0"], None]
    assert results[0] == [None, ["payload of rank 0", "payload of rank 1"]]
