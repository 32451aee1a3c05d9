"""Where each role acts in one RL step: the step's phases in order, who works in each, and what the
reward model's and the judge's roles hold while they do not work (the plan report's ``step`` lines).

The phases are the residency table's (megarl/memory/residency.py) with ``reward`` after ``generate``:
the controller scores a batch once it is generated (megarl/rollout/collect.py: rule functions in
the reward workers, the reward model where reward.model.placement puts it, the judge in its engine,
all of a batch's components one after another) and the training phases start once it is scored. An
asynchronous run (rollout.max_staleness >= 1) generates and scores in its producer, concurrently
with the training phases. Torch-free, like the planner.
"""

from __future__ import annotations

from megarl.config.sections import MegaRLConfig
from megarl.memory.residency import GENERATE, REWARD, STEP_PHASES, residency_of
from megarl.plan.issues import counted
from megarl.plan.own_devices import judge_on_devices
from megarl.plan.reward_model_plan import reward_model_gpus

# What works in each training phase (the roles of the residency table's phases).
_WORKERS = {
    "policy_forward": "policy old log-probs",
    "reference_forward": "reference log-probs",
    "critic_forward": "critic values",
    "critic_update": "critic",
    "policy_update": "policy",
    "weight_push": "policy -> rollout engines",
}


def step_phases(cfg: MegaRLConfig) -> list[tuple[str, str]]:
    """(phase, who works in it) for one step, in order: the passes the trainer runs (a strictly
    on-policy step has no old log-probs' pass; the reference's log-probs may come in the old
    log-probs' pass or in the update's, megarl/trainer/build.py)."""
    table = residency_of(cfg)
    phases = [(GENERATE, _generators(cfg)), (REWARD, ", ".join(reward_workers(cfg)))]
    for p in STEP_PHASES:
        if p not in table.rows or p in (GENERATE, REWARD) or _folded(cfg, p):
            continue
        who = _WORKERS[p]
        if p == "policy_forward" and cfg.reference_with_old_logprobs:
            who += ", with the reference's"
        elif p == "policy_update" and cfg.reference_in_update:
            who += ", with the reference's log-probs on its micro-batches"
        phases.append((p, who))
    return phases


def _folded(cfg: MegaRLConfig, phase: str) -> bool:
    """Whether ``phase`` has no pass of its own in the step (its work is in another one, or none)."""
    if phase == "policy_forward":
        return cfg.algorithm.old_logprobs == "engine" or cfg.strictly_on_policy
    if phase == "reference_forward":
        return cfg.reference_in_update or cfg.reference_with_old_logprobs
    return False


def reward_workers(cfg: MegaRLConfig) -> list[str]:
    """Who scores in the ``reward`` phase: the rule functions' workers, the reward model, the judge."""
    r = cfg.reward
    unit, units = ("GPU", "GPUs") if cfg.cluster.device == "cuda" else ("process", "processes")
    rules = not r.combine or any(n not in ("model", "judge") for parts in r.combine.values() for n in parts)
    out = [f"rule rewards in {r.workers} reward workers"] if (rules and (r.model is None or r.combine)) else []
    if r.model is not None:
        where = {"workers": f"in the {r.workers} reward workers on {r.model.device}",
                 "disaggregated": f"{counted(r.model.gpus, 'actor')} on {counted(r.model.gpus, unit, units)} of its own",
                 "colocated": f"one actor on each training {unit}, loaded onto it for this phase only"}[r.model.placement]  # fmt: skip
        out.append(f"reward model {where}")
    if r.judge is not None and judge_on_devices(cfg):
        out.append(f"LLM judge in {counted(r.judge.gpus // r.judge.tp, 'SGLang server')} on {counted(r.judge.gpus, 'GPU')} of its own")
    elif r.judge is not None:
        out.append(f"LLM judge in its {r.judge.engine} engine")
    return out


def held_throughout(cfg: MegaRLConfig) -> list[str]:
    """The reward roles that keep their memory in every phase while they work only in ``reward``."""
    r = cfg.reward
    unit, units = ("GPU", "GPUs") if cfg.cluster.device == "cuda" else ("process", "processes")
    held = []
    if reward_model_gpus(cfg):
        held.append(f"the reward model holds its {counted(r.model.gpus, unit, units)} in every phase and works in reward only")  # type: ignore[union-attr]
    if r.judge is not None and judge_on_devices(cfg):
        held.append(f"the LLM judge holds its {counted(r.judge.gpus, 'GPU')} in every phase and works in reward only")
    elif r.judge is not None:
        held.append(f"the LLM judge's {r.judge.engine} engine keeps its weights in host memory in every phase and works in reward only")
    return held


def timeline_text(cfg: MegaRLConfig) -> str:
    """The report's ``step timeline`` line: the phases in order with their workers; asynchronous
    runs say which phases overlap."""
    phases = step_phases(cfg)
    if cfg.asynchronous:
        produced = " -> ".join(f"{p} ({who})" for p, who in phases[:2])
        trained = " -> ".join(f"{p} ({who})" for p, who in phases[2:])
        text = f"producer: {produced}; concurrently, trainer: {trained}"
    else:
        text = " -> ".join(f"{p} ({who})" for p, who in phases)
    held = held_throughout(cfg)
    return text + (f"; {'; '.join(held)}" if held else "")


def timeline_dict(cfg: MegaRLConfig) -> dict:
    """`megarl plan --json`'s ``step``: the same phases, overlap and held roles as the report's line."""
    return {"phases": [{"phase": p, "workers": who} for p, who in step_phases(cfg)],
            "asynchronous": cfg.asynchronous, "held_throughout": held_throughout(cfg)}  # fmt: skip


def _generators(cfg: MegaRLConfig) -> str:
    if cfg.rollout.engine == "torch":
        return "torch engine" + (" process of its own" if cfg.asynchronous else "s in the policy ranks")
    where = "their own GPUs" if cfg.cluster.placement == "disaggregated" else "the training GPUs"
    return f"SGLang engines on {where}"
