"""The Batch contract: alignment survives select / split / concat; sequences() layout."""

import pytest
import torch

from megarl.data.batch import Batch


def make_batch(b=6, p=4, r=5, seed=0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(1, p + 1, (b,), generator=g)
    rlen = torch.randint(0, r + 1, (b,), generator=g)
    prompt_mask = (torch.arange(p)[None, :] >= (p - plen)[:, None]).long()
    prompt_ids = torch.randint(1, 50, (b, p), generator=g) * prompt_mask
    valid = (torch.arange(r)[None, :] < rlen[:, None]).long()
    response_ids = torch.randint(1, 50, (b, r), generator=g) * valid
    return Batch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_lengths=rlen,
        response_mask=valid.float(),
        group_id=torch.arange(b) // 2,
        data_source=[f"src{i}" for i in range(b)],
        ground_truth=[str(i) for i in range(b)],
        extra_info=[{"row": i} for i in range(b)],
        finish_reason=["stop" if i % 2 else "length" for i in range(b)],
        scores=torch.arange(b, dtype=torch.float),
        rollout_logprobs=-torch.rand(b, r, generator=g) * valid,
    )


def _row_signature(batch: Batch, i: int):
    """Everything one row carries, with padding stripped, to compare rows across layouts."""
    plen = int(batch.prompt_mask[i].sum())
    rlen = int(batch.response_lengths[i])
    return (
        batch.prompt_ids[i, batch.prompt_len - plen :].tolist(),
        batch.response_ids[i, :rlen].tolist(),
        batch.response_mask[i, :rlen].tolist(),
        batch.rollout_logprobs[i, :rlen].tolist(),
        int(batch.group_id[i]),
        float(batch.scores[i]),
        batch.data_source[i],
        batch.ground_truth[i],
        batch.extra_info[i],
        batch.finish_reason[i],
    )


def test_select_keeps_rows_aligned():
    batch = make_batch()
    idx = [4, 0, 3]
    sub = batch.select(idx)
    assert len(sub) == 3
    for j, i in enumerate(idx):
        assert _row_signature(sub, j) == _row_signature(batch, i)
    mask = torch.tensor([True, False, True, False, False, True])
    assert [sub2 for sub2 in batch.select(mask).data_source] == ["src0", "src2", "src5"]


def test_split_then_concat_round_trips():
    batch = make_batch(b=7)
    parts = batch.split(3)
    assert [len(p) for p in parts] == [3, 3, 1]
    back = Batch.concat(parts)
    for i in range(len(batch)):
        assert _row_signature(back, i) == _row_signature(batch, i)


def test_concat_repads_different_widths():
    a, b = make_batch(b=2, p=3, r=2, seed=1), make_batch(b=3, p=5, r=6, seed=2)
    both = Batch.concat([a, b])
    assert both.prompt_ids.shape == (5, 5) and both.response_ids.shape == (5, 6)
    for i in range(2):
        assert _row_signature(both, i) == _row_signature(a, i)
    for i in range(3):
        assert _row_signature(both, 2 + i) == _row_signature(b, i)
    # prompts stay left-padded: the last column of every prompt is a real token
    assert bool((both.prompt_mask[:, -1] == 1).all())


def test_concat_refuses_partially_filled_fields():
    a, b = make_batch(b=2), make_batch(b=2)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        Batch.concat([a, b.replace(rollout_logprobs=None)])


def test_chunk_requires_equal_parts():
    assert [len(c) for c in make_batch(b=6).chunk(3)] == [2, 2, 2]
    with pytest.raises(ValueError, match="cannot cut a batch of 6 rows into 4"):
        make_batch(b=6).chunk(4)


def test_shape_contract_is_enforced():
    batch = make_batch()
    with pytest.raises(AssertionError):
        batch.replace(old_logprobs=torch.zeros(len(batch), batch.response_len + 1))
    with pytest.raises(AssertionError):
        batch.replace(data_source=["x"])


def test_sequences_layout_and_positions():
    batch = make_batch(b=1, p=4, r=3).replace(
        prompt_ids=torch.tensor([[0, 0, 7, 8]]),
        prompt_mask=torch.tensor([[0, 0, 1, 1]]),
        response_ids=torch.tensor([[9, 10, 0]]),
        response_lengths=torch.tensor([2]),
        response_mask=torch.tensor([[1.0, 1.0, 0.0]]),
        rollout_logprobs=None,
    )
    tokens, mask, pos = batch.sequences()
    assert tokens.tolist() == [[0, 0, 7, 8, 9, 10, 0]]
    assert mask.tolist() == [[0, 0, 1, 1, 1, 1, 0]]
    assert pos.tolist()[0][2:6] == [0, 1, 2, 3]
    assert batch.response_valid.tolist() == [[1, 1, 0]]
