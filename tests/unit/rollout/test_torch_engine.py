"""TorchEngine against a direct Hugging Face reference: log-probs, greedy, stopping, seeds."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from megarl.engines.base import RolloutEngine, SamplingParams
from megarl.engines.torch_engine import TorchEngine, sample_tokens

PROMPTS = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15, 16, 2]]


def _hf_logits(hf_model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """Logits predicting each response token from an unpadded, cache-free forward, [R, V]."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = hf_model(input_ids=ids).logits[0]
    return logits[len(prompt) - 1 : len(prompt) + len(response) - 1].float()


def test_engine_satisfies_protocol(task_engine):
    assert isinstance(task_engine, RolloutEngine)


def test_sampled_logprobs_are_prefilter_log_softmax_of_hf_logits(task_engine, hf_task_model):
    params = SamplingParams(temperature=0.7, top_p=0.8, top_k=4, max_new_tokens=10, n=3, seed=11)
    results = task_engine.generate(PROMPTS, params)
    assert [r.prompt_index for r in results] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    cut_something = False
    for r in results:
        logits = _hf_logits(hf_task_model, PROMPTS[r.prompt_index], r.response_ids)  # [R, V]
        logp = torch.log_softmax(logits / 0.7, dim=-1)
        tokens = torch.tensor(r.response_ids)
        expected = logp.gather(-1, tokens[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(r.logprobs), expected, atol=1e-5, rtol=0)
        # every sampled token survives top-k then top-p filtering of the reference distribution
        probs, order = logp.exp().sort(dim=-1, descending=True, stable=True)
        rank = (order == tokens[:, None]).float().argmax(dim=-1)  # [R]
        mass_before = (probs.cumsum(-1) - probs).gather(-1, rank[:, None]).squeeze(-1)
        assert (rank < 4).all() and (mass_before <= 0.8).all()
        # and a filtered-renormalised log-prob would have differed somewhere
        kept = (probs.cumsum(-1) - probs <= 0.8) & (torch.arange(probs.shape[-1]) < 4)
        cut_something |= bool((kept.logical_not() & (probs > 1e-3)).any())
    assert cut_something, "top-p/top-k never removed a token: the test does not exercise filtering"


def test_greedy_equals_hf_generate(task_engine, hf_task_model):
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    results = task_engine.generate(PROMPTS, params)
    eos = task_engine.eos_token_ids
    width = max(len(p) for p in PROMPTS)
    pad = task_engine.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    with torch.no_grad():
        ref = hf_task_model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12,
            pad_token_id=pad, eos_token_id=list(eos),
        )[:, width:].tolist()
    for r, expected in zip(results, ref, strict=True):
        cut = next((i + 1 for i, t in enumerate(expected) if t in eos), len(expected))
        assert r.response_ids == expected[:cut]
        assert r.finish_reason == ("stop" if cut < 12 or expected[-1] in eos else "length")
        # greedy log-probs are log_softmax(logits) (T counted as 1)
        logits = _hf_logits(hf_task_model, PROMPTS[r.prompt_index], r.response_ids)
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.response_ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(r.logprobs), lp, atol=1e-5, rtol=0)


def _greedy(engine, prompt, **kw):
    return engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=16, **kw))[0]


def test_stop_token_id_keeps_the_token_and_reports_stop(task_engine):
    base = _greedy(task_engine, PROMPTS[0])
    assert base.finish_reason == "length" and len(base.response_ids) == 16
    stop_id = base.response_ids[5]
    cut = base.response_ids.index(stop_id) + 1
    got = _greedy(task_engine, PROMPTS[0], stop_token_ids=(stop_id,))
    assert got.response_ids == base.response_ids[:cut]
    assert got.logprobs == pytest.approx(base.logprobs[:cut], abs=1e-6)
    assert got.finish_reason == "stop"


def test_stop_string_spanning_tokens_stays_in_response(task_engine):
    base = _greedy(task_engine, PROMPTS[0])
    assert base.finish_reason == "length"
    tok = task_engine.tokenizer
    stop = tok.decode(base.response_ids[6:9])
    assert len(stop) == 3  # one character per token in the task vocabulary
    cut = next(k for k in range(1, 17) if stop in tok.decode(base.response_ids[:k]))
    got = _greedy(task_engine, PROMPTS[0], stop=("never-there", stop))
    assert got.response_ids == base.response_ids[:cut]
    assert tok.decode(got.response_ids).endswith(stop)
    assert got.finish_reason == "stop"


def test_tokenizer_eos_stops_and_stays_in_response(task_engine):
    got = _greedy(task_engine, PROMPTS[1])
    assert got.response_ids[-1] == task_engine.tokenizer.eos_token_id
    assert got.finish_reason == "stop" and len(got.response_ids) < 16
    assert len(got.logprobs) == len(got.response_ids)


def test_ignore_eos_generates_past_eos_to_the_budget(task_engine):
    stopped = _greedy(task_engine, PROMPTS[1])
    assert stopped.finish_reason == "stop" and len(stopped.response_ids) < 16
    got = _greedy(task_engine, PROMPTS[1], ignore_eos=True)
    assert got.finish_reason == "length" and len(got.response_ids) == 16
    assert got.response_ids[: len(stopped.response_ids)] == stopped.response_ids  # the EOS, then on
    # stop token ids are ignored too (SGLang's rule), stop strings are not
    assert len(_greedy(task_engine, PROMPTS[1], ignore_eos=True, stop_token_ids=(got.response_ids[0],)).response_ids) == 16


def test_generation_config_eos_ids_stop(task_model_dir, tmp_path, task_engine):
    first = _greedy(task_engine, PROMPTS[2]).response_ids[0]
    model_dir = tmp_path / "eos_model"
    shutil.copytree(task_model_dir, model_dir)
    gen_cfg = json.loads((model_dir / "generation_config.json").read_text())
    gen_cfg["eos_token_id"] = [gen_cfg["eos_token_id"], first]
    (model_dir / "generation_config.json").write_text(json.dumps(gen_cfg))
    engine = TorchEngine(model_dir, dtype="float32")
    got = _greedy(engine, PROMPTS[2])
    assert got.response_ids == [first] and got.finish_reason == "stop"


def test_length_finish_reason_when_cut(task_engine):
    results = task_engine.generate(PROMPTS, SamplingParams(max_new_tokens=3, seed=1, n=2))
    for r in results:
        eos_hit = any(t in task_engine.eos_token_ids for t in r.response_ids)
        assert r.finish_reason == ("stop" if eos_hit else "length")
        assert len(r.response_ids) == (r.response_ids.index(next(t for t in r.response_ids if t in task_engine.eos_token_ids)) + 1 if eos_hit else 3)


def test_each_prompt_stops_at_its_own_budget_with_the_same_tokens(task_engine):
    """prompt_max_new_tokens caps each prompt's samples (the agent driver's turns of different
    budgets in one request); a capped sample is the uncapped one's prefix, cut as length."""
    params = SamplingParams(max_new_tokens=8, n=2, seed=5, stop_token_ids=())
    full = task_engine.generate(PROMPTS, params)
    capped = task_engine.generate(PROMPTS, SamplingParams(**{**params.__dict__, "prompt_max_new_tokens": (2, 8, 5)}))
    for r, whole in zip(capped, full, strict=True):
        cap = (2, 8, 5)[r.prompt_index]
        assert r.response_ids == whole.response_ids[:cap]
        assert r.finish_reason == ("length" if len(whole.response_ids) > cap else whole.finish_reason)
    with pytest.raises(ValueError, match=r"prompt_max_new_tokens \(2, 9, 5\) needs one value in \[1, max_new_tokens=8\]"):
        task_engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, prompt_max_new_tokens=(2, 9, 5)))


def test_seeded_sample_is_independent_of_batch_composition_and_chunking(task_model_dir, task_engine):
    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=8, n=2, seed=1234)
    batch = task_engine.generate(PROMPTS, params)
    # prompt 2 alone: its samples are global indices 4 and 5 of the request
    alone = task_engine.generate([PROMPTS[2]], params, first_sample_index=4)
    assert [r.response_ids for r in alone] == [r.response_ids for r in batch[4:6]]
    for a, b in zip(alone, batch[4:6], strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    one_at_a_time = TorchEngine(task_model_dir, dtype="float32", max_running_requests=1)
    assert [r.response_ids for r in one_at_a_time.generate(PROMPTS, params)] == [r.response_ids for r in batch]
    again = task_engine.generate(PROMPTS, params)
    assert [r.response_ids for r in again] == [r.response_ids for r in batch]
    other_seed = task_engine.generate(PROMPTS, SamplingParams(**{**params.__dict__, "seed": 99}))
    assert [r.response_ids for r in other_seed] != [r.response_ids for r in batch]
    # the two samples of one prompt differ (each has its own stream)
    assert batch[0].response_ids != batch[1].response_ids


def test_sample_tokens_follows_the_filtered_distribution():
    """Empirical frequencies of the inverse-CDF sampler match top-k/top-p renormalised probs."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]]).repeat(4000, 1)
    gens = [torch.Generator().manual_seed(i) for i in range(4000)]
    params = SamplingParams(temperature=1.0, top_k=3, top_p=0.9)
    tokens, lps = sample_tokens(logits, params, gens)
    probs = torch.softmax(logits[0], -1)
    kept = probs[:3] / probs[:3].sum()  # top-3 mass before token 2 is 0.82 < 0.9: all 3 kept
    freq = torch.bincount(tokens, minlength=5).float() / 4000
    assert freq[3:].sum() == 0
    assert torch.allclose(freq[:3], kept, atol=0.03)
    assert torch.allclose(lps, torch.log(probs)[tokens])


@pytest.mark.parametrize(
    "field, value, match",
    [("n", 0, "n"), ("top_k", 0, "top_k"), ("top_p", 0.0, "top_p"), ("max_new_tokens", 0, "max_new_tokens")],
)
def test_bad_sampling_params_name_the_field(task_engine, field, value, match):
    with pytest.raises(ValueError, match=match):
        task_engine.generate(PROMPTS, SamplingParams(**{field: value}))


def test_dropping_finished_rows_from_the_cache_changes_nothing(task_model_dir):
    params = SamplingParams(temperature=1.0, max_new_tokens=12, n=4, seed=7)
    every_finish = TorchEngine(task_model_dir, dtype="float32", compact_fraction=0.0).generate(PROMPTS, params)
    never = TorchEngine(task_model_dir, dtype="float32", compact_fraction=1e9).generate(PROMPTS, params)
    assert any(r.finish_reason == "stop" for r in never)  # rows did finish early
    assert [r.response_ids for r in every_finish] == [r.response_ids for r in never]
    for a, b in zip(every_finish, never, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
