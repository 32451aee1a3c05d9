import math

import algos_reference as ref
import pytest
import torch

from megarl.algos import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    compute_advantages,
    token_rewards_from_scores,
)
from megarl.algos.advantages import discounted_reverse_scan, group_stats, masked_reverse_scan
from megarl.config.algorithm_sections import AlgorithmConfig
from megarl.data.batch import Batch

GROUP_MODES = {"grpo": "grpo", "dr_grpo": "dr_grpo", "rloo": "rloo"}


def ragged(
    b: int, r: int, seed: int, holes: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random rows: lengths in [0, r] (one empty row), optional holes inside the response."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, r + 1, (b,), generator=g)
    lengths[0] = 0
    mask = (torch.arange(r)[None, :] < lengths[:, None]).float()
    if holes:
        mask = mask * (torch.rand(b, r, generator=g) > 0.3).float()
    scores = torch.randint(0, 3, (b,), generator=g).float() / 2
    return lengths, mask, scores


def inputs_for(scores, lengths, mask, groups, values=None, baseline=None) -> AdvantageInputs:
    rewards = token_rewards_from_scores(scores, lengths, mask)
    return AdvantageInputs(rewards, mask, groups, values, baseline)


def test_token_rewards_put_score_on_last_token_and_subtract_kl():
    scores = torch.tensor([1.0, 2.0, 3.0])
    lengths = torch.tensor([2, 4, 0])
    mask = (torch.arange(4)[None] < lengths[:, None]).float()
    kl = torch.full((3, 4), 0.5)
    out = token_rewards_from_scores(scores, lengths, mask, kl=kl, kl_coef=0.1)
    expected = torch.tensor(
        [[-0.05, 0.95, 0.0, 0.0], [-0.05, -0.05, -0.05, 1.95], [3.0, 0.0, 0.0, 0.0]]
    )
    torch.testing.assert_close(out, expected)


def test_grpo_hand_example():
    # group 7: scores 1,0,1,1 (mean .75, unbiased std .5); group 3: one sample; group 9: equal
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 2.0, 2.0])
    groups = torch.tensor([7, 7, 7, 7, 3, 9, 9])
    lengths = torch.tensor([3, 2, 1, 3, 2, 3, 1])
    mask = (torch.arange(3)[None] < lengths[:, None]).float()
    cfg = AlgorithmConfig(estimator="grpo")
    adv, ret = ADVANTAGE_ESTIMATORS.get("grpo")(inputs_for(scores, lengths, mask, groups), cfg)
    d = 0.5 + 1e-6
    row = torch.tensor([0.25 / d, -0.75 / d, 0.25 / d, 0.25 / d, 0.5, 0.0, 0.0])
    torch.testing.assert_close(adv, row[:, None] * mask)
    torch.testing.assert_close(ret, adv)
    dr, _ = ADVANTAGE_ESTIMATORS.get("dr_grpo")(inputs_for(scores, lengths, mask, groups), cfg)
    torch.testing.assert_close(dr[:, 0], torch.tensor([0.25, -0.75, 0.25, 0.25, 0.5, 0.0, 0.0]))
    loo, _ = ADVANTAGE_ESTIMATORS.get("rloo")(inputs_for(scores, lengths, mask, groups), cfg)
    torch.testing.assert_close(loo[:, 0], torch.tensor([1 / 3, -1.0, 1 / 3, 1 / 3, 0.5, 0.0, 0.0]))


def test_grpo_without_std_equals_dr_grpo():
    lengths, mask, scores = ragged(12, 5, seed=1)
    groups = torch.arange(12) // 4
    x = inputs_for(scores, lengths, mask, groups)
    a, _ = ADVANTAGE_ESTIMATORS.get("grpo")(x, AlgorithmConfig(norm_by_std=False))
    b, _ = ADVANTAGE_ESTIMATORS.get("dr_grpo")(x, AlgorithmConfig())
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_group_estimators_match_loop_reference(name, seed):
    lengths, mask, scores = ragged(23, 9, seed=seed, holes=seed == 2)
    g = torch.Generator().manual_seed(seed + 10)
    groups = torch.randint(100, 108, (23,), generator=g) * 1000  # sparse ids, ragged group sizes
    scores = scores + torch.rand(23, generator=g).round(decimals=1)  # some ties, some not
    adv, _ = ADVANTAGE_ESTIMATORS.get(name)(
        inputs_for(scores, lengths, mask, groups), AlgorithmConfig()
    )
    expected = ref.group_relative(scores.tolist(), groups.tolist(), GROUP_MODES[name])
    torch.testing.assert_close(adv, torch.tensor(expected)[:, None] * mask, atol=1e-5, rtol=1e-5)


def test_equal_rewards_give_exact_zero_and_singletons_keep_raw_score():
    scores = torch.full((6,), 0.1)  # mean computes to 0.1 + rounding: must still be exactly 0
    scores[5] = 0.7
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    mask = torch.ones(6, 3)
    lengths = torch.full((6,), 3)
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"):
        adv, _ = ADVANTAGE_ESTIMATORS.get(name)(
            inputs_for(scores, lengths, mask, groups), AlgorithmConfig()
        )
        assert torch.isfinite(adv).all(), name
        if name != "reinforce_plus_plus_baseline":
            assert (adv[:5] == 0).all(), name
            assert adv[5, 0].item() == pytest.approx(0.7), name
    st = group_stats(scores, groups)
    assert st.constant.tolist() == [True, True, True]
    assert st.count.tolist() == [3.0, 2.0, 1.0]


def test_reinforce_plus_plus_baseline_matches_loop_reference():
    lengths, mask, scores = ragged(16, 7, seed=4)
    groups = torch.arange(16) // 4
    adv, _ = ADVANTAGE_ESTIMATORS.get("reinforce_plus_plus_baseline")(
        inputs_for(scores, lengths, mask, groups), AlgorithmConfig()
    )
    centred = ref.group_relative(scores.tolist(), groups.tolist(), "dr_grpo")
    rows = [[c] * 7 for c in centred]
    expected = ref.whiten(rows, mask.tolist())
    torch.testing.assert_close(adv, torch.tensor(expected), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_matches_loop_reference(gamma):
    lengths, mask, _ = ragged(9, 11, seed=5, holes=True)
    rewards = torch.randn(9, 11, generator=torch.Generator().manual_seed(3))
    x = AdvantageInputs(rewards, mask, torch.arange(9))
    adv, ret = ADVANTAGE_ESTIMATORS.get("reinforce_plus_plus")(x, AlgorithmConfig(gamma=gamma))
    expected = ref.discounted_returns(rewards.tolist(), mask.tolist(), gamma)
    torch.testing.assert_close(ret, torch.tensor(expected), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        adv, torch.tensor(ref.whiten(expected, mask.tolist())), atol=1e-4, rtol=1e-4
    )


def test_remax_hand_example():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.5, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    x = AdvantageInputs(rewards, mask, torch.arange(2), baseline_scores=torch.tensor([0.25, 1.0]))
    adv, ret = ADVANTAGE_ESTIMATORS.get("remax")(x, AlgorithmConfig())
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.5, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.75, 0.75, 0.75, 0.0], [-0.5, 0.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="baseline_scores"):
        ADVANTAGE_ESTIMATORS.get("remax")(
            AdvantageInputs(rewards, mask, torch.arange(2)), AlgorithmConfig()
        )


def test_gae_hand_example():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.2, 0.1]])
    mask = torch.ones(1, 3)
    raw = masked_reverse_scan(rewards, mask, 0.9 * 0.5, values, 0.9)
    torch.testing.assert_close(raw, torch.tensor([[-0.18725, 0.295, 0.9]]))
    x = AdvantageInputs(rewards, mask, torch.zeros(1, dtype=torch.long), values)
    adv, ret = ADVANTAGE_ESTIMATORS.get("gae")(x, AlgorithmConfig(gamma=0.9, lam=0.5))
    torch.testing.assert_close(ret, torch.tensor([[0.31275, 0.495, 1.0]]))
    torch.testing.assert_close(adv, torch.tensor(ref.whiten([[-0.18725, 0.295, 0.9]], [[1, 1, 1]])))
    with pytest.raises(ValueError, match="critic"):
        ADVANTAGE_ESTIMATORS.get("gae")(
            AdvantageInputs(rewards, mask, torch.zeros(1)), AlgorithmConfig()
        )


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.95), (0.99, 0.95)])
@pytest.mark.parametrize("holes", [False, True])
def test_gae_matches_loop_reference_at_4096_tokens(gamma, lam, holes):
    b, r = 3, 4096
    g = torch.Generator().manual_seed(7)
    lengths = torch.tensor([4096, 3000, 1])
    mask = (torch.arange(r)[None] < lengths[:, None]).float()
    if holes:
        mask = mask * (torch.rand(b, r, generator=g) > 0.2).float()
    rewards = torch.randn(b, r, generator=g) * 0.1 * mask  # dense (per-token KL) rewards
    values = torch.randn(b, r, generator=g)
    adv, ret = ADVANTAGE_ESTIMATORS.get("gae")(
        AdvantageInputs(rewards, mask, torch.arange(b), values),
        AlgorithmConfig(gamma=gamma, lam=lam),
    )
    raw, returns = ref.gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    torch.testing.assert_close(ret, torch.tensor(returns), atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(
        adv, torch.tensor(ref.whiten(raw, mask.tolist())), atol=2e-4, rtol=1e-4
    )
    assert torch.isfinite(adv).all()


@pytest.mark.parametrize("c", [0.0, 0.5, 0.999, 1.0])
@pytest.mark.parametrize("length", [1, 63, 64, 65, 200])
def test_discounted_reverse_scan_any_length(c, length):
    x = torch.randn(2, length, dtype=torch.float64, generator=torch.Generator().manual_seed(length))
    expected = torch.zeros_like(x)
    run = torch.zeros(2, dtype=torch.float64)
    for t in reversed(range(length)):
        run = x[:, t] + c * run
        expected[:, t] = run
    torch.testing.assert_close(discounted_reverse_scan(x, c), expected)


@pytest.mark.parametrize(
    "name",
    [
        "gae",
        "grpo",
        "dr_grpo",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
    ],
)
def test_padding_and_empty_rows_are_zero_and_finite(name):
    lengths, mask, scores = ragged(8, 6, seed=11, holes=True)
    mask[3] = 0.0  # a second empty response
    groups = torch.arange(8) // 2
    values = torch.randn(8, 6)
    x = inputs_for(scores, lengths, mask, groups, values=values, baseline=torch.rand(8))
    adv, ret = ADVANTAGE_ESTIMATORS.get(name)(x, AlgorithmConfig())
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()


def test_all_masked_batch_gives_zeros_not_nan():
    mask = torch.zeros(3, 4)
    x = AdvantageInputs(
        torch.zeros(3, 4), mask, torch.zeros(3, dtype=torch.long), torch.randn(3, 4)
    )
    for name in ("gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "grpo"):
        adv, _ = ADVANTAGE_ESTIMATORS.get(name)(x, AlgorithmConfig())
        assert (adv == 0).all(), name


def test_compute_advantages_fills_the_batch():
    b, r = 4, 3
    batch = Batch(
        prompt_ids=torch.ones(b, 2, dtype=torch.long),
        prompt_mask=torch.ones(b, 2, dtype=torch.long),
        response_ids=torch.ones(b, r, dtype=torch.long),
        response_lengths=torch.tensor([3, 2, 3, 1]),
        response_mask=(torch.arange(r)[None] < torch.tensor([3, 2, 3, 1])[:, None]).float(),
        group_id=torch.tensor([5, 5, 6, 6]),
        scores=torch.tensor([1.0, 0.0, 1.0, 1.0]),
    )
    with pytest.raises(ValueError, match="token_rewards"):
        compute_advantages(batch, AlgorithmConfig())
    rewards = token_rewards_from_scores(batch.scores, batch.response_lengths, batch.response_mask)
    out = compute_advantages(
        batch.replace(token_rewards=rewards), AlgorithmConfig(estimator="grpo")
    )
    s = 1 / math.sqrt(2)
    torch.testing.assert_close(
        out.advantages[:, 0], torch.tensor([0.5 / (s + 1e-6), -0.5 / (s + 1e-6), 0.0, 0.0])
    )
    assert out.returns is not None and out.advantages.shape == (b, r)


def test_reinforce_plus_plus_hand_example():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    x = AdvantageInputs(rewards, mask, torch.arange(2))
    adv, ret = ADVANTAGE_ESTIMATORS.get("reinforce_plus_plus")(x, AlgorithmConfig(gamma=0.5))
    torch.testing.assert_close(ret, torch.tensor([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]))
    vals = [0.25, 0.5, 1.0, 1.0, 2.0]  # mean 0.95, unbiased var 0.45
    z = [(v - 0.95) / math.sqrt(0.45 + 1e-8) for v in vals]
    torch.testing.assert_close(adv, torch.tensor([z[:3], [z[3], z[4], 0.0]]))
