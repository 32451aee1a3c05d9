"""Where the step's reference log-probs come from: the policy update's micro-batches
(MegaRLConfig.reference_in_update), the old log-probs' pass, or a pass of their own, decided
when the trainer is built."""

from __future__ import annotations

import pytest

from megarl.config.loading import load_config
from megarl.trainer.build import old_logprobs_phase, reference_phase
from megarl.trainer.phases import OldLogprobs, ReferenceLogprobs, Skip


@pytest.mark.parametrize(("overrides", "where"), [
    ([], "update"),  # the demo: KL in the loss, one epoch, pp 1
    (["actor.ppo_epochs=2"], "old"),  # each epoch would run the reference again: with the old log-probs
    (["algorithm.kl.use_in_reward=true"], "old"),  # the advantages need them before the update
    (["actor.mini_batch_size=128"], "update"),  # each sample still passes the update once
    (["reference.offload=true", "actor.ppo_epochs=2"], "own"),  # off the device outside its own phase
    (["actor.parallel.pp=2", "cluster.gpus_per_node=4"], "own"),  # the pipeline's schedule has no second model
])  # fmt: skip
def test_where_the_reference_logprobs_come_from(overrides, where):
    cfg = load_config("configs/tiny_grpo.yaml", overrides)
    assert cfg.reference_in_update is (where == "update")
    old = old_logprobs_phase(cfg, forward=None)
    assert isinstance(old, OldLogprobs) and old.with_reference if where == "old" else not getattr(old, "with_reference", False)
    assert isinstance(reference_phase(cfg, policy=None, handover=None), ReferenceLogprobs if where == "own" else Skip)


def test_no_reference_no_phase():
    cfg = load_config("configs/tiny_grpo.yaml", ["algorithm.kl.use_in_loss=false", "actor.ppo_epochs=2"])
    assert not cfg.reference_in_update
    assert not old_logprobs_phase(cfg, forward=None).with_reference
    assert isinstance(reference_phase(cfg, policy=None, handover=None), Skip)
