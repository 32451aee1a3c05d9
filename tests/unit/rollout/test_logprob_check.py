"""The post-push log-prob check: the torch engine generates, an HF forward over the Batch's rows
plays the trainer (what the Megatron policy computes), and a corrupted push is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megarl.config.rollout_sections import WeightSyncConfig
from megarl.data.batch import Batch
from megarl.data.prompt_batch import PromptBatch
from megarl.engines.base import SamplingParams, WeightBucket
from megarl.engines.torch_engine import TorchEngine
from megarl.rollout.batching import batch_from_generations
from megarl.weight_sync.logprob_check import (
    PROBE_MAX_NEW_TOKENS,
    LogprobMismatchError,
    PostPushCheck,
    compare_logprobs,
)


class HFTrainer:
    """The trainer's side: one forward over the Batch's rows, logits at P + t - 1, [B, R]."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.temperatures = model, []

    def compute_logprobs(self, batch: Batch, temperature: float) -> torch.Tensor:
        self.temperatures.append(temperature)
        tokens, mask, positions = batch.sequences()
        with torch.no_grad():
            logits = self.model(input_ids=tokens, attention_mask=mask, position_ids=positions).logits.float()
        p = batch.prompt_len
        logp = torch.log_softmax(logits[:, p - 1 : -1] / temperature, dim=-1)  # [B, R, V]
        return logp.gather(-1, batch.response_ids[..., None]).squeeze(-1) * batch.response_valid


def prompts_of(ids: list[list[int]]) -> PromptBatch:
    n = len(ids)
    return PromptBatch(prompt_ids=ids, prompt_text=[""] * n, data_source=["t"] * n, ground_truth=[""] * n,
                       extra_info=[{} for _ in range(n)], index=list(range(n)), file_index=[0] * n)  # fmt: skip


def generator(engine: TorchEngine, seen: list[SamplingParams]):
    def generate(prompts: PromptBatch, params: SamplingParams) -> Batch:
        seen.append(params)
        results = engine.generate(prompts.prompt_ids, params)
        return batch_from_generations(prompts.prompt_ids, results, params.n)

    return generate


def test_check_passes_on_same_weights_and_fails_on_a_corrupted_push(task_model_dir, hf_task_model):
    engine = TorchEngine(task_model_dir, dtype="float32")
    seen: list[SamplingParams] = []
    sampling = SamplingParams(temperature=0.9, top_p=0.5, top_k=3, max_new_tokens=200, n=8, seed=7)
    trainer = HFTrainer(hf_task_model)
    check = PostPushCheck(generator(engine, seen), trainer, prompts_of([[1, 2, 3], [4, 5], [6]]), sampling, max_diff=0.05)
    metrics = check(version=1)
    assert metrics["weight_sync/logprob_diff"] <= 1e-5
    # The probe samples the full distribution, one short response per prompt, at the run's T.
    assert (seen[0].top_p, seen[0].top_k, seen[0].n, seen[0].temperature) == (1.0, -1, 1, 0.9)
    assert seen[0].max_new_tokens == PROBE_MAX_NEW_TOKENS and trainer.temperatures == [0.9]
    # A push that perturbs one weight by 1 % (as a dtype slip or a wrong layout would) is caught.
    weights = [(n, p.detach().clone()) for n, p in engine.model.named_parameters()]
    weights = [(n, t * 1.01 if n.endswith("layers.0.mlp.down_proj.weight") else t) for n, t in weights]
    engine.load_weights(WeightBucket(weights, 2, last=True))
    with pytest.raises(LogprobMismatchError, match="max_logprob_diff"):
        PostPushCheck(generator(engine, []), trainer, prompts_of([[1, 2, 3], [4, 5], [6]]), sampling, max_diff=1e-4)(2)


def test_compare_ignores_padding_and_refuses_nan_and_empty():
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    a = torch.tensor([[-1.0, -2.0, 5.0]])
    b = torch.tensor([[-1.1, -2.1, -9.0]])
    assert compare_logprobs(a, b, mask, max_diff=0.2)["weight_sync/logprob_diff"] == pytest.approx(0.1)
    with pytest.raises(LogprobMismatchError):
        compare_logprobs(a, torch.full_like(b, float("nan")), mask, max_diff=0.2)
    with pytest.raises(LogprobMismatchError, match="no response tokens"):
        compare_logprobs(a, b, torch.zeros_like(mask), max_diff=0.2)


def test_default_bound_is_the_benchmarked_one():
    """The default comes from bench/results/logprob_check.json: 3x the worst mean |diff| over 20 bf16
    pushes of each configuration measured there, rounded up; the field's description says so."""
    recorded = json.loads((Path(__file__).parents[3] / "bench/results/logprob_check.json").read_text())
    default = WeightSyncConfig().max_logprob_diff
    assert default == recorded["default_max_logprob_diff"]
    assert 3 * recorded["worst_mean"] <= default <= 4.5 * recorded["worst_mean"]  # rounded up to 1, 1.5, 2, 2.5, 3, 4, 5, 6, 8 x 10^k
    assert {"tiny/tp2", "tiny/pp2", "qwen05/tp2", "qwen05/pp2"} <= set(recorded["configs"])
    assert "bench/results/logprob_check.json" in WeightSyncConfig.model_fields["max_logprob_diff"].description
