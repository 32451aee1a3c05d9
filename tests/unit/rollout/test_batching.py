"""Engine results -> Batch: grouping, padding, metadata alignment; response texts."""

import dataclasses

import pytest
import torch

from megarl.engines.base import GenerationResult
from megarl.models.tiny import build_tokenizer
from megarl.rollout.batching import batch_from_generations, response_texts


def results_for(prompts, n, lengths):
    out, k = [], 0
    for p in range(len(prompts)):
        for _ in range(n):
            ln = lengths[k]
            out.append(GenerationResult(p, list(range(1, ln + 1)), [-0.5] * ln, "stop" if ln < 3 else "length"))
            k += 1
    return out


def test_grouping_padding_and_metadata():
    prompts = [[5, 6, 7], [8]]
    batch = batch_from_generations(prompts, results_for(prompts, 2, [1, 3, 0, 2]), 2, group_offset=10,
                                   data_source=["a", "b"], ground_truth=["x", "y"], extra_info=[{}, {"k": 1}],
                                   prompt_text=["p0", "p1"])
    assert batch.group_id.tolist() == [10, 10, 11, 11]
    assert batch.data_source == ["a", "a", "b", "b"] and batch.extra_info[3] == {"k": 1}
    assert batch.prompt_ids.tolist() == [[5, 6, 7]] * 2 + [[0, 0, 8]] * 2
    assert batch.prompt_mask.tolist()[2] == [0, 0, 1]
    assert batch.response_lengths.tolist() == [1, 3, 0, 2]
    assert batch.response_mask.tolist()[0] == [1.0, 0.0, 0.0]
    assert batch.rollout_logprobs[1].tolist() == [-0.5] * 3 and batch.rollout_logprobs[0, 1] == 0
    assert batch.finish_reason == ["stop", "length", "stop", "stop"]
    batch.extra_info[2]["note"] = 1  # each sample owns its copy of the prompt's metadata
    assert "note" not in batch.extra_info[3]


def test_ungrouped_results_are_refused():
    prompts = [[1], [2]]
    res = results_for(prompts, 1, [1, 1])
    with pytest.raises(ValueError, match="not grouped by prompt"):
        batch_from_generations(prompts, list(reversed(res)), 1)
    with pytest.raises(ValueError, match="expected 2 prompts x n=2"):
        batch_from_generations(prompts, res, 2)


def test_response_texts_drop_final_eos_keep_other_specials():
    tok = build_tokenizer("0123456789")
    eos = tok.eos_token_id
    start = tok.convert_tokens_to_ids("<|im_start|>")
    d = [tok.convert_tokens_to_ids(c) for c in "472"]
    prompts = [[1]]
    res = [GenerationResult(0, [*d, eos], [0.0] * 4, "stop"), GenerationResult(0, [d[0], start, d[1], d[2]], [0.0] * 4, "length")]
    batch = batch_from_generations(prompts, res, 2)
    assert response_texts(batch, tok, [eos]) == ["472", "4<|im_start|>72"]
    assert torch.equal(batch.response_lengths, torch.tensor([4, 4]))


def test_token_versions_are_laid_out_per_token_when_every_result_has_them():
    prompts = [[5, 6], [7]]
    results = [dataclasses.replace(r, token_versions=tuple(range(3, 3 + len(r.response_ids))))
               for r in results_for(prompts, 1, [3, 1])]  # fmt: skip
    assert batch_from_generations(prompts, results, 1).token_versions.tolist() == [[3, 4, 5], [3, 0, 0]]
    # an engine that does not report them (SGLang) leaves the field empty, also when some do
    assert batch_from_generations(prompts, [results[0], results_for(prompts, 1, [3, 1])[1]], 1).token_versions is None
    with pytest.raises(ValueError, match="3 response tokens but 2 token versions"):
        batch_from_generations(prompts, [dataclasses.replace(results[0], token_versions=(1, 1)), results[1]], 1)
