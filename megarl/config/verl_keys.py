"""verl's config keys and what each becomes in megarl: the one mapping behind `megarl config
--from-verl`, the refusal of a verl key given to megarl (megarl/config/loading.py), and the
tables of docs/migrating-from-verl.md (megarl/config/verl_doc.py writes them; a test compares).

A rule names a verl key (or a pattern of them, ``*`` for any part), verl's default, and either the
megarl keys it sets with a converter, or why megarl has none. Converters read the whole verl run
(a ``Verl`` view: the keys given over verl's defaults; megarl/config/verl_values.py holds them),
because units differ: verl's
``ppo_mini_batch_size`` counts prompts where megarl's ``actor.mini_batch_size`` counts samples
(prompts x rollout.n), and a key may only mean something beside another (``kl_loss_coef`` only
with ``use_kl_loss``). Torch-free, like every config module.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

from megarl.config.verl_correction import (
    bypass_mode,
    correction_loss_type,
    rollout_is,
    rollout_is_batch_normalize,
    rollout_is_threshold,
    rollout_rs,
    rollout_rs_threshold,
)
from megarl.config.verl_values import (
    ACTOR,
    FSDP_ONLY,
    MODEL,
    NONE,
    NOT_YET,
    PLACEHOLDER_MODEL,
    REF,
    ROLLOUT,
    VLLM_ONLY,
    Convert,
    agent_loop,
    clip,
    critic,
    critic_path,
    critic_warmup,
    custom_cls,
    custom_cls_name,
    custom_cls_path,
    custom_path,
    default_ckpt,
    default_critic_mini,
    default_critic_shuffle,
    default_output_dir,
    default_prompt,
    default_response,
    device,
    dict_entries,
    differs,
    do_sample,
    dynamic,
    dynamic_flag,
    engine,
    engine_arg,
    ep_rollout,
    estimator,
    filter_rounds,
    global_micro,
    granularity,
    is_true,
    keep,
    kl_estimator,
    loggers,
    logprob_dynamic_flag,
    logprob_size,
    lora,
    lora_rank,
    loss_agg,
    loss_mode,
    mcore_modules,
    min_lr,
    min_lr_ratio,
    model_path,
    needs,
    null_is_one,
    offload,
    output_dir,
    overlong,
    overlong_enable,
    prompts_to_samples,
    recompute,
    resume,
    resume_path,
    reward_custom,
    reward_manager,
    reward_model,
    reward_model_enable,
    rollout_tp,
    router_replay,
    same,
    same_wrap,
    schedule,
    sequence_parallel,
    steps,
    target_modules,
    top_k,
    total_epochs,
    truncation,
    val_greedy,
    val_sampling,
    warmup_ratio,
    warmup_steps,
)


@dataclass(frozen=True)
class Rule:
    verl: str  # a dotted verl key, or a pattern (fnmatch: * spans dots)
    megarl: tuple[str, ...] = ()  # the megarl keys it sets; () = none (``reason`` says why)
    convert: Convert | None = None  # None: the value as it is
    default: Any = None  # verl's default (a function of the run for an interpolated one); None: none applied
    reason: str = ""  # no equivalent: why; else a note on the conversion
    group: str = NONE  # FSDP_ONLY, VLLM_ONLY, NOT_YET or NONE (for a key without equivalent)
    show_default: bool = False  # the default's row is shown even when megarl's default means the same

    def megarl_keys(self, key: str) -> tuple[str, ...]:
        """The megarl keys ``key`` sets: a megarl key ending in ``*`` takes what the verl pattern's
        trailing ``*`` matched (``engine_kwargs.sglang.*`` -> ``rollout.engine_kwargs.*``)."""
        star = key[len(self.verl) - 1:] if self.verl.endswith("*") else ""
        return tuple(k[:-1] + star if k.endswith("*") else k for k in self.megarl)

    @property
    def doc_default(self) -> str:
        if callable(self.default):
            return getattr(self.default, "__doc__", None) or "derived"
        return "" if self.default is None else str(self.default)


def _parallel_rules(engine: str, section: str) -> list[Rule]:
    """A Megatron layout group (actor's or critic's) -> megarl's {section}.parallel."""
    wrap = critic if section == "critic" else same_wrap
    keys = (f"{engine}.param_offload", f"{engine}.grad_offload", f"{engine}.optimizer_offload")
    return [
        Rule(f"{engine}.tensor_model_parallel_size", (f"{section}.parallel.tp",), wrap(same)),
        Rule(f"{engine}.pipeline_model_parallel_size", (f"{section}.parallel.pp",), wrap(same)),
        Rule(f"{engine}.virtual_pipeline_model_parallel_size", (f"{section}.parallel.vpp",), wrap(null_is_one)),
        Rule(f"{engine}.context_parallel_size", (f"{section}.parallel.cp",), wrap(same)),
        Rule(f"{engine}.expert_model_parallel_size", (f"{section}.parallel.ep",), wrap(same)),
        Rule(f"{engine}.expert_tensor_parallel_size", (f"{section}.parallel.etp",), wrap(null_is_one)),
        Rule(f"{engine}.sequence_parallel", (f"{section}.parallel.sequence_parallel",), wrap(sequence_parallel)),
        Rule(f"{engine}.use_distributed_optimizer", (f"{section}.optimizer.distributed",), wrap(same)),
        *[Rule(k, (f"{section}.offload",), wrap(offload(keys)), reason="megarl offloads params, grads and "
               "optimizer state together, while the engines generate") for k in keys],  # fmt: skip
        Rule(f"{engine}.override_transformer_config.recompute_granularity", (f"{section}.recompute",), wrap(granularity)),
        Rule(f"{engine}.dtype", ("model.dtype",) if section == "actor" else (), wrap(same),
             reason="" if section == "actor" else "the critic takes model.dtype"),
    ]


def _optim_rules(actor: str, section: str) -> list[Rule]:
    """An optim group (verl's FSDP and Megatron names) -> megarl's {section}.optimizer."""
    wrap = critic if section == "critic" else same_wrap
    lr = 1e-5 if section == "critic" else 1e-6
    opt = f"{section}.optimizer"
    return [
        Rule(f"{actor}.optim.lr", (f"{opt}.lr",), wrap(same), default=lr),
        Rule(f"{actor}.optim.weight_decay", (f"{opt}.weight_decay",), wrap(same), default=0.01),
        Rule(f"{actor}.optim.lr_warmup_steps", (f"{opt}.warmup_steps",),
             wrap(lambda x, v: warmup_steps(x, v, actor)), default=-1,
             reason="verl's scheduler steps once per RL step, megarl's once per optimizer step: x mini-batches x ppo_epochs"),
        Rule(f"{actor}.optim.lr_warmup_steps_ratio", (f"{opt}.warmup_ratio",), wrap(warmup_ratio(actor)), default=0.0,
             reason="of the run's steps in both (verl's RL steps, megarl's optimizer steps: the same fraction); used "
             "when lr_warmup_steps is null or <= 0"),
        Rule(f"{actor}.optim.warmup_style", (f"{opt}.schedule",), wrap(schedule),
             reason="wsd: megarl's wsd_decay_ratio 0.1 is verl's stable ratio 0.9"),
        Rule(f"{actor}.optim.lr_scheduler_type", (f"{opt}.schedule",), wrap(schedule),
             reason="wsd: megarl's wsd_decay_ratio 0.1 is verl's stable ratio 0.9"),
        Rule(f"{actor}.optim.lr_decay_style", (f"{opt}.schedule",), wrap(schedule)),
        Rule(f"{actor}.optim.min_lr_ratio", (f"{opt}.min_lr_ratio",), wrap(min_lr_ratio), reason="x optim.lr in both"),
        Rule(f"{actor}.optim.min_lr", (f"{opt}.min_lr",), wrap(min_lr(actor))),
        Rule(f"{actor}.optim.betas", (f"{opt}.betas",), wrap(lambda x, v: tuple(x))),
        Rule(f"{actor}.optim.clip_grad", (f"{opt}.clip_grad",), wrap(same)),
        Rule(f"{actor}.grad_clip", (f"{opt}.clip_grad",), wrap(same)),
        Rule(f"{actor}.optim.total_training_steps", reason="verl fills it in from trainer.total_training_steps"),
        Rule(f"{actor}.optim.num_cycles", reason="megarl's cosine decays once, from the peak to min_lr"),
        Rule(f"{actor}.optim.optimizer", reason="megarl trains with Adam (AdamW's decoupled weight decay)"),
        Rule(f"{actor}.optim.lr_decay_steps", reason="megarl decays over the run's optimizer steps"),
        Rule(f"{actor}.optim.lr_warmup_init", reason="megarl's warm-up starts from 0"),
        Rule(f"{actor}.optim.*", reason="megarl's optimizer keys are those of `megarl config actor.optimizer`", group=NOT_YET),
    ]


def _batch_rules(actor: str, section: str) -> list[Rule]:
    """Mini- and micro-batches, epochs, dynamic batch sizes of the actor or the critic."""
    wrap = critic if section == "critic" else same_wrap
    flag = f"{actor}.use_dynamic_bsz"
    return [
        Rule(f"{actor}.ppo_mini_batch_size", (f"{section}.mini_batch_size",), wrap(prompts_to_samples),
             default=default_critic_mini if section == "critic" else 256, reason="prompts x rollout.n: megarl counts samples"),
        Rule(f"{actor}.ppo_micro_batch_size_per_gpu", (f"{section}.micro_batch_size",), wrap(same),
             reason="per GPU in verl, per DP rank (tp x pp GPUs) in megarl"),
        Rule(f"{actor}.ppo_micro_batch_size", (f"{section}.micro_batch_size",), wrap(global_micro),
             reason="verl's global micro-batch / its data-parallel ranks"),
        Rule(flag, (f"{section}.max_tokens_per_gpu",), wrap(dynamic_flag(actor, section))),
        Rule(f"{actor}.ppo_max_token_len_per_gpu", (f"{section}.max_tokens_per_gpu",),
             wrap(lambda x, v: dynamic(x, v, flag))),
        Rule(f"{actor}.ppo_epochs", (f"{section}.ppo_epochs",), wrap(same), default=1),
        Rule(f"{actor}.shuffle", (f"{section}.shuffle",), wrap(is_true),
             default=default_critic_shuffle if section == "critic" else False,
             reason="the step's samples shuffled before mini-batches are cut, seeded by trainer.seed and the step"),
        *([Rule(f"{actor}.forward_micro_batch_size_per_gpu", (f"{section}.logprob_micro_batch_size",), wrap(same),
                reason="the values pass; per GPU in verl, per DP rank (tp x pp GPUs) in megarl"),
           Rule(f"{actor}.forward_micro_batch_size", (f"{section}.logprob_micro_batch_size",), wrap(global_micro),
                reason="the values pass; verl's global micro-batch / its data-parallel ranks"),
           Rule(f"{actor}.forward_max_token_len_per_gpu", (f"{section}.logprob_max_tokens_per_gpu",),
                wrap(lambda x, v: dynamic(x, v, flag)), reason="the values pass")] if section == "critic" else [
           Rule(f"{actor}.forward_micro_batch_size*", reason="megarl's log-prob passes take actor.logprob_micro_batch_size"),
           Rule(f"{actor}.forward_max_token_len_per_gpu", reason="megarl's log-prob passes take actor.logprob_max_tokens_per_gpu")]),
        Rule(f"{actor}.ulysses_sequence_parallel_size", reason="Ulysses sequence parallelism (megarl's context "
             "parallelism, actor.parallel.cp, is not supported yet)", group=FSDP_ONLY),  # fmt: skip
    ]


def _model_rules(model: str, section: str) -> list[Rule]:
    wrap = critic if section == "critic" else same_wrap
    return [
        Rule(f"{model}.enable_gradient_checkpointing", (f"{section}.recompute",), wrap(recompute),
             default=True if section == "actor" else default_ckpt),
        Rule(f"{model}.use_remove_padding", (f"{section}.pack_sequences",), wrap(same)),
        Rule(f"{model}.enable_activation_offload", reason="activations stay on the GPU (actor.recompute saves their memory)", group=FSDP_ONLY),
        Rule(f"{model}.use_liger", reason="Liger kernels", group=FSDP_ONLY),
        Rule(f"{model}.use_fused_kernels", reason="verl's fused kernels for HF models", group=FSDP_ONLY),
        Rule(f"{model}.fused_kernel_options.*", reason="verl's fused kernels for HF models", group=FSDP_ONLY),
        Rule(f"{model}.use_shm", reason="megarl reads model.path where it is"),
        Rule(f"{model}.external_lib", reason="megarl builds llama, qwen2, qwen3 and qwen3_moe models itself", group=NOT_YET),
        Rule(f"{model}.override_config*", reason="megarl reads the model's config.json as it is", group=NOT_YET),
        Rule(f"{model}.trust_remote_code", reason="megarl builds the model itself; no remote code runs"),
        Rule(f"{model}.tokenizer_path", reason="the critic reads the policy's tokenizer (checked before launch)"),
    ]


def _logprob_rules(prefix: str) -> list[Rule]:
    """The log-prob micro-batching of verl's rollout (old log-probs) or ref (reference log-probs) pass."""
    per_gpu = "per GPU in verl, per DP rank (tp x pp GPUs) in megarl; one setting for both log-prob passes"
    return [
        Rule(f"{prefix}.log_prob_micro_batch_size_per_gpu", ("actor.logprob_micro_batch_size",),
             logprob_size(prefix, tokens=False), reason=per_gpu),
        Rule(f"{prefix}.log_prob_micro_batch_size", ("actor.logprob_micro_batch_size",), logprob_size(prefix, tokens=False),
             reason="verl's global micro-batch / its data-parallel ranks; one setting for both log-prob passes"),
        Rule(f"{prefix}.log_prob_use_dynamic_bsz", ("actor.logprob_max_tokens_per_gpu",), logprob_dynamic_flag(prefix)),
        Rule(f"{prefix}.log_prob_max_token_len_per_gpu", ("actor.logprob_max_tokens_per_gpu",),
             logprob_size(prefix, tokens=True), reason=per_gpu),
    ]


def _data_rules() -> list[Rule]:
    """verl's keys of data."""
    return [
        Rule("data.train_files", ("data.train_files",), target_modules, default="~/data/rlhf/gsm8k/train.parquet"),
        Rule("data.val_files", ("data.val_files",), target_modules, default="~/data/rlhf/gsm8k/test.parquet"),
        Rule("data.prompt_key", ("data.prompt_key",)),
        Rule("data.train_batch_size", ("data.prompts_per_step",), default=1024, reason="prompts per step in both"),
        Rule("data.max_prompt_length", ("data.max_prompt_length",), default=512),
        Rule("data.max_response_length", ("rollout.sampling.max_new_tokens",), default=512),
        Rule("data.filter_overlong_prompts", ("data.filter_overlong_prompts",), default=False),
        Rule("data.truncation", ("data.truncation",), truncation),
        Rule("data.shuffle", ("data.shuffle",)),
        Rule("data.seed", ("data.seed",), lambda x, v: int(x) if x is not None else 1),
        Rule("data.val_batch_size", reason="megarl validates the whole val set per eval"),
        Rule("data.gen_batch_size", reason="megarl's dynamic sampling generates further rounds of data.prompts_per_step"),
        Rule("data.return_raw_chat", reason="megarl keeps each prompt's messages"),
        Rule("data.return_raw_input_ids", reason="megarl keeps each prompt's messages"),
        Rule("data.return_full_prompt", reason="megarl keeps each prompt's messages"),
        Rule("data.tokenizer", reason="megarl reads the model's tokenizer (model.path)"),
        Rule("data.use_shm", reason="megarl reads the data files where they are"),
        Rule("data.reward_fn_key", ("data.reward_fn_key",), reason="the column that picks each row's reward function"),
        Rule("data.dataloader_num_workers", reason="megarl's prompt stream reads the files itself"),
        Rule("data.filter_overlong_prompts_workers", reason="megarl's prompt stream reads the files itself"),
        Rule("data.validation_shuffle", reason="megarl validates in file order"),
        Rule("data.train_max_samples", reason="megarl reads every row (`megarl data` makes a subset)", group=NOT_YET),
        Rule("data.val_max_samples", reason="megarl reads every row (`megarl data` makes a subset)", group=NOT_YET),
        Rule("data.apply_chat_template_kwargs", ("data.apply_chat_template_kwargs",),
             reason="apply_chat_template's keyword arguments for every prompt, e.g. {enable_thinking: false}"),
        Rule("data.apply_chat_template_kwargs.*", ("data.apply_chat_template_kwargs.*",),
             reason="an apply_chat_template keyword argument for every prompt"),
        Rule("data.trust_remote_code", reason="megarl reads the tokenizer without remote code"),
        Rule("data.tool_config_path", reason="megarl's tool file is rollout.agent.tools_file (from multi_turn.tool_config_path)"),
        Rule("data.image_key", reason="multimodal data", group=NOT_YET),
        Rule("data.video_key", reason="multimodal data", group=NOT_YET),
        Rule("data.image_patch_size", reason="multimodal data", group=NOT_YET),
        Rule("data.return_multi_modal_inputs", reason="multimodal data", group=NOT_YET),
        Rule("data.custom_cls", ("data.custom_cls",), custom_cls, reason="your dataset class, built as verl builds it"),
        Rule("data.custom_cls.path", ("data.custom_cls.path",), custom_cls_path,
             reason="the file of your dataset class, built as verl builds it"),
        Rule("data.custom_cls.name", ("data.custom_cls.name",), custom_cls_name, reason="your dataset class's name"),
        Rule("data.sampler.*", reason="megarl samples with its own seeded, weighted sampler (data.train_files weights)", group=NOT_YET),
        Rule("data.datagen.*", reason="megarl's prompts are fixed files", group=NOT_YET),
    ]


def _policy_model_rules() -> list[Rule]:
    """verl's keys of the policy model."""
    return [
        Rule(f"{MODEL}.path", ("model.path", "model.arch"), model_path,
             default=PLACEHOLDER_MODEL, show_default=True,
             reason="a hub id or a directory named after a built-in architecture also sets model.arch, so megarl plan "
             "runs without the weights; any other path sets model.path alone; launch needs the weights in a local directory"),
        Rule(f"{MODEL}.lora_rank", ("actor.lora.rank",), lora_rank),
        Rule(f"{MODEL}.lora_alpha", ("actor.lora.alpha",), lora(lambda x, v: float(x))),
        Rule(f"{MODEL}.target_modules", ("actor.lora.target_modules",), lora(target_modules)),
        Rule(f"{MODEL}.exclude_modules", reason="megarl's LoRA targets modules by name (actor.lora.target_modules)", group=NOT_YET),
        Rule(f"{MODEL}.lora_adapter_path", convert=differs("megarl's LoRA starts from fresh adapters, not this adapter"),
             reason="megarl's LoRA starts from fresh adapters", group=NOT_YET),
        Rule(f"{MODEL}.use_dora", convert=differs("megarl's LoRA is plain LoRA, not DoRA"), reason="DoRA", group=NOT_YET),
        Rule(f"{MODEL}.custom_chat_template", reason="megarl renders the tokenizer's own chat template", group=NOT_YET),
        Rule(f"{MODEL}.lora.rank", ("actor.lora.rank",), lora_rank, reason="verl's Megatron LoRA"),
        Rule(f"{MODEL}.lora.alpha", ("actor.lora.alpha",), lora(lambda x, v: float(x), f"{MODEL}.lora.rank"),
             default=32, reason="verl's Megatron LoRA default alpha is 32 (megarl's is 16)"),
        Rule(f"{MODEL}.lora.dropout", ("actor.lora.dropout",), lora(lambda x, v: float(x), f"{MODEL}.lora.rank")),
        Rule(f"{MODEL}.lora.target_modules", ("actor.lora.target_modules",), lora(mcore_modules, f"{MODEL}.lora.rank"),
             reason="Megatron's module names as HF's: linear_qkv = q_proj, k_proj, v_proj; linear_fc1 = gate_proj, up_proj"),
        Rule(f"{MODEL}.lora.*", reason="megarl's LoRA keys are those of `megarl config actor.lora`", group=NOT_YET),
        Rule(f"{MODEL}.hf_config_path", reason="megarl reads config.json from model.path"),
        Rule(f"{MODEL}.mtp.*", reason="multi-token prediction", group=NOT_YET),
        *_model_rules(MODEL, "actor"),
    ]


def _actor_rules() -> list[Rule]:
    """verl's keys of the actor."""
    return [
        *_batch_rules(ACTOR, "actor"),
        *_optim_rules(ACTOR, "actor"),
        Rule(f"{ACTOR}.strategy", reason="megarl trains with Megatron-core whatever verl's strategy"),
        Rule(f"{ACTOR}.clip_ratio", ("algorithm.clip.low", "algorithm.clip.high"), clip("both"),
             reason="both sides, unless clip_ratio_low / clip_ratio_high is given"),
        Rule(f"{ACTOR}.clip_ratio_low", ("algorithm.clip.low",), clip("low")),
        Rule(f"{ACTOR}.clip_ratio_high", ("algorithm.clip.high",), clip("high")),
        Rule(f"{ACTOR}.clip_ratio_c", ("algorithm.clip.dual_c",)),
        Rule(f"{ACTOR}.loss_agg_mode", ("algorithm.loss_agg",), loss_agg),
        Rule(f"{ACTOR}.entropy_coeff", ("algorithm.entropy_coef",)),
        Rule(f"{ACTOR}.use_kl_loss", ("algorithm.kl.use_in_loss",), is_true),
        Rule(f"{ACTOR}.kl_loss_coef", ("algorithm.kl.loss_coef",), needs(f"{ACTOR}.use_kl_loss", "the KL loss")),
        Rule(f"{ACTOR}.kl_loss_type", ("algorithm.kl.loss_estimator",), kl_estimator(f"{ACTOR}.use_kl_loss"),
             reason="low_var_kl = k3, kl = k1, mse = k2"),
        Rule(f"{ACTOR}.policy_loss.loss_mode", ("algorithm.policy_loss",), loss_mode),
        Rule(f"{ACTOR}.policy_loss.*", reason="parameters of verl's clip_cov / kl_cov losses", group=NOT_YET),
        Rule(f"{ACTOR}.use_torch_compile", reason="torch.compile of verl's FSDP model", group=FSDP_ONLY),
        Rule(f"{ACTOR}.entropy_from_logits_with_chunking", reason="megarl always chunks the LM head (actor.logprob_chunk_tokens)"),
        Rule(f"{ACTOR}.entropy_checkpointing", reason="megarl always chunks the LM head (actor.logprob_chunk_tokens)"),
        Rule(f"{ACTOR}.checkpoint.*", reason="megarl's checkpoints always hold the model, optimizer and loop state"),
        Rule(f"{ACTOR}.use_fused_kernels", reason="verl's fused kernels for HF models", group=FSDP_ONLY),
        Rule(f"{ACTOR}.data_loader_seed", reason="megarl's sampler takes data.seed"),
        Rule(f"{ACTOR}.load_weight", reason="megarl always loads model.path"),
        Rule(f"{ACTOR}.freeze_vision_tower", reason="multimodal models", group=NOT_YET),
        Rule(f"{ACTOR}.use_remove_padding", ("actor.pack_sequences",)),
        Rule(f"{ACTOR}.router_replay.mode", ("actor.moe.routing_replay",), router_replay),
        Rule(f"{ACTOR}.router_replay.*", reason="megarl replays the routing of the samples it trains, kept in memory"),
        Rule(f"{ACTOR}.rollout_n", reason="verl derives it from rollout.n"),
        Rule(f"{ACTOR}.calculate_entropy", reason="megarl always computes the entropy (actor/entropy, algorithm.entropy_coef)"),
        Rule(f"{ACTOR}.tau_pos", reason="parameters of verl's SAPO loss", group=NOT_YET),
        Rule(f"{ACTOR}.tau_neg", reason="parameters of verl's SAPO loss", group=NOT_YET),
        Rule(f"{ACTOR}.loss_scale_factor", reason="megarl's loss scale is algorithm.loss_agg's", group=NOT_YET),
        Rule(f"{ACTOR}.use_prefix_grouper", reason="shared-prefix grouping", group=NOT_YET),
        Rule(f"{ACTOR}.*sum_pi_squared*", reason="verl's sum of pi squared statistics", group=NOT_YET),
        *_parallel_rules(f"{ACTOR}.megatron", "actor"),
        *[Rule(f"{actor}.fsdp_config.{k}", (f"{section}.offload",), wrap(offload(tuple(
            f"{actor}.fsdp_config.{o}" for o in ("param_offload", "optimizer_offload")))),
            reason="megarl offloads params, grads and optimizer state while the engines generate")
          for actor, section, wrap in ((ACTOR, "actor", same_wrap), ("critic.model", "critic", critic), ("critic", "critic", critic))
          for k in ("param_offload", "optimizer_offload")],  # fmt: skip
    ]


def _reference_rules() -> list[Rule]:
    """verl's keys of the reference."""
    return [
        Rule(f"{REF}.fsdp_config.param_offload", ("reference.offload",)),
        Rule(f"{REF}.megatron.param_offload", ("reference.offload",)),
        Rule(f"{REF}.megatron.*", reason="the reference takes the policy's layout (actor.parallel)"),
        *_logprob_rules(REF),
        Rule(f"{REF}.log_prob_*", reason="megarl's log-prob passes take actor.logprob_micro_batch_size / logprob_max_tokens_per_gpu"),
        Rule(f"{REF}.ulysses_sequence_parallel_size", reason="Ulysses sequence parallelism", group=FSDP_ONLY),
        Rule(f"{REF}.*", reason="the reference is the policy's model, frozen (reference.enabled, reference.offload)"),
    ]


def _agent_rules() -> list[Rule]:
    """verl's multi-turn and agent-loop keys (docs/agents.md shows them)."""
    return [
        Rule(f"{ROLLOUT}.multi_turn.enable", reason="megarl picks each sample's agent loop by its agent_name column "
             "(else rollout.agent.default_agent)"),  # fmt: skip
        Rule(f"{ROLLOUT}.multi_turn.max_assistant_turns", ("rollout.agent.max_turns",), lambda x, v: int(x) if x else 8,
             reason="model turns; null (no limit) = megarl's 8"),
        Rule(f"{ROLLOUT}.multi_turn.max_user_turns", reason="rollout.agent.max_turns bounds the conversation"),
        Rule(f"{ROLLOUT}.multi_turn.max_parallel_calls", ("rollout.agent.max_parallel_calls",),
             reason="verl's 1, megarl's 4 when not given; calls past it are answered with an error, not dropped"),
        Rule(f"{ROLLOUT}.multi_turn.max_tool_response_length", ("rollout.agent.max_tool_response_length",),
             lambda x, v: max(16, int(x)), reason="characters in both (verl's 256, megarl's 4096 when not given); the end is cut"),
        Rule(f"{ROLLOUT}.multi_turn.tool_response_truncate_side", reason="megarl cuts a long tool answer's end"),
        Rule(f"{ROLLOUT}.multi_turn.tool_config_path", ("rollout.agent.tools_file",)),
        Rule(f"{ROLLOUT}.multi_turn.interaction_config_path", ("rollout.agent.interactions_file",)),
        Rule(f"{ROLLOUT}.multi_turn.format", ("rollout.agent.tool_parser",), reason="hermes, or your function (package.module:function)"),
        Rule(f"{ROLLOUT}.multi_turn.use_inference_chat_template", reason="megarl never re-tokenizes a trajectory"),
        Rule(f"{ROLLOUT}.multi_turn.tokenization_sanity_check_mode", reason="megarl never re-tokenizes a trajectory"),
        Rule(f"{ROLLOUT}.multi_turn.num_repeat_rollouts", reason="rollout.n samples per prompt"),
        Rule(f"{ROLLOUT}.agent.default_agent_loop", ("rollout.agent.default_agent",), agent_loop,
             reason="verl's single_turn_agent is megarl's single_turn"),
        Rule(f"{ROLLOUT}.agent.num_workers", reason="rollout.agent.max_concurrent bounds trajectories in flight"),
        Rule(f"{ROLLOUT}.agent.agent_loop_config_path", reason="name your loops in rollout.agent.loops", group=NOT_YET),
        Rule(f"{ROLLOUT}.agent.*", reason="megarl's agent keys are those of `megarl config rollout.agent`", group=NOT_YET),
    ]


def _rollout_rules() -> list[Rule]:
    """verl's keys of the rollout."""
    return [
        Rule(f"{ROLLOUT}.name", ("rollout.engine",), engine, reason="sglang and vllm: SGLang; hf (verl's HF rollout): "
             "the torch engine, megarl's engine in the policy's processes"),
        Rule(f"{ROLLOUT}.n", ("rollout.n",), default=1),
        Rule(f"{ROLLOUT}.temperature", ("rollout.sampling.temperature",)),
        Rule(f"{ROLLOUT}.top_p", ("rollout.sampling.top_p",)),
        Rule(f"{ROLLOUT}.top_k", ("rollout.sampling.top_k",), top_k),
        Rule(f"{ROLLOUT}.do_sample", ("rollout.sampling.temperature",), do_sample),
        Rule(f"{ROLLOUT}.response_length", ("rollout.sampling.max_new_tokens",), default=default_response),
        Rule(f"{ROLLOUT}.prompt_length", ("data.max_prompt_length",), default=default_prompt),
        Rule(f"{ROLLOUT}.tensor_model_parallel_size", ("rollout.tp",), rollout_tp, default=2),
        Rule(f"{ROLLOUT}.gpu_memory_utilization", ("rollout.mem_fraction",), default=0.5,
             reason="SGLang's --mem-fraction-static"),
        Rule(f"{ROLLOUT}.max_num_seqs", ("rollout.max_running_requests",)),
        Rule(f"{ROLLOUT}.update_weights_bucket_megabytes", ("rollout.weight_sync.bucket_mb",)),
        Rule(f"{ROLLOUT}.val_kwargs.do_sample", ("rollout.val.greedy",), val_greedy, default=False,
             reason="greedy = not do_sample"),
        Rule(f"{ROLLOUT}.val_kwargs.temperature", ("rollout.val.temperature",), val_sampling(lambda x, v: float(x)), default=0,
             reason="used with do_sample=true only; verl ignores it otherwise"),
        Rule(f"{ROLLOUT}.val_kwargs.top_p", ("rollout.val.top_p",), val_sampling(lambda x, v: float(x)), default=1.0,
             reason="used with do_sample=true only; verl ignores it otherwise"),
        Rule(f"{ROLLOUT}.val_kwargs.top_k", ("rollout.val.top_k",), val_sampling(top_k), default=-1,
             reason="used with do_sample=true only; verl ignores it otherwise; verl's 0 and -1 = the whole vocabulary = megarl's -1"),
        Rule(f"{ROLLOUT}.val_kwargs.n", ("rollout.val.n",), default=1),
        Rule(f"{ROLLOUT}.val_kwargs.*", reason="a validation sampling setting megarl's config does not have "
             "(`megarl config rollout.val`)", group=NOT_YET),
        Rule(f"{ROLLOUT}.ignore_eos", ("rollout.sampling.ignore_eos",),
             reason="megarl refuses it with rollout.sampling.stop_token_ids"),
        Rule(f"{ROLLOUT}.mode", reason="megarl's engines are servers (sync and async verl modes alike)"),
        Rule(f"{ROLLOUT}.calculate_log_probs", reason="megarl always records the engines' log-probs"),
        *_logprob_rules(ROLLOUT),
        Rule(f"{ROLLOUT}.log_prob_*", reason="megarl's log-prob passes take actor.logprob_micro_batch_size / logprob_max_tokens_per_gpu"),
        Rule(f"{ROLLOUT}.dtype", reason="the engines take model.dtype"),
        Rule(f"{ROLLOUT}.expert_parallel_size", convert=ep_rollout, reason="megarl's SGLang engines split experts by "
             "rollout.tp; SGLang's --ep-size goes in rollout.server_args", group=NOT_YET),
        Rule(f"{ROLLOUT}.data_parallel_size", reason="megarl runs one engine per rollout.tp GPUs"),
        Rule(f"{ROLLOUT}.pipeline_model_parallel_size", reason="megarl's engines split by rollout.tp only", group=NOT_YET),
        Rule(f"{ROLLOUT}.engine_kwargs.sglang", ("rollout.engine_kwargs",), dict_entries,
             reason="SGLang's ServerArgs by field name, checked against megarl's table; nulls left out as verl does"),
        Rule(f"{ROLLOUT}.engine_kwargs.sglang.*", ("rollout.engine_kwargs.*",), engine_arg,
             reason="SGLang's ServerArgs field, checked against megarl's table"),
        Rule(f"{ROLLOUT}.engine_kwargs.vllm*", reason="vLLM's engine arguments", group=VLLM_ONLY),
        *[Rule(f"{ROLLOUT}.{k}", reason="a vLLM engine setting", group=VLLM_ONLY) for k in (
            "enforce_eager", "free_cache_engine", "max_num_batched_tokens", "enable_chunked_prefill", "enable_prefix_caching",
            "max_model_len", "disable_log_stats", "load_format", "layered_summon", "cudagraph_capture_sizes",
            "swap_space", "use_fire_sampling")],  # fmt: skip
        Rule(f"{ROLLOUT}.trace.*", reason="megarl writes samples to trainer.output_dir", group=NOT_YET),
        Rule(f"{ROLLOUT}.skip_*", reason="megarl always generates"),
        Rule(f"{ROLLOUT}.over_sample_rate", reason="megarl's dynamic sampling generates further rounds instead", group=NOT_YET),
        Rule(f"{ROLLOUT}.multi_stage_wake_up", reason="megarl's memory hand-over is its own (docs/architecture.md)"),
        Rule(f"{ROLLOUT}.prometheus.*", reason="metrics go to trainer.loggers", group=NOT_YET),
        Rule(f"{ROLLOUT}.quantization", reason="quantized rollouts", group=NOT_YET),
        Rule(f"{ROLLOUT}.*", reason="a rollout setting megarl's config does not have (`megarl config rollout`)", group=NOT_YET),
        Rule("actor_rollout_ref.hybrid_engine", reason="colocated training and rollout: cluster.placement=colocated (the default)"),
        Rule("actor_rollout_ref.nccl_timeout", reason="megarl's deadlines: rollout.weight_sync.timeout_s, trainer.hang_timeout_s"),
    ]


def _critic_rules() -> list[Rule]:
    """verl's keys of the critic."""
    return [
        Rule("critic.enable", ("critic.enabled",)),
        Rule("critic.model.path", ("critic.path",), critic_path, default=PLACEHOLDER_MODEL, show_default=True),
        *_model_rules("critic.model", "critic"),
        Rule("critic.model.lora_rank", convert=critic(differs("megarl trains the whole critic (its LoRA is the policy's)")),
             reason="megarl's LoRA is the policy's (actor.lora)", group=NOT_YET),
        Rule("critic.model.lora_*", reason="megarl's LoRA is the policy's (actor.lora)", group=NOT_YET),
        Rule("critic.model.target_modules", reason="megarl's LoRA is the policy's (actor.lora)", group=NOT_YET),
        *_batch_rules("critic", "critic"),
        *_optim_rules("critic", "critic"),
        Rule("critic.cliprange_value", ("algorithm.clip.value",), critic(), default=0.5),
        Rule("critic.loss_agg_mode", reason="megarl's value loss takes algorithm.loss_agg"),
        Rule("critic.strategy", reason="megarl trains with Megatron-core whatever verl's strategy"),
        Rule("critic.rollout_n", reason="verl derives it from rollout.n"),
        Rule("critic.checkpoint.*", reason="megarl's checkpoints always hold the model, optimizer and loop state"),
        Rule("critic.model.lora.rank", convert=critic(differs("megarl trains the whole critic (its LoRA is the policy's)")),
             reason="megarl's LoRA is the policy's (actor.lora)", group=NOT_YET),
        Rule("critic.model.lora.*", reason="megarl's LoRA is the policy's (actor.lora)", group=NOT_YET),
        Rule("critic.data_loader_seed", reason="megarl's sampler takes data.seed"),
        Rule("critic.load_weight", reason="megarl always loads the critic's model"),
        Rule("critic.nccl_timeout", reason="megarl's deadlines: rollout.weight_sync.timeout_s, trainer.hang_timeout_s"),
        *_parallel_rules("critic.megatron", "critic"),
    ]


def _reward_rules() -> list[Rule]:
    """verl's keys of the reward."""
    return [
        Rule("reward_model.enable", ("reward.model.path",), reward_model_enable,
             reason="with reward_model.model.path"),
        Rule("reward_model.model.path", ("reward.model.path",), reward_model()),
        Rule("reward_model.micro_batch_size_per_gpu", ("reward.model.batch_size",), reward_model()),
        Rule("reward_model.reward_manager", ("reward.custom.batched",), reward_manager),
        *[Rule(f"{p}.{part}", ("algorithm.overlong.penalty",), overlong(p, part)) if part == "penalty_factor" else
          Rule(f"{p}.{part}", ("algorithm.overlong.length",), overlong_enable(p) if part == "enable" else overlong(p, part))
          for p in ("reward_model.overlong_buffer", "reward_model.reward_kwargs.overlong_buffer_cfg")
          for part in ("enable", "len", "penalty_factor")],  # fmt: skip
        Rule("reward_model.overlong_buffer.log", reason="megarl always logs reward/overlong_penalty_mean"),
        Rule("reward_model.reward_kwargs.overlong_buffer_cfg.log", reason="megarl always logs reward/overlong_penalty_mean"),
        Rule("reward_model.reward_kwargs.max_resp_len", reason="megarl's limit is rollout.sampling.max_new_tokens"),
        Rule("reward_model.launch_reward_fn_async", reason="megarl's reward workers score while the engines generate"),
        Rule("reward_model.sandbox_fusion.*", reason="sandboxed code execution", group=NOT_YET),
        Rule("reward_model.fsdp_config.*", reason="verl's FSDP reward model", group=FSDP_ONLY),
        Rule("reward_model.*", reason="megarl's reward model keys are those of `megarl config reward.model`", group=NOT_YET),
        Rule("custom_reward_function.path", ("reward.custom.path",), custom_path),
        Rule("custom_reward_function.name", ("reward.custom.name",), reward_custom, default="compute_score"),
        Rule("custom_reward_function.reward_kwargs*", reason="megarl calls your function with verl's arguments only", group=NOT_YET),
    ]


def _algorithm_rules() -> list[Rule]:
    """verl's keys of the algorithm."""
    return [
        Rule("algorithm.adv_estimator", ("algorithm.estimator",), estimator, default="gae"),
        Rule("algorithm.gamma", ("algorithm.gamma",)),
        Rule("algorithm.lam", ("algorithm.lam",)),
        Rule("algorithm.norm_adv_by_std_in_grpo", ("algorithm.norm_by_std",)),
        Rule("algorithm.use_kl_in_reward", ("algorithm.kl.use_in_reward",), is_true),
        Rule("algorithm.kl_penalty", ("algorithm.kl.reward_estimator",), kl_estimator("algorithm.use_kl_in_reward"),
             default="kl", reason="kl = k1, low_var_kl = k3, mse = k2"),
        Rule("algorithm.kl_ctrl.kl_coef", ("algorithm.kl.reward_coef",), needs("algorithm.use_kl_in_reward", "the KL reward penalty")),
        Rule("algorithm.kl_ctrl.type", ("algorithm.kl.controller",), needs("algorithm.use_kl_in_reward", "the KL reward penalty")),
        Rule("algorithm.kl_ctrl.horizon", ("algorithm.kl.horizon",), needs("algorithm.use_kl_in_reward", "the KL reward penalty")),
        Rule("algorithm.kl_ctrl.target_kl", ("algorithm.kl.target",), needs("algorithm.use_kl_in_reward", "the KL reward penalty")),
        Rule("algorithm.filter_groups.enable", ("algorithm.dynamic_sampling.enabled",), is_true),
        Rule("algorithm.filter_groups.max_num_gen_batches", ("algorithm.dynamic_sampling.max_rounds",), filter_rounds),
        Rule("algorithm.filter_groups.metric", reason="megarl drops the groups whose rewards are all equal"),
        Rule("algorithm.use_pf_ppo", reason="preference-feedback PPO", group=NOT_YET),
        Rule("algorithm.pf_ppo.*", reason="preference-feedback PPO", group=NOT_YET),
        *_rollout_correction_rules(),
        Rule("algorithm.*", reason="an algorithm setting megarl's config does not have (`megarl config algorithm`)", group=NOT_YET),
    ]


def _rollout_correction_rules() -> list[Rule]:
    """verl's algorithm.rollout_correction: bypass mode, truncated importance sampling, rejection."""
    rc = "algorithm.rollout_correction"
    return [
        Rule(f"{rc}.bypass_mode", ("algorithm.old_logprobs",), bypass_mode, default=False,
             reason="true: the engine's log-probs are PPO's old ones (no recomputation)"),
        Rule(f"{rc}.loss_type", convert=correction_loss_type, default="ppo_clip",
             reason="bypass mode's loss: ppo_clip is megarl's policy loss with algorithm.old_logprobs=engine"),
        Rule(f"{rc}.rollout_is", ("algorithm.tis.level",), rollout_is,
             reason="truncated importance weights pi_old / pi_rollout, per token or per sequence"),
        Rule(f"{rc}.rollout_is_threshold", ("algorithm.tis.cap",), rollout_is_threshold, default=2.0,
             reason="the weights' cap"),
        Rule(f"{rc}.rollout_is_batch_normalize", convert=rollout_is_batch_normalize,
             reason="the weights normalised to a batch mean of 1", group=NOT_YET),
        Rule(f"{rc}.rollout_rs", ("algorithm.mis.level", "algorithm.mis.low", "algorithm.mis.high"), rollout_rs,
             reason="token_k1 = token, seq_sum_k1 = sequence, seq_mean_k1 = geometric, bounds from rollout_rs_threshold; "
             "megarl's mis drops rejected tokens from the policy-gradient term only (verl also from the normaliser, the "
             "KL and entropy terms and the critic)"),
        Rule(f"{rc}.rollout_rs_threshold", convert=rollout_rs_threshold,
             reason="the bounds of rollout_rs (its row gives algorithm.mis.low / high)"),
        Rule(f"{rc}.*", reason="megarl's corrections are algorithm.tis, algorithm.mis and algorithm.old_logprobs", group=NOT_YET),
    ]


def _trainer_rules() -> list[Rule]:
    """verl's keys of the trainer."""
    return [
        Rule("trainer.total_epochs", ("trainer.total_epochs",), total_epochs, default=30),
        Rule("trainer.total_training_steps", ("trainer.total_steps",)),
        Rule("trainer.project_name", ("trainer.project",), default="verl_examples"),
        Rule("trainer.experiment_name", ("trainer.experiment",), default="gsm8k"),
        Rule("trainer.logger", ("trainer.loggers",), loggers),
        Rule("trainer.nnodes", ("cluster.nnodes",), default=1),
        Rule("trainer.n_gpus_per_node", ("cluster.gpus_per_node",), default=8),
        Rule("trainer.device", ("cluster.device",), device),
        Rule("trainer.save_freq", ("trainer.save_freq",), steps, reason="-1 (never) = 0 (at the end only)"),
        Rule("trainer.test_freq", ("trainer.eval_freq",), steps, reason="-1 = 0 (no periodic validation)"),
        Rule("trainer.val_before_train", ("trainer.eval_before_train",), default=True),
        Rule("trainer.val_only", ("trainer.val_only",)),
        Rule("trainer.critic_warmup", ("trainer.critic_warmup_steps",), critic_warmup,
             reason="verl's N trains the actor from step N, megarl's from step N+1"),
        Rule("trainer.default_local_dir", ("trainer.output_dir",), output_dir, default=default_output_dir),
        Rule("trainer.resume_mode", ("trainer.resume",), resume),
        Rule("trainer.resume_from_path", ("trainer.resume",), resume_path),
        Rule("trainer.max_actor_ckpt_to_keep", ("trainer.keep_last",), keep),
        Rule("trainer.max_critic_ckpt_to_keep", reason="megarl keeps trainer.keep_last checkpoints of the whole run"),
        Rule("trainer.log_val_generations", ("trainer.val_samples_logged",)),
        Rule("trainer.balance_batch", reason="megarl balances tokens over DP ranks with its packing (actor.pack_sequences)"),
        Rule("trainer.default_hdfs_dir", reason="HDFS copies of checkpoints", group=NOT_YET),
        Rule("trainer.del_local_ckpt_after_load", reason="megarl keeps trainer.keep_last checkpoints"),
        Rule("trainer.rollout_data_dir", ("trainer.rollout_data_dir",),
             reason="`<dir>/<step>.jsonl` per training step, with verl's fields"),
        Rule("trainer.validation_data_dir", reason="megarl writes validation samples to trainer.output_dir/samples"),
        Rule("trainer.esi_redundant_time", reason="megarl saves on SIGTERM (trainer.checkpoint_on_signal)"),
        Rule("trainer.ray_wait_register_center_timeout", reason="megarl's start-up deadline is cluster.build_timeout_s"),
        Rule("trainer.use_legacy_worker_impl", reason="verl's worker implementations"),
        Rule("trainer.*", reason="a trainer setting megarl's config does not have (`megarl config trainer`)", group=NOT_YET),
    ]


def _other_rules() -> list[Rule]:
    """verl's keys of profiling, Ray, FSDP and verl's own bookkeeping."""
    return [
        Rule("*.fsdp_config.*", reason="FSDP's sharding and offload", group=FSDP_ONLY),
        Rule("*.profiler.*", reason="megarl profiles trainer.profile_steps with the torch profiler", group=NOT_YET),
        Rule("global_profiler.*", reason="megarl profiles trainer.profile_steps with the torch profiler", group=NOT_YET),
        Rule("ray_kwargs.*", reason="megarl starts Ray itself (cluster.ray_address to attach)"),
        Rule("ray_init.*", reason="megarl starts Ray itself (cluster.ray_address to attach)"),
        Rule("reward_manager.*", reason="megarl scores with its reward workers (reward.workers, reward.custom)"),
        Rule("transfer_queue.*", reason="megarl moves batches through Ray's object store"),
        Rule("*.tiled_mlp.*", reason="tiled MLP for FSDP models", group=FSDP_ONLY),
        Rule("*.megatron.use_dist_checkpointing", reason="model.path takes an HF directory or a `megarl convert "
             "hf-to-megatron` checkpoint"),  # fmt: skip
        Rule("*.megatron.dist_checkpointing_*", reason="model.path takes an HF directory or a `megarl convert hf-to-megatron` checkpoint"),
        Rule("*.megatron.use_mbridge", reason="megarl converts HF weights with its own bridges"),
        Rule("*.megatron.seed", reason="megarl seeds every rank from trainer.seed"),
        Rule("*.megatron.*", reason="Megatron settings megarl's config does not have (`megarl config actor.parallel`)", group=NOT_YET),
        Rule("*._target_", reason="verl's dataclass name"),
        Rule("*.strategy", reason="megarl trains with Megatron-core whatever verl's strategy"),
    ]


def _verl_rules() -> list[Rule]:
    """Every rule, the most specific first (patterns after the keys they would also match)."""
    return [*_data_rules(), *_policy_model_rules(), *_actor_rules(), *_reference_rules(), *_agent_rules(),
            *_rollout_rules(), *_critic_rules(), *_reward_rules(), *_algorithm_rules(), *_trainer_rules(),
            *_other_rules()]  # fmt: skip


RULES: list[Rule] = _verl_rules()


_EXACT: dict[str, Rule] = {}


for _rule in RULES:
    if "*" not in _rule.verl:
        _EXACT.setdefault(_rule.verl, _rule)


# verl key -> verl's default (a function of the run for an interpolated one): what ``Verl.get`` reads.
VERL_DEFAULTS: dict[str, Any] = {key: rule.default for key, rule in _EXACT.items() if rule.default is not None}


def exact_rule(key: str) -> Rule | None:
    return _EXACT.get(key)


def rule_for(key: str) -> Rule | None:
    """The rule of a verl key: its own, else the first pattern that matches it."""
    found = _EXACT.get(key)
    if found is not None:
        return found
    return next((r for r in RULES if "*" in r.verl and fnmatch.fnmatchcase(key, r.verl)), None)


def is_verl_key(key: str) -> bool:
    """Whether ``key`` is one of verl's keys (or a group of them) that the mapping knows."""
    return rule_for(key) is not None or any(r.verl.startswith(f"{key}.") for r in RULES)


def megarl_name(key: str) -> str | None:
    """The megarl key a verl key becomes, for the refusal of a verl key given to megarl."""
    rule = rule_for(key)
    return ", ".join(rule.megarl_keys(key)) if rule is not None and rule.megarl else None


def no_equivalent_reason(key: str) -> str | None:
    rule = rule_for(key)
    if rule is None or rule.megarl:
        return None
    return f"{rule.group}: {rule.reason}" if rule.group != NONE else f"no equivalent: {rule.reason}"
