"""The post-push check: after a weight push, engine and trainer must agree on log-probs.

It runs on the first push of a process and every ``check_logprobs_every``-th push after it: the
pushes between move the same tensors through the same code, so on a tiny model, where the check
costs as much as the push, checking each one doubles the push's cost for nothing new.

The engines generate short responses to a few real prompts of the run (natural text, the kind
of sequence training sees; random token ids would probe tail tokens where bf16 rounding
dominates), reporting the log-prob of every sampled token as they always do
(``log_softmax(logits / T)`` before top-p/top-k). The trainer then computes its log-probs of
the very same tokens at the same temperature. The mean |engine - trainer| over the response
tokens is ``weight_sync/logprob_diff`` (the worst token: ``weight_sync/logprob_diff_max``);
above the bound (:class:`LogprobBound`) the push is refused with :class:`LogprobMismatchError`:
a silent mis-conversion, a dtype slip or a partial push shows up here, before it poisons
training.

The bound is relative to the run's own baseline. What an honest push scores depends on the
engine's kernels: torch against torch stays below 0.012 on CPU (bench/results/logprob_check.md,
which set ``max_logprob_diff`` = 0.04), while SGLang's (FlashInfer or FA3 attention, fused norms,
CUDA-graph decode) against Megatron's differ more, and heavy-tailed, at scale. So the median of
the first ``logprob_baseline_checks`` checks of the run is its baseline (logged once set, kept in
the trainer state across a resume), and a later check is refused above
``logprob_baseline_factor`` x baseline, held within [``max_logprob_diff``, ``logprob_diff_ceiling``]:
the floor keeps a quiet engine's noise from refusing pushes, the ceiling refuses a gross change
(q and k swapped: 0.32 on the 0.5B shape) from the first push on, while the baseline is measured.
A corruption present from the first push that scores below the ceiling becomes part of the
baseline: the exact export check (export_check.py) is what refuses those.

Both sides run through the controller (the engines' generate with its memory hand-over, then
the policy client), so the check needs nothing from the transports.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from typing import Any, Protocol

import torch

from megarl.config.rollout_sections import WeightSyncConfig
from megarl.data.batch import Batch
from megarl.engines.base import SamplingParams
from megarl.engines.seeds import step_seed

log = logging.getLogger(__name__)

# Probe sizes: enough tokens for a stable mean, short enough to cost little after every push.
PROBE_PROMPTS = 4
PROBE_MAX_NEW_TOKENS = 32
_KEYS = "rollout.weight_sync."


class LogprobMismatchError(RuntimeError):
    """Engine and trainer disagree on the log-probs of the probe sequences after a push."""


class TrainerLogprobs(Protocol):
    def compute_logprobs(self, batch: Batch, temperature: float) -> torch.Tensor: ...


def compare_logprobs(engine_lp: torch.Tensor, trainer_lp: torch.Tensor, mask: torch.Tensor, max_diff: float,
                     bound: str | None = None) -> dict[str, float]:  # fmt: skip
    """Mean / max |engine - trainer| over ``mask`` (all ``[B, R]``); raises above ``max_diff``
    (``bound``: where that number comes from, for the message; default max_logprob_diff)."""
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
            f"{bound or f'{_KEYS}max_logprob_diff ({max_diff})'}; the engine did not receive the "
            "trainer's weights as the trainer uses them (bridge conversion, dtype or a partial push)"
        )
    return {"weight_sync/logprob_diff": mean, "weight_sync/logprob_diff_max": worst}


@dataclasses.dataclass
class LogprobBound:
    """What the mean |d log-prob| of a post-push check may reach (module docstring).

    ``floor``: rollout.weight_sync.max_logprob_diff; alone (``baseline_checks`` 0) it is the
    bound. ``ceiling``: logprob_diff_ceiling, the bound while the baseline is measured and the
    most any bound is. ``baseline``: the median of the first ``baseline_checks`` passed checks'
    means (``first``), then ``factor`` x baseline within [floor, ceiling] is the bound. A version
    counts once (``version``: the last one counted): the re-push of a resume's version, checked
    again, does not move the baseline away from the uninterrupted run's."""

    floor: float
    ceiling: float = float("inf")
    baseline_checks: int = 0
    factor: float = 5.0
    first: list[float] = dataclasses.field(default_factory=list)
    baseline: float | None = None
    version: int | None = None

    @property
    def measuring(self) -> bool:
        """The baseline is still being measured (every push is then checked)."""
        return self.baseline_checks > 0 and self.baseline is None

    def limit(self) -> tuple[float, str]:
        """The bound now, and where it comes from (for a refusal's message)."""
        floor = (self.floor, f"{_KEYS}max_logprob_diff ({self.floor})")
        if not self.baseline_checks:
            return floor
        ceiling = (self.ceiling, f"{_KEYS}logprob_diff_ceiling ({self.ceiling})")
        if self.baseline is None:
            measured = f"check {len(self.first) + 1} of {self.baseline_checks}"
            return ceiling[0], f"{ceiling[1]}, the bound while the run's baseline is measured ({measured})"
        relative = self.factor * self.baseline
        about = f"{_KEYS}logprob_baseline_factor ({self.factor:g}) x the run's baseline {self.baseline:.4g}"
        if relative < self.floor:
            return floor[0], f"{floor[1]}, the floor of {about}"
        if relative > self.ceiling:
            return ceiling[0], f"{ceiling[1]}, the cap of {about}"
        return relative, f"{relative:.4g} = {about}"

    def passed(self, mean: float, version: int | None = None) -> None:
        """Note a check that passed (of the weights of ``version``): the first ``baseline_checks``
        versions' set the baseline."""
        if not self.baseline_checks or self.baseline is not None:
            return
        if version is not None and self.version is not None and version <= self.version:
            return  # these weights were counted already
        self.first.append(mean)
        self.version = version
        if len(self.first) == self.baseline_checks:
            self.baseline = statistics.median(self.first)
            bound, why = self.limit()
            log.info("post-push log-prob check: baseline %.4g (median of the first %d checks: %s); pushes are now refused "
                     "above %.4g (%s)", self.baseline, len(self.first), ", ".join(f"{m:.4g}" for m in self.first), bound, why)  # fmt: skip

    @classmethod
    def of(cls, ws: WeightSyncConfig) -> LogprobBound:
        """The bound rollout.weight_sync's keys describe."""
        return cls(floor=ws.max_logprob_diff, ceiling=ws.logprob_diff_ceiling, baseline_checks=ws.logprob_baseline_checks,
                   factor=ws.logprob_baseline_factor)  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """The measured part (the config gives the rest), for the trainer state."""
        return {"first": list(self.first), "baseline": self.baseline, "version": self.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (an empty one, from a checkpoint without it: measure anew)."""
        self.first = [float(m) for m in state.get("first", [])][: self.baseline_checks]
        baseline, version = state.get("baseline"), state.get("version")
        self.baseline = None if baseline is None or not self.baseline_checks else float(baseline)
        self.version = None if version is None else int(version)
        if self.baseline is not None:
            log.info("post-push log-prob check: baseline %.4g from the checkpoint", self.baseline)


class PostPushCheck:
    """``check(version) -> metrics``: generate with the engines, score with the trainer, compare.

    ``prompts``: a few prompts of the run (a PromptBatch of ``PROBE_PROMPTS``, validation
    prompts when there are some); ``generate(prompts, params) -> Batch`` is the controller's
    generation (engines plus memory hand-over); ``policy`` computes the trainer's side;
    ``max_diff``: a fixed bound, or a :class:`LogprobBound` (relative to the run's baseline).
    ``every``: check every push until the bound's baseline is set (its first checks), then the
    first push this object sees and every ``every``-th after it (rollout.weight_sync.check_logprobs_every);
    the others return no metrics.
    """

    def __init__(self, generate: Any, policy: TrainerLogprobs, prompts: Any, sampling: SamplingParams,
                 max_diff: float | LogprobBound, every: int = 1) -> None:  # fmt: skip
        self.generate, self.policy, self.prompts = generate, policy, prompts
        # Counted per process, not from the version: a resumed run's first push is checked.
        self.every, self.pushes = every, 0
        self.bound = max_diff if isinstance(max_diff, LogprobBound) else LogprobBound(floor=max_diff)
        # The full distribution (log-probs are pre-filter anyway), one sample per prompt, short.
        self.sampling = dataclasses.replace(
            sampling, top_p=1.0, top_k=-1, n=1, max_new_tokens=min(sampling.max_new_tokens, PROBE_MAX_NEW_TOKENS)
        )

    def __call__(self, version: int) -> dict[str, float]:
        self.pushes += 1
        # While the baseline is measured only the ceiling guards a push: measure it on consecutive pushes.
        if (self.pushes - 1) % self.every and not self.bound.measuring:
            return {}
        params = dataclasses.replace(self.sampling, seed=step_seed(self.sampling.seed or 0, version))
        batch = self.generate(self.prompts, params)
        trainer = self.policy.compute_logprobs(batch, params.temperature)
        assert batch.rollout_logprobs is not None, "engines report the log-probs of what they sample"
        bound, why = self.bound.limit()
        metrics = compare_logprobs(batch.rollout_logprobs, trainer, batch.response_mask, bound, why)
        self.bound.passed(metrics["weight_sync/logprob_diff"], version)
        return metrics | {"weight_sync/logprob_diff_bound": bound}

    def state_dict(self) -> dict[str, Any]:
        return self.bound.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bound.load_state_dict(state)

