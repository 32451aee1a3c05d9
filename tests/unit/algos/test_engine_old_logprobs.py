"""``algorithm.old_logprobs: engine``: the engines' log-probs are the PPO ratio's old log-probs.
The build picks a phase that runs no forward (synchronous and asynchronous alike), that phase
hands the loss the engine's log-probs, the loss clips pi_theta / pi_behaviour, and a batch without
finite engine log-probs is refused; the default stays the trainer's recomputed ones."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megarl.algos import ModelOutputs, make_policy_loss_fn, reduce_metrics
from megarl.config.algorithm_sections import AlgorithmConfig
from megarl.config.loading import load_config
from megarl.data.batch import Batch
from megarl.trainer.build import old_logprobs_phase
from megarl.trainer.phases import EngineOldLogprobs, OldLogprobs, Skip

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny_grpo.yaml"
BEHAVIOUR = [[-1.0, -2.0, -0.5], [-0.7, -1.5, 0.0]]  # the engine's; 0 on padding
RATIO = [[1.5, 0.5, 1.1], [0.9, 1.2, 1.0]]  # pi_theta / pi_behaviour
ADV = [[1.0, -1.0, 2.0], [-0.5, -1.0, 3.0]]
VALID = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]


class CountingForward:
    """A PolicyForward stand-in that counts the forwards asked of it."""

    def __init__(self) -> None:
        self.calls = 0

    def compute_logprobs(self, batch: Batch, temperature: float) -> torch.Tensor:
        self.calls += 1
        return torch.zeros_like(batch.response_mask)

    def compute_logprobs_and_reference(self, batch: Batch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1  # one pass for both (the reference's beside the policy's)
        return torch.zeros_like(batch.response_mask), torch.zeros_like(batch.response_mask)


def _batch(**fields) -> Batch:
    return Batch(prompt_ids=torch.ones(2, 2, dtype=torch.long), prompt_mask=torch.ones(2, 2, dtype=torch.long),
                 response_ids=torch.ones(2, 3, dtype=torch.long), response_lengths=torch.tensor([3, 2]),
                 response_mask=torch.tensor(VALID), group_id=torch.arange(2), advantages=torch.tensor(ADV),
                 rollout_logprobs=torch.tensor(BEHAVIOUR), **fields)  # fmt: skip


@pytest.mark.parametrize("overrides", [(), ("rollout.max_staleness=1",), ("actor.ppo_epochs=2",),
                                       ("algorithm.kl.use_in_reward=true", "reference.enabled=true")])  # fmt: skip
def test_engine_old_logprobs_run_no_forward_in_sync_and_async_runs(overrides):
    cfg = load_config(TINY, ["algorithm.old_logprobs=engine", *overrides])
    forward = CountingForward()
    phase = old_logprobs_phase(cfg, forward)  # type: ignore[arg-type]
    assert isinstance(phase, EngineOldLogprobs)
    batch = _batch()
    out = phase(batch)
    assert forward.calls == 0
    assert out.old_logprobs is batch.rollout_logprobs


def test_the_default_still_recomputes_or_skips_as_before():
    assert AlgorithmConfig().old_logprobs == "recompute"
    forward = CountingForward()
    assert isinstance(old_logprobs_phase(load_config(TINY, []), forward), Skip)  # type: ignore[arg-type]
    for overrides in (["rollout.max_staleness=1"], ["actor.ppo_epochs=2"]):
        phase = old_logprobs_phase(load_config(TINY, overrides), forward)  # type: ignore[arg-type]
        assert isinstance(phase, OldLogprobs)
        phase(_batch())
    assert forward.calls == 2


def test_a_batch_without_engine_log_probs_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^algorithm\.old_logprobs=engine needs the engines' log-probs.*"
                                         r"set algorithm\.old_logprobs=recompute$"):  # fmt: skip
        EngineOldLogprobs()(_batch().replace(rollout_logprobs=None))
    missing = torch.tensor(BEHAVIOUR)
    missing[0, 1] = math.nan
    with pytest.raises(ValueError, match=r"no log-prob for 1 response tokens; set algorithm\.old_logprobs=recompute"):
        EngineOldLogprobs()(_batch().replace(rollout_logprobs=missing))
    padded = torch.tensor(BEHAVIOUR)
    padded[1, 2] = math.nan  # padding: no sample's token
    assert EngineOldLogprobs()(_batch().replace(rollout_logprobs=padded)).old_logprobs is padded


def test_the_loss_clips_the_ratio_to_the_engine_policy_and_reports_the_gap_to_it():
    cfg = AlgorithmConfig(clip={"low": 0.2, "high": 0.28, "dual_c": None}, old_logprobs="engine")
    batch = EngineOldLogprobs()(_batch())
    theta = (torch.tensor(BEHAVIOUR) + torch.tensor(RATIO).log()).requires_grad_()
    loss_sum, count, metrics = make_policy_loss_fn(cfg, 3)(batch, ModelOutputs(theta))
    # -min(r A, clip(r, 0.8, 1.28) A) over the 5 valid tokens, r against the engine's policy:
    #   -1.28 | 0.8 | -2.2 | 0.45 | 1.2
    assert (loss_sum / count).item() == pytest.approx((-1.28 + 0.8 - 2.2 + 0.45 + 1.2) / 5, rel=1e-5)
    reduced = reduce_metrics([metrics])
    assert reduced["actor/clip_frac"] == pytest.approx(2 / 5)
    gap = sum(abs(math.log(RATIO[i][t])) for i in range(2) for t in range(3) if VALID[i][t]) / 5
    assert reduced["rollout/logprob_mismatch"] == pytest.approx(gap, rel=1e-5)  # theta vs engine, not 0
    # the same batch under the default: ``old`` is the engine's too here, so the gap is old - engine = 0
    _, _, metrics = make_policy_loss_fn(cfg.model_copy(update={"old_logprobs": "recompute"}), 3)(batch, ModelOutputs(theta))
    assert reduce_metrics([metrics])["rollout/logprob_mismatch"] == pytest.approx(0.0, abs=1e-7)
