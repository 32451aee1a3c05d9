"""Typed configuration: one pydantic model per component (the key tree in README's Configuration).

Every model forbids unknown keys and is frozen: the config is read once, checked by the planner
(megarl/config/planner.py) before anything starts, and never mutated at run time. This module
imports neither torch nor megatron so that `megarl plan` stays fast.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Names selectable in the config; megarl.algos' registries hold the implementations and a test
# keeps both lists equal (the planner must not import torch to validate a name).
ESTIMATORS = (
    "gae",
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
)
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline")
POLICY_LOSSES = ("ppo", "gspo")
LOSS_AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3", "abs")
# A user's own function (algorithm.estimator / policy_loss, rollout.generate_function).
IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class ModelConfig(Section):
    path: str | None = Field(None, description="Hugging Face model directory (config.json, safetensors, tokenizer), or a "
                             "model checkpoint of `megarl convert hf-to-megatron` (any TP/PP layout).")
    arch: str | None = Field(
        None,
        description="Built-in architecture name (e.g. qwen2.5-72b) for planning without weights; see `megarl plan --list-archs`.",
    )
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="Parameter and activation dtype for training and rollout."
    )
    layer_spec: Literal["auto", "te", "local"] = Field(
        "local",
        description="Modules of the Megatron layers: local = Megatron's plain-torch modules with torch's SDPA "
        "attention (runs anywhere); te = transformer-engine's (norms fused into the next linear layer, TE's fused "
        "attention; CUDA only; not yet run on a GPU by megarl's tests, hence not the default); auto = te on CUDA "
        "where transformer-engine is installed, else local.",
    )

    @model_validator(mode="after")
    def _path_or_arch(self) -> ModelConfig:
        if self.path is None and self.arch is None:
            raise ValueError("set model.path (an HF model directory) or model.arch (a built-in architecture name)")
        return self


class ClusterConfig(Section):
    device: Literal["cuda", "cpu"] = Field("cuda", description="cuda for GPU clusters; cpu runs everything on gloo with the torch engine.")
    nnodes: int = Field(1, ge=1, description="Number of nodes.")
    gpus_per_node: int = Field(8, ge=1, description="GPUs per node (processes per node when device is cpu).")
    gpu_memory_gib: float = Field(80.0, gt=0, description="Memory of one GPU in GiB, for the memory plan.")
    placement: Literal["colocated", "disaggregated"] = Field(
        "colocated",
        description="colocated: training and rollout share every GPU; disaggregated: rollout gets its own pool of rollout_gpus.",
    )
    rollout_gpus: int = Field(0, ge=0, description="GPUs given to rollout when placement is disaggregated (taken from the last nodes).")
    ray_address: str | None = Field(None, description="Ray cluster to attach to ('auto' or host:port); None starts an embedded local Ray.")
    nvlink_gb_per_s: float = Field(
        360.0, gt=0,
        description="Gigabytes (not gigabits) per second per GPU and direction within a node, for the plan's weight-push estimate: an all-gather's "
        "bus bandwidth as nccl-tests measures it (about 360 on H100 NVLink 4, 180 on A100 NVLink 3).",
    )
    network_gb_per_s: float = Field(
        45.0, gt=0,
        description="Gigabytes per second per GPU and direction between nodes, for the weight-push estimate (about 45 with one "
        "400 Gb/s NIC per GPU, 22 with 200 Gb/s).",
    )
    host_gb_per_s: float = Field(
        20.0, gt=0,
        description="GB/s between a GPU and host memory or the shared filesystem, for the disk transport's "
        "estimate (PCIe Gen4 x16 about 20; the filesystem is often slower).",
    )

    @property
    def world_size(self) -> int:
        return self.nnodes * self.gpus_per_node


class DataFile(Section):
    path: str = Field(description="A parquet file in the verl schema (data_source, prompt, reward_model, extra_info).")
    weight: float = Field(1.0, gt=0, description="Relative sampling weight when several train files are mixed.")


class DataConfig(Section):
    train_files: list[DataFile] = Field(default_factory=list, description="Training parquet files (strings or {path, weight}).")
    val_files: list[str] = Field(default_factory=list, description="Validation parquet files.")
    prompt_key: str = Field("prompt", description="Column holding the prompt (a string or a list of chat messages).")
    prompts_per_step: int = Field(32, ge=1, description="Prompts drawn per RL step; the step generates prompts_per_step x rollout.n samples.")
    max_prompt_length: int = Field(1024, ge=1, description="Maximum prompt length in tokens after templating.")
    truncation: Literal["error", "left", "right"] = Field(
        "error", description="What to do with a prompt over max_prompt_length when it is not filtered out."
    )
    filter_overlong_prompts: bool = Field(True, description="Drop prompts longer than max_prompt_length when the dataset is loaded.")
    apply_chat_template: bool = Field(True, description="Render prompts with the tokenizer's chat template (else raw text).")
    shuffle: bool = Field(True, description="Shuffle each epoch (seeded, resumable).")
    seed: int = Field(1, description="Seed of the sampler's shuffles.")

    @field_validator("train_files", mode="before")
    @classmethod
    def _strings_to_files(cls, value: object) -> object:
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list):
            return [{"path": v} if isinstance(v, str) else v for v in value]
        return value

    @field_validator("val_files", mode="before")
    @classmethod
    def _string_to_list(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value


def _builtin_or_import_path(value: str, builtin: tuple[str, ...], what: str) -> str:
    if value in builtin or IMPORT_PATH.match(value):
        return value
    raise ValueError(f"{what} {value!r} is not one of {', '.join(builtin)}, nor an import path package.module:function")


class SamplingConfig(Section):
    temperature: float = Field(1.0, ge=0, description="Sampling temperature; the trainer computes log-probs at the same temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling; < 1 makes the rollout differ from the trained distribution.")
    top_k: int = Field(-1, ge=-1, description="Top-k sampling; -1 = the whole vocabulary.")
    max_new_tokens: int = Field(1024, ge=1, description="Maximum response length; a response cut here is marked truncated.")
    stop: list[str] = Field(default_factory=list, description="Stop strings (the matched string stays in the response).")
    stop_token_ids: list[int] = Field(default_factory=list, description="Extra stop token ids besides the tokenizer's EOS.")


WEIGHT_TRANSPORTS = ("auto", "in_process", "tensor", "distributed", "disk")


class WeightSyncConfig(Section):
    transport: Literal[WEIGHT_TRANSPORTS] = Field(  # type: ignore[valid-type]
        "auto",
        description="How weights reach the engines: in_process (torch engine), tensor (colocated SGLang, CUDA IPC), "
        "distributed (disaggregated SGLang, a broadcast group per pipeline stage), disk (HF files in disk_dir that the "
        "engines reload; any engine). auto picks in_process, tensor or distributed from the engine and placement.",
    )
    disk_dir: str | None = Field(
        None, description="Directory of the disk transport (on a filesystem every engine reads); None = <output_dir>/weights."
    )
    bucket_mb: int = Field(512, ge=1, description="Size of one weight-transfer bucket in MiB.")
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
        "alternate.",
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
        description="After each push, the engines generate short responses to a few of the run's prompts and the "
        "trainer's log-probs of the same tokens must agree (within max_logprob_diff).",
    )
    max_logprob_diff: float = Field(
        0.04,
        gt=0,
        description="Refuse a push whose mean |engine - trainer| log-prob over the post-push probe exceeds this. "
        "Default: 3x the worst mean seen over 20 honest bf16 pushes (demo model and the Qwen2.5-0.5B shape, TP=2 and "
        "PP=2, CPU: 0.0117), rounded up; see bench/results/logprob_check.json. It refuses gross mis-conversions (q and "
        "k swapped in an early layer, a weight off by 10 % to 2x), not a 1 % error in one tensor (within bf16 noise).",
    )


class ValSamplingConfig(Section):
    greedy: bool = Field(True, description="Validate with greedy decoding (else sample at the training temperature).")
    n: int = Field(1, ge=1, description="Samples per validation prompt (pass@k, best@k and maj@k are reported for k = 1, 2, 4, ..., n).")
    pass_threshold: float = Field(
        1.0,
        description="A validation response passes (pass@k) when its score is at least this; for a reward function "
        "that returns an 'acc' value, that decides instead.",
    )


AGENT_LOOPS = ("single_turn", "tool_agent")  # megarl.agents.loops.LOOPS holds the classes (a test keeps them equal)
LOOP_ALIASES = {"single_turn_agent": "single_turn"}  # verl's names for the same loops, as its datasets write them


def loop_name(agent_name: str | None, default: str) -> str:
    """The loop a data row runs: its agent_name (verl's names mapped to ours), else ``default``."""
    name = agent_name or default
    return LOOP_ALIASES.get(name, name)
TOOL_PARSERS = ("hermes",)  # megarl.agents.tool_calls.PARSERS


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
    tools_file: str | None = Field(
        None,
        description="Tool file in verl's format (tools: [{class_name, config, tool_schema}]); the schemas go to the "
        "chat template. Built-in class names: calculator, python, retrieval.",
    )
    interactions_file: str | None = Field(
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
        return _builtin_or_import_path(value, TOOL_PARSERS, "rollout.agent.tool_parser")

    @model_validator(mode="after")
    def _known_default(self) -> AgentConfig:
        if self.default_agent not in (*AGENT_LOOPS, *self.loops):
            raise ValueError(f"rollout.agent.default_agent {self.default_agent!r} is not a loop; "
                             f"use {', '.join((*AGENT_LOOPS, *self.loops))}")  # fmt: skip
        return self


class RolloutConfig(Section):
    engine: Literal["sglang", "torch"] = Field("sglang", description="sglang on GPUs; torch is the reference engine (CPU, CI, debugging).")
    tp: int = Field(1, ge=1, description="Tensor parallel size of one rollout engine.")
    mem_fraction: float = Field(0.8, gt=0, lt=1, description="Fraction of GPU memory SGLang takes for weights and KV cache.")
    max_running_requests: int = Field(256, ge=1, description="Concurrent requests per engine.")
    deterministic: bool = Field(
        False,
        description="SGLang: --enable-deterministic-inference, so the per-sample seeds are honoured and a resumed run "
        "regenerates exactly (costs throughput). The torch engine is always seeded.",
    )
    weights_cpu_backup: bool = Field(
        False,
        description="Colocated SGLang: --enable-weights-cpu-backup, so weights released for the updates and checkpoints come back intact "
        "(costs host memory: one copy of the engine's weights); without it the memory hand-over re-pushes the last "
        "version before a generation that follows a release (docs/architecture.md, 'Memory between training and generation').",
    )
    server_python: str | None = Field(
        None,
        description="SGLang: the Python interpreter that runs `python -m sglang.launch_server` (e.g. the bin/python of a "
        "separate SGLang venv, such as the CPU one `make sglang-cpu` builds); None = the trainer's own interpreter.",
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

    @field_validator("generate_function")
    @classmethod
    def _generate_function(cls, value: str) -> str:
        return _builtin_or_import_path(value, ("default",), "rollout.generate_function")


class ParallelConfig(Section):
    tp: int = Field(1, ge=1, description="Tensor parallel size.")
    pp: int = Field(1, ge=1, description="Pipeline parallel size.")
    vpp: int = Field(1, ge=1, description="Virtual pipeline stages per rank (not supported yet: 1).")
    cp: int = Field(1, ge=1, description="Context parallel size (not supported yet: 1).")
    ep: int = Field(1, ge=1, description="Expert parallel size (not supported yet: 1).")
    sequence_parallel: bool | None = Field(
        None,
        description="Megatron sequence parallelism: norms, residuals and dropout hold 1/tp of the sequence, and each "
        "TP all-reduce becomes a reduce-scatter plus an all-gather. None = on when tp > 1; always off at tp = 1.",
    )

    @property
    def uses_sequence_parallel(self) -> bool:
        """Whether the model runs with sequence parallelism: the one reading of the field (kept as
        written, so a saved config still means 'on when tp > 1' after tp changes)."""
        return self.sequence_parallel is not False and self.tp > 1


class OptimizerConfig(Section):
    lr: float = Field(1e-6, gt=0, description="Peak learning rate.")
    min_lr: float = Field(0.0, ge=0, description="Final learning rate of the decay schedule.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up, in optimizer steps.")
    schedule: Literal["constant", "cosine", "linear"] = Field("constant", description="Decay after warm-up.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam betas.")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon.")
    clip_grad: float = Field(1.0, ge=0, description="Global gradient-norm clip; 0 disables.")
    distributed: bool = Field(True, description="Megatron's distributed optimizer (optimizer state sharded over DP).")


class ActorConfig(Section):
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="Model parallel layout.")
    micro_batch_size: int | None = Field(1, ge=1, description="Samples per micro-batch per DP rank (or use max_tokens_per_gpu).")
    max_tokens_per_gpu: int | None = Field(None, ge=1, description="Token budget of a micro-batch per DP rank; overrides micro_batch_size. Packed, it counts real tokens (samples are packed first-fit-decreasing); padded, rows x the longest row.")
    pack_sequences: bool = Field(True, description="Lay a micro-batch's samples end to end in one sequence (Megatron's THD format, attention kept within each sample) instead of padding each to the longest: no compute on padding. False = padded rows.")
    mini_batch_size: int | None = Field(None, ge=1, description="Samples per optimizer step over all DP ranks; None = the whole step's samples.")
    ppo_epochs: int = Field(1, ge=1, description="Passes over the step's samples.")
    recompute: Literal["none", "selective", "full", "auto"] = Field(
        "none",
        description="Activation recomputation. auto: the least the plan's memory check fits (none, else full), "
        "resolved by megarl plan / launch and printed; none on CPU and in megarl sft.",
    )
    logprob_chunk_tokens: int = Field(1024, ge=1, description="Tokens whose LM-head logits exist at once when log-probs and entropy are computed (the head's memory is a few chunk x vocab/tp fp32 buffers, whatever the response length); the critic ignores it.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="Optimizer and LR schedule.")
    offload: bool = Field(False, description="Move params, grads and optimizer state to host memory while the engine generates (colocated).")


class ReferenceConfig(Section):
    enabled: bool | None = Field(None, description="Keep a frozen reference policy; None = derived from the algorithm (a KL term needs one).")
    offload: bool = Field(False, description="Keep the reference weights in host memory between uses.")


class CriticConfig(ActorConfig):
    enabled: bool | None = Field(None, description="Train a critic; None = derived from the estimator (gae needs one).")
    path: str | None = Field(None, description="HF model (or model checkpoint of `megarl convert hf-to-megatron`) to initialise the critic backbone from; None = the policy's model.path.")


class ClipConfig(Section):
    low: float = Field(0.2, ge=0, description="Lower clip ratio epsilon (ratio >= 1 - low).")
    high: float = Field(0.2, ge=0, description="Upper clip ratio epsilon (ratio <= 1 + high); DAPO clip-higher uses 0.28.")
    dual_c: float | None = Field(3.0, gt=1, description="Dual-clip bound for negative advantages; None disables.")
    value: float | None = Field(0.2, gt=0, description="Value-function clip range of the critic loss; None disables.")


class KLConfig(Section):
    use_in_reward: bool = Field(False, description="Subtract coef x KL from the token rewards.")
    use_in_loss: bool = Field(False, description="Add coef x KL to the policy loss.")
    estimator: Literal["k1", "k2", "k3", "abs"] = Field("k3", description="KL estimator (k3 = low-variance KL).")
    coef: float = Field(0.001, ge=0, description="KL coefficient (initial value for the adaptive controller).")
    controller: Literal["fixed", "adaptive"] = Field("fixed", description="Keep coef fixed or adapt it towards target.")
    target: float = Field(0.01, gt=0, description="Target KL of the adaptive controller.")
    horizon: int = Field(10000, ge=1, description="Horizon of the adaptive controller.")

    @property
    def enabled(self) -> bool:
        return self.use_in_reward or self.use_in_loss


class TISConfig(Section):
    level: Literal["none", "token", "sequence"] = Field("none", description="Truncated importance sampling against the engine's log-probs.")
    cap: float = Field(2.0, gt=0, description="Cap of the importance weight.")


class DynamicSamplingConfig(Section):
    enabled: bool = Field(False, description="DAPO: drop groups whose rewards are all equal and generate more.")
    max_rounds: int = Field(3, ge=1, description="Generation rounds per step at most before training on what is there.")


class OverlongConfig(Section):
    length: int = Field(0, ge=0, description="DAPO overlong shaping: penalise the last `length` tokens before max_new_tokens; 0 disables.")
    penalty: float = Field(1.0, ge=0, description="Penalty at the limit (linear from 0 over the window).")


class AlgorithmConfig(Section):
    estimator: str = Field(
        "grpo",
        description=f"Advantage estimator: {', '.join(ESTIMATORS)}, or your own as package.module:function (docs/extending.md).",
    )
    policy_loss: str = Field(
        "ppo",
        description="ppo (token ratio), gspo (sequence ratio), or your own as package.module:function (docs/extending.md).",
    )
    gamma: float = Field(1.0, ge=0, le=1, description="Discount (gae, reinforce++).")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda.")
    norm_by_std: bool = Field(True, description="Divide group-relative advantages by the group's std (grpo).")
    clip: ClipConfig = Field(default_factory=ClipConfig, description="Ratio and value clipping.")
    loss_agg: Literal[LOSS_AGGS] = Field("token-mean", description="How token losses are aggregated.")  # type: ignore[valid-type]
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus coefficient.")
    kl: KLConfig = Field(default_factory=KLConfig, description="KL to the reference policy.")
    tis: TISConfig = Field(default_factory=TISConfig, description="Train/inference mismatch correction.")
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig, description="DAPO dynamic sampling.")
    overlong: OverlongConfig = Field(default_factory=OverlongConfig, description="DAPO overlong reward shaping.")

    @field_validator("estimator")
    @classmethod
    def _estimator(cls, value: str) -> str:
        return _builtin_or_import_path(value, ESTIMATORS, "estimator")

    @field_validator("policy_loss")
    @classmethod
    def _policy_loss(cls, value: str) -> str:
        return _builtin_or_import_path(value, POLICY_LOSSES, "policy_loss")


class CustomRewardConfig(Section):
    path: str = Field(description="Python file defining the reward function.")
    name: str = Field("compute_score", description="Function name in that file.")
    batched: bool = Field(False, description="The function takes lists and returns a list (verl's batch reward).")


class RewardModelConfig(Section):
    path: str = Field(description="HF sequence-classification model directory.")
    batch_size: int = Field(8, ge=1, description="Samples per forward.")
    device: str = Field("cpu", description="Device of the reward model in the reward workers.")


class RewardConfig(Section):
    functions: dict[str, str] = Field(default_factory=dict, description="data_source -> built-in scorer name (gsm8k, math, code, ...); unlisted sources use their own name.")
    custom: CustomRewardConfig | None = Field(None, description="A user reward function (verl signature) used for every sample.")
    model: RewardModelConfig | None = Field(None, description="An HF reward model instead of rule-based scoring.")
    timeout_s: float = Field(10.0, gt=0, description="Per-sample scoring timeout; a timeout scores 0 and is counted.")
    workers: int = Field(2, ge=1, description="Reward worker processes.")
    max_failed_fraction: float = Field(
        1.0, gt=0, le=1,
        description="Stop the run (with the first failure's traceback) when reward functions raise or time out on at "
        "least this fraction of a step's samples; 1.0 = only when every sample failed.",
    )


class TrainerConfig(Section):
    total_steps: int | None = Field(None, ge=1, description="RL steps to run (or set total_epochs).")
    total_epochs: int | None = Field(None, ge=1, description="Passes over the training prompts (used when total_steps is None).")
    save_freq: int = Field(0, ge=0, description="Checkpoint every N steps (and at the end); 0 = at the end only.")
    eval_freq: int = Field(0, ge=0, description="Validate every N steps; 0 disables periodic validation.")
    eval_before_train: bool = Field(False, description="Validate once before the first step.")
    val_only: bool = Field(False, description="Only validate, then exit.")
    critic_warmup_steps: int = Field(0, ge=0, description="Steps where only the critic trains (PPO).")
    output_dir: str = Field("outputs/run", description="Checkpoints, metrics.jsonl, TensorBoard logs and samples go here.")
    resume: str = Field("auto", description="auto (latest valid checkpoint in output_dir), disable, or a checkpoint path.")
    keep_last: int = Field(3, ge=1, description="Checkpoints kept on disk.")
    loggers: list[Literal["console", "jsonl", "tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=lambda: ["console", "jsonl", "tensorboard"], description="Metric sinks."
    )
    project: str = Field("megarl", description="Project name for W&B / MLflow.")
    experiment: str = Field("run", description="Run name for W&B / MLflow.")
    seed: int = Field(1, description="Run seed; per-rank and per-sample seeds derive from it.")
    profile_steps: list[int] = Field(default_factory=list, description="Steps to trace with the torch profiler.")
    val_samples_logged: int = Field(4, ge=0, description="Validation generations written to output_dir/samples per eval.")
    checkpoint_on_signal: bool = Field(
        True, description="On Ctrl-C / SIGTERM (Slurm preemption), finish the step and save a checkpoint before stopping.",
    )
    hang_timeout_s: float = Field(
        3600.0, ge=0,
        description="Stop the run when no phase of a step makes progress for this long, after every rank wrote its "
        "Python stacks to its log; 0 disables the watchdog.",
    )


class SFTConfig(Section):
    train_files: list[str] = Field(
        default_factory=list,
        description="Parquet files of `megarl sft`: prompt + response columns (sft.prompt_key, sft.response_key), or chat "
        "conversations (sft.messages_key).",
    )
    val_files: list[str] = Field(default_factory=list, description="Held-out parquet files: the loss on them is logged as sft/val_loss.")
    prompt_key: str = Field("prompt", description="Column of the prompt (text or chat messages), templated as RL prompts are (data.apply_chat_template).")
    response_key: str = Field(
        "response",
        description="Column of the response text; a dotted key reads a struct column (reward_model.ground_truth trains "
        "on an RL file's answers). The model's EOS id is appended.",
    )
    messages_key: str = Field(
        "messages",
        description="Column of whole conversations [{role, content}], used when the response column is absent: every "
        "assistant turn is trained on, nothing else.",
    )
    max_length: int = Field(2048, ge=2, description="Rows longer than this many tokens (prompt + response), or than the model's max_position_embeddings when fewer, are dropped and counted in a warning.")
    batch_size: int = Field(64, ge=1, description="Sequences per optimizer step, over all data-parallel ranks (a multiple of the DP size).")
    total_steps: int | None = Field(None, ge=1, description="Optimizer steps; None = sft.epochs passes over the training rows.")
    epochs: int = Field(1, ge=1, description="Passes over the training rows when total_steps is None.")
    eval_freq: int = Field(0, ge=0, description="Held-out loss every N steps (and always after the last); 0 = after the last only.")
    output_dir: str = Field(
        "outputs/sft",
        description="metrics.jsonl, logs and model/: the fine-tuned model checkpoint that model.path can name to start RL "
        "from, and that `megarl convert` exports.",
    )


class MegaRLConfig(Section):
    """The whole run."""

    model: ModelConfig = Field(description="The policy model.")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="Hardware and placement.")
    data: DataConfig = Field(default_factory=DataConfig, description="Prompts.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Generation.")
    actor: ActorConfig = Field(default_factory=ActorConfig, description="The trained policy.")
    reference: ReferenceConfig = Field(default_factory=ReferenceConfig, description="The frozen reference policy.")
    critic: CriticConfig = Field(default_factory=CriticConfig, description="The value model (gae).")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="Advantages, losses, KL.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Scoring.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="The loop, checkpoints and logging.")
    sft: SFTConfig = Field(
        default_factory=SFTConfig,
        description="Supervised fine-tuning (`megarl sft`): data, steps and output; model, layout (actor.parallel, "
        "actor.micro_batch_size) and optimizer (actor.optimizer) are the RL run's.",
    )

    @property
    def reference_enabled(self) -> bool:
        if self.reference.enabled is not None:
            return self.reference.enabled
        return self.algorithm.kl.enabled

    @property
    def critic_enabled(self) -> bool:
        if self.critic.enabled is not None:
            return self.critic.enabled
        return self.algorithm.estimator == "gae"

    @property
    def weight_transport(self) -> str:
        """``rollout.weight_sync.transport`` with ``auto`` resolved from the engine and placement."""
        chosen = self.rollout.weight_sync.transport
        if chosen != "auto":
            return chosen
        if self.rollout.engine == "torch":
            return "in_process"
        return "tensor" if self.cluster.placement == "colocated" else "distributed"

    @property
    def weight_disk_dir(self) -> str:
        return self.rollout.weight_sync.disk_dir or f"{self.trainer.output_dir}/weights"

    @property
    def samples_per_step(self) -> int:
        return self.data.prompts_per_step * self.rollout.n
