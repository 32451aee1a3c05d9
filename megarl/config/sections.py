"""Typed configuration: one pydantic model per component (the key tree in docs/configuration.md).

Every model forbids unknown keys and is frozen: the config is read once, checked by the planner
(megarl/plan/planner.py) before anything starts, and never mutated at run time. This module
imports neither torch nor megatron so that `megarl plan` stays fast.
"""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from megarl.config.algorithm_sections import (
    ESTIMATORS,
    GROUP_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGGS,
    POLICY_LOSSES,
    AlgorithmConfig,
    ClipConfig,
    DynamicSamplingConfig,
    KLConfig,
    MISConfig,
    OverlongConfig,
    TISConfig,
)
from megarl.config.architectures import BUILTIN_ARCHS
from megarl.config.reward_sections import (
    RewardJudgeConfig,
    RewardModelConfig,
    combine_numbers,
    combine_problem,
    combine_weights,
)
from megarl.config.rollout_sections import (
    AgentConfig,
    RolloutConfig,
    SamplingConfig,
    ValSamplingConfig,
    WeightSyncConfig,
)
from megarl.config.section_base import Section, UserPath
from megarl.config.train_sections import (
    LORA_MODULES,
    ActorConfig,
    CriticConfig,
    LoRAConfig,
    MoEConfig,
    OptimizerConfig,
    ParallelConfig,
    ReferenceConfig,
)

# The key tree's sections, this module's and those defined beside it (train_sections.py,
# algorithm_sections.py, reward_sections.py, rollout_sections.py): all importable from here, as
# user extensions annotate with them (docs/extending.md).
__all__ = [
    "ActorConfig",
    "AgentConfig",
    "AlgorithmConfig",
    "BUILD_TIMEOUT_S",
    "ClipConfig",
    "ClusterConfig",
    "CriticConfig",
    "CustomDatasetConfig",
    "CustomRewardConfig",
    "DataConfig",
    "DataFile",
    "DynamicSamplingConfig",
    "ESTIMATORS",
    "GROUP_ESTIMATORS",
    "KLConfig",
    "KL_ESTIMATORS",
    "LORA_MODULES",
    "LOSS_AGGS",
    "LoRAConfig",
    "MISConfig",
    "MegaRLConfig",
    "MoEConfig",
    "ModelConfig",
    "OptimizerConfig",
    "OverlongConfig",
    "POLICY_LOSSES",
    "ParallelConfig",
    "ROLE_SECTIONS",
    "ReferenceConfig",
    "RewardConfig",
    "RewardJudgeConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "SFTConfig",
    "SamplingConfig",
    "TEMPLATE_ARGUMENTS",
    "TISConfig",
    "TrainerConfig",
    "ValSamplingConfig",
    "WeightSyncConfig",
]


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
    output_log_max_mb: float = Field(
        100.0, ge=0, description="Cap, in MB, of each log your code's prints go to (logs/reward_workers.log, "
        "logs/user_code.log, evaluate's and generate's logs beside their output): past it the rest is dropped, with a "
        "marker line in the log and one warning; 0 = no cap.",
    )
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
    def strictly_on_policy(self) -> bool:
        """One epoch, one optimizer step per RL step, no KL-in-reward, synchronous: the update's
        own forward gives the old log-probs (the ratio starts at exactly 1), so no separate
        forward is needed. Asynchronous samples come from older policies: their proximal
        log-probs are recomputed, unless algorithm.old_logprobs=engine takes the behaviour
        policy's (docs/async.md)."""
        one_step = (self.actor.mini_batch_size or self.samples_per_step) == self.samples_per_step
        return self.actor.ppo_epochs == 1 and one_step and not self.algorithm.kl.use_in_reward and not self.asynchronous

    @property
    def reference_with_old_logprobs(self) -> bool:
        """The old log-probs' pass computes the reference's too, micro-batch by micro-batch (one
        packing, one call to the ranks): both are needed and the update does not compute them."""
        needs_old = self.algorithm.old_logprobs == "recompute" and not self.strictly_on_policy
        return self.reference_enabled and needs_old and self.reference_beside_policy and not self.reference_in_update

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
