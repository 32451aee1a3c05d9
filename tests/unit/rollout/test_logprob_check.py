"""The post-sync log-prob check against a trainer-side reference (an HF forward over Batch.sequences)."""

from __future__ import annotations

import pytest
import torch

from megarl.rollout.engine import WeightBucket
from megarl.rollout.logprob_check import (
    LogprobMismatchError,
    compare_logprobs,
    engine_logprobs,
    probe_batch,
    probe_sequences,
)
from megarl.rollout.torch_engine import TorchEngine


def _reference_logprobs(hf_model, batch, temperature: float) -> torch.Tensor:
    """What a trainer computes: one forward over the Batch's rows, logits at P + t - 1, [B, R]."""
    tokens, mask, positions = batch.sequences()
    with torch.no_grad():
        logits = hf_model(input_ids=tokens, attention_mask=mask, position_ids=positions).logits.float()
    p = batch.prompt_len
    logp = torch.log_softmax(logits[:, p - 1 : -1] / temperature, dim=-1)  # [B, R, V]
    return logp.gather(-1, batch.response_ids[..., None]).squeeze(-1) * batch.response_valid


def test_probe_has_varied_prompt_lengths_and_fixed_content():
    prompts, responses = probe_sequences(100, num=4, prompt_len=6, response_len=5, seed=1)
    assert len({len(p) for p in prompts}) > 1 and all(len(r) == 5 for r in responses)
    assert probe_sequences(100, num=4, prompt_len=6, response_len=5, seed=1) == (prompts, responses)


def test_check_passes_on_same_weights_and_fails_on_perturbed(task_model_dir, hf_task_model):
    engine = TorchEngine(task_model_dir, dtype="float32")
    vocab = hf_task_model.config.vocab_size
    batch = probe_batch(*probe_sequences(vocab, num=4, prompt_len=6, response_len=5), pad_id=engine.pad_token_id)
    trainer = _reference_logprobs(hf_task_model, batch, 0.9)
    metrics = compare_logprobs(engine_logprobs(engine, batch, 0.9), trainer, batch.response_mask, max_diff=0.05)
    assert metrics["weight_sync/logprob_diff"] <= 1e-5
    # a push that scrambles one layer (as a wrong qkv layout would) is caught
    q = engine.model.model.layers[0].self_attn.q_proj.weight
    scrambled = [(n, p.detach().clone()) for n, p in engine.model.named_parameters()]
    scrambled = [(n, t.flip(0) if n.endswith("layers.0.self_attn.q_proj.weight") else t) for n, t in scrambled]
    engine.load_weights(WeightBucket(scrambled, 1, last=True))
    assert not torch.equal(q, hf_task_model.model.layers[0].self_attn.q_proj.weight)
    with pytest.raises(LogprobMismatchError, match="max_logprob_diff"):
        compare_logprobs(engine_logprobs(engine, batch, 0.9), trainer, batch.response_mask, max_diff=1e-3)


def test_compare_ignores_padding_and_refuses_nan():
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    a = torch.tensor([[-1.0, -2.0, 5.0]])
    b = torch.tensor([[-1.1, -2.1, -9.0]])
    assert compare_logprobs(a, b, mask, max_diff=0.2)["weight_sync/logprob_diff"] == pytest.approx(0.1)
    with pytest.raises(LogprobMismatchError):
        compare_logprobs(a, torch.full_like(b, float("nan")), mask, max_diff=0.2)
