"""The metrics catalogue: every metric megarl reports, declared once.

Each entry is a public name (what ``metrics.jsonl``, TensorBoard and W&B show), its reduction
and a one-line meaning. Emitters write these names directly; nothing downstream renames them.
A name with a ``<part>`` is a family with a dynamic segment (``time/<phase>_s``).

Reductions say how the pieces of one step combine into the reported number:

- ``mean``: sum of the values / sum of their counts (tokens, sequences, samples, steps): a
  global mean, whatever the micro-batches, mini-batches and data-parallel ranks;
- ``sum``: the total (counts of events, steps, seconds);
- ``max`` / ``min``: the extreme over every piece that counted anything;
- ``last``: the latest value (a learning rate, a coefficient, the one weight push of a step);
- ``std``: a standard deviation, computed once on the controller (never accumulated).

The worker-side accumulator (``megarl.algos.metrics``) applies these rules as tensor
operations and refuses a name that is not here. This module imports nothing heavy (no torch):
the controller, the docs and the tests read it freely.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from functools import cache
from typing import Literal

Reduction = Literal["mean", "sum", "max", "min", "last", "std"]
ACCUMULATED: tuple[Reduction, ...] = ("mean", "sum", "max", "min", "last")  # what the accumulator runs

# Who writes a metric. "actor" and "critic" are the trained roles: their update names the
# optimizer metrics (``<role>/grad_norm``) after the role of the loss metrics it saw.
Emitter = Literal[
    "actor", "critic", "advantages", "rollout", "scorer", "weight_sync", "trainer", "validation", "data", "sft", "moe"
]


@dataclass(frozen=True)
class Metric:
    name: str  # public name; "<part>" marks a dynamic segment
    reduction: Reduction
    emitter: Emitter
    meaning: str

    @property
    def family(self) -> str:
        """The first path segment (``actor``, ``reward``, ``time``, ...)."""
        return self.name.split("/", 1)[0]

    @property
    def is_pattern(self) -> bool:
        return "<" in self.name


class UnknownMetricError(KeyError):
    """A metric name that the catalogue does not declare."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0])


def _optimizer_metrics(role: Emitter, what: str) -> tuple[Metric, ...]:
    return (
        Metric(f"{role}/grad_norm", "mean", role, f"{what} gradient norm before clipping, mean over the optimizer steps that were taken"),
        Metric(f"{role}/lr", "last", role, f"{what} learning rate of the last optimizer step"),
        Metric(f"{role}/optimizer_steps", "sum", role, f"{what} optimizer steps of the update (ppo_epochs x mini-batches)"),
        Metric(f"{role}/skipped_steps", "sum", role, f"{what} optimizer steps skipped (fp16 overflow: inf/nan gradients)"),
    )


def _moe_metrics(role: str) -> tuple[Metric, ...]:
    """What a trained role's update reports of a mixture-of-experts model (megarl.megatron_runtime.moe_balance),
    computed over the whole update by the workers."""
    return (
        Metric(f"{role}/moe/expert_load_max_over_mean", "last", "moe", "tokens of the busiest expert / the mean over experts, per MoE layer over the update's training forwards, mean over the layers (1 = balanced)"),
        Metric(f"{role}/moe/expert_load_max_over_mean/layer<i>", "last", "moe", "the same for MoE layer i (HF's 0-based layer index)"),
        Metric(f"{role}/moe/aux_loss", "last", "moe", "Megatron's Switch load-balancing loss (without its coefficient), mean over micro-batches, DP ranks and MoE layers; with <section>.moe.aux_loss_coef > 0"),
        Metric(f"{role}/moe/z_loss", "last", "moe", "router z-loss (mean squared logsumexp of the router logits, without its coefficient), same mean; with <section>.moe.z_loss_coef > 0"),
        Metric(f"{role}/moe/expert_bias_abs_max", "last", "moe", "largest |correction bias| of the router (aux-loss-free balancing) after the update, max over the MoE layers; with <section>.moe.expert_bias_update_rate > 0"),
        Metric(f"{role}/moe/expert_bias_abs_max/layer<i>", "last", "moe", "the same for MoE layer i (HF's 0-based layer index); it grows by at most the rate per optimizer step"),
    )


# What megarl.evaluation.summarize reports: over every validation prompt, and per data source.
_VALIDATION: tuple[tuple[str, Reduction, str], ...] = (
    ("reward/mean", "mean", "held-out score, mean over the prompts of each prompt's mean (mean@n)"),
    ("pass@<k>", "mean", "unbiased pass@k (the reward's acc where given, else score >= rollout.val.pass_threshold), mean over prompts"),
    ("best@<k>", "mean", "expected best score of k of a prompt's responses, mean over prompts"),
    ("worst@<k>", "mean", "expected worst score of k of a prompt's responses, mean over prompts"),
    ("maj@<k>", "mean", "score of the majority answer (the reward's pred) of k responses, mean over prompts"),
    ("response_length/mean", "mean", "validation response length in tokens"),
    ("response_length/min", "min", "shortest validation response in tokens"),
    ("response_length/max", "max", "longest validation response in tokens"),
    ("truncated_frac", "mean", "share of validation responses cut by max_new_tokens"),
    ("reward/<component>", "mean", "a reward.combine component's score, mean over the responses whose data source uses it"),
)


def _validation_metrics() -> tuple[Metric, ...]:
    overall = tuple(Metric(f"val/{name}", red, "validation", meaning) for name, red, meaning in _VALIDATION)
    per_source = tuple(Metric(f"val/<data_source>/{name}", red, "validation", f"{meaning}; one data source")
                       for name, red, meaning in _VALIDATION)  # fmt: skip
    return overall + per_source


CATALOGUE: tuple[Metric, ...] = (
    # ---- policy update (megarl.algos.losses.PolicyLossFn and the Megatron runtime) --------
    Metric("actor/loss", "mean", "actor", "the optimised policy loss: policy gradient x TIS weight x MIS mask - entropy bonus + KL term, per algorithm.loss_agg"),
    Metric("actor/pg_loss", "mean", "actor", "the policy-gradient term alone (x TIS weight x MIS mask), same aggregation"),
    Metric("actor/clip_frac", "mean", "actor", "share of valid tokens whose ratio the 1 -/+ clip bound holds (advantage != 0)"),
    Metric("actor/clip_frac_lower", "mean", "actor", "share of valid tokens held by the dual-clip bound c (negative advantage)"),
    Metric("actor/ppo_kl", "mean", "actor", "mean of -log(pi / pi_old) over valid tokens, with the log-ratio clamped as the loss clamps it"),
    Metric("actor/ratio_mean", "mean", "actor", "mean importance ratio pi / pi_old over valid tokens"),
    Metric("actor/ratio_max", "max", "actor", "largest importance ratio over valid tokens"),
    Metric("actor/ratio_min", "min", "actor", "smallest importance ratio over valid tokens"),
    Metric("actor/entropy", "mean", "actor", "policy entropy at the sampling temperature, mean over valid tokens"),
    Metric("actor/kl", "mean", "actor", "KL estimate (algorithm.kl.loss_estimator, else estimator) to the reference over valid tokens; null without a reference"),
    Metric("actor/tis_weight", "mean", "actor", "truncated importance weight pi_train / pi_rollout (algorithm.tis), mean over valid tokens"),
    Metric("actor/tis_capped_frac", "mean", "actor", "share of valid tokens whose TIS weight reached the cap"),
    Metric("actor/mis_masked_frac", "mean", "actor", "share of valid tokens that masked importance sampling (algorithm.mis) drops from the policy-gradient loss"),
    Metric("rollout/logprob_mismatch", "mean", "actor", "mean |trainer - engine| log-prob of the sampled tokens (trainer: old log-probs, else current; "
           "current with algorithm.old_logprobs=engine)"),
    Metric("rollout/logprob_mismatch/staleness<s>", "last", "rollout", "asynchronous runs: mean |old - engine| log-prob over the valid tokens of the samples s policy versions older than the trained one"),
    Metric("rollout/tis_weight/staleness<s>", "last", "rollout", "asynchronous runs with algorithm.tis: mean TIS weight over the valid tokens of the samples s policy versions stale"),
    Metric("rollout/tis_capped_frac/staleness<s>", "last", "rollout", "asynchronous runs with algorithm.tis: share of those tokens whose weight reached the cap"),
    Metric("rollout/mis_masked_frac/staleness<s>", "last", "rollout", "asynchronous runs with algorithm.mis: share of the valid tokens of the samples s versions stale that MIS masks"),
    *_optimizer_metrics("actor", "policy"),
    Metric("actor/moe/routing_agreement", "last", "moe", "MoE with routing replay: mean over MoE layers of actor/moe/routing_agreement/layer<i>"),
    Metric("actor/moe/routing_agreement/layer<i>", "last", "moe", "share of the tokens the engine routed whose trainer top-k experts (without replay) equal the engine's, MoE layer i (HF's 0-based decoder layer index, as expert_load_max_over_mean)"),
    Metric("actor/moe/logprob_diff_replay", "last", "moe", "mean |trainer log-prob before the update - rollout log-prob| over loss tokens, routers replaying the engine's routing"),
    Metric("actor/moe/logprob_diff_no_replay", "last", "moe", "the same, the trainer's routers routing by themselves (one extra forward)"),
    *_moe_metrics("actor"),
    Metric("actor/param_checksum", "last", "trainer", "on checkpoint steps: sum of |parameters| of the policy, as its exported HF tensors: the same at any TP/PP (resume checks)"),
    # ---- critic update (megarl.algos.losses.ValueLossFn) ------------------------------------
    Metric("critic/loss", "mean", "critic", "the optimised critic loss (the value loss: it has no other term)"),
    Metric("critic/vf_loss", "mean", "critic", "clipped value loss 0.5 * max((v - R)^2, (v_clip - R)^2), per algorithm.loss_agg"),
    Metric("critic/vf_clipfrac", "mean", "critic", "share of valid tokens where the clipped value error is the larger one"),
    Metric("critic/vpred_mean", "mean", "critic", "predicted value, mean over valid tokens"),
    *_optimizer_metrics("critic", "critic"),
    *_moe_metrics("critic"),
    # ---- advantages (megarl.algos.step.advantage_step) -------------------------------------
    Metric("reward/kl", "mean", "advantages", "KL penalty in the reward: token mean per sequence, mean over sequences (what the adaptive controller sees)"),
    Metric("reward/kl_coef", "last", "advantages", "KL-in-reward coefficient used this step (before the controller's update)"),
    Metric("reward/overlong_penalty_mean", "mean", "advantages", "DAPO overlong shaping added to the scores, mean over samples"),
    Metric("advantages/mean", "mean", "advantages", "advantage, mean over valid tokens"),
    Metric("advantages/return_mean", "mean", "advantages", "return (value target), mean over valid tokens"),
    # ---- the step's samples (megarl.rollout.collect.rollout_metrics) -----------------------
    Metric("reward/mean", "mean", "rollout", "outcome score, mean over the step's samples"),
    Metric("reward/std", "std", "rollout", "standard deviation of the step's scores"),
    Metric("reward/zero_var_group_frac", "mean", "rollout", "share of groups (size >= 2) whose samples all scored the same"),
    Metric("response_length/mean", "mean", "rollout", "response length in tokens, mean over samples"),
    Metric("response_length/max", "max", "rollout", "longest response in tokens"),
    Metric("response/truncated_frac", "mean", "rollout", "share of samples cut by max_new_tokens (finish reason length)"),
    Metric("response/finish_<reason>_frac", "mean", "rollout", "share of samples that ended for a reason other than stop or length (abort, max_turns, max_tool_calls, tool_error, timeout); logged when it occurs"),
    Metric("agent/turns_mean", "mean", "rollout", "model turns per trajectory (multi-turn agent loops)"),
    Metric("agent/tool_calls_mean", "mean", "rollout", "tool calls per trajectory, malformed ones included"),
    Metric("agent/tool_failures_mean", "mean", "rollout", "failed tool calls (raised, timed out, malformed, unknown tool) per trajectory"),
    Metric("agent/with_tool_call_frac", "mean", "rollout", "share of trajectories with at least one tool call that ran"),
    Metric("dynamic_sampling/rounds", "sum", "rollout", "generation rounds of DAPO dynamic sampling this step"),
    Metric("dynamic_sampling/kept_groups", "sum", "rollout", "groups with reward variance kept by dynamic sampling"),
    # ---- asynchronous training (megarl.rollout.producer, megarl.trainer.rollout_source) -------
    Metric("async/staleness_mean", "last", "trainer", "policy versions between the trained one and each sample's oldest token, mean over the step's samples"),
    Metric("async/staleness_max", "last", "trainer", "the largest staleness among the step's samples (at most rollout.max_staleness)"),
    Metric("async/staleness<s>_frac", "last", "trainer", "share of the step's samples s policy versions stale (s = 0 .. rollout.max_staleness)"),
    Metric("async/buffer_groups", "last", "trainer", "scored groups left in the producer's buffer once the step took its own"),
    Metric("async/dropped_stale", "last", "trainer", "groups the step found more than rollout.max_staleness versions stale: re-issued once, then dropped"),
    Metric("async/dropped_no_variance", "last", "trainer", "groups dropped since the last step by dynamic sampling (all samples scored the same)"),
    Metric("async/trainer_idle_frac", "last", "trainer", "share of the step the trainer waited for rollouts"),
    Metric("async/engine_idle_frac", "last", "trainer", "share of the time since the previous step's batch the producer was neither generating nor scoring"),
    Metric("async/push_while_generating_s", "last", "trainer", "seconds of the step's weight push during which the producer was generating or scoring"),
    # ---- scoring (megarl.rewards.scorer.ScoreResult.metrics) -------------------------------
    Metric("reward/score_mean", "mean", "scorer", "score, mean over the scored samples (with dynamic sampling: the last round)"),
    Metric("reward/errors", "sum", "scorer", "reward functions that raised (they score 0)"),
    Metric("reward/timeouts", "sum", "scorer", "reward functions that timed out (they score 0)"),
    Metric("reward/<extra>", "mean", "scorer", "an extra value a reward function returns, mean over the samples that report it"),
    Metric("reward/<component>", "mean", "scorer", "a reward.combine component's score (a rule scorer, custom, model, judge), mean over the samples whose data source uses it"),
    Metric("reward/judge_errors", "sum", "scorer", "samples whose judge output did not parse or whose judge call failed (they score 0 on the judge)"),
    Metric("reward/judge_timeouts", "sum", "scorer", "samples whose judge call passed reward.judge.timeout_s (they score 0 on the judge)"),
    # ---- weight sync (megarl.weight_sync.stream, megarl.weight_sync.logprob_check) ----------
    Metric("weight_sync/seconds", "last", "weight_sync", "wall time of the step's weight push"),
    Metric("weight_sync/bytes", "last", "weight_sync", "bytes pushed to the engines"),
    Metric("weight_sync/gbps", "last", "weight_sync", "push speed, GB/s"),
    Metric("weight_sync/buckets", "last", "weight_sync", "buckets of rollout.weight_sync.bucket_mb pushed"),
    Metric("weight_sync/logprob_diff", "mean", "weight_sync", "mean |engine - trainer| log-prob of the probe tokens after the push (above weight_sync/logprob_diff_bound: refused)"),
    Metric("weight_sync/logprob_diff_bound", "last", "weight_sync", "the bound the push's check held logprob_diff to: logprob_diff_ceiling while the run's baseline is measured, then logprob_baseline_factor x baseline within [max_logprob_diff, logprob_diff_ceiling]"),
    Metric("weight_sync/logprob_diff_max", "max", "weight_sync", "largest |engine - trainer| log-prob of a probe token after the push"),
    # ---- timing (megarl.progress.PhaseTimer: the loop and the collectors) ----------------
    Metric("time/step_s", "sum", "trainer", "wall time of the RL step"),
    Metric("time/<phase>_s", "sum", "trainer", "wall time of one phase of the step (generate, reward, policy_update, validate, ...)"),
    # ---- validation (megarl.trainer.loop.Trainer.validate) ---------------------------------
    *_validation_metrics(),
    # ---- supervised fine-tuning (megarl.algos.losses.SFTLossFn, megarl.commands.sft) -------
    Metric("sft/loss", "mean", "sft", "negative log-likelihood of the trained (response / assistant) tokens, mean over them"),
    Metric("sft/tokens", "sum", "sft", "trained tokens of the optimizer step"),
    Metric("sft/val_loss", "mean", "sft", "the same loss on sft.val_files, mean over their trained tokens"),
    # ---- training data (megarl.data.stream, logged once at start) --------------------------
    Metric("data/train_rows_read", "sum", "data", "rows read from data.train_files"),
    Metric("data/train_prompts", "sum", "data", "training prompts kept"),
    Metric("data/train_dropped_overlong", "sum", "data", "prompts dropped as longer than data.max_prompt_length"),
)


@cache
def _exact() -> dict[str, Metric]:
    names = [m.name for m in CATALOGUE]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise AssertionError(f"metrics declared twice in the catalogue: {duplicates}")
    return {m.name: m for m in CATALOGUE if not m.is_pattern}


@cache
def _patterns() -> tuple[tuple[re.Pattern[str], Metric], ...]:
    def regex(name: str) -> re.Pattern[str]:
        parts = re.split(r"<[a-z_]+>", name)
        return re.compile(".+".join(re.escape(p) for p in parts))

    return tuple((regex(m.name), m) for m in CATALOGUE if m.is_pattern)


def lookup(name: str) -> Metric:
    """The catalogue entry of public name ``name`` (an exact entry first, then a family);
    raises :class:`UnknownMetricError` naming the closest declared names."""
    metric = _exact().get(name)
    if metric is not None:
        return metric
    for regex, family in _patterns():
        if regex.fullmatch(name):
            return family
    close = difflib.get_close_matches(name, [m.name for m in CATALOGUE], n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise UnknownMetricError(
        f"metric {name!r} is not in the catalogue (megarl/metrics.py){hint} A new metric is "
        "declared there once, with its reduction and meaning, and listed in docs/metrics.md's table"
    )


def accumulated(name: str) -> Metric:
    """The entry of ``name`` if the accumulator can reduce it: an exact name (its row is fixed)
    whose reduction is not ``std``."""
    metric = lookup(name)
    if metric.is_pattern or metric.reduction not in ACCUMULATED:
        raise UnknownMetricError(
            f"metric {name!r} ({metric.reduction}, family {metric.name!r}) cannot be accumulated: "
            "only exact catalogue names with a mean, sum, max, min or last reduction can"
        )
    return metric


def optimizer_metric_names(role: str) -> dict[str, str]:
    """``{grad_norm, lr, optimizer_steps, skipped_steps} -> public name`` of ``role``."""
    return {key: lookup(f"{role}/{key}").name for key in ("grad_norm", "lr", "optimizer_steps", "skipped_steps")}


def catalogue_markdown() -> str:
    """The metrics catalogue page of the documentation site: every entry, family by family, in
    the catalogue's order (generated when the site is built, so it cannot drift from the code)."""
    out = ["# Metrics catalogue", "",
           "Generated from `megarl/metrics.py` when the site is built: every metric megarl reports, its reduction "
           "(how the pieces of a step combine), who writes it and what it means. A `<part>` is filled in at run time. "
           "[Metrics](../metrics.md) says where they go and how the reductions work.", ""]  # fmt: skip
    families = list(dict.fromkeys(m.family for m in CATALOGUE))
    for family in families:
        out += [f"## `{family}/`", "", "| name | reduction | written by | meaning |", "|---|---|---|---|"]
        for m in CATALOGUE:
            if m.family == family:
                meaning = m.meaning.replace("|", "\\|").replace("<", "&lt;")
                out.append(f"| `{m.name}` | {m.reduction} | {m.emitter} | {meaning} |")
        out.append("")
    return "\n".join(out)
