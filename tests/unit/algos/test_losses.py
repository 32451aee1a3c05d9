import math

import algos_reference as ref
import pytest
import torch

from megarl.algos import (
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    ModelOutputs,
    aggregate,
    make_policy_loss_fn,
    make_value_loss_fn,
    reduce_metrics,
)
from megarl.algos.kl import kl_estimate
from megarl.config.algorithm_sections import AlgorithmConfig, ClipConfig
from megarl.data.batch import Batch

MAX_LEN = 16


def make_batch(b: int, r: int, seed: int, empty_rows: tuple[int, ...] = (1,), **fields) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, r + 1, (b,), generator=g)
    for i in empty_rows:
        lengths[i] = 0
    mask = (torch.arange(r)[None] < lengths[:, None]).float()
    defaults = dict(
        old_logprobs=-torch.rand(b, r, generator=g) * 2,
        advantages=torch.randn(b, r, generator=g) * mask,
        ref_logprobs=-torch.rand(b, r, generator=g) * 2,
        rollout_logprobs=-torch.rand(b, r, generator=g) * 2,
    )
    defaults.update(fields)
    return Batch(
        prompt_ids=torch.ones(b, 2, dtype=torch.long),
        prompt_mask=torch.ones(b, 2, dtype=torch.long),
        response_ids=torch.ones(b, r, dtype=torch.long),
        response_lengths=lengths,
        response_mask=mask,
        group_id=torch.arange(b),
        **defaults,
    )


def new_logprobs(batch: Batch, seed: int, scale: float = 0.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (
        batch.old_logprobs + torch.randn(batch.old_logprobs.shape, generator=g) * scale
    ).requires_grad_()


def test_ppo_hand_example_clip_higher_and_dual_clip():
    clip = ClipConfig(low=0.2, high=0.28, dual_c=3.0)
    old = torch.zeros(1, 4)
    ratio = torch.tensor([[1.5, 5.0, 0.5, 1.1]])
    adv = torch.tensor([[1.0, -1.0, -1.0, 2.0]])
    t = POLICY_LOSSES.get("ppo")(ratio.log(), old, adv, torch.ones(1, 4), clip)
    torch.testing.assert_close(t.loss, torch.tensor([[-1.28, 3.0, 0.8, -2.2]]))
    assert t.clipped.tolist() == [[1.0, 0.0, 1.0, 0.0]]
    assert t.clipped_lower.tolist() == [[0.0, 1.0, 0.0, 0.0]]
    no_dual = POLICY_LOSSES.get("ppo")(
        ratio.log(), old, adv, torch.ones(1, 4), ClipConfig(dual_c=None)
    )
    assert no_dual.loss[0, 1].item() == pytest.approx(5.0)


@pytest.mark.parametrize("seed", [0, 1])
def test_ppo_matches_loop_reference(seed):
    batch = make_batch(7, 9, seed)
    logp = new_logprobs(batch, seed, scale=1.0)
    clip = ClipConfig(low=0.2, high=0.28, dual_c=3.0)
    t = POLICY_LOSSES.get("ppo")(
        logp, batch.old_logprobs, batch.advantages, batch.response_mask, clip
    )
    rows = [
        [ref.ppo_token(a, b, c, 0.2, 0.28, 3.0) for a, b, c in zip(ra, rb, rc, strict=True)]
        for ra, rb, rc in zip(
            logp.tolist(), batch.old_logprobs.tolist(), batch.advantages.tolist(), strict=True
        )
    ]
    loss, clipped, lower = (
        torch.tensor([[tok[k] for tok in row] for row in rows]) for k in range(3)
    )
    torch.testing.assert_close(t.loss, loss.float(), atol=1e-5, rtol=1e-5)
    assert (t.clipped == clipped).all() and (t.clipped_lower == lower).all()
    assert clipped.any() and lower.any()  # the random draw exercises both bounds


@pytest.mark.parametrize("seed", [0, 1])
def test_gspo_value_matches_loop_reference(seed):
    batch = make_batch(6, 8, seed)
    logp = new_logprobs(batch, seed, scale=0.3)
    clip = ClipConfig(low=3e-4, high=4e-4)
    t = POLICY_LOSSES.get("gspo")(
        logp, batch.old_logprobs, batch.advantages, batch.response_mask, clip
    )
    expected = ref.gspo_rows(
        logp.tolist(),
        batch.old_logprobs.tolist(),
        batch.advantages.tolist(),
        batch.response_mask.tolist(),
        3e-4,
        4e-4,
    )
    torch.testing.assert_close(t.loss, torch.tensor(expected), atol=1e-5, rtol=1e-5)


def test_gspo_token_gradient_is_sequence_ratio_times_advantage():
    # Unclipped (wide clip): d loss_t / d logp_t = -A_t * s_i, s_i = exp(mean log ratio of row i).
    old = torch.tensor([[-1.0, -2.0, -0.5, 0.0]])
    logp = torch.tensor([[-0.8, -2.3, -0.4, -9.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv = torch.tensor([[1.0, -2.0, 0.5, 0.0]])
    t = POLICY_LOSSES.get("gspo")(logp, old, adv, mask, ClipConfig(low=0.9, high=9.0))
    (t.loss * mask).sum().backward()
    s = math.exp((0.2 - 0.3 + 0.1) / 3)
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0 * s, 2.0 * s, -0.5 * s, 0.0]]))
    torch.testing.assert_close(t.ratio, torch.full((1, 4), s))


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_aggregation_matches_reference_and_is_global_across_slices(mode):
    batch = make_batch(9, 7, 3, empty_rows=(1, 5))
    loss = torch.randn(9, 7, generator=torch.Generator().manual_seed(0))
    mask = batch.response_mask
    total, count = aggregate(loss, mask, mode, MAX_LEN)
    expected = ref.aggregate(loss.tolist(), mask.tolist(), mode, MAX_LEN)
    assert (total / count).item() == pytest.approx(expected, rel=1e-5)
    # Megatron adds sums and counts over micro-batches: slicing must not change the result
    parts = [aggregate(loss[i : i + 2], mask[i : i + 2], mode, MAX_LEN) for i in range(0, 9, 2)]
    merged = sum(p[0] for p in parts) / sum(p[1] for p in parts)
    assert merged.item() == pytest.approx(expected, rel=1e-5)
    assert set(LOSS_AGGREGATIONS.names()) >= {mode}


@pytest.mark.parametrize("policy_loss", ["ppo", "gspo"])
@pytest.mark.parametrize(
    "loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_policy_loss_fn_composes_terms(policy_loss, loss_agg):
    cfg = AlgorithmConfig(
        policy_loss=policy_loss,
        loss_agg=loss_agg,
        entropy_coef=0.01,
        kl={"use_in_loss": True, "coef": 0.1, "estimator": "k3"},
        tis={"level": "token", "cap": 1.5},
    )
    batch = make_batch(6, 8, 5)
    logp = new_logprobs(batch, 5, scale=0.2)
    entropy = torch.rand(6, 8)
    loss_sum, count, metrics = make_policy_loss_fn(cfg, MAX_LEN)(batch, ModelOutputs(logp, entropy))
    mask = batch.response_mask
    terms = POLICY_LOSSES.get(policy_loss)(
        logp, batch.old_logprobs, batch.advantages, mask, cfg.clip
    )
    w = torch.exp(batch.old_logprobs - batch.rollout_logprobs).clamp(max=1.5)
    per_token = terms.loss * w - 0.01 * entropy + 0.1 * kl_estimate(logp, batch.ref_logprobs, "k3")
    expected = ref.aggregate(per_token.tolist(), mask.tolist(), loss_agg, MAX_LEN)
    assert (loss_sum / count).item() == pytest.approx(expected, rel=1e-5)
    loss_sum.backward()
    assert torch.isfinite(logp.grad).all()
    assert (logp.grad[mask == 0] == 0).all()
    values = reduce_metrics([metrics])
    n = mask.sum()
    assert values["actor/entropy"] == pytest.approx(((entropy * mask).sum() / n).item(), rel=1e-5)
    assert values["actor/ppo_kl"] == pytest.approx(
        ((-terms.log_ratio * mask).sum() / n).item(), rel=1e-5
    )
    if policy_loss == "ppo":  # small log-ratios: the clamp is inactive, ppo_kl = mean(old - new)
        assert values["actor/ppo_kl"] == pytest.approx(
            (((batch.old_logprobs - logp) * mask).sum() / n).item(), rel=1e-5
        )
    assert values["actor/ratio_max"] >= values["actor/ratio_mean"] >= values["actor/ratio_min"] > 0
    assert 0 <= values["actor/clip_frac"] <= 1 and 0 < values["actor/tis_weight"] <= 1.5
    assert values["rollout/logprob_mismatch"] == pytest.approx(
        (((batch.old_logprobs - batch.rollout_logprobs).abs() * mask).sum() / n).item(), rel=1e-5
    )
    pg_only = ref.aggregate((terms.loss * w).tolist(), mask.tolist(), loss_agg, MAX_LEN)
    assert values["actor/pg_loss"] == pytest.approx(pg_only, rel=1e-5)
    assert values["actor/loss"] == pytest.approx(expected, rel=1e-5)


def test_on_policy_without_old_logprobs_has_ratio_one_and_reinforce_gradient():
    batch = make_batch(4, 5, 9, old_logprobs=None, rollout_logprobs=None, ref_logprobs=None)
    logp = (-torch.rand(4, 5)).requires_grad_()
    cfg = AlgorithmConfig()
    loss_sum, count, metrics = make_policy_loss_fn(cfg, MAX_LEN)(batch, ModelOutputs(logp))
    loss_sum.backward()
    torch.testing.assert_close(logp.grad, -batch.advantages * batch.response_mask)
    v = reduce_metrics([metrics])
    assert v["actor/ratio_max"] == v["actor/ratio_min"] == 1.0 and v["actor/clip_frac"] == 0.0
    assert math.isnan(v["actor/kl"])  # no reference: the key is there, null in the run log
    assert "rollout/logprob_mismatch" not in v
    assert v["actor/pg_loss"] == v["actor/loss"]  # no entropy / KL term


def test_empty_slice_contributes_nothing_and_no_nan():
    batch = make_batch(3, 4, 1, empty_rows=(0, 1, 2))
    logp = new_logprobs(batch, 1)
    cfg = AlgorithmConfig(
        policy_loss="gspo", loss_agg="seq-mean-token-mean", tis={"level": "sequence"}
    )
    loss_sum, count, metrics = make_policy_loss_fn(cfg, MAX_LEN)(batch, ModelOutputs(logp))
    assert loss_sum.item() == 0.0 and count.item() == 0.0
    loss_sum.backward()
    assert (logp.grad == 0).all()
    full = make_batch(3, 4, 2, empty_rows=())
    merged = reduce_metrics(
        [metrics, make_policy_loss_fn(cfg, MAX_LEN)(full, ModelOutputs(new_logprobs(full, 2)))[2]]
    )
    assert all(math.isfinite(x) for x in merged.values())
    assert math.isnan(reduce_metrics([metrics])["actor/ratio_max"])


def test_missing_inputs_name_the_field():
    batch = make_batch(2, 3, 0, ref_logprobs=None, rollout_logprobs=None)
    logp = new_logprobs(batch, 0)
    with pytest.raises(ValueError, match="ref_logprobs"):
        make_policy_loss_fn(AlgorithmConfig(kl={"use_in_loss": True}), MAX_LEN)(
            batch, ModelOutputs(logp)
        )
    with pytest.raises(ValueError, match="rollout_logprobs"):
        make_policy_loss_fn(AlgorithmConfig(tis={"level": "token"}), MAX_LEN)(
            batch, ModelOutputs(logp)
        )
    with pytest.raises(ValueError, match="entropy"):
        make_policy_loss_fn(AlgorithmConfig(entropy_coef=0.1), MAX_LEN)(batch, ModelOutputs(logp))


def test_value_loss_clipping_hand_example():
    returns = torch.tensor([[1.0, 1.0, 0.0, 5.0]])
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    vpred = torch.tensor([[0.5, 0.1, -1.0, 9.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    batch = make_batch(1, 4, 0, empty_rows=()).replace(
        values=old, returns=returns, response_mask=mask
    )
    loss_sum, count, metrics = make_value_loss_fn(AlgorithmConfig(clip={"value": 0.2}))(
        batch, ModelOutputs(vpred.detach() * 0, values=vpred)
    )
    # token 0: clipped to .2 -> (0.8)^2 > (0.5)^2; token 1: .1 within; token 2: clipped -.2 -> .04 < 1
    expected = 0.5 * (0.64 + 0.81 + 1.0)
    assert loss_sum.item() == pytest.approx(expected) and count.item() == 3
    values = reduce_metrics([metrics])
    assert values["critic/vf_clipfrac"] == pytest.approx(1 / 3)
    assert values["critic/vf_loss"] == values["critic/loss"] == pytest.approx(expected / 3)
    assert values["critic/vpred_mean"] == pytest.approx((0.5 + 0.1 - 1.0) / 3)
    loss_sum.backward()
    torch.testing.assert_close(
        vpred.grad, torch.tensor([[0.0, -0.9, -1.0, 0.0]])
    )  # clipped branch: no grad
    unclipped, _, _ = make_value_loss_fn(AlgorithmConfig(clip={"value": None}))(
        batch, ModelOutputs(vpred.detach(), values=vpred)
    )
    assert unclipped.item() == pytest.approx(0.5 * (0.25 + 0.81 + 1.0))


def test_ppo_kl_uses_the_clamped_log_ratio_of_the_loss():
    # verl's ppo_kl: mean of -clamp(logp - old, -20, 20). Token 0: log-ratio -30 (clamped to
    # -20), token 1: +25 (clamped to 20), token 2: -0.5 (as is); the unclamped mean would be
    # (30 - 25 + 0.5) / 3.
    old = torch.tensor([[0.0, -25.0, -1.0]])
    logp = torch.tensor([[-30.0, 0.0, -1.5]], requires_grad=True)
    batch = make_batch(1, 3, 0, empty_rows=(), old_logprobs=old, advantages=torch.ones(1, 3))
    batch = batch.replace(response_mask=torch.ones(1, 3))
    _, _, metrics = make_policy_loss_fn(AlgorithmConfig(), MAX_LEN)(batch, ModelOutputs(logp))
    values = reduce_metrics([metrics])
    assert values["actor/ppo_kl"] == pytest.approx((20.0 - 20.0 + 0.5) / 3)
    assert values["actor/ratio_max"] == pytest.approx(math.exp(20.0))  # the same clamp
    assert values["actor/ratio_min"] == pytest.approx(math.exp(-20.0))


def test_gspo_ppo_kl_uses_its_clamped_sequence_log_ratio():
    # Row 0: token log-ratios 12 and 14, sequence log-ratio 13 > 10 -> clamped to 10 on both
    # tokens; row 1: 0.2 and -0.4 -> -0.1 on both. ppo_kl = -(10 + 10 - 0.1 - 0.1) / 4.
    old = torch.tensor([[-13.0, -15.0], [-1.0, -1.0]])
    logp = torch.tensor([[-1.0, -1.0], [-0.8, -1.4]], requires_grad=True)
    batch = make_batch(2, 2, 0, empty_rows=(), old_logprobs=old, advantages=torch.ones(2, 2))
    batch = batch.replace(response_mask=torch.ones(2, 2))
    cfg = AlgorithmConfig(policy_loss="gspo")
    _, _, metrics = make_policy_loss_fn(cfg, MAX_LEN)(batch, ModelOutputs(logp))
    assert reduce_metrics([metrics])["actor/ppo_kl"] == pytest.approx(-(20.0 - 0.2) / 4)


def test_sft_loss_is_the_masked_token_mean_nll_over_the_step():
    from megarl.algos.losses import ModelOutputs, SFTLossFn
    from megarl.algos.metrics import MetricAccumulator

    logp = torch.tensor([[-0.5, -1.0, -2.0], [-0.25, -4.0, 0.0]], requires_grad=True)  # [2, 3]
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 0.0]])  # the trained tokens
    batch = Batch(prompt_ids=torch.zeros(2, 1, dtype=torch.long), prompt_mask=torch.ones(2, 1, dtype=torch.long),
                  response_ids=torch.zeros(2, 3, dtype=torch.long), response_lengths=torch.tensor([3, 2]),
                  response_mask=mask, group_id=torch.arange(2))  # fmt: skip
    loss_sum, count, metrics = SFTLossFn()(batch, ModelOutputs(logprobs=logp))
    assert float(loss_sum.detach()) == 0.5 + 1.0 + 4.0 and float(count) == 3.0
    loss_sum.backward()
    assert logp.grad.tolist() == [[-1.0, -1.0, 0.0], [0.0, -1.0, 0.0]]  # only trained tokens learn
    acc = MetricAccumulator(torch.device("cpu"))
    acc.add(metrics)
    assert acc.values() == {"sft/loss": pytest.approx(5.5 / 3), "sft/tokens": 3.0}
