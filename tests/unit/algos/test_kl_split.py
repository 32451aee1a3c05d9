"""Separate KL settings for the reward penalty and the loss term, and verl's estimator names."""

import math

import pytest
import torch
from test_losses import MAX_LEN, make_batch, new_logprobs
from test_step import batch_of

from megarl.algos import (
    ModelOutputs,
    kl_estimate,
    make_kl_controller,
    make_policy_loss_fn,
    reduce_metrics,
)
from megarl.algos.step import advantage_step
from megarl.config.algorithm_sections import AlgorithmConfig, KLConfig
from megarl.config.loading import ConfigError, load_config


def verl_kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, name: str) -> torch.Tensor:
    """verl's core_algos.kl_penalty_forward, written out from its definitions."""
    if name in ("kl", "k1"):
        return logprob - ref_logprob
    if name == "abs":
        return (logprob - ref_logprob).abs()
    if name in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    assert name in ("low_var_kl", "k3")
    d = torch.clamp(ref_logprob - logprob, -20, 20)
    return torch.clamp(torch.exp(d) - d - 1, -10, 10)


@pytest.mark.parametrize("verl_name,ours", [("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3"), ("abs", "abs")])
def test_verl_estimator_names_are_aliases_with_verls_values(verl_name, ours):
    cfg = KLConfig(estimator=verl_name, reward_estimator=verl_name, loss_estimator=verl_name)
    assert cfg.estimator == cfg.reward_kl_estimator == cfg.loss_kl_estimator == ours
    # token 2: d = ref - logp = 30 is clamped to 20, then exp(20) - 21 to 10; token 3: d = -50 -> -20 -> 19 -> 10
    logp = torch.tensor([-1.0, -2.0, -35.0, 0.0])
    ref = torch.tensor([-1.5, -1.0, -5.0, -50.0])
    hand = {
        "k1": [0.5, -1.0, -30.0, 50.0],
        "k2": [0.125, 0.5, 450.0, 1250.0],
        "abs": [0.5, 1.0, 30.0, 50.0],
        "k3": [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1, 10.0, 10.0],
    }[ours]
    torch.testing.assert_close(kl_estimate(logp, ref, cfg.estimator), torch.tensor(hand))
    torch.testing.assert_close(kl_estimate(logp, ref, cfg.estimator), verl_kl_penalty(logp, ref, verl_name))


def test_full_kl_is_refused_in_one_line_naming_why():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.path=/m", "algorithm.kl.loss_estimator=full"])
    msg = str(err.value)
    assert "algorithm.kl.loss_estimator" in msg and "whole-vocabulary" in msg and "use k3 (low_var_kl)" in msg


def test_old_config_uses_the_shared_coef_and_estimator_for_both():
    cfg = KLConfig(use_in_reward=True, use_in_loss=True, coef=0.2, estimator="k2")
    assert (cfg.reward_kl_coef, cfg.reward_kl_estimator, cfg.loss_kl_coef, cfg.loss_kl_estimator) == (0.2, "k2", 0.2, "k2")
    assert make_kl_controller(cfg).value == 0.2
    split = KLConfig(coef=0.2, reward_coef=0.0, loss_coef=0.5, reward_estimator="k1")
    assert (split.reward_kl_coef, split.reward_kl_estimator, split.loss_kl_coef, split.loss_kl_estimator) == (0.0, "k1", 0.5, "k3")


def test_reward_coef_and_estimator_reach_the_reward_and_the_controller():
    batch = batch_of([10, 4], [1.0, 0.0], [0, 0])
    cfg = AlgorithmConfig(estimator="dr_grpo", kl={"use_in_reward": True, "use_in_loss": True, "coef": 0.1,
                                                    "estimator": "k3", "reward_coef": 0.3, "reward_estimator": "mse",
                                                    "controller": "adaptive", "target": 1.0, "horizon": 100})
    ctl = make_kl_controller(cfg.kl)
    assert ctl.value == 0.3
    out, metrics = advantage_step(batch, cfg, ctl, max_new_tokens=10)
    mask = batch.response_mask
    kl = 0.5 * (batch.old_logprobs - batch.ref_logprobs).square() * mask
    expected = -0.3 * kl
    expected[torch.arange(2), batch.response_lengths - 1] += batch.scores
    torch.testing.assert_close(out.token_rewards, expected)
    assert metrics["reward/kl_coef"] == 0.3


def test_loss_coef_and_estimator_reach_the_loss():
    batch = make_batch(4, 6, 3)
    logp = new_logprobs(batch, 3, scale=0.2)
    base = AlgorithmConfig(kl={"use_in_loss": False})
    split = AlgorithmConfig(kl={"use_in_loss": True, "use_in_reward": True, "coef": 0.01, "estimator": "k3",
                                "loss_coef": 0.7, "loss_estimator": "abs"})
    without, count, _ = make_policy_loss_fn(base, MAX_LEN)(batch, ModelOutputs(logp))
    with_kl, _, metrics = make_policy_loss_fn(split, MAX_LEN)(batch, ModelOutputs(logp))
    mask = batch.response_mask
    kl = (logp - batch.ref_logprobs).abs() * mask
    n = mask.sum()
    assert ((with_kl - without) / count).item() == pytest.approx((0.7 * kl.sum() / n).item(), rel=1e-5)
    assert reduce_metrics([metrics])["actor/kl"] == pytest.approx((kl.sum() / n).item(), rel=1e-5)


def verl_kl_penalty_plus(logprob: torch.Tensor, ref_logprob: torch.Tensor, name: str) -> torch.Tensor:
    """verl's core_algos.kl_penalty for a name ending in "+" (its docs: the named estimator's value,
    k2's gradient by straight-through), written out from its definition."""
    forward = verl_kl_penalty(logprob, ref_logprob, name.removesuffix("+"))
    backward = 0.5 * (logprob - ref_logprob).square()
    return backward - backward.detach() + forward.detach()


@pytest.mark.parametrize("verl_name,ours", [("kl+", "k1+"), ("k1+", "k1+"), ("low_var_kl+", "k3+"), ("k3+", "k3+"),
                                            ("abs+", "abs+"), ("mse+", "k2"), ("k2+", "k2")])  # fmt: skip
def test_straight_through_estimators_take_the_value_of_theirs_and_the_gradient_of_k2(verl_name, ours):
    assert KLConfig(loss_estimator=verl_name).loss_kl_estimator == ours
    logp = torch.tensor([-1.0, -2.0, -0.3, -4.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, -0.3, -1.0])
    ours_kl = kl_estimate(logp, ref, ours)
    (grad,) = torch.autograd.grad(ours_kl.sum(), logp)
    verl_logp = logp.detach().clone().requires_grad_(True)
    verl_kl = verl_kl_penalty_plus(verl_logp, ref, verl_name)
    (verl_grad,) = torch.autograd.grad(verl_kl.sum(), verl_logp)
    torch.testing.assert_close(ours_kl.detach(), verl_kl.detach())
    torch.testing.assert_close(grad, verl_grad)
    # by hand: the value is the named estimator's, the gradient d/dlogp 0.5 (logp - ref)^2 = logp - ref
    base = ours.removesuffix("+")
    torch.testing.assert_close(ours_kl.detach(), kl_estimate(logp.detach(), ref, base))
    torch.testing.assert_close(grad, torch.tensor([0.5, -1.0, 0.0, -3.0]))
    with torch.no_grad():  # the reward penalty: the value alone
        torch.testing.assert_close(kl_estimate(logp, ref, ours), ours_kl.detach())


def test_a_straight_through_loss_term_reads_like_k3_and_trains_like_k2():
    batch = make_batch(4, 6, 3)
    logp = new_logprobs(batch, 3, scale=0.2).requires_grad_(True)
    grads, values = {}, {}
    for estimator in ("k3", "k2", "k3+"):
        cfg = AlgorithmConfig(kl={"use_in_loss": True, "loss_coef": 0.5, "loss_estimator": estimator})
        loss, _, metrics = make_policy_loss_fn(cfg, MAX_LEN)(batch, ModelOutputs(logp))
        (grads[estimator],) = torch.autograd.grad(loss, logp)
        values[estimator] = reduce_metrics([metrics])["actor/kl"]
    torch.testing.assert_close(grads["k3+"], grads["k2"])
    assert values["k3+"] == pytest.approx(values["k3"]) and values["k3+"] != pytest.approx(values["k2"])
