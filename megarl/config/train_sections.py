"""The training sections of the key tree of megarl/config/sections.py: a trained model's
parallel layout, optimizer, mixture-of-experts and LoRA settings (``actor``, ``critic``,
``reference``). Torch-free, like every config module.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from megarl.config.section_base import Section, UserPath


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
