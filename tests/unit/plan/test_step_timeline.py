"""The plan's step timeline names the passes the trainer runs: which pass computes the old and
the reference's log-probs follows the config as megarl/trainer/build.py chooses them."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.config.loading import load_config
from megarl.plan.step_timeline import step_phases

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny_grpo.yaml"


@pytest.mark.parametrize(("overrides", "phases", "where"), [
    ((), ["generate", "reward", "policy_update", "weight_push"], ("policy_update", "reference's log-probs on its micro-batches")),
    (("algorithm.old_logprobs=engine",), ["generate", "reward", "policy_update", "weight_push"], None),
    (("actor.ppo_epochs=2",), ["generate", "reward", "policy_forward", "policy_update", "weight_push"],
     ("policy_forward", "with the reference's")),
    (("reference.offload=true",), ["generate", "reward", "reference_forward", "policy_update", "weight_push"], None),
    (("actor.ppo_epochs=2", "reference.offload=true"),
     ["generate", "reward", "policy_forward", "reference_forward", "policy_update", "weight_push"], None),
])  # fmt: skip
def test_the_timeline_lists_the_passes_the_step_runs(overrides, phases, where):
    cfg = load_config(TINY, list(overrides))
    timeline = step_phases(cfg)
    assert [p for p, _ in timeline] == phases
    if where is not None:
        assert where[1] in dict(timeline)[where[0]]
