import math

import pytest
import torch

from megarl.algos import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    kl_estimate,
    make_kl_controller,
)
from megarl.config.algorithm_sections import KLConfig


def test_estimators_hand_values():
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])  # log r = logp - ref = [0.5, -1.0]
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), torch.tensor([0.5, -1.0]))
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), torch.tensor([0.125, 0.5]))
    torch.testing.assert_close(kl_estimate(logp, ref, "abs"), torch.tensor([0.5, 1.0]))
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]
    torch.testing.assert_close(kl_estimate(logp, ref, "k3"), torch.tensor(k3))


def test_k3_is_clamped_and_nonnegative():
    logp = torch.tensor([-50.0, 0.0, -3.0])
    ref = torch.tensor([0.0, -50.0, -3.0])
    k3 = kl_estimate(logp, ref, "k3")
    assert torch.isfinite(k3).all() and (k3 >= 0).all() and (k3 <= 10).all()
    assert k3[2].item() == 0.0


def test_k3_mean_estimates_true_kl():
    # samples from p = N-free categorical: KL(p || q) by sampling tokens from p
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.5, 0.3])
    tokens = torch.multinomial(
        p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0)
    )
    true = (p * (p / q).log()).sum().item()
    for name in ("k1", "k3"):
        est = KL_ESTIMATORS.get(name)(p.log()[tokens], q.log()[tokens]).mean().item()
        assert est == pytest.approx(true, abs=5e-3), name


def test_fixed_controller():
    ctl = make_kl_controller(KLConfig(coef=0.05))
    assert isinstance(ctl, FixedKLController)
    ctl.update(10.0, 100)
    assert ctl.value == 0.05


def test_resume_keeps_an_edited_fixed_coefficient():
    """A fixed coefficient is config: resuming with another algorithm.kl.coef (or from an
    adaptive run's state) uses the new one; an adaptive run resumed from a fixed run's state
    starts from its configured coef."""
    old = make_kl_controller(KLConfig(coef=0.001))
    edited = make_kl_controller(KLConfig(coef=0.5))
    edited.load_state_dict(old.state_dict())
    assert edited.value == 0.5
    adaptive = make_kl_controller(KLConfig(coef=0.1, controller="adaptive", target=0.01, horizon=10))
    adaptive.update(1.0, 10)
    fixed = make_kl_controller(KLConfig(coef=0.5))
    fixed.load_state_dict(adaptive.state_dict())
    assert fixed.value == 0.5
    switched = make_kl_controller(KLConfig(coef=0.2, controller="adaptive", target=0.01, horizon=10))
    switched.load_state_dict(old.state_dict())
    assert switched.value == 0.2


def test_adaptive_controller_moves_towards_target_and_checkpoints():
    ctl = make_kl_controller(KLConfig(coef=0.1, controller="adaptive", target=0.01, horizon=1000))
    assert isinstance(ctl, AdaptiveKLController)
    ctl.update(0.02, 100)  # KL above target: error clipped to 0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 100 / 1000))
    ctl.update(0.009, 100)  # below: error -0.1
    assert ctl.value == pytest.approx(0.1 * 1.02 * (1 - 0.1 * 0.1))
    state = ctl.state_dict()
    fresh = make_kl_controller(KLConfig(coef=0.1, controller="adaptive", target=0.01, horizon=1000))
    fresh.load_state_dict(state)
    assert fresh.value == ctl.value
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, 0.01, 0)


@pytest.mark.parametrize("name", ["k1", "k2", "k3", "abs"])
def test_grad_and_no_grad_paths_agree(name):
    g = torch.Generator().manual_seed(1)
    logp = -torch.rand(4, 6, generator=g) * 3
    ref = -torch.rand(4, 6, generator=g) * 3
    plain = kl_estimate(logp, ref, name)
    leaf = logp.clone().requires_grad_()
    tracked = kl_estimate(leaf, ref, name)
    torch.testing.assert_close(tracked.detach(), plain)
    tracked.sum().backward()
    expected = {
        "k1": torch.ones_like(logp),
        "k2": logp - ref,
        "k3": 1.0 - torch.exp(ref - logp),
        "abs": torch.sign(logp - ref),
    }[name]
    torch.testing.assert_close(leaf.grad, expected)
