import math

import pytest
import torch

from megarl.algos import (
    dynamic_sampling_filter,
    logprob_mismatch,
    overlong_penalty,
    tis_weights,
    zero_var_group_frac,
)
from megarl.algos.mismatch import corrections_by_staleness, tis_capped


def test_token_tis_weights_are_capped_ratios():
    train = torch.tensor([[0.0, -1.0, -2.0, 0.0]])
    rollout = torch.tensor([[-1.0, -1.0, -1.0, -30.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w = tis_weights(train, rollout, mask, "token", cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 1.0, math.exp(-1.0), 1.0]]))
    assert not w.requires_grad


def test_sequence_tis_weights_multiply_over_valid_tokens_without_overflow():
    train = torch.tensor([[-0.1, -0.2, 0.0], [0.0] * 3, [5.0] * 3])
    rollout = torch.tensor([[-0.3, -0.3, -99.0], [0.0] * 3, [-900.0] * 3])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0] * 3, [1.0] * 3])
    w = tis_weights(train, rollout, mask, "sequence", cap=5.0)
    expected = math.exp(0.2 + 0.1)  # the masked token's huge ratio is ignored
    torch.testing.assert_close(w[0], torch.tensor([expected, expected, 1.0]))
    assert (w[1] == 1).all() and (w[2] == 5.0).all()
    assert (tis_weights(train, rollout, mask, "none", 2.0) == 1).all()
    with pytest.raises(ValueError, match="tis.level"):
        tis_weights(train, rollout, mask, "seq", 2.0)


def test_logprob_mismatch_metric():
    train = torch.tensor([[0.0, -1.0, -2.0]])
    rollout = torch.tensor([[-0.5, -1.5, 7.0]])
    m = logprob_mismatch(train, rollout, torch.tensor([[1.0, 1.0, 0.0]]))
    torch.testing.assert_close(m, torch.tensor([1.0, 2.0]))


def test_dynamic_sampling_drops_constant_groups_keeps_singletons():
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5])
    groups = torch.tensor([4, 4, 4, 9, 9, 2, 2, 8])
    keep, counts = dynamic_sampling_filter(scores, groups)
    assert keep.tolist() == [False, False, False, True, True, False, False, True]
    assert (counts.kept_groups, counts.dropped_groups) == (2, 2)
    assert (counts.kept_samples, counts.dropped_samples) == (3, 5)
    assert zero_var_group_frac(scores, groups) == pytest.approx(2 / 3)
    assert zero_var_group_frac(torch.tensor([1.0]), torch.tensor([0])) == 0.0


def test_overlong_penalty_is_linear_over_the_window():
    lengths = torch.tensor([0, 60, 70, 75, 80, 100])
    out = overlong_penalty(lengths, max_new_tokens=80, length=20, penalty=1.0)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.5, -0.75, -1.0, -1.0]))
    assert (overlong_penalty(lengths, 80, 0, 1.0) == 0).all()
    with pytest.raises(ValueError, match="overlong.length"):
        overlong_penalty(lengths, 10, 20, 1.0)


@pytest.mark.parametrize("cap", [2.0, 3.5, 7.0, 10.3])
def test_tokens_at_the_cap_are_counted_as_capped_whatever_the_cap(cap):
    # exp(log(cap)) rounds below cap for 3.5, 7.0 and 10.3 in fp32: a weight >= cap test misses them
    train = torch.tensor([[0.0, 5.0, math.log(cap) - 0.5]])
    rollout = torch.zeros(1, 3)
    mask = torch.ones(1, 3)
    assert tis_capped(train, rollout, mask, "token", cap).tolist() == [[0.0, 1.0, 0.0]]
    assert tis_weights(train, rollout, mask, "token", cap)[0, 1].item() == pytest.approx(cap)
    staleness = corrections_by_staleness(train, rollout, mask, torch.tensor([0]), ("token", cap), ("none", 0.5, 2.0))
    assert staleness["rollout/tis_capped_frac/staleness0"] == pytest.approx(1 / 3)
