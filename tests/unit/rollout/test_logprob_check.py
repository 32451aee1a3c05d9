"""The post-push log-prob check: the torch engine generates, an HF forward over the Batch's rows
plays the trainer (what the Megatron policy computes), and a corrupted push is refused."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

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
    LogprobBound,
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


class Scripted:
    """An engine and a trainer whose log-probs of 8 probe tokens differ by ``diffs[k]`` at check k."""

    def __init__(self, diffs: list[float]) -> None:
        self.diffs, self.k = diffs, -1

    def generate(self, prompts: PromptBatch, params: SamplingParams) -> SimpleNamespace:
        self.k += 1
        return SimpleNamespace(rollout_logprobs=torch.full((2, 4), -1.0), response_mask=torch.ones(2, 4))

    def compute_logprobs(self, batch: SimpleNamespace, temperature: float) -> torch.Tensor:
        return batch.rollout_logprobs - self.diffs[self.k]


def run_checks(diffs: list[float], bound: LogprobBound | None = None) -> tuple[PostPushCheck, list[dict[str, float]]]:
    """The checks of pushes 0, 1, ... with the config's default bound; stops at the first refusal."""
    script = Scripted(diffs)
    check = PostPushCheck(script.generate, script, prompts_of([[1]]), SamplingParams(), bound or LogprobBound.of(WeightSyncConfig()))
    return check, [check(version) for version in range(len(diffs))]


def test_steady_diffs_above_max_logprob_diff_pass_once_the_baseline_is_set(caplog):
    """SGLang against Megatron at scale: honest diffs above 0.04 (the torch-against-torch bound),
    steady. The first 5 checks set the baseline (their median) and pass under the ceiling; later
    checks pass within 5x the baseline. The baseline is logged once, when it is set."""
    ws = WeightSyncConfig()
    assert (ws.max_logprob_diff, ws.logprob_baseline_checks, ws.logprob_baseline_factor, ws.logprob_diff_ceiling) == (0.04, 5, 5.0, 0.2)
    first, later = [0.03, 0.045, 0.035, 0.05, 0.032], [0.048, 0.06, 0.041, 0.07, 0.055] * 4
    with caplog.at_level(logging.INFO, logger="megarl.weight_sync.logprob_check"):
        check, metrics = run_checks(first + later)
    assert [m["weight_sync/logprob_diff"] for m in metrics] == pytest.approx(first + later, abs=1e-6)  # (float32 log-probs)
    assert check.bound.baseline == pytest.approx(0.035, abs=1e-6)
    bounds = [m["weight_sync/logprob_diff_bound"] for m in metrics]
    assert bounds == [pytest.approx(0.2)] * 5 + [pytest.approx(5 * 0.035)] * len(later)
    logged = [r.getMessage() for r in caplog.records if "baseline" in r.getMessage()]
    assert len(logged) == 1 and logged[0].startswith("post-push log-prob check: baseline 0.035 (median of the first 5 checks: ")
    assert "pushes are now refused above 0.175" in logged[0]


def test_a_jump_to_several_times_the_baseline_is_refused():
    with pytest.raises(LogprobMismatchError, match=r"differ by 0\.18 on average .* above 0\.175 = rollout\.weight_sync\."
                       r"logprob_baseline_factor \(5\) x the run's baseline 0\.035"):  # fmt: skip
        run_checks([0.03, 0.045, 0.035, 0.05, 0.032, 0.048, 0.18])
    # A noisier engine (baseline 0.06: 5x is 0.3): the ceiling caps the bound.
    with pytest.raises(LogprobMismatchError, match=r"above rollout\.weight_sync\.logprob_diff_ceiling \(0\.2\), the cap of"):
        run_checks([0.06, 0.07, 0.05, 0.06, 0.065, 0.07, 0.24])
    # A quiet one (baseline 0.002): the floor keeps its 5x (0.01) from refusing honest noise.
    _, metrics = run_checks([0.002] * 5 + [0.03])
    assert metrics[-1]["weight_sync/logprob_diff_bound"] == 0.04


def test_a_qk_swap_sized_diff_is_refused_from_the_first_push():
    """q and k swapped in layer 0 scored 0.32-0.35 on the Qwen2.5-0.5B shape
    (bench/results/logprob_check.md): above the ceiling, the bound while the baseline is measured."""
    with pytest.raises(LogprobMismatchError, match=r"differ by 0\.32 .* above rollout\.weight_sync\.logprob_diff_ceiling \(0\.2\), "
                       r"the bound while the run's baseline is measured \(check 1 of 5\)"):  # fmt: skip
        run_checks([0.32])
    with pytest.raises(LogprobMismatchError, match=r"\(check 3 of 5\)"):
        run_checks([0.01, 0.012, 0.33])


def test_without_baseline_checks_max_logprob_diff_is_the_bound():
    bound = LogprobBound.of(WeightSyncConfig(logprob_baseline_checks=0))
    _, metrics = run_checks([0.039] * 7, bound)
    assert {m["weight_sync/logprob_diff_bound"] for m in metrics} == {0.04}
    with pytest.raises(LogprobMismatchError, match=r"above rollout\.weight_sync\.max_logprob_diff \(0\.04\);"):
        run_checks([0.041], LogprobBound.of(WeightSyncConfig(logprob_baseline_checks=0)))


def test_the_baseline_is_kept_across_a_resume():
    check, _ = run_checks([0.03, 0.045, 0.035, 0.05, 0.032, 0.04])
    state = check.state_dict()
    assert state == {"first": pytest.approx([0.03, 0.045, 0.035, 0.05, 0.032], abs=1e-6), "baseline": pytest.approx(0.035, abs=1e-6),
                     "version": 4}  # fmt: skip
    resumed = Scripted([0.18])
    again = PostPushCheck(resumed.generate, resumed, prompts_of([[1]]), SamplingParams(), LogprobBound.of(WeightSyncConfig()))
    again.load_state_dict(state)
    with pytest.raises(LogprobMismatchError, match=r"above 0\.175 = "):  # no new baseline measured: refused at once
        again(6)
    fresh = PostPushCheck(resumed.generate, resumed, prompts_of([[1]]), SamplingParams(), LogprobBound.of(WeightSyncConfig()))
    fresh.load_state_dict({})  # a checkpoint written before the baseline was kept: measured again
    resumed.k = -1
    assert fresh(6)["weight_sync/logprob_diff_bound"] == 0.2 and fresh.bound.first == [pytest.approx(0.18, abs=1e-6)]


def test_the_ceiling_must_exceed_the_floor():
    with pytest.raises(ValueError, match=r"logprob_diff_ceiling \(0\.04\) must exceed max_logprob_diff \(0\.04\)"):
        WeightSyncConfig(logprob_diff_ceiling=0.04)
    assert WeightSyncConfig(logprob_diff_ceiling=0.04, logprob_baseline_checks=0)  # no baseline: no ceiling used


def test_a_resumes_re_push_does_not_count_twice_toward_the_baseline():
    """A resume from step 2 pushes version 2 again and checks it: the baseline is still the
    median of versions 0 to 4, as in the run that was not interrupted."""
    script = Scripted([0.01, 0.02, 0.03, 0.031, 0.04, 0.05])  # (0.031: the re-push of version 2)
    check = PostPushCheck(script.generate, script, prompts_of([[1]]), SamplingParams(), LogprobBound.of(WeightSyncConfig()))
    for version in (0, 1, 2):
        check(version)
    resumed = PostPushCheck(script.generate, script, prompts_of([[1]]), SamplingParams(), LogprobBound.of(WeightSyncConfig()))
    resumed.load_state_dict(check.state_dict())
    for version in (2, 3):  # the re-push of version 2, then step 3
        resumed(version)
    assert resumed.bound.baseline is None and resumed.bound.first == pytest.approx([0.01, 0.02, 0.03, 0.04], abs=1e-6)
    resumed(4)
    assert resumed.bound.first == pytest.approx([0.01, 0.02, 0.03, 0.04, 0.05], abs=1e-6)  # versions 0 to 4, once each
    assert resumed.bound.baseline == pytest.approx(0.03, abs=1e-6)


def test_the_check_runs_on_the_first_push_and_every_nth_after_it():
    """check_logprobs_every=3: every push while the baseline is measured (its 5 checks: pushes 1-5,
    the engines generate, the trainer scores), then 7 and 10 (1, 4, 7, ... anchored at the first),
    6, 8 and 9 only counted; a resumed run (a new check object) checks its first push; a fixed bound
    (no baseline) gives pushes 1, 4 and 7."""
    script = Scripted([0.01] * 20)
    check = PostPushCheck(script.generate, script, prompts_of([[1]]), SamplingParams(), LogprobBound.of(WeightSyncConfig()), every=3)
    metrics = [check(version) for version in range(10)]
    assert [bool(m) for m in metrics] == [True] * 5 + [False, True, False, False, True]
    assert script.k == 6  # seven probes generated
    assert check.bound.first == [pytest.approx(0.01, abs=1e-6)] * 5 and check.bound.baseline is not None
    resumed = PostPushCheck(script.generate, script, prompts_of([[1]]), SamplingParams(), LogprobBound.of(WeightSyncConfig()), every=3)
    resumed.load_state_dict(check.state_dict())
    assert resumed(10)["weight_sync/logprob_diff"] == pytest.approx(0.01, abs=1e-6) and script.k == 7
    assert resumed(11) == {} and script.k == 7  # the baseline came with the checkpoint: the cadence at once
    fixed = PostPushCheck(script.generate, script, prompts_of([[1]]), SamplingParams(), LogprobBound(floor=0.04), every=3)
    assert [bool(fixed(version)) for version in range(7)] == [True, False, False, True, False, False, True]
    assert WeightSyncConfig().check_logprobs_every == 10
    with pytest.raises(ValueError, match="check_logprobs_every"):
        WeightSyncConfig(check_logprobs_every=0)
