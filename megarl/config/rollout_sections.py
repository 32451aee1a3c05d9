"""The rollout's config sections: sampling, weight sync, agent loops, and the engines (``rollout``).

Part of the key tree of megarl/config/sections.py (MegaRLConfig.rollout); torch-free.
"""

from __future__ import annotations

import difflib
import json
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from megarl.config.section_base import IMPORT_PATH, Section, UserPath, builtin_or_import_path
from megarl.config.sglang_server_args import SERVER_ARGS, SGLANG_VERSION


def top_k_samples(value: int) -> int:
    """A top-k the engines accept (their SamplingParams refuse 0): checked with the config, before Ray."""
    if value == 0:
        raise ValueError("0 samples nothing; use -1 (the whole vocabulary) or >= 1")
    return value


class SamplingConfig(Section):
    temperature: float = Field(1.0, ge=0, description="Sampling temperature; the trainer computes log-probs at the same temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling; < 1 makes the rollout differ from the trained distribution.")
    top_k: int = Field(-1, ge=-1, description="Top-k sampling; -1 = the whole vocabulary, else >= 1.")
    max_new_tokens: int = Field(1024, ge=1, description="Maximum response length; a response cut here is marked truncated.")
    stop: list[str] = Field(default_factory=list, description="Stop strings (the matched string stays in the response).")
    stop_token_ids: list[int] = Field(default_factory=list, description="Extra stop token ids besides the tokenizer's EOS.")
    ignore_eos: bool = Field(
        False,
        description="Generate past EOS (and stop_token_ids) up to max_new_tokens, in training rollouts, validation "
        "and megarl generate (SGLang's and vLLM's ignore_eos; stop strings still end a response). For throughput "
        "and length experiments: responses run on after the answer.",
    )

    @field_validator("top_k")
    @classmethod
    def _top_k_samples_something(cls, value: int) -> int:
        return top_k_samples(value)

    @model_validator(mode="after")
    def _ignored_stop_ids(self) -> SamplingConfig:
        if self.ignore_eos and self.stop_token_ids:
            raise ValueError(f"rollout.sampling.stop_token_ids {self.stop_token_ids} are ignored with ignore_eos=true "
                             "(SGLang ignores them too); drop them or set rollout.sampling.ignore_eos=false")  # fmt: skip
        return self


WEIGHT_TRANSPORTS = ("auto", "in_process", "tensor", "distributed", "disk")


class WeightSyncConfig(Section):
    transport: Literal[WEIGHT_TRANSPORTS] = Field(  # type: ignore[valid-type]
        "auto",
        description="How weights reach the engines: in_process (torch engine), tensor (colocated SGLang, CUDA IPC), "
        "distributed (disaggregated SGLang, a broadcast group per pipeline stage), disk (HF files in disk_dir that the "
        "engines reload; any engine). auto picks in_process, tensor or distributed from the engine and placement.",
    )
    disk_dir: UserPath | None = Field(
        None, description="Directory of the disk transport (on a filesystem every engine reads); None = <output_dir>/weights."
    )
    bucket_mb: int = Field(512, ge=1, description="Size of one weight-transfer bucket in MiB.")
    lora: Literal["merged", "adapter"] = Field(
        "merged",
        description="With actor.lora: merged pushes base + alpha/rank * B A of every targeted weight (any transport, any "
        "engine); adapter pushes only the adapters, which SGLang serves with its LoRA support (docs/lora.md).",
    )
    gather_mb: int = Field(
        1, ge=0,
        description="The export's TP all-gathers, in MiB: the TP shards of up to this many MiB of tensors are gathered "
        "with one collective per dtype; a larger tensor is gathered alone, straight into place. 0 = one collective "
        "per tensor. A group saves per-collective latency at the cost of a copy of the rank's shards and the group's "
        "gathered buffer beside its tensors (the planner counts it); on gloo, large groups are slower "
        "(bench/results/weight_sync.json).",
    )
    overlap: bool = Field(
        True,
        description="Export (TP gather, pipeline-stage collection, HF conversion) the next bucket while the current "
        "one is sent: a push then holds up to two buckets plus one tensor instead of one. false: export and send "
        "alternate. The in_process transport always alternates: its send is the engine's copy in the same thread.",
    )
    timeout_s: float = Field(
        600.0, ge=0,
        description="Deadline of one weight push (export, transfer, engine requests). When it passes, every policy "
        "rank writes its Python stacks to its log and the run stops, naming the rank(s) the push waited for and "
        "where each rank was; 0 = no deadline (trainer.hang_timeout_s still applies).",
    )

    @field_validator("timeout_s")
    @classmethod
    def _deadline(cls, value: float) -> float:
        if 0 < value < 1:
            raise ValueError("must be 0 (no deadline) or at least 1 s: a push's calls alone take longer")
        return value
    check_logprobs: bool = Field(
        True,
        description="After a push (every one until the baseline is set, the first of each process, then every "
        "check_logprobs_every-th), the engines "
        "generate short responses to a few of the run's prompts and the trainer's log-probs of the same tokens must "
        "agree (within max_logprob_diff).",
    )
    check_logprobs_every: int = Field(
        10,
        ge=1,
        description="The post-push check runs on every push until the run's baseline is set (its first "
        "logprob_baseline_checks checks, guarded only by logprob_diff_ceiling), on the first push of each process (a "
        "start or a resume: where a conversion or transport mistake shows) and on every this-many-th push after it "
        "(pushes 1, N+1, 2N+1, ...): "
        "the pushes between move the same tensors by the same code, so a check there finds what the last one would "
        "have (every push still passes the exact export check). 1 = every push. On the CPU demo a check takes longer "
        "than the push it checks (bench/results/vs_trl.md).",
    )
    max_logprob_diff: float = Field(
        0.04,
        gt=0,
        description="The floor of the post-push check's bound on the mean |engine - trainer| log-prob of the probe: a "
        "mean at or below it always passes; with logprob_baseline_checks 0 it is the bound. Default: 3x the worst mean "
        "seen over 20 honest bf16 pushes torch against torch (demo model and the Qwen2.5-0.5B shape, TP=2 and PP=2, "
        "CPU: 0.0117), rounded up; see bench/results/logprob_check.json. It refuses gross mis-conversions (q and k "
        "swapped in an early layer, a weight off by 10 % to 2x), not a 1 % error in one tensor (within bf16 noise).",
    )
    logprob_baseline_checks: int = Field(
        5,
        ge=0,
        description="The median of the run's first this many post-push checks is its baseline (logged once set, kept "
        "across a resume); later pushes are refused above logprob_baseline_factor x baseline, within "
        "[max_logprob_diff, logprob_diff_ceiling]; until then above logprob_diff_ceiling. SGLang's kernels against "
        "Megatron's differ more than torch against torch, and more at scale. 0: max_logprob_diff is the bound.",
    )
    logprob_baseline_factor: float = Field(
        5.0,
        gt=1,
        description="A post-push check is refused above this many times the run's baseline (logprob_baseline_checks). "
        "Over 20 honest pushes the worst mean was 1.3x (Qwen2.5-0.5B shape) to 3.5x (demo model) the median of the "
        "first 5, and q and k swapped in layer 0 scored 18x to 46x the same weights' honest mean "
        "(bench/results/logprob_check.json, .md). The noise can grow as a model trains (the demo model's worst over 300 "
        "pushes was 23x, below the 0.04 floor): raise this if a long run is refused without a cause.",
    )
    logprob_diff_ceiling: float = Field(
        0.2,
        gt=0,
        description="The most any post-push bound is, and the bound while the baseline is measured (the first pushes): "
        "a gross change such as q and k swapped in layer 0 (0.32 on the Qwen2.5-0.5B shape, "
        "bench/results/logprob_check.md) is refused from the first push on. Must exceed max_logprob_diff.",
    )

    @model_validator(mode="after")
    def _ceiling_above_floor(self) -> WeightSyncConfig:
        if self.logprob_baseline_checks and self.logprob_diff_ceiling <= self.max_logprob_diff:
            raise ValueError(f"rollout.weight_sync.logprob_diff_ceiling ({self.logprob_diff_ceiling}) must exceed "
                             f"max_logprob_diff ({self.max_logprob_diff}), the bound's floor")  # fmt: skip
        return self


class ValSamplingConfig(Section):
    greedy: bool = Field(
        True, description="Validate with greedy decoding; false = sample at temperature, top_p and top_k below (verl's val_kwargs.do_sample=true)."
    )
    temperature: float | None = Field(
        None, ge=0, description="Validation sampling temperature (with greedy=false); None = rollout.sampling.temperature."
    )
    top_p: float | None = Field(None, gt=0, le=1, description="Validation nucleus sampling (with greedy=false); None = rollout.sampling.top_p.")
    top_k: int | None = Field(None, ge=-1, description="Validation top-k (with greedy=false; -1 = the whole vocabulary); None = rollout.sampling.top_k.")
    n: int = Field(1, ge=1, description="Samples per validation prompt (pass@k, best@k and maj@k are reported for k = 1, 2, 4, ..., n).")
    pass_threshold: float = Field(
        1.0,
        description="A validation response passes (pass@k) when its score is at least this; for a reward function "
        "that returns an 'acc' value, that decides instead.",
    )

    @model_validator(mode="after")
    def _sampling_needs_sampling(self) -> ValSamplingConfig:
        given = {k: v for k, v in (("temperature", self.temperature), ("top_p", self.top_p), ("top_k", self.top_k)) if v is not None}
        if self.greedy and given:
            key, value = next(iter(given.items()))
            raise ValueError(f"rollout.val.{key}={value} has no effect while rollout.val.greedy=true; set "
                             "rollout.val.greedy=false to sample validation responses")  # fmt: skip
        return self

    @field_validator("top_k")
    @classmethod
    def _top_k_samples_something(cls, value: int | None) -> int | None:
        return value if value is None else top_k_samples(value)


AGENT_LOOPS = ("single_turn", "tool_agent")  # megarl.rollout.agents.loops.LOOPS holds the classes (a test keeps them equal)
LOOP_ALIASES = {"single_turn_agent": "single_turn"}  # verl's names for the same loops, as its datasets write them


def loop_name(agent_name: str | None, default: str) -> str:
    """The loop a data row runs: its agent_name (verl's names mapped to ours), else ``default``."""
    name = agent_name or default
    return LOOP_ALIASES.get(name, name)
TOOL_PARSERS = ("hermes",)  # megarl.rollout.agents.tool_calls.PARSERS


class AgentConfig(Section):
    default_agent: str = Field(
        "single_turn",
        description="The agent loop of a sample whose data row has no agent_name column: single_turn, tool_agent, "
        "or a name from loops.",
    )
    loops: dict[str, str] = Field(
        default_factory=dict,
        description="Your own agent loops: agent_name -> package.module:Class (an AgentLoop subclass, docs/agents.md).",
    )
    tools_file: UserPath | None = Field(
        None,
        description="Tool file in verl's format (tools: [{class_name, config, tool_schema}]); the schemas go to the "
        "chat template. Built-in class names: calculator, python, retrieval.",
    )
    interactions_file: UserPath | None = Field(
        None,
        description="Interaction file in verl's format (interaction: [{name, class_name, config}]): a simulated user "
        "who answers between turns, chosen per sample by extra_info.interaction_kwargs.name.",
    )
    tool_parser: str = Field("hermes", description="How tool calls are found in a turn: hermes (<tool_call>{json}</tool_call>) or package.module:function.")
    max_turns: int = Field(8, ge=1, description="Model turns per trajectory; a trajectory still calling tools after them ends as max_turns.")
    max_tool_calls: int = Field(16, ge=1, description="Tool calls per trajectory; a turn that would exceed it ends the trajectory as max_tool_calls.")
    max_parallel_calls: int = Field(
        4, ge=1, description="Tool calls run per turn; further calls of the turn are answered with an error (and count as failed)."
    )
    max_tool_response_length: int = Field(
        4096, ge=16, description="Characters of one tool answer the model sees; a longer answer is cut and marked ...(truncated)."
    )
    max_tool_failures: int = Field(
        3, ge=1, description="Failed tool calls (errors, timeouts, malformed calls) after which a trajectory ends as tool_error or timeout."
    )
    max_tokens_per_turn: int | None = Field(
        None, ge=1, description="Tokens one model turn may generate; None = what is left of rollout.sampling.max_new_tokens, "
        "which bounds the whole response (model turns, tool answers and user turns together)."
    )
    turn_rewards: bool = Field(
        False,
        description="Also reward each turn: a tool call's reward and an interaction's turn score go on the last generated "
        "token of the turn that earned them (the reward function's score stays on the trajectory's last token). "
        "Group estimators (grpo, rloo, ...) add them to the trajectory's score; gae, reinforce_plus_plus and remax "
        "credit each to the tokens before it (docs/agents.md).",
    )
    tool_timeout_s: float = Field(30.0, gt=0, description="Seconds one tool call may take; then the model is told it timed out.")
    interaction_timeout_s: float = Field(
        600.0, gt=0, description="Seconds one call of an interaction's method (generate_response, start_interaction, "
        "finalize_interaction) may take; then the run stops with an error naming the interaction. Generous by default: "
        "a simulated user may be a remote LLM that sometimes answers slowly; lower it to stop a stuck one sooner."
    )
    max_concurrent: int = Field(1024, ge=1, description="Trajectories in flight at once (each engine batches its share of them).")
    overlap_tools: bool | None = Field(
        None,
        description="Let trajectories whose tools answered generate while other tools still run. None = on with SGLang "
        "(unless rollout.deterministic), off with the torch engine: there every round waits for its tools, so that a "
        "resumed run regenerates exactly.",
    )

    @field_validator("default_agent")
    @classmethod
    def _default_agent(cls, value: str) -> str:
        if not value:
            raise ValueError("rollout.agent.default_agent is empty; use single_turn, tool_agent or a name from loops")
        return value

    @field_validator("loops")
    @classmethod
    def _loops(cls, value: dict[str, str]) -> dict[str, str]:
        for name, path in value.items():
            if name in AGENT_LOOPS:
                raise ValueError(f"rollout.agent.loops.{name}: {name} is a built-in loop; give yours another name")
            if not IMPORT_PATH.match(path):
                raise ValueError(f"rollout.agent.loops.{name} {path!r} is not an import path package.module:Class")
        return value

    @field_validator("tool_parser")
    @classmethod
    def _tool_parser(cls, value: str) -> str:
        return builtin_or_import_path(value, TOOL_PARSERS, "rollout.agent.tool_parser")

    @model_validator(mode="after")
    def _known_default(self) -> AgentConfig:
        if self.default_agent not in (*AGENT_LOOPS, *self.loops):
            raise ValueError(f"rollout.agent.default_agent {self.default_agent!r} is not a loop; "
                             f"use {', '.join((*AGENT_LOOPS, *self.loops))}")  # fmt: skip
        return self


# SGLang server arguments (ServerArgs field names) that megarl sets itself (megarl/rollout_sglang/server.py
# build_launch_command), with the key that owns each: rollout.engine_kwargs refuses them. Those megarl
# sets only in some modes and a user may override (log_level, max_total_tokens on CPU,
# disable_overlap_schedule, sleep_on_idle) are not here. The flags among these that
# megarl/plan/rollout_checks.py OWNED_SERVER_ARGS refuses in rollout.server_args are a subset (a test).
OWNED_ENGINE_KWARGS = {
    "model_path": "model.path", "tp_size": "rollout.tp", "mem_fraction_static": "rollout.mem_fraction",
    "host": "(the node's address)", "port": "(a free port)", "base_gpu_id": "(the engine's GPUs)",
    "device": "cluster.device", "load_format": "(dummy when a push follows)",
    "max_running_requests": "rollout.max_running_requests", "random_seed": "trainer.seed", "dtype": "model.dtype",
    "enable_memory_saver": "cluster.placement", "enable_weights_cpu_backup": "rollout.weights_cpu_backup",
    "enable_deterministic_inference": "rollout.deterministic", "skip_server_warmup": "(megarl's health probe)",
    "enable_return_routed_experts": "actor.moe.routing_replay",
    **dict.fromkeys(("enable_lora", "max_lora_rank", "lora_target_modules", "max_loras_per_batch", "lora_backend",
                     "lora_paths"), "actor.lora with rollout.weight_sync.lora=adapter"),
}  # fmt: skip

EngineKwarg = bool | int | float | str | list[bool | int | float | str] | dict[str, Any] | None


def _engine_kwarg_problem(name: str, value: Any) -> str | None:
    """Why SGLang's server would not take ``name: value`` from rollout.engine_kwargs, or None."""
    shown = f"{name} ({value!r})"
    if name in OWNED_ENGINE_KWARGS:
        return f"{shown} is set by megarl from {OWNED_ENGINE_KWARGS[name]}; drop it (set that key instead)"
    if name not in SERVER_ARGS:
        field = name.lstrip("-").replace("-", "_")
        close = [field] if field in SERVER_ARGS else difflib.get_close_matches(field, SERVER_ARGS, n=3, cutoff=0.7)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        return (f"{shown} is not a server argument of SGLang {SGLANG_VERSION} (ServerArgs field names, as "
                f"verl's engine_kwargs.sglang); {hint}a flag of another SGLang version goes in rollout.server_args")
    if value is None:  # left out
        return None
    flag, kind, kind_type, choices = SERVER_ARGS[name]
    if kind in ("switch", "bool"):
        return None if isinstance(value, bool) else f"{shown} is an on/off switch ({flag}); give true or false"
    values = value if kind == "list" and isinstance(value, list) else [value]
    for one in values:
        if kind_type == "json" and isinstance(one, (dict, list)) or kind_type in ("str", "any") and isinstance(one, dict):
            continue
        if isinstance(one, (dict, list)) or isinstance(one, bool) and kind_type != "str":
            return f"{shown} takes {'values' if kind == 'list' else 'one value'} of type {kind_type} ({flag})"
        if kind_type == "int" and not isinstance(one, int) or kind_type == "float" and not isinstance(one, (int, float)):
            return f"{shown} takes {'values' if kind == 'list' else 'one value'} of type {kind_type} ({flag})"
        if choices and str(one) not in choices:
            return f"{shown} is not one of SGLang's choices for {flag}: {', '.join(choices)}"
    return None


def _flag_value(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def engine_kwargs_args(engine_kwargs: dict[str, Any]) -> list[str]:
    """rollout.engine_kwargs (checked) as the server's command-line flags: a value as ``--flag
    value``, a list as ``--flag v1 v2`` (a dict or a list of a JSON argument as JSON), a switch as
    ``--flag`` when true, a --x / --no-x argument as either; None leaves the argument out."""
    args: list[str] = []
    for name, value in engine_kwargs.items():
        if value is None:
            continue
        flag, kind, kind_type, _ = SERVER_ARGS[name]
        if kind == "switch":
            args += [flag] if value else []
        elif kind == "bool":
            args.append(flag if value else "--no-" + flag.removeprefix("--"))
        elif kind == "list" and isinstance(value, list) and kind_type != "json":
            args += [flag, *(_flag_value(v) for v in value)]
        else:
            args += [flag, _flag_value(value)]
    return args


class RolloutConfig(Section):
    engine: Literal["sglang", "torch"] = Field("sglang", description="sglang on GPUs; torch is the reference engine (CPU, CI, debugging).")
    tp: int = Field(1, ge=1, description="Tensor parallel size of one rollout engine.")
    mem_fraction: float = Field(
        0.8, gt=0, lt=1,
        description="Fraction of the GPU memory SGLang sees free when it starts (after its own CUDA context; colocated, "
        "beside the trainer's process) that it takes for weights and KV cache (--mem-fraction-static); its CUDA graphs "
        "come on top.",
    )
    max_running_requests: int = Field(256, ge=1, description="Concurrent requests per engine.")
    deterministic: bool = Field(
        False,
        description="SGLang: --enable-deterministic-inference, so the per-sample seeds are honoured and a resumed run "
        "regenerates exactly (costs throughput; GPU only: a CPU server refuses it). The torch engine is always seeded.",
    )
    weights_cpu_backup: bool = Field(
        False,
        description="Colocated SGLang: --enable-weights-cpu-backup, so weights released for the updates and checkpoints come back intact "
        "(costs host memory: one copy of the engine's weights); without it the memory hand-over re-pushes the last "
        "version before a generation that follows a release (docs/architecture.md, 'Memory between training and generation').",
    )
    server_python: UserPath | None = Field(
        None,
        description="SGLang: the Python interpreter that runs `python -m sglang.launch_server` (e.g. the bin/python of a "
        "separate SGLang venv, such as the CPU one `make sglang-cpu` builds); None = the trainer's own interpreter.",
    )
    server_args: list[str] = Field(
        default_factory=list,
        description="SGLang: extra command-line arguments of every server, appended to the ones megarl passes "
        "(docs/sglang.md), e.g. [--disable-radix-cache]; not the ones megarl sets from the config (refused, naming the key). "
        "Unchecked: prefer engine_kwargs, checked before launch.",
    )
    engine_kwargs: dict[str, EngineKwarg] = Field(
        default_factory=dict,
        description="SGLang: server arguments by their ServerArgs field names (verl's engine_kwargs.sglang), e.g. "
        "{chunked_prefill_size: 4096, attention_backend: flashinfer}: checked before launch against the arguments of "
        f"SGLang {SGLANG_VERSION} (names, types, choices) and passed as flags before server_args; true turns a switch "
        "on, null leaves an argument out. Not the ones megarl sets from the config (refused, naming the key).",
    )
    n: int = Field(8, ge=1, description="Samples (responses) per prompt.")
    generate_function: str = Field(
        "default",
        description="How a step's prompts become a Batch of responses: default (each sample's agent loop, "
        "rollout.agent; single-turn unless the data says otherwise), or your own as package.module:function(engines, prompts, params) -> Batch (docs/extending.md).",
    )
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="Sampling of training rollouts.")
    val: ValSamplingConfig = Field(default_factory=ValSamplingConfig, description="Sampling of validation rollouts.")
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig, description="Trainer -> engine weight transfer.")
    agent: AgentConfig = Field(
        default_factory=AgentConfig, description="Multi-turn, tool-calling rollouts: agent loops chosen per sample by the agent_name column."
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="Asynchronous training (docs/async.md): 0 = the synchronous on-policy loop; k >= 1 = the engines keep "
        "generating while the trainer trains, and a sample may come from a policy at most k versions older than the one it trains.",
    )
    partial: bool | None = Field(
        None,
        description="Asynchronous training: a weight push pauses the requests in flight and continues them under the new "
        "weights (partial rollouts; each token records its policy version); false = a push waits for them to finish. "
        "None = true when max_staleness >= 1.",
    )

    @field_validator("generate_function")
    @classmethod
    def _generate_function(cls, value: str) -> str:
        return builtin_or_import_path(value, ("default",), "rollout.generate_function")

    @field_validator("engine_kwargs")
    @classmethod
    def _engine_kwargs(cls, value: dict[str, Any]) -> dict[str, Any]:
        for name, one in value.items():
            if problem := _engine_kwarg_problem(name, one):
                raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _engine_kwargs_once(self) -> RolloutConfig:
        given = {a.split("=", 1)[0] for a in self.server_args if a.startswith("--")}
        for name in self.engine_kwargs:
            flag = SERVER_ARGS[name][0]
            if flag in given or "--no-" + flag.removeprefix("--") in given:
                raise ValueError(f"rollout.engine_kwargs.{name} and rollout.server_args both give {flag}; keep one")
        return self
