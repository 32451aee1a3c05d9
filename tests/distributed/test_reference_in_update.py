"""The reference log-probs computed inside the policy update (MegaRLConfig.reference_in_update)
against their own forward pass first: the same update, bit for bit; and beside the old log-probs,
in their pass (MegaRLConfig.reference_with_old_logprobs): the same values.

Two processes (DP=2), a policy and its reference in each; the loss is megarl's own (GRPO's
clipped ratio with the k3 KL term in the loss, a large coefficient so the reference weighs)."""

from __future__ import annotations

import actor_cases as ac
import pytest
import torch
from spawn import run_distributed

from megarl.config.algorithm_sections import AlgorithmConfig
from megarl.config.train_sections import ActorConfig, OptimizerConfig

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megarl.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("policy") / "m", **ac.TINY))


def _updates(rank: int, world: int, path: str) -> dict:
    from megarl.actors.policy import PolicyWorker
    from megarl.actors.reference import ReferenceWorker
    from megarl.algos.losses import make_policy_loss_fn

    cfg = ActorConfig(optimizer=OptimizerConfig(lr=1e-2, distributed=True), micro_batch_size=2)
    loss_fn = make_policy_loss_fn(AlgorithmConfig(kl={"use_in_loss": True, "coef": 0.5}), max_response_length=9)
    policy = PolicyWorker(path, cfg, "float32", seed=1)
    reference = ReferenceWorker(path, cfg, "float32", seed=1)
    # The reference apart from the policy, or nothing would tell them apart: one update first.
    warm = ac.make_batch(1)
    warm = warm.replace(old_logprobs=torch.zeros_like(warm.advantages), ref_logprobs=torch.zeros_like(warm.advantages))
    policy.update(warm, loss_fn, temperature=TEMPERATURE)
    batch = ac.make_batch(0)
    old = ac.gathered(policy.compute_logprobs(batch, TEMPERATURE), batch)["logprobs"]
    ref = ac.gathered(reference.compute_logprobs(batch, TEMPERATURE), batch)["logprobs"]
    # The old log-probs' pass with the reference's beside them (one packing): the same values.
    both = ac.gathered(policy.compute_logprobs(batch, TEMPERATURE, reference=reference), batch)
    batch = batch.replace(old_logprobs=old)
    out = {"ref_vs_policy": float((ref - old).abs().max()), "one_pass_equal": torch.equal(both["logprobs"], old)
           and torch.equal(both["ref_logprobs"], ref)}  # fmt: skip
    start = {n: p.detach().clone() for n, p in policy.model.module.named_parameters()}
    out["apart"] = policy.update(batch.replace(ref_logprobs=ref), loss_fn, temperature=TEMPERATURE)
    out["apart_state"] = ac.exported_state(policy)
    # The same update again, by a second policy with the same history (weights and Adam's state).
    policy2 = PolicyWorker(path, cfg, "float32", seed=1)
    policy2.update(warm, loss_fn, temperature=TEMPERATURE)
    with torch.no_grad():
        for n, p in policy2.model.module.named_parameters():
            assert torch.equal(p, start[n])
    out["in_update"] = policy2.update(batch, loss_fn, temperature=TEMPERATURE, reference=reference)
    out["in_update_state"] = ac.exported_state(policy2)
    return ac.portable(out)


def test_reference_in_update_equals_its_own_pass(model_dir):
    for r in [ac.tensors(x) for x in run_distributed(_updates, 2, model_dir)]:
        assert r["ref_vs_policy"] > 1e-3  # the KL term is not zero: the reference's values matter
        assert r["one_pass_equal"]
        assert r["in_update"] == r["apart"]  # loss, KL, ratio, grad norm: equal bit for bit
        assert r["in_update"]["actor/kl"] > 0
        for name, tensor in r["apart_state"].items():
            assert torch.equal(r["in_update_state"][name], tensor), name
