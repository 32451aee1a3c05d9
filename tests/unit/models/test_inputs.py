"""GPT inputs from padded batches, and masking of padded vocabulary columns."""

from __future__ import annotations

import torch

from megarl.models.inputs import gpt_inputs, mask_vocab_padding_


def test_gpt_inputs_left_padding():
    ids = torch.arange(8).view(2, 4)
    valid = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    _, pos, mask = gpt_inputs(ids, valid)
    assert pos.tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]
    assert mask.shape == (2, 1, 4, 4) and mask.dtype == torch.bool
    # row 0, query 3 sees keys 2 and 3 only (causal, padding masked)
    assert (~mask[0, 0, 3]).nonzero().flatten().tolist() == [2, 3]
    assert (~mask[1, 0, 2]).nonzero().flatten().tolist() == [0, 1, 2]


def test_mask_vocab_padding_per_tp_rank():
    # vocab 5 padded to 6, tp 2: rank 0 holds columns 0-2, rank 1 holds 3-5 (5 is padding)
    r0, r1 = torch.zeros(2, 3), torch.zeros(2, 3)
    mask_vocab_padding_(r0, vocab_size=5, tp_rank=0)
    mask_vocab_padding_(r1, vocab_size=5, tp_rank=1)
    low = torch.finfo(torch.float32).min
    assert (r0 == 0).all() and (r1[:, :2] == 0).all() and (r1[:, 2] == low).all()
    logits = torch.cat([r0, r1], -1)
    probs = torch.softmax(logits, -1)
    assert probs[:, 5].max() == 0 and torch.allclose(probs[:, :5], torch.full((2, 5), 0.2))
    assert torch.isfinite((probs * logits).sum(-1)).all()  # entropy term; -inf would give NaN
