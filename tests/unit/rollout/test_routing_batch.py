"""Engine routing -> Batch.routed_experts / routing_weights, aligned with Batch.sequences() (hand-built results)."""

from __future__ import annotations

import pytest
import torch

from megarl.data.prompt_batch import PromptBatch
from megarl.engines.base import GenerationResult
from megarl.rollout.agents.driver import _cut, batch_from_trajectories
from megarl.rollout.agents.loops import AgentSample, Trajectory
from megarl.rollout.batching import batch_from_generations

L, K = 2, 2


def _routing(positions: list[int], tag: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing whose ids say which token they belong to: token at ``positions[t]`` (plus ``tag``)
    in every layer and slot, -1 (weight 0) in the last row as engines report it; [T, L, K]."""
    ids = torch.tensor(positions, dtype=torch.int16)[:, None, None].expand(-1, L, K).clone() + tag
    ids[-1] = -1
    weights = (ids.float() + 0.5) * (ids >= 0)
    return ids, weights


def _result(prompt: int, context: int, response: list[int], tag: int = 0) -> GenerationResult:
    ids, weights = _routing(list(range(context + len(response))), tag)
    return GenerationResult(prompt, response, [-0.5] * len(response), "stop", 0, ids, weights)


def test_single_turn_routing_lines_up_with_sequences():
    prompts = [[5, 6, 7], [8]]  # left padding of 2 on the second prompt
    results = [_result(0, 3, [1, 2]), _result(1, 1, [3, 4, 5, 6])]
    batch = batch_from_generations(prompts, results, 1)
    tokens, mask, _ = batch.sequences()  # [B, P+R] each
    assert batch.routed_experts is not None and batch.routing_weights is not None
    assert batch.routed_experts.shape == (2, 3 + 4, L, K) and batch.routed_experts.dtype == torch.int16
    for row, start in ((0, 0), (1, 2)):
        real = mask[row].nonzero().squeeze(-1)  # columns of this sample's tokens, in order
        expected = torch.arange(len(real), dtype=torch.int16)
        expected[-1] = -1  # its last response token
        assert torch.equal(batch.routed_experts[row, real, 0, 0], expected)
        assert real[0] == start
        pad = mask[row] == 0
        assert (batch.routed_experts[row][pad] == -1).all() and (batch.routing_weights[row][pad] == 0).all()
    assert torch.equal(batch.routing_weights[1, 2:6, 1, 1], torch.tensor([0.5, 1.5, 2.5, 3.5]))


def test_concat_keeps_routing_on_its_tokens():
    a = batch_from_generations([[5, 6, 7]], [_result(0, 3, [1])], 1)
    b = batch_from_generations([[8]], [_result(0, 1, [3, 4, 5])], 1)
    both = type(a).concat([a, b])
    _, mask, _ = both.sequences()
    assert both.routed_experts is not None
    for row in (0, 1):  # 3 + 1 and 1 + 3 tokens
        assert torch.equal(both.routed_experts[row, mask[row].bool(), 1, 0], torch.tensor([0, 1, 2, -1], dtype=torch.int16))


def test_results_with_and_without_routing_are_refused():
    plain = GenerationResult(0, [1], [-0.1], "stop")
    with pytest.raises(ValueError, match="routing for 1 of 2 samples"):
        batch_from_generations([[5], [6]], [_result(0, 1, [1]), GenerationResult(1, [1], [-0.1], "stop")], 1)
    assert batch_from_generations([[5]], [plain], 1).routed_experts is None


def test_multi_turn_takes_the_latest_turns_routing_over_tool_output():
    prompt = [1, 2, 3]
    t = Trajectory(list(prompt), budget=20)
    t.add_generated(_result(0, 3, [10, 11], tag=100))  # covers prompt + turn 1
    t.add_context([20, 21, 22])  # a tool's answer: no engine routed it yet
    # turn 2's prefill routes all 8 tokens of context again; the engine sampled 3, the budget keeps 2
    t.add_generated(_cut(_result(0, 8, [12, 13, 14]), 2))
    t.add_context([30])  # after the last turn: dropped with the trailing context
    t.drop_trailing_context()
    prompts = PromptBatch([prompt], ["p"], ["x"], [""], [{}], [0], [0])
    batch = batch_from_trajectories(prompts, [AgentSample(t, "p", {})], ["stop"], 1)
    assert batch.routed_experts is not None and batch.routing_weights is not None
    ids = batch.routed_experts[0, :, 0, 0].tolist()
    assert len(ids) == 3 + 7  # prompt, turn 1, tool, turn 2 (cut), no trailing context
    # turn 2's routing (tag 0) everywhere, the tool's tokens included; the token the cut made last
    # was routed by the engine (it sampled one more after it), so it keeps its row
    assert ids == list(range(10))
    assert batch.response_mask[0].tolist() == [1, 1, 0, 0, 0, 1, 1]


def test_routing_the_last_turn_did_not_cover_is_minus_one():
    t = Trajectory([1, 2], budget=20)
    t.add_generated(_result(0, 2, [10, 11]))
    t.add_context([20, 21])  # kept by a loop that ends here without another turn's prefill
    prompts = PromptBatch([[1, 2]], ["p"], ["x"], [""], [{}], [0], [0])
    batch = batch_from_trajectories(prompts, [AgentSample(t, "p", {})], ["max_turns"], 1)
    assert batch.routed_experts is not None and batch.routing_weights is not None
    assert batch.routed_experts[0, :, 1, 1].tolist() == [0, 1, 2, -1, -1, -1]
    assert batch.routing_weights[0, 3:].abs().sum() == 0


def test_routing_replay_is_on_for_moe_models_only(tmp_path):
    from types import SimpleNamespace

    from megarl.engines.routing import routing_replay
    from megarl.models.tiny import tiny_hf_config

    def run(arch: str, mode: str) -> str:
        tiny_hf_config(arch, vocab_size=32).save_pretrained(tmp_path / arch)
        cfg = SimpleNamespace(actor=SimpleNamespace(moe=SimpleNamespace(routing_replay=mode)),
                              model=SimpleNamespace(path=str(tmp_path / arch), arch=None))  # fmt: skip
        return routing_replay(cfg)

    assert run("qwen3_moe", "experts") == "experts"
    assert run("qwen3_moe", "none") == "none"
    assert run("qwen2", "experts_and_weights") == "none"  # a dense model has no routing to report
