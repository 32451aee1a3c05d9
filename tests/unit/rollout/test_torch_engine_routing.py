"""TorchEngine's mixture-of-experts routing against the HF model's own routers on the same tokens."""

from __future__ import annotations

import pytest
import torch

from megarl.data.routing_ids import unpack_expert_ids
from megarl.engines.base import SamplingParams
from megarl.engines.torch_engine import TorchEngine
from megarl.models.tiny import build_tiny_model

PROMPTS = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15, 16, 2]]
MOE_LAYERS = (0, 2)  # 3 layers, layer 1 dense (mlp_only_layers): the engine must skip it


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("moe"), arch="qwen3_moe", num_layers=3, mlp_only_layers=[1],
                            num_experts=4, experts_per_token=2, seed=7)  # fmt: skip


def _hf_routing(hf_model, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One unpadded, cache-free forward; the routers' (ids, weights), each [T, L, k]."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    gates = [hf_model.model.layers[i].mlp.gate for i in MOE_LAYERS]
    handles = [g.register_forward_hook(lambda m, a, out: seen.append((out[2], out[1]))) for g in gates]
    try:
        with torch.no_grad():
            hf_model(input_ids=torch.tensor([tokens]))
    finally:
        for h in handles:
            h.remove()
    return torch.stack([i for i, _ in seen], dim=1), torch.stack([w for _, w in seen], dim=1).float()


@pytest.mark.parametrize("compact_fraction", [0.3, 1.0])  # compact after 2 of 4 rows end / never: finished rows stay
def test_routing_equals_hf_routers_over_prompt_and_response(moe_model_dir, compact_fraction):
    from transformers import AutoModelForCausalLM

    # 6 rows in chunks of 4 and 2, budgets that end rows at different steps: compaction and
    # left padding both move rows around the cache while the routing is recorded
    engine = TorchEngine(moe_model_dir, dtype="float32", max_running_requests=4, compact_fraction=compact_fraction)
    params = SamplingParams(temperature=1.0, max_new_tokens=9, n=2, seed=3, prompt_max_new_tokens=(3, 9, 6),
                            return_routing=True)  # fmt: skip
    results = engine.generate(PROMPTS, params)
    hf = AutoModelForCausalLM.from_pretrained(str(moe_model_dir), dtype=torch.float32).eval()
    assert len({len(r.response_ids) for r in results}) > 1
    for r in results:
        tokens = PROMPTS[r.prompt_index] + r.response_ids
        assert r.routed_experts is not None and r.routing_weights is not None
        assert r.routed_experts.dtype == torch.uint8 and r.routed_experts.shape == (len(tokens), len(MOE_LAYERS), 2)
        ids, weights = _hf_routing(hf, tokens)  # [T, L, k]
        assert torch.equal(unpack_expert_ids(r.routed_experts)[:-1], ids[:-1])  # same experts, same order
        assert torch.allclose(r.routing_weights[:-1], weights[:-1], atol=1e-6, rtol=0)
        assert (unpack_expert_ids(r.routed_experts)[-1] == -1).all() and (r.routing_weights[-1] == 0).all()  # no forward saw it


def test_no_routing_unless_asked_and_same_samples(moe_model_dir):
    engine = TorchEngine(moe_model_dir, dtype="float32")
    params = SamplingParams(temperature=1.0, max_new_tokens=5, seed=3)
    plain = engine.generate(PROMPTS[:2], params)
    routed = engine.generate(PROMPTS[:2], SamplingParams(temperature=1.0, max_new_tokens=5, seed=3, return_routing=True))
    assert all(r.routed_experts is None and r.routing_weights is None for r in plain)
    assert [r.response_ids for r in plain] == [r.response_ids for r in routed]  # recording changes nothing sampled
    assert [r.logprobs for r in plain] == [r.logprobs for r in routed]


def test_routing_of_a_dense_model_is_refused(tmp_path):
    engine = TorchEngine(build_tiny_model(tmp_path, arch="qwen2"), dtype="float32")
    with pytest.raises(ValueError, match="no mixture-of-experts router.*routing_replay: none"):
        engine.generate([[3, 4]], SamplingParams(max_new_tokens=2, return_routing=True))


@pytest.mark.parametrize("mode", ["experts", "experts_and_weights"])
def test_rollout_batch_carries_the_routers_choice_on_its_token_rows(moe_model_dir, mode):
    from transformers import AutoModelForCausalLM

    from megarl.config.rollout_sections import AgentConfig
    from megarl.data.prompt_batch import PromptBatch
    from megarl.rollout.agents.driver import AgentRollout

    engine = TorchEngine(moe_model_dir, dtype="float32")
    n = len(PROMPTS)
    prompts = PromptBatch(PROMPTS, [""] * n, ["x"] * n, [""] * n, [{} for _ in PROMPTS], list(range(n)), [0] * n)
    rollout = AgentRollout(AgentConfig(), None, False, routing=mode)
    assert rollout(engine, prompts, SamplingParams(max_new_tokens=4, seed=1)).routed_experts is None  # validation's params
    batch = rollout(engine, prompts, SamplingParams(max_new_tokens=4, seed=1, return_routing=True))  # a training step's
    hf = AutoModelForCausalLM.from_pretrained(str(moe_model_dir), dtype=torch.float32).eval()
    tokens, mask, _ = batch.sequences()  # [B, P+R]
    assert batch.routed_experts is not None
    assert (batch.routing_weights is not None) == (mode == "experts_and_weights")
    for row in range(len(batch)):
        real = mask[row].bool()
        ids, weights = _hf_routing(hf, tokens[row, real].tolist())  # [T, L, k]
        assert torch.equal(unpack_expert_ids(batch.routed_experts[row, real])[:-1], ids[:-1])
        assert (unpack_expert_ids(batch.routed_experts[row, ~real]) == -1).all()
        if batch.routing_weights is not None:
            assert torch.allclose(batch.routing_weights[row, real][:-1], weights[:-1], atol=1e-6, rtol=0)
