"""The torch engine serves a tiny DeepSeek-V3 (MLA, one dense first layer, grouped sigmoid routing
with a correction bias) and records its routing: the HF routers' experts and weights (the routed
scaling factor included) on prompt and response tokens, the dense layer skipped; a push carries the
routers' correction bias (a buffer, not a parameter) into the engine, and one without it is refused."""

from __future__ import annotations

import pytest
import torch

from megarl.data.routing_ids import unpack_expert_ids
from megarl.engines.base import SamplingParams, WeightBucket
from megarl.engines.torch_engine import TorchEngine, WeightLoadError
from megarl.models.tiny import build_tiny_model

PROMPTS = [[3, 4, 5, 6, 7], [8, 9]]


def test_torch_engine_routing_of_deepseek_v3(tmp_path):
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path / "ds", "deepseek_v3", hidden_size=64, num_layers=3, num_heads=4, ffn_hidden_size=96)
    engine = TorchEngine(path, dtype="float32")
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=1, seed=3, return_routing=True)
    results = engine.generate(PROMPTS, params)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    gates = [hf.model.layers[i].mlp.gate for i in (1, 2)]  # layer 0 is dense (first_k_dense_replace 1)
    for r in results:
        tokens = PROMPTS[r.prompt_index] + r.response_ids
        seen: list = []

        def record(module, args, out, seen=seen) -> None:
            seen.append((out[2], out[1]))  # (ids, weights) [T, k]

        handles = [g.register_forward_hook(record) for g in gates]
        with torch.no_grad():
            hf(input_ids=torch.tensor([tokens]))
        for h in handles:
            h.remove()
        ids, weights = torch.stack([i for i, _ in seen], dim=1), torch.stack([w for _, w in seen], dim=1)  # [T, 2, k]
        assert r.routed_experts is not None and r.routing_weights is not None
        assert r.routed_experts.shape == (len(tokens), 2, 2)
        assert torch.equal(unpack_expert_ids(r.routed_experts)[:-1], ids[:-1])
        assert torch.allclose(r.routing_weights[:-1], weights[:-1], atol=1e-6, rtol=0)
        assert r.routing_weights[:-1].sum(-1).allclose(torch.tensor(2.5))  # normalised, times routed_scaling_factor


def test_a_push_carries_the_correction_bias(tmp_path):
    from safetensors.torch import load_file

    path = build_tiny_model(tmp_path / "ds", "deepseek_v3", hidden_size=64, num_layers=2, num_heads=4, ffn_hidden_size=96)
    engine = TorchEngine(path, dtype="float32")
    pushed = load_file(str(path / "model.safetensors"))
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    pushed[bias] = pushed[bias] + 0.5  # as the trainer's load balancing moved it
    engine.load_weights(WeightBucket(sorted(pushed.items()), 2, last=True))
    assert torch.equal(engine.model.model.layers[1].mlp.gate.e_score_correction_bias, pushed[bias])
    assert engine.weight_version == 2
    with pytest.raises(WeightLoadError, match=r"weight push 3 ended without 1 parameter\(s\): " + bias.replace(".", r"\.")):
        engine.load_weights(WeightBucket([(n, t) for n, t in pushed.items() if n != bias], 3, last=True))
