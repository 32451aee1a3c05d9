"""The planner's checks of asynchronous training (``rollout.max_staleness`` >= 1, docs/async.md):
where it can run today (the torch engine process on CPU; SGLang servers on devices of their
own), and the settings it cannot combine with. Torch-free, like the planner."""

from __future__ import annotations

from megarl.config.sections import MegaRLConfig
from megarl.plan.issues import Issue


def check_asynchronous(cfg: MegaRLConfig, issues: list[Issue], *, in_process: bool = False) -> None:
    r = cfg.rollout
    if not cfg.asynchronous:
        if r.partial is not None:
            issues.append(Issue("rollout.partial", f"({str(r.partial).lower()}) applies to asynchronous runs only; set "
                                "rollout.max_staleness >= 1 or leave it out", level="warning"))  # fmt: skip
        return
    k = f"({r.max_staleness})"  # after the key of an issue about rollout.max_staleness itself
    staleness = f"rollout.max_staleness={r.max_staleness}"  # in an issue about another key
    if cfg.cluster.device == "cuda" and cfg.cluster.placement == "colocated":
        issues.append(Issue("rollout.max_staleness", f"{k} generates while the policy trains, so the engines need GPUs "
                            "of their own: set cluster.placement=disaggregated and cluster.rollout_gpus"))  # fmt: skip
    elif cfg.cluster.device == "cuda" and r.engine == "torch":
        issues.append(Issue("rollout.max_staleness", f"{k} runs the torch engine on CPU only (one engine process); on "
                            "cuda use rollout.engine=sglang"))  # fmt: skip
    if r.engine == "sglang":
        _check_sglang(cfg, issues)
    if in_process:
        issues.append(Issue("rollout.max_staleness", f"{k} runs the engine as a process of its own, which --in-process "
                            "does not start; launch without --in-process or set rollout.max_staleness=0"))  # fmt: skip
    if cfg.actor.moe.routing_replay != "none":
        issues.append(Issue("actor.moe.routing_replay", f"({cfg.actor.moe.routing_replay}) is not supported yet with "
                            f"asynchronous training ({staleness}): a retracted or concurrent request's routing is not "
                            "recorded whole; set actor.moe.routing_replay=none or rollout.max_staleness=0"))  # fmt: skip
    if cfg.algorithm.estimator == "remax":
        issues.append(Issue("algorithm.estimator", f"(remax) scores each prompt's greedy response under the current "
                            f"weights, which an asynchronous sample ({staleness}) was not generated with; use grpo, or "
                            "rollout.max_staleness=0"))  # fmt: skip
    if r.engine == "torch" and r.weight_sync.transport not in ("auto", "disk"):
        issues.append(Issue("rollout.weight_sync.transport", f"({r.weight_sync.transport}) cannot reach an engine process "
                            "of its own; asynchronous runs push through disk (auto)"))  # fmt: skip


def _check_sglang(cfg: MegaRLConfig, issues: list[Issue]) -> None:
    """What asynchronous SGLang servers cannot do yet (their placement is checked above)."""
    if cfg.rollout.partial is False:
        # A push that waits for the requests in flight is not simple on SGLang: its update requests
        # (begin, each bucket, end) take its update lock one by one, and a request that starts
        # between two of them would generate from half-updated weights.
        issues.append(Issue("rollout.partial", "(false) is not supported with asynchronous SGLang engines (a push "
                            "pauses the requests in flight and continues them); set rollout.partial=true or leave it out"))  # fmt: skip


def async_summary(cfg: MegaRLConfig, servers: int) -> str | None:
    """The plan report's line on asynchronous training (None when synchronous); ``servers``: the
    SGLang servers the plan places (the rollout role's data-parallel size)."""
    if not cfg.asynchronous:
        return None
    engines = "1 torch engine process generates" if cfg.rollout.engine == "torch" else \
        f"{servers} SGLang server{'s' if servers != 1 else ''} generate{'s' if servers == 1 else ''}"
    old = "old log-probs recomputed" if cfg.algorithm.old_logprobs == "recompute" else "the engines' log-probs are the old ones"
    partial = "partial rollouts (a push pauses the requests in flight)" if cfg.partial_rollouts else "a push waits for the requests in flight"
    return (f"[bold]asynchronous[/] max_staleness {cfg.rollout.max_staleness}: {engines} while the "
            f"policy ranks train (overlap up to 2x when generation and training take as long); {partial}; "
            f"{old}")  # fmt: skip
