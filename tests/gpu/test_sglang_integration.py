"""A real SGLang server on a tiny model: generation with log-probs, weight push from tensor
(CUDA IPC), weight_version, memory release / resume.

Skipped unless CUDA and sglang are importable. NOT yet run: it was written on a machine
without a GPU (see docs/sglang.md).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.sglang,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("sglang") is None,
        reason="needs a CUDA GPU and sglang installed",
    ),
]

PROMPT = [72, 101, 108, 108, 111, 44, 32]  # "Hello, " in the byte-level tiny tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megarl.models.tiny import build_tiny_model

    # head_dim 64: what SGLang's attention kernels support everywhere.
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), "qwen2", dtype="bfloat16",
                            hidden_size=256, num_heads=4, num_kv_heads=2, ffn_hidden_size=512)  # fmt: skip


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    from megarl.rollout_sglang.engine import SGLangEngine
    from megarl.rollout_sglang.server import ServerSpec, SGLangServer

    log = tmp_path_factory.mktemp("logs") / "sglang.log"
    spec = ServerSpec(model_path=str(model_dir), tp=1, mem_fraction=0.3, max_running_requests=16,
                      memory_saver=True, log_level="info", log_path=str(log))  # fmt: skip
    server = SGLangServer(spec)
    server.start(timeout=900)
    eng = SGLangEngine(server, max_running_requests=16)
    yield eng
    eng.shutdown()


def hf_logprobs(model_dir, state, prompt, response) -> torch.Tensor:
    """log_softmax(logits) of ``response`` under the HF model with ``state`` (T = 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16).cuda()
    model.load_state_dict(state)
    ids = torch.tensor([prompt + response], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits.float()[0, len(prompt) - 1 : -1]  # [R, V]
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0].cpu()


def hf_state(model_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"), device="cuda")


def push(engine, state: dict[str, torch.Tensor], version: int) -> dict[str, float]:
    """A tensor-transport push (CUDA IPC) of ``state`` from this process to ``engine``."""
    from megarl.rollout_sglang.engine import EngineEndpoint
    from megarl.weight_sync.cuda_ipc import SGLangTensorTransport
    from megarl.weight_sync.stream import WeightStream

    transport = SGLangTensorTransport(WeightStream(lambda: iter(state.items()), bucket_mb=1), make_engine=lambda _: engine)
    transport.connect([EngineEndpoint(engine.url, engine.tp)])
    return transport.push(version)


def test_generate_logprobs_match_hf(engine, model_dir):
    from megarl.engines.base import SamplingParams

    results = engine.generate([PROMPT], SamplingParams(max_new_tokens=8, n=2, temperature=1.0))
    assert [r.prompt_index for r in results] == [0, 0]
    for r in results:
        assert len(r.response_ids) == len(r.logprobs) > 0
        assert r.finish_reason in ("stop", "length")
        ref = hf_logprobs(model_dir, hf_state(model_dir), PROMPT, r.response_ids)
        assert (torch.tensor(r.logprobs) - ref).abs().mean() < 0.05


def test_push_from_tensor_changes_logprobs_and_version(engine, model_dir):
    from megarl.engines.base import SamplingParams

    new = {
        n: t * 1.5 if n.endswith("lm_head.weight") else t.clone()
        for n, t in hf_state(model_dir).items()
    }
    metrics = push(engine, new, 1)
    assert engine.server_weight_version() == 1 and metrics["weight_sync/bytes"] > 0
    (r,) = engine.generate([PROMPT], SamplingParams(max_new_tokens=8, temperature=1.0))
    assert r.weight_version == 1
    new_ref = hf_logprobs(model_dir, new, PROMPT, r.response_ids)
    old_ref = hf_logprobs(model_dir, hf_state(model_dir), PROMPT, r.response_ids)
    got = torch.tensor(r.logprobs)
    assert (got - new_ref).abs().mean() < 0.05 < (got - old_ref).abs().mean()


def test_release_frees_memory_and_a_push_after_resume_restores_the_weights(engine, model_dir):
    from megarl.engines.base import SamplingParams

    free_before, _ = torch.cuda.mem_get_info()
    engine.release_memory()
    free_released, _ = torch.cuda.mem_get_info()
    assert free_released > free_before  # KV cache and weights went back to the driver
    engine.resume_memory(["weights"])  # the hand-over's order: weights, push, then the KV cache
    push(engine, hf_state(model_dir), 2)
    engine.resume_memory(["kv_cache", "cuda_graph"])
    assert not engine.released and engine.server_weight_version() == 2
    (r,) = engine.generate([PROMPT], SamplingParams(max_new_tokens=4, temperature=0.0))
    ref = hf_logprobs(model_dir, hf_state(model_dir), PROMPT, r.response_ids)
    assert r.weight_version == 2 and len(r.response_ids) > 0
    assert r.logprobs[0] == pytest.approx(float(ref[0]), abs=0.1)
