"""The post-push check: after every weight push, engine and trainer must agree on log-probs.

The engines generate short responses to a few real prompts of the run (natural text, the kind
of sequence training sees; random token ids would probe tail tokens where bf16 rounding
dominates), reporting the log-prob of every sampled token as they always do
(``log_softmax(logits / T)`` before top-p/top-k). The trainer then computes its log-probs of
the very same tokens at the same temperature. The mean |engine - trainer| over the response
tokens is ``weight_sync/logprob_diff`` (the worst token: ``weight_sync/logprob_diff_max``);
above ``rollout.weight_sync.max_logprob_diff`` the push is refused with
:class:`LogprobMismatchError`: a silent mis-conversion, a dtype slip or a partial push shows
up here, before it poisons training.

Both sides run through the controller (the engines' generate with its memory hand-over, then
the policy client), so the check needs nothing from the transports.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch

from megarl.data.batch import Batch
from megarl.engines.base import SamplingParams
from megarl.engines.seeds import step_seed

# Probe sizes: enough tokens for a stable mean, short enough to cost little after every push.
PROBE_PROMPTS = 4
PROBE_MAX_NEW_TOKENS = 32


class LogprobMismatchError(RuntimeError):
    """Engine and trainer disagree on the log-probs of the probe sequences after a push."""


class TrainerLogprobs(Protocol):
    def compute_logprobs(self, batch: Batch, temperature: float) -> torch.Tensor: ...


def compare_logprobs(engine_lp: torch.Tensor, trainer_lp: torch.Tensor, mask: torch.Tensor, max_diff: float) -> dict[str, float]:
    """Mean / max |engine - trainer| over ``mask`` (all ``[B, R]``); raises above ``max_diff``."""
    if engine_lp.shape != trainer_lp.shape:
        raise ValueError(f"engine log-probs {tuple(engine_lp.shape)} vs trainer {tuple(trainer_lp.shape)}")
    valid = mask.bool()
    diff = (engine_lp.float() - trainer_lp.float().cpu()).abs()[valid]
    if diff.numel() == 0:
        raise LogprobMismatchError("the post-push probe produced no response tokens to compare")
    mean, worst = float(diff.mean()), float(diff.max())
    if not mean <= max_diff:  # also catches NaN
        raise LogprobMismatchError(
            f"after the weight push, engine and trainer log-probs differ by {mean:.4g} on average "
            f"(max {worst:.4g}) over {int(valid.sum())} probe tokens, above "
            f"rollout.weight_sync.max_logprob_diff ({max_diff}); the engine did not receive the "
            "trainer's weights as the trainer uses them (bridge conversion, dtype or a partial push)"
        )
    return {"weight_sync/logprob_diff": mean, "weight_sync/logprob_diff_max": worst}


class PostPushCheck:
    """``check(version) -> metrics``: generate with the engines, score with the trainer, compare.

    ``prompts``: a few prompts of the run (a PromptBatch of ``PROBE_PROMPTS``, validation
    prompts when there are some); ``generate(prompts, params) -> Batch`` is the controller's
    generation (engines plus memory hand-over); ``policy`` computes the trainer's side.
    """

    def __init__(self, generate: Any, policy: TrainerLogprobs, prompts: Any, sampling: SamplingParams, max_diff: float) -> None:
        self.generate, self.policy, self.prompts, self.max_diff = generate, policy, prompts, max_diff
        # The full distribution (log-probs are pre-filter anyway), one sample per prompt, short.
        self.sampling = dataclasses.replace(
            sampling, top_p=1.0, top_k=-1, n=1, max_new_tokens=min(sampling.max_new_tokens, PROBE_MAX_NEW_TOKENS)
        )

    def __call__(self, version: int) -> dict[str, float]:
        params = dataclasses.replace(self.sampling, seed=step_seed(self.sampling.seed or 0, version))
        batch = self.generate(self.prompts, params)
        trainer = self.policy.compute_logprobs(batch, params.temperature)
        assert batch.rollout_logprobs is not None, "engines report the log-probs of what they sample"
        return compare_logprobs(batch.rollout_logprobs, trainer, batch.response_mask, self.max_diff)

