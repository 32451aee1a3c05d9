"""Typed configuration: one pydantic model per component (the key tree in README's Configuration).

Every model forbids unknown keys and is frozen: the config is read once, checked by the planner
(megarl/plan/planner.py) before anything starts, and never mutated at run time. This module
imports neither torch nor megatron so that `megarl plan` stays fast.
"""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from megarl.config.architectures import BUILTIN_ARCHS
from megarl.config.reward_sections import (
    RewardJudgeConfig,
    RewardModelConfig,
    combine_numbers,
    combine_problem,
    combine_weights,
)
from megarl.config.rollout_sections import RolloutConfig
from megarl.config.section_base import Section, UserPath, builtin_or_import_path

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
# "+": verl's straight-through variants, the estimator's value with k2's gradient (megarl/algos/kl.py).
KL_ESTIMATORS = ("k1", "k2", "k3", "abs", "k1+", "k3+", "abs+")
# verl's names (algorithm.kl_penalty, actor.kl_loss_type) for the same estimators; "full" (the
# whole-vocabulary KL) is refused by KLConfig with its reason. k2+ is k2 (its own gradient).
KL_ESTIMATOR_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3", "kl+": "k1+", "mse+": "k2", "k2+": "k2", "low_var_kl+": "k3+"}
KLEstimatorName = Literal["k1", "k2", "k3", "abs", "k1+", "k3+", "abs+"]
class ModelConfig(Section):
    path: UserPath | None = Field(None, description="Hugging Face model directory (config.json, safetensors, tokenizer), or a "
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

    @field_validator("arch")
    @classmethod
    def _known_arch(cls, arch: str | None) -> str | None:
        """Also beside a path: a misspelt name would be ignored until the day the path is absent."""
        if arch is not None and arch.lower() not in BUILTIN_ARCHS:
            close = difflib.get_close_matches(arch.lower(), BUILTIN_ARCHS, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ValueError(f"{arch!r} is not a built-in architecture; {hint}choose one of: {', '.join(BUILTIN_ARCHS)}")
        return arch


# Default of cluster.build_timeout_s, and of the worker groups that have no config (megarl/ray_cluster/worker_group.py).
BUILD_TIMEOUT_S = 1800.0

# The config section of each model role (the reference takes the policy's layout, its own offload flag).
ROLE_SECTIONS = {"policy": "actor", "critic": "critic", "reference": "reference"}


class ClusterConfig(Section):
    device: Literal["cuda", "cpu"] = Field("cuda", description="cuda for GPU clusters; cpu runs everything on gloo with the torch engine.")
    nnodes: int = Field(1, ge=1, description="Number of nodes.")
    gpus_per_node: int = Field(8, ge=1, description="GPUs per node (processes per node when device is cpu).")
    gpu_memory_gib: float = Field(80.0, gt=0, description="Memory of one GPU in GiB, for the memory plan.")
    host_memory_gib: float | None = Field(
        None, gt=0,
        description="Host memory of one node in GiB, for the memory plan: a plan whose host buffers on a node (the copies of "
        "offloaded states, SGLang's weight backup, a fully_reshardable checkpoint save's gather) need more is refused. "
        "None: the plan shows them without a check.",
    )
    placement: Literal["colocated", "disaggregated"] = Field(
        "colocated",
        description="colocated: training and rollout share every GPU; disaggregated: rollout gets its own pool of rollout_gpus.",
    )
    rollout_gpus: int = Field(0, ge=0, description="GPUs given to rollout when placement is disaggregated (taken from the last nodes).")
    ray_address: str | None = Field(None, description="Ray cluster to attach to ('auto' or host:port); None starts an embedded local Ray.")
    build_timeout_s: float = Field(
        BUILD_TIMEOUT_S, ge=0,
        description="Seconds the Ray ranks of `megarl launch` and `megarl sft` may take to start and build their models "
        "(Megatron's setup, reading model.path) before the command gives up, naming the ranks not done; generous "
        "because a 72B model read from a slow shared filesystem takes many minutes. 0 = no deadline.",
    )
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
    path: UserPath = Field(description="A parquet file in the verl schema (data_source, prompt, reward_model, extra_info).")
    weight: float = Field(1.0, gt=0, description="Relative sampling weight when several train files are mixed.")


class CustomDatasetConfig(Section):
    path: UserPath = Field(description="Python file defining the dataset class.")
    name: str = Field(description="Class name in that file.")


# apply_chat_template's own arguments, which megarl sets: not data.apply_chat_template_kwargs.
TEMPLATE_ARGUMENTS = ("conversation", "tools", "add_generation_prompt", "tokenize", "return_tensors", "return_dict",
                      "return_assistant_tokens_mask")


class DataConfig(Section):
    train_files: list[DataFile] = Field(default_factory=list, description="Training parquet files (strings or {path, weight}).")
    val_files: list[UserPath] = Field(default_factory=list, description="Validation parquet files.")
    prompt_key: str = Field("prompt", description="Column holding the prompt (a string or a list of chat messages).")
    reward_fn_key: str = Field(
        "data_source",
        description="Column read as each row's data source: it picks the row's reward scorer (reward.functions) "
        "and names the source in metrics and sample files (verl's data.reward_fn_key).",
    )
    custom_cls: CustomDatasetConfig | None = Field(
        None,
        description="Your own dataset class instead of verl-schema parquet files (verl's data.custom_cls): built as "
        "cls(data_files=..., tokenizer=..., config=...) for train_files and for val_files; its __len__ and "
        "__getitem__ (a row dict in the verl schema) are read (docs/rewards.md#your-own-dataset-class-datacustom_cls).",
    )
    apply_chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of the tokenizer's apply_chat_template for every prompt (training, validation, "
        "megarl generate and evaluate, agent turns), e.g. {enable_thinking: false} for Qwen3.",
    )
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

    @field_validator("apply_chat_template_kwargs")
    @classmethod
    def _own_arguments(cls, value: dict[str, Any]) -> dict[str, Any]:
        taken = [k for k in value if k in TEMPLATE_ARGUMENTS]
        if taken:
            raise ValueError(f"{taken[0]!r} is an argument megarl sets itself ({', '.join(TEMPLATE_ARGUMENTS)}); "
                             "give only the template's own variables, e.g. {enable_thinking: false}")
        return value

    @model_validator(mode="after")
    def _kwargs_need_template(self) -> DataConfig:
        if self.apply_chat_template_kwargs and not self.apply_chat_template:
            raise ValueError("data.apply_chat_template_kwargs is set but data.apply_chat_template is false (no template "
                             "is rendered); set data.apply_chat_template=true, or drop data.apply_chat_template_kwargs")
        return self


class ParallelConfig(Section):
    tp: int = Field(1, ge=1, description="Tensor parallel size.")
    pp: int = Field(1, ge=1, description="Pipeline parallel size.")
    vpp: int = Field(1, ge=1, description="Virtual pipeline stages per rank (not supported yet: 1).")
    cp: int = Field(1, ge=1, description="Context parallel size (not supported yet: 1).")
    ep: int = Field(
        1,
        ge=1,
        description="Expert parallel size: ranks that split each mixture-of-experts layer's experts (each holds "
        "num_experts / ep). MoE models only; must divide num_experts, and ep x etp must divide tp x dp (an "
        "expert-parallel group may span data-parallel replicas).",
    )
    etp: int = Field(
        1,
        ge=1,
        description="Expert tensor parallel size: ranks that split each expert's weights (Megatron's "
        "expert_tensor_parallel_size): each expert's gate/up rows and down columns over etp ranks; 1 = whole experts. "
        "Must divide moe_intermediate_size, and at ep = 1 must equal tp. Trains for Qwen3-MoE; DeepSeek-V3 takes 1 only.",
    )
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
    min_lr_ratio: float | None = Field(None, ge=0, le=1, description="The final learning rate as a fraction of lr (verl's min_lr_ratio); "
                                       "instead of a min_lr above 0.")  # fmt: skip
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up, in optimizer steps.")
    warmup_ratio: float | None = Field(
        None, ge=0, le=1, description="Linear warm-up as a fraction of the run's optimizer steps, int(ratio x steps) "
        "(verl's lr_warmup_steps_ratio); instead of a warmup_steps above 0.",
    )
    schedule: Literal["constant", "cosine", "linear", "wsd"] = Field(
        "constant",
        description="After warm-up: constant lr; cosine / linear decay to min_lr over the remaining steps; wsd "
        "(warmup-stable-decay) lr, then a cosine decay to min_lr over the last wsd_decay_ratio of the remaining steps.",
    )
    wsd_decay_ratio: float = Field(
        0.1, gt=0, le=1, description="schedule wsd: the fraction of the steps after warm-up that decay (verl's wsd "
        "keeps int(0.9 x them) at lr: stable_ratio 0.9 = 1 - this).",
    )
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam betas.")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon.")
    clip_grad: float = Field(1.0, ge=0, description="Global gradient-norm clip; 0 disables.")
    distributed: bool = Field(True, description="Megatron's distributed optimizer (optimizer state sharded over DP).")
    checkpoint_format: Literal["dp_reshardable", "fully_reshardable"] = Field(
        "dp_reshardable",
        description="How checkpoints lay out the distributed optimizer's state. dp_reshardable: each rank writes "
        "its own shard, no gather; a resume may change the data-parallel size only. fully_reshardable: each "
        "parameter's Adam state whole, so a resume may also change parallel.tp and parallel.pp; the save "
        "all-gathers the state over the data-parallel ranks (each rank holds its stage's full fp32 master "
        "params and Adam moments, 12 B x params / (tp x pp), in host memory while it saves; megarl plan counts it per "
        "node) and every "
        "data-parallel rank reads its stage's whole state at load: slower, more host memory. Applies to the "
        "checkpoints this run writes; a resume loads whichever format its checkpoint holds. Needs distributed.",
    )

    @model_validator(mode="after")
    def _ratio_or_absolute(self) -> OptimizerConfig:
        for ratio, absolute, what in (("warmup_ratio", "warmup_steps", "the warm-up"), ("min_lr_ratio", "min_lr", "the final lr")):
            if getattr(self, ratio) is not None and getattr(self, absolute):
                raise ValueError(f"{ratio} ({getattr(self, ratio)}) and {absolute} ({getattr(self, absolute)}) both set {what}; "
                                 f"keep one: {absolute}=0 or {ratio}=null")  # fmt: skip
        return self

    @property
    def final_lr(self) -> float:
        """The decay's end: min_lr_ratio x lr, else min_lr."""
        return self.min_lr if self.min_lr_ratio is None else self.min_lr_ratio * self.lr

    def warmup_steps_of(self, total_steps: int | None) -> int:
        """The warm-up's optimizer steps: int(warmup_ratio x total_steps) (as verl rounds), else warmup_steps."""
        if self.warmup_ratio is None:
            return self.warmup_steps
        if total_steps is None:
            raise ValueError(f"actor.optimizer.warmup_ratio={self.warmup_ratio} needs the run's optimizer steps; "
                             "pass total_optimizer_steps to the worker or set warmup_steps")  # fmt: skip
        return int(self.warmup_ratio * total_steps)

    @model_validator(mode="after")
    def _format_needs_distributed(self) -> OptimizerConfig:
        if self.checkpoint_format != "dp_reshardable" and not self.distributed:
            raise ValueError(
                f"checkpoint_format={self.checkpoint_format} lays out the distributed optimizer's state; with "
                "distributed=false set checkpoint_format=dp_reshardable, or distributed=true"
            )
        return self


class MoEConfig(Section):
    routing_replay: Literal["none", "experts", "experts_and_weights"] = Field(
        "none",
        description="Route the trainer's tokens as the engine routed them, in the old-log-prob, reference and update "
        "forwards (mixture-of-experts models). none: the trainer's router decides; experts: the engine's expert "
        "ids per token and layer, with the trainer's own routing weights over them (its router still gets "
        "gradients); experts_and_weights: the engine's ids and routing weights (torch engine only: SGLang "
        "returns ids alone). Mixture-of-experts models only (refused on a dense one); megarl sft ignores it.",
    )
    aux_loss_coef: float = Field(
        0.0, ge=0, description="Coefficient of Megatron's Switch load-balancing loss, per MoE layer and micro-batch "
        "(HF's router_aux_loss_coef pools the layers and is k times larger: not read); 0 = none. Its gradient joins "
        "the training loss's; reported as <role>/moe/aux_loss.",
    )  # fmt: skip
    z_loss_coef: float = Field(
        0.0, ge=0, description="Coefficient of the router z-loss (penalises large router logits); 0 = none.",
    )  # fmt: skip
    expert_bias_update_rate: float = Field(
        0.0, ge=0, description="DeepSeek-style auxiliary-loss-free balancing: a per-expert bias added to the "
        "router's scores for the top-k choice only, moved by this rate towards equal load after each optimizer "
        "step (Megatron's moe_router_bias_update_rate); 0 = off.",
    )  # fmt: skip
    capacity_factor: float | None = Field(
        None, gt=0, description="Tokens an expert takes per micro-batch, as a multiple of the even share; the rest "
        "are dropped (their expert output is zero). None = dropless: every token reaches its experts, as the "
        "engines route them (recommended for RL: a dropped token's log-prob differs from the engine's).",
    )  # fmt: skip
    token_drop_policy: Literal["probs", "position"] = Field(
        "probs", description="With capacity_factor: which tokens an over-full expert drops (lowest routing "
        "probability, or latest in the micro-batch).",
    )  # fmt: skip


LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRAConfig(Section):
    """Low-rank adapters on the policy's linear layers (docs/lora.md): the base model is frozen."""

    rank: int = Field(8, ge=1, description="The adapters' rank r (A is [r, in], B is [out, r]).")
    alpha: float = Field(16.0, gt=0, description="Scale numerator: an adapter adds alpha / rank * B A x to its layer's output.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on an adapter's input (training only); > 0 needs actor.parallel.tp=1.")
    target_modules: list[str] = Field(
        ["all-linear"], min_length=1,
        description="HF module names that get an adapter: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, "
        "or all-linear (every one of them); a plain string is a list of one. In a mixture-of-experts layer gate_proj, up_proj and down_proj adapt each "
        "expert (its own adapters; pushes then must be rollout.weight_sync.lora=merged).",
    )  # fmt: skip
    init: Literal["kaiming", "gaussian"] = Field(
        "kaiming", description="A's initialisation as peft's: kaiming (uniform, peft's default) or gaussian (std 1/rank); "
        "B starts at zero, so the first step's policy is the base model.",
    )  # fmt: skip

    @field_validator("target_modules", mode="before")
    @classmethod
    def _one_module(cls, value: Any) -> Any:
        """A plain string (``q_proj``, ``all-linear``), as peft's and verl's configs take it, is a one-element list."""
        return [value] if isinstance(value, str) else value

    @field_validator("target_modules")
    @classmethod
    def _known_modules(cls, value: list[str]) -> list[str]:
        unknown = [m for m in value if m not in (*LORA_MODULES, "all-linear")]
        if unknown:
            raise ValueError(f"{unknown} are not module names LoRA can target; use any of {', '.join(LORA_MODULES)} or all-linear")
        if len(set(value)) != len(value):
            raise ValueError(f"{value} names a module twice")
        return value

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def modules(self) -> tuple[str, ...]:
        """The targeted HF module names, all-linear expanded, in LORA_MODULES order."""
        return LORA_MODULES if "all-linear" in self.target_modules else tuple(m for m in LORA_MODULES if m in self.target_modules)


class ActorConfig(Section):
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="Model parallel layout.")
    micro_batch_size: int | None = Field(1, ge=1, description="Samples per micro-batch per DP rank (or use max_tokens_per_gpu).")
    max_tokens_per_gpu: int | None = Field(None, ge=1, description="Token budget of a micro-batch per DP rank; overrides micro_batch_size. Packed, it counts real tokens (samples are packed first-fit-decreasing); padded, rows x the longest row.")
    pack_sequences: bool = Field(True, description="Lay a micro-batch's samples end to end in one sequence (Megatron's THD format, attention kept within each sample) instead of padding each to the longest: no compute on padding. False = padded rows.")
    packed_attention: Literal["auto", "flex"] = Field(
        "auto",
        description="Attention of packed micro-batches under the local layer spec. auto: torch's varlen flash "
        "kernel on CUDA in bf16/fp16, else SDPA over groups of samples of similar length, each padded to its "
        "longest (exact; a long sample alone); flex: FlexAttention "
        "with a document mask (compiled; CUDA only, as torch has no FlexAttention backward on CPU).",
    )
    logprob_micro_batch_size: int | None = Field(
        None, ge=1, description="Samples per micro-batch per DP rank of the forward-only passes (old and reference log-probs, the "
        "weight push's log-prob check; the critic's values); None = as the update (micro_batch_size / max_tokens_per_gpu).",
    )
    logprob_max_tokens_per_gpu: int | None = Field(
        None, ge=1, description="Token budget of a forward-only pass's micro-batch per DP rank (as max_tokens_per_gpu); "
        "overrides logprob_micro_batch_size; None = as the update.",
    )
    mini_batch_size: int | None = Field(None, ge=1, description="Samples per optimizer step over all DP ranks; None = the whole step's samples.")
    ppo_epochs: int = Field(1, ge=1, description="Passes over the step's samples.")
    shuffle: bool = Field(
        False,
        description="Shuffle the step's samples before cutting mini-batches, each epoch its own permutation, seeded "
        "by trainer.seed and the step (a resumed run shuffles as an uninterrupted one); false = generation order.",
    )
    recompute: Literal["none", "selective", "full", "auto"] = Field(
        "none",
        description="Activation recomputation. auto: the least the plan's memory check fits (none, else full), "
        "resolved by megarl plan / launch and printed; none on CPU and in megarl sft.",
    )
    logprob_chunk_tokens: int = Field(1024, ge=1, description="Tokens whose LM-head logits exist at once when log-probs and entropy are computed (the head's memory is a few chunk x vocab/tp fp32 buffers, whatever the response length); the critic ignores it.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="Optimizer and LR schedule.")
    offload: bool = Field(False, description="Move params, grads and optimizer state to host memory while the engine generates (colocated).")
    moe: MoEConfig = Field(default_factory=MoEConfig, description="Mixture-of-experts training: routing replay, load balance, token drops.")
    lora: LoRAConfig | None = Field(
        None, description="Train low-rank adapters instead of the whole model (docs/lora.md); None = full fine-tuning. "
        "Setting any of its keys (actor.lora.rank=8) turns it on with the other keys' defaults; actor.lora={} turns it on with every default.",
    )  # fmt: skip


class ReferenceConfig(Section):
    enabled: bool | None = Field(None, description="Keep a frozen reference policy; None = derived from the algorithm (a KL term needs one).")
    offload: bool = Field(False, description="Keep the reference weights in host memory between uses.")


class CriticConfig(ActorConfig):
    enabled: bool | None = Field(None, description="Train a critic; None = derived from the estimator (gae needs one).")
    path: UserPath | None = Field(None, description="HF model (or model checkpoint of `megarl convert hf-to-megatron`) to initialise the critic backbone from; None = the policy's model.path. It reads the policy's token ids, so its tokenizer must be the policy's (checked before launch).")


class ClipConfig(Section):
    low: float = Field(0.2, ge=0, description="Lower clip ratio epsilon (ratio >= 1 - low).")
    high: float = Field(0.2, ge=0, description="Upper clip ratio epsilon (ratio <= 1 + high); DAPO clip-higher uses 0.28.")
    dual_c: float | None = Field(3.0, gt=1, description="Dual-clip bound for negative advantages; None disables.")
    value: float | None = Field(0.2, gt=0, description="Value-function clip range of the critic loss; None disables.")


class KLConfig(Section):
    use_in_reward: bool = Field(False, description="Subtract the reward coefficient x KL from the token rewards (verl's use_kl_in_reward).")
    use_in_loss: bool = Field(False, description="Add the loss coefficient x KL to the policy loss (verl's use_kl_loss).")
    estimator: KLEstimatorName = Field(
        "k3",
        description="KL estimator of both uses unless reward_estimator / loss_estimator say otherwise: k1, k2, k3 "
        "(low-variance KL), abs; verl's kl, mse, low_var_kl are read as k1, k2, k3. A trailing + (k1+, k3+, abs+; "
        "verl's kl+, low_var_kl+) is verl's straight-through variant: the estimator's value, k2's gradient.",
    )
    coef: float = Field(0.001, ge=0, description="KL coefficient of both uses unless reward_coef / loss_coef say otherwise (the reward's is the adaptive controller's initial value).")
    reward_estimator: KLEstimatorName | None = Field(None, description="Estimator of the KL penalty in the reward (verl's algorithm.kl_penalty); None = estimator.")
    reward_coef: float | None = Field(None, ge=0, description="Coefficient of the KL penalty in the reward, the adaptive controller's initial value (verl's algorithm.kl_ctrl.kl_coef); None = coef.")
    loss_estimator: KLEstimatorName | None = Field(None, description="Estimator of the KL term in the policy loss (verl's actor.kl_loss_type); None = estimator.")
    loss_coef: float | None = Field(None, ge=0, description="Coefficient of the KL term in the policy loss (verl's actor.kl_loss_coef); None = coef.")
    controller: Literal["fixed", "adaptive"] = Field("fixed", description="Keep the reward's coefficient fixed or adapt it towards target.")
    target: float = Field(0.01, gt=0, description="Target KL of the adaptive controller.")
    horizon: int = Field(10000, ge=1, description="Horizon of the adaptive controller.")

    @field_validator("estimator", "reward_estimator", "loss_estimator", mode="before")
    @classmethod
    def _verl_estimator_names(cls, value: object) -> object:
        """verl's names for the same estimators; its ``full`` is refused with the reason."""
        if value == "full":
            raise ValueError(
                "full (the whole-vocabulary KL) needs both models' distributions over the vocabulary at every "
                "token, and megarl's log-prob pass keeps only the sampled token's log-prob (verl does not "
                "implement it either); use k3 (low_var_kl), k1 (kl), k2 (mse) or abs"
            )
        return KL_ESTIMATOR_ALIASES.get(value, value) if isinstance(value, str) else value

    @property
    def enabled(self) -> bool:
        return self.use_in_reward or self.use_in_loss

    @property
    def reward_kl_estimator(self) -> str:
        """The estimator of the KL penalty in the reward."""
        return self.reward_estimator or self.estimator

    @property
    def reward_kl_coef(self) -> float:
        """The (initial) coefficient of the KL penalty in the reward."""
        return self.coef if self.reward_coef is None else self.reward_coef

    @property
    def loss_kl_estimator(self) -> str:
        """The estimator of the KL term in the policy loss (and of the actor/kl metric)."""
        return self.loss_estimator or self.estimator

    @property
    def loss_kl_coef(self) -> float:
        """The coefficient of the KL term in the policy loss."""
        return self.coef if self.loss_coef is None else self.loss_coef


class TISConfig(Section):
    level: Literal["none", "token", "sequence"] = Field("none", description="Truncated importance sampling against the engine's log-probs.")
    cap: float = Field(2.0, gt=0, description="Cap of the importance weight.")


class MISConfig(Section):
    level: Literal["none", "token", "sequence", "geometric"] = Field(
        "none",
        description="Masked importance sampling against the engine's log-probs: drop from the policy-gradient loss each token "
        "(token), or each whole sequence (sequence: product of its token ratios; geometric: their geometric mean), whose ratio "
        "pi_train / pi_rollout falls outside [low, high]. Composes with tis (tis truncates, mis masks). Masked tokens add 0 "
        "to the loss but still count in its normaliser.",
    )
    low: float = Field(0.5, gt=0, description="Smallest kept ratio pi_train / pi_rollout.")
    high: float = Field(2.0, gt=0, description="Largest kept ratio pi_train / pi_rollout; must exceed low.")

    @model_validator(mode="after")
    def _low_below_high(self) -> MISConfig:
        if self.low >= self.high:
            raise ValueError(f"algorithm.mis.low ({self.low}) must be below algorithm.mis.high ({self.high})")
        return self


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
    mis: MISConfig = Field(default_factory=MISConfig, description="Train/inference mismatch masking (composes with tis).")
    old_logprobs: Literal["recompute", "engine"] = Field(
        "recompute",
        description="The PPO ratio's old log-probs: recompute (the trainer's forward before the update; skipped when a "
        "synchronous step is strictly on-policy) or engine (the rollout engine's own log-probs of the sampled tokens, "
        "no forward: the ratio is pi_theta / pi_behaviour, docs/async.md).",
    )
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig, description="DAPO dynamic sampling.")
    overlong: OverlongConfig = Field(default_factory=OverlongConfig, description="DAPO overlong reward shaping.")

    @field_validator("estimator")
    @classmethod
    def _estimator(cls, value: str) -> str:
        return builtin_or_import_path(value, ESTIMATORS, "estimator")

    @field_validator("policy_loss")
    @classmethod
    def _policy_loss(cls, value: str) -> str:
        return builtin_or_import_path(value, POLICY_LOSSES, "policy_loss")


class CustomRewardConfig(Section):
    path: UserPath = Field(description="Python file defining the reward function.")
    name: str = Field("compute_score", description="Function name in that file.")
    batched: bool = Field(False, description="The function takes lists and returns a list (verl's batch reward).")


class RewardConfig(Section):
    functions: dict[str, str] = Field(default_factory=dict, description="data_source -> built-in scorer name (gsm8k, math, code, qa_em, ...) or "
                                     "your own function as path/to/file.py:function (verl's signature); an unlisted source uses its "
                                     "known dataset's scorer (openai/gsm8k -> gsm8k, docs/rewards.md), else its own name.")
    format_score: float = Field(
        0.0, description="What a formatted but wrong answer scores with the scorers that check a format: gsm8k and "
        "gsm8k_flexible (an answer was extracted), qa_em (an <answer> tag); verl's format_score.",
    )
    num_examine: int = Field(
        0, ge=0, description="Log this many scored samples (prompt, response, ground truth, score) of each data source "
        "per scoring call (a training step, a validation pass) to the driver's log (verl's num_examine); 0 = none.",
    )
    custom: CustomRewardConfig | None = Field(None, description="A user reward function (verl signature) used for every sample.")
    model: RewardModelConfig | None = Field(
        None, description="An HF reward model: every sample's score, or with reward.combine the component 'model'.")
    judge: RewardJudgeConfig | None = Field(None, description="An LLM judge: the component 'judge' of reward.combine (docs/reward-models.md).")
    combine: dict[str, dict[str, float]] = Field(
        default_factory=dict, description="data_source -> {component: weight}: the score is the weighted sum of the "
        "components, each a built-in rule scorer's name, 'custom' (reward.custom), 'model' (reward.model) or 'judge' "
        "(reward.judge); each is logged as reward/<component>. An unlisted data source is scored as without it.",
    )
    timeout_s: float = Field(10.0, gt=0, description="Per-sample scoring timeout; a timeout scores 0 and is counted.")
    workers: int = Field(2, ge=1, description="Reward worker processes.")
    max_failed_fraction: float = Field(
        1.0, gt=0, le=1,
        description="Stop the run (with the first failure's traceback) when reward functions raise or time out on at "
        "least this fraction of a step's samples; 1.0 = only when every sample failed.",
    )

    @field_validator("combine", mode="before")
    @classmethod
    def _combine_numbers(cls, value: Any) -> Any:
        return combine_numbers(value)

    @field_validator("combine")
    @classmethod
    def _combine(cls, value: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        return combine_weights(value)

    @model_validator(mode="after")
    def _combined_components(self) -> RewardConfig:
        problem = combine_problem(self.combine, self.model is not None, self.judge is not None)
        if problem:
            raise ValueError(problem)
        return self


MetricSink = Literal["console", "jsonl", "tensorboard", "wandb", "mlflow", "swanlab"]


def _default_loggers() -> list[MetricSink]:  # (a lambda's list would be a list[str] to mypy)
    return ["console", "jsonl", "tensorboard"]


class TrainerConfig(Section):
    total_steps: int | None = Field(None, ge=1, description="RL steps to run (or set total_epochs).")
    total_epochs: int | None = Field(None, ge=1, description="Passes over the training prompts (used when total_steps is None).")
    save_freq: int = Field(0, ge=0, description="Checkpoint every N steps (and at the end); 0 = at the end only.")
    eval_freq: int = Field(0, ge=0, description="Validate every N steps; 0 disables periodic validation.")
    eval_before_train: bool = Field(False, description="Validate once before the first step.")
    val_only: bool = Field(False, description="Only validate, then exit.")
    critic_warmup_steps: int = Field(0, ge=0, description="Steps where only the critic trains (PPO): the actor trains from step N+1 (verl's trainer.critic_warmup=N trains it from step N).")
    output_dir: UserPath = Field("outputs/run", min_length=1, description="Checkpoints, metrics.jsonl, TensorBoard logs and samples go here.")
    resume: Literal["auto", "disable"] | UserPath = Field("auto", description="auto (latest valid checkpoint in output_dir), disable, or a checkpoint path.")
    keep_last: int = Field(3, ge=1, description="Checkpoints kept on disk.")
    loggers: list[MetricSink] = Field(
        default_factory=_default_loggers,
        description="Metric sinks: console, jsonl, tensorboard, wandb, mlflow, swanlab (pip install swanlab; its mode, e.g. "
        "SWANLAB_MODE=offline, is SwanLab's own setting).",
    )
    project: str = Field("megarl", description="Project name for W&B / MLflow / SwanLab.")
    experiment: str = Field("run", description="Run name for W&B / MLflow / SwanLab.")
    seed: int = Field(1, description="Run seed; per-rank and per-sample seeds derive from it.")
    profile_steps: list[int] = Field(default_factory=list, description="Steps to trace with the torch profiler.")
    val_samples_logged: int = Field(4, ge=0, description="Validation generations written to output_dir/samples per eval.")
    rollout_data_dir: UserPath | None = Field(
        None,
        description="Write every training step's samples to <dir>/<step>.jsonl, one line per sample: input, output, "
        "gts, score, step, data_source, advantage (the mean over the response's tokens), response_length, "
        "finish_reason (verl's dump); written beside the run, in a thread of its own. A relative path is relative to the "
        "directory megarl is launched from, as trainer.output_dir is. None (or '', as for other optional paths) = not written.",
    )
    checkpoint_on_signal: bool = Field(
        True, description="On Ctrl-C / SIGTERM (Slurm preemption), finish the step and save a checkpoint before stopping.",
    )
    hang_timeout_s: float = Field(
        3600.0, ge=0,
        description="Stop the run when no phase of a step makes progress for this long, after every rank wrote its "
        "Python stacks to its log; 0 disables the watchdog.",
    )

    @field_validator("rollout_data_dir", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        """'' (an empty ``trainer.rollout_data_dir=``, a YAML ''), read as unset the way every optional path key's
        is, is None here, so the resolved config and `megarl config` say the samples are not written."""
        return None if value == "" else value


class SFTConfig(Section):
    train_files: list[UserPath] = Field(
        default_factory=list,
        description="Parquet files of `megarl sft`: prompt + response columns (sft.prompt_key, sft.response_key), or chat "
        "conversations (sft.messages_key).",
    )
    val_files: list[UserPath] = Field(default_factory=list, description="Held-out parquet files: the loss on them is logged as sft/val_loss.")
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
    batch_size: int = Field(64, ge=1, description="Sequences per optimizer step, over all data-parallel ranks (a multiple of the DP size, at most the training rows).")
    total_steps: int | None = Field(None, ge=1, description="Optimizer steps; None = sft.epochs passes over the training rows.")
    epochs: int = Field(1, ge=1, description="Passes over the training rows when total_steps is None: every row is seen once a pass (a pass's last step is filled from the next one's rows).")
    eval_freq: int = Field(0, ge=0, description="Held-out loss every N steps (and always after the last); 0 = after the last only.")
    output_dir: UserPath = Field(
        "outputs/sft",
        min_length=1,
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
    def reference_model(self) -> bool:
        """A separate frozen reference model is built: with LoRA the reference is the policy with its
        adapters off (docs/lora.md)."""
        return self.reference_enabled and self.actor.lora is None

    @property
    def reference_beside_policy(self) -> bool:
        """The reference can run micro-batch by micro-batch on the policy's micro-batches, in the
        policy's pass: one pipeline stage runs the whole model (pp 1), the reference is a model of
        its own that stays on the device (no LoRA reference, no reference.offload) and no router
        replays the engine's routing."""
        a = self.actor
        return self.reference_model and a.parallel.pp == 1 and not self.reference.offload and a.moe.routing_replay == "none"

    @property
    def reference_in_update(self) -> bool:
        """The reference log-probs are computed inside the policy update, on the very micro-batches
        the policy trains on (one packing, one call to the ranks, no pass of their own): where
        :attr:`reference_beside_policy`, only the loss reads them (not algorithm.kl.use_in_reward)
        and each sample passes the update once (ppo_epochs 1)."""
        kl = self.algorithm.kl
        return self.reference_beside_policy and kl.use_in_loss and not kl.use_in_reward and self.actor.ppo_epochs == 1

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
        if self.rollout.engine == "torch":  # asynchronous: the engine is a process of its own
            return "disk" if self.asynchronous else "in_process"
        return "tensor" if self.cluster.placement == "colocated" else "distributed"

    @property
    def asynchronous(self) -> bool:
        """Generation overlaps training (``rollout.max_staleness`` >= 1, docs/async.md)."""
        return self.rollout.max_staleness >= 1

    @property
    def partial_rollouts(self) -> bool:
        """A push pauses the requests in flight and continues them under the new weights."""
        return self.rollout.partial if self.rollout.partial is not None else self.asynchronous

    @property
    def weight_disk_dir(self) -> str:
        return self.rollout.weight_sync.disk_dir or f"{self.trainer.output_dir}/weights"

    @property
    def samples_per_step(self) -> int:
        return self.data.prompts_per_step * self.rollout.n
