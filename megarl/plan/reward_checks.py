"""Pre-launch checks of reward.combine and reward.judge, and their roles in the printed plan.

- reward.combine: every component names a built-in scorer or a configured section; every data
  source it lists is one some row of the data files has (the preflight reads them all).
- reward.judge: its model directory has a config.json and tokenizer files; its prompt template has
  only known placeholders and renders on a data row of a data source that uses it.
- the roles: where the reward model and the judge run and what their weights (and the judge's KV
  cache for one step's batch) take, from their config.json (:func:`reward_roles`); the reward
  model placed as a role of its own: megarl/plan/reward_model_plan.py; the judge's SGLang servers
  on devices of their own (cluster.device cuda): megarl/plan/judge_plan.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megarl.config.reward_sections import JUDGE_COMPONENT, RewardJudgeConfig
from megarl.config.sections import MegaRLConfig
from megarl.models.hf_files import tokenizer_files_problem
from megarl.plan.issues import Finding, counted
from megarl.plan.judge_plan import judge_layout, judge_memory
from megarl.plan.model_size import model_size
from megarl.plan.reward_model_plan import reward_model_layout, reward_model_memory
from megarl.plan.role_layout import RoleLayout
from megarl.rewards.judge_prompt import render, template_problem, template_text
from megarl.rollout_sglang.server_sizes import CPU_MAX_TOTAL_TOKENS


def combine_findings(cfg: MegaRLConfig, files: list[tuple[str, list[Any]]]) -> list[Finding]:
    """reward.combine and reward.judge against the data files' rows (label, PromptRecords) and the
    judge's files (the components' names are the planner's own check: make_plan)."""
    findings: list[Finding] = []
    seen = {r.data_source for _, records in files for r in records}
    if files:  # (none read: data.custom_cls reads its own files)
        for source in sorted(set(cfg.reward.combine) - seen):
            findings.append(Finding("reward.combine", f"[{source!r}] is a data_source no row of the data files has "
                                    f"(they have {', '.join(sorted(seen)) or 'none'}); fix the key"))  # fmt: skip
    judge = cfg.reward.judge
    if judge is None:
        return findings
    problem = model_problem(judge.model)
    if problem:
        findings.append(Finding("reward.judge.model", problem))
    template = template_text(judge.prompt_template)
    problem = template_problem(template)
    if problem:
        return [*findings, Finding("reward.judge.prompt_template", problem)]
    judged = {s for s, parts in cfg.reward.combine.items() if JUDGE_COMPONENT in parts}
    row = next((r for _, records in files for r in records if r.data_source in judged), None)
    if row is not None:
        try:
            render(template, row.prompt, "<response>", row.ground_truth)
        except Exception as exc:  # noqa: BLE001 - whatever str.format finds in a real row
            findings.append(Finding("reward.judge.prompt_template", f"does not render on row {row.row} "
                                    f"(data_source {row.data_source!r}): {type(exc).__name__}: {exc}; fix the template"))  # fmt: skip
    return findings


def judge_problem(judge: RewardJudgeConfig) -> str | None:
    """reward.judge's model directory and template, as one line naming the key (``megarl evaluate``,
    which has no data rows to render on), or None."""
    problem = model_problem(judge.model)
    if problem:
        return f"reward.judge.model: {problem}"
    problem = template_problem(template_text(judge.prompt_template))
    return f"reward.judge.prompt_template: {problem}" if problem else None


def model_problem(path: str) -> str | None:
    """Why ``path`` is no HF model directory an engine can load (config.json, tokenizer files), or None."""
    directory = Path(path)
    fix = "give an HF causal-LM directory (config.json, weights, tokenizer)"
    if not directory.is_dir():
        return f"({path}) is not a directory; {fix}"
    if not (directory / "config.json").is_file():
        return f"({path}) has no config.json; {fix}"
    tokenizer = tokenizer_files_problem(directory)
    if tokenizer:
        return f"({path}) {tokenizer}; {fix}"
    try:
        architectures = json.loads((directory / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return f"({path}) has a config.json that is no JSON object; {fix}"
    # a sequence classifier (a reward model) would load as a causal LM with a random LM head and
    # "judge" in noise that parses as scores
    if architectures and not any(str(a).endswith("ForCausalLM") for a in architectures):
        return f"({path}) holds a {', '.join(map(str, architectures))}, not a causal LM (*ForCausalLM); {fix}"
    return None


def reward_roles(cfg: MegaRLConfig, samples_per_step: int, training: RoleLayout | None = None) -> list[dict[str, Any]]:
    """The reward model's and the judge's roles: name, where they run, their memory estimate (GiB);
    ``training``: the policy's layout (a colocated reward model has an actor on each of its devices)."""
    roles = []
    r = cfg.reward
    layout = reward_model_layout(cfg, training)
    if r.model is not None and layout is not None:
        mem = reward_model_memory(cfg)
        unit, units = ("GPU", "GPUs") if cfg.cluster.device == "cuda" else ("process", "processes")
        where = (f"{counted(layout.dp, 'Ray actor')} on the training {units}, one per {unit} beside its policy rank, on the {unit} in "
                 "phase reward only (offloaded to host memory otherwise)" if r.model.placement == "colocated" else
                 f"{counted(layout.dp, 'Ray actor')} of its own, one per {unit}, on {counted(layout.dp, unit, units)} kept out of the training and "
                 "rollout pools (a placement group bundle each)")  # fmt: skip
        roles.append({"role": "reward model", "where": where, "per": f"per {unit}",
                      "memory_gib": mem.total / 2**30 if mem else None,
                      "what": "weights + one batch's activations" + (" + runtime" if mem and mem.runtime else "")})  # fmt: skip
    elif r.model is not None:
        size = model_size(r.model.path)
        gib = size.classifier_params * size.dtype_bytes * r.workers / 2**30 if size else None
        roles.append({"role": "reward model", "where": f"{r.workers} reward worker processes on {r.model.device or 'cpu'}",
                      "per": "host memory", "memory_gib": gib, "what": f"{r.workers} copies of the weights"})  # fmt: skip
    judge = judge_layout(cfg)
    if r.judge is not None and judge is not None:
        held = judge_memory(cfg)
        roles.append({"role": "LLM judge", "where": f"{counted(judge.dp, 'SGLang server')} of its own, tp {judge.tp}, on "
                      f"{counted(len(judge.gpus), 'GPU')} kept out of the other pools (a placement group each), its log "
                      "judge_sglang<k>.log",
                      "per": "per GPU", "memory_gib": held.total / 2**30 if held else None,
                      "what": "mem_fraction of the GPU for weights + KV cache, + SGLang's own outside it"})  # fmt: skip
    elif r.judge is not None:
        gib = _judge_bytes(r.judge, samples_per_step)
        gib = gib / 2**30 if gib is not None else None
        where = ("SGLang server of its own on the controller's node (CPU)" if r.judge.engine == "sglang" else
                 "torch engine on CPU, a Ray actor of its own on any node Ray picks (it asks for no CPU); "
                 "in-process runs: the controller's process")  # fmt: skip
        roles.append({"role": "LLM judge", "where": where, "per": "host memory", "memory_gib": gib,
                      "what": "weights + KV cache (torch: its context x the samples it decodes at once; "
                      "sglang: the server's token pool)"})  # fmt: skip
    return roles


def _judge_bytes(judge: RewardJudgeConfig, samples_per_step: int) -> float | None:
    """The judge's weights and KV cache (fp32 on CPU) at the context it runs with: reward.judge.context_length,
    else config.json's max_position_embeddings (megarl/rollout/judge.py judge_context, read here without
    transformers). The torch engine caches up to max_running_requests sequences of that context; the
    SGLang server a token pool of max_total_tokens (megarl/rollout/judge_server.py)."""
    size = model_size(judge.model)
    if size is None:
        return None
    a = size.arch
    context = judge.context_length or a.max_positions
    if judge.engine == "sglang":
        tokens = max(CPU_MAX_TOTAL_TOKENS, context)
    else:
        tokens = context * min(samples_per_step, judge.max_running_requests)
    kv_per_token = a.num_layers * a.num_kv_heads * (a.qk_head_dim + a.v_dim) * 4
    return size.causal_lm_params * size.dtype_bytes + kv_per_token * tokens
