"""Off-policy corrections for asynchronous RL, against values computed by hand: the masked
importance sampling mask (algorithm.mis), the whole policy loss as AReaL's decoupled PPO
(old log-probs = proximal policy, rollout log-probs = behaviour policy), the per-staleness
log-prob mismatch, and the mis config's validation."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from megarl.algos import ModelOutputs, make_policy_loss_fn, reduce_metrics
from megarl.algos.mismatch import corrections_by_staleness, mis_mask, mismatch_by_staleness
from megarl.config.algorithm_sections import AlgorithmConfig, MISConfig
from megarl.data.batch import Batch

L = math.log


# ---- (a) the MIS mask at each level ----------------------------------------------------------
# Ratios pi_train / pi_rollout per token; None = padding (its log-probs are wild on purpose).
RATIOS = [
    [1.5, 1.5, 1.5],  # every token in [0.5, 2]; product 3.375 > 2; geometric mean 1.5
    [4.0, 0.25, None],  # both tokens out; product 1.0 and geometric mean 1.0 are in
    [0.4, None, None],  # the one token is out, whatever the level
    [None, None, None],  # empty response
]
EXPECTED_MASKS = {
    "token": [[1, 1, 1], [0, 0, 1], [0, 1, 1], [1, 1, 1]],
    "sequence": [[0, 0, 0], [1, 1, 1], [0, 1, 1], [1, 1, 1]],
    "geometric": [[1, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1]],
}


def _ratio_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train, rollout, mask) [4, 3] with train - rollout = log ratio on valid tokens."""
    rollout = torch.tensor([[-1.0, -2.0, -0.5]] * 4)
    log_ratio = torch.tensor([[50.0 if r is None else L(r) for r in row] for row in RATIOS])
    mask = torch.tensor([[0.0 if r is None else 1.0 for r in row] for row in RATIOS])
    return rollout + log_ratio, rollout, mask


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_mis_mask_by_hand_at_each_level(level):
    train, rollout, mask = _ratio_batch()
    train.requires_grad_()
    keep = mis_mask(train, rollout, mask, level, low=0.5, high=2.0)
    assert keep.tolist() == EXPECTED_MASKS[level]
    assert not keep.requires_grad and keep.dtype == train.dtype


def test_mis_mask_none_keeps_everything_and_a_bad_level_is_named():
    train, rollout, mask = _ratio_batch()
    assert (mis_mask(train, rollout, mask, "none", 0.5, 2.0) == 1).all()
    with pytest.raises(ValueError, match="mis.level"):
        mis_mask(train, rollout, mask, "seq", 0.5, 2.0)


def test_mis_sequence_level_masks_an_overflowing_product_without_nan():
    # 200 tokens of ratio e: the product e^200 is inf in float32; compared in log space it is
    # simply above high
    train, rollout, mask = torch.ones(1, 200), torch.zeros(1, 200), torch.ones(1, 200)
    assert (mis_mask(train, rollout, mask, "sequence", 0.5, 2.0) == 0).all()
    assert (mis_mask(train, rollout, mask, "geometric", 0.5, 3.0) == 1).all()  # e < 3
    # an impossible token (-inf) on padding does not poison its sequence's product
    rollout[0, -1], mask[0, -1] = -math.inf, 0.0
    assert (mis_mask(train, rollout, mask, "geometric", 0.5, 3.0) == 1).all()


# ---- (b) the policy loss is decoupled PPO --------------------------------------------------
# Two sequences of 3 tokens, the second with 2 valid ones. Per token: r = pi_theta / pi_prox
# (the PPO ratio against the recomputed old log-probs), A the advantage, w = pi_prox / pi_behav
# (the behaviour importance weight against the engine's log-probs).
R = [[1.5, 0.5, 1.1], [0.9, 1.2, 7.0]]
A = [[1.0, -1.0, 2.0], [-0.5, -1.0, 3.0]]
W = [[1.2, 3.0, 0.5], [1.0, 2.5, 9.0]]
VALID = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
EPS_LOW, EPS_HIGH, CAP = 0.2, 0.28, 2.0


def _decoupled_batch() -> tuple[Batch, torch.Tensor]:
    """The batch (old = proximal, rollout = behaviour log-probs) and pi_theta's log-probs."""
    behav = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -1.5, -30.0]])
    prox = behav + torch.tensor(W).log()
    theta = (prox + torch.tensor(R).log()).requires_grad_()
    batch = Batch(
        prompt_ids=torch.ones(2, 2, dtype=torch.long),
        prompt_mask=torch.ones(2, 2, dtype=torch.long),
        response_ids=torch.ones(2, 3, dtype=torch.long),
        response_lengths=torch.tensor([3, 2]),
        response_mask=torch.tensor(VALID),
        group_id=torch.arange(2),
        advantages=torch.tensor(A),
        old_logprobs=prox,
        rollout_logprobs=behav,
    )
    return batch, theta


def _clip(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def _areal_token_loss(r: float, a: float, behaviour_weight: float) -> float:
    """loss_t = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) * behaviour_weight."""
    return -min(r * a, _clip(r, 1 - EPS_LOW, 1 + EPS_HIGH) * a) * behaviour_weight


def _token_mean(weight) -> float:
    """Sum of the AReaL token losses with behaviour weight ``weight(w)`` over valid tokens /
    their count."""
    total = sum(
        _areal_token_loss(R[i][t], A[i][t], weight(W[i][t]))
        for i in range(2)
        for t in range(3)
        if VALID[i][t]
    )
    return total / sum(map(sum, VALID))


def _run(**algorithm) -> tuple[float, torch.Tensor, dict[str, float]]:
    cfg = AlgorithmConfig(clip={"low": EPS_LOW, "high": EPS_HIGH, "dual_c": None}, **algorithm)
    batch, theta = _decoupled_batch()
    loss_sum, count, metrics = make_policy_loss_fn(cfg, 3)(batch, ModelOutputs(theta))
    (loss_sum / count).backward()
    assert count.item() == 5  # masked tokens stay in the normaliser
    assert theta.grad is not None
    return (loss_sum / count).item(), theta.grad, reduce_metrics([metrics])


def test_token_tis_is_decoupled_ppo_with_a_truncated_behaviour_weight():
    loss, grad, metrics = _run(tis={"level": "token", "cap": CAP})
    # loss_t = -min(r_t A_t, clip(r_t, 0.8, 1.28) A_t) * min(w_t, 2), token-mean over the 5:
    #   -1.28*1.2 = -1.536 | 0.8*2 = 1.6 | -2.2*0.5 = -1.1 | 0.45*1 = 0.45 | 1.2*2 = 2.4
    hand = (-1.536 + 1.6 - 1.1 + 0.45 + 2.4) / 5
    assert _token_mean(lambda w: min(w, CAP)) == pytest.approx(hand)
    assert loss == pytest.approx(hand, rel=1e-5)
    # d loss / d log pi_theta = -A r min(w, cap) / 5 where the clip is inactive, else 0
    expected_grad = [[0.0, 0.0, -2 * 1.1 * 0.5 / 5], [0.5 * 0.9 * 1.0 / 5, 1.2 * 2.0 / 5, 0.0]]
    torch.testing.assert_close(grad, torch.tensor(expected_grad))
    assert metrics["actor/tis_capped_frac"] == pytest.approx(2 / 5)
    assert metrics["actor/tis_weight"] == pytest.approx((1.2 + 2 + 0.5 + 1 + 2) / 5, rel=1e-5)


def test_token_tis_with_token_mis_is_areals_filtered_behaviour_weight():
    # AReaL's ppo_actor_loss_fn with behav_imp_weight_cap: w_t where w_t <= cap, else 0 (the
    # token is filtered out, still counted). TIS at the cap times MIS [~0, cap] is that weight.
    loss, grad, metrics = _run(
        tis={"level": "token", "cap": CAP}, mis={"level": "token", "low": 1e-3, "high": CAP}
    )
    hand = (-1.536 + 0.0 - 1.1 + 0.45 + 0.0) / 5
    assert _token_mean(lambda w: w if w <= CAP else 0.0) == pytest.approx(hand)
    assert loss == pytest.approx(hand, rel=1e-5)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, -0.22], [0.09, 0.0, 0.0]]))
    assert metrics["actor/mis_masked_frac"] == pytest.approx(2 / 5)


def test_sequence_mis_drops_whole_sequences_and_composes_with_token_tis():
    # sequence ratios: 1.2 * 3 * 0.5 = 1.8 (kept), 1.0 * 2.5 = 2.5 (out of [0.5, 2]; the
    # padding's 9 is ignored): the second sequence contributes 0, its 2 tokens still count
    loss, grad, metrics = _run(tis={"level": "token", "cap": CAP}, mis={"level": "sequence"})
    assert loss == pytest.approx((-1.536 + 1.6 - 1.1) / 5, rel=1e-5)
    assert (grad[1] == 0).all() and grad[0, 2].item() == pytest.approx(-0.22, rel=1e-5)
    assert metrics["actor/mis_masked_frac"] == pytest.approx(2 / 5)
    # MIS alone: the kept sequence's losses are unweighted
    loss, _, _ = _run(mis={"level": "sequence"})
    assert loss == pytest.approx((-1.28 + 0.8 - 2.2) / 5, rel=1e-5)


def test_mis_needs_the_engine_log_probs():
    batch, theta = _decoupled_batch()
    batch = batch.replace(rollout_logprobs=None)
    with pytest.raises(ValueError, match=r"rollout_logprobs because algorithm\.mis\.level is set"):
        make_policy_loss_fn(AlgorithmConfig(mis={"level": "token"}), 3)(batch, ModelOutputs(theta))


# ---- (c) mismatch by staleness ----------------------------------------------------------------
def test_mismatch_by_staleness_by_hand():
    rollout = torch.tensor([[-1.0, -2.0, -0.5]] * 4)
    diff = torch.tensor([[0.1, -0.3, 5.0], [0.5, 0.5, -1.0], [0.2, 9.0, 9.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    staleness = torch.tensor([0, 1, 0, 2])
    out = mismatch_by_staleness(rollout + diff, rollout, mask, staleness)
    # staleness 0: rows 0 and 2, (0.1 + 0.3 + 0.2) / 3; staleness 1: (0.5 + 0.5 + 1.0) / 3;
    # staleness 2: its one sample has no valid token, so no value
    assert set(out) == {
        "rollout/logprob_mismatch/staleness0",
        "rollout/logprob_mismatch/staleness1",
    }
    assert out["rollout/logprob_mismatch/staleness0"] == pytest.approx(0.2, rel=1e-5)
    assert out["rollout/logprob_mismatch/staleness1"] == pytest.approx(2 / 3, rel=1e-5)


def test_corrections_by_staleness_by_hand():
    rollout = torch.tensor([[-1.0, -2.0, -0.5]] * 4)
    diff = torch.tensor([[0.1, -0.3, 5.0], [0.5, 0.5, -1.0], [0.2, 9.0, 9.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    staleness = torch.tensor([0, 1, 0, 2])
    out = corrections_by_staleness(rollout + diff, rollout, mask, staleness, ("token", 1.5), ("token", 0.5, 1.5))
    # staleness 0: ratios e^0.1, e^-0.3, e^0.2, all inside [0.5, 1.5] and below the cap;
    # staleness 1: e^0.5 (twice, capped at 1.5, outside the band) and e^-1 (outside the band);
    # staleness 2: no valid token, no values
    assert set(out) == {f"rollout/{m}/staleness{s}" for m in ("tis_weight", "tis_capped_frac", "mis_masked_frac") for s in (0, 1)}
    assert out["rollout/tis_weight/staleness0"] == pytest.approx((math.exp(0.1) + math.exp(-0.3) + math.exp(0.2)) / 3, rel=1e-5)
    assert out["rollout/tis_capped_frac/staleness0"] == 0.0 and out["rollout/mis_masked_frac/staleness0"] == 0.0
    assert out["rollout/tis_weight/staleness1"] == pytest.approx((1.5 + 1.5 + math.exp(-1.0)) / 3, rel=1e-5)
    assert out["rollout/tis_capped_frac/staleness1"] == pytest.approx(2 / 3)
    assert out["rollout/mis_masked_frac/staleness1"] == 1.0
    # unset corrections report nothing; sequence-level TIS weighs each row by its product
    assert corrections_by_staleness(rollout + diff, rollout, mask, staleness, ("none", 2.0), ("none", 0.5, 2.0)) == {}
    seq = corrections_by_staleness(rollout + diff, rollout, mask, staleness, ("sequence", 10.0), ("none", 0.5, 2.0))
    assert seq["rollout/tis_weight/staleness0"] == pytest.approx((2 * math.exp(-0.2) + math.exp(0.2)) / 3, rel=1e-5)


# ---- (d) the mis config ----------------------------------------------------------------------
@pytest.mark.parametrize(("low", "high"), [(2.0, 2.0), (3.0, 2.0)])
def test_mis_low_must_be_below_high(low, high):
    with pytest.raises(
        ValidationError, match=r"algorithm\.mis\.low .* must be below algorithm\.mis\.high"
    ):
        AlgorithmConfig(mis={"level": "token", "low": low, "high": high})


def test_mis_config_refuses_unknown_keys_bad_levels_and_non_positive_bounds():
    assert MISConfig() == MISConfig(level="none", low=0.5, high=2.0)
    with pytest.raises(ValidationError, match="cap"):
        AlgorithmConfig(mis={"level": "token", "cap": 2.0})
    with pytest.raises(ValidationError, match="level"):
        MISConfig(level="seq")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="low"):
        MISConfig(low=0.0)
