"""Where the step's reference log-probs come from: their own pass, or the policy update's
micro-batches (MegaRLConfig.reference_in_update), decided when the trainer is built."""

from __future__ import annotations

import pytest

from megarl.config.loading import load_config
from megarl.trainer.build import reference_phase
from megarl.trainer.phases import ReferenceLogprobs, Skip


@pytest.mark.parametrize(("overrides", "in_update"), [
    ([], True),  # the demo: KL in the loss, one epoch, pp 1
    (["actor.ppo_epochs=2"], False),  # each epoch would run the reference again
    (["algorithm.kl.use_in_reward=true"], False),  # the advantages need them before the update
    (["reference.offload=true"], False),  # off the device outside its own phase
    (["actor.parallel.pp=2", "cluster.gpus_per_node=4"], False),  # the pipeline's schedule has no second model
])  # fmt: skip
def test_reference_in_update_or_its_own_pass(overrides, in_update):
    cfg = load_config("configs/tiny_grpo.yaml", overrides)
    assert cfg.reference_in_update is in_update
    phase = reference_phase(cfg, policy=None, handover=None)
    assert isinstance(phase, Skip if in_update else ReferenceLogprobs)


def test_no_reference_no_phase():
    cfg = load_config("configs/tiny_grpo.yaml", ["algorithm.kl.use_in_loss=false"])
    assert not cfg.reference_in_update
    assert isinstance(reference_phase(cfg, policy=None, handover=None), Skip)
