"""verl's config keys and what each becomes in megarl: the one mapping behind `megarl config
--from-verl`, the refusal of a verl key given to megarl (megarl/config/loading.py), and the
tables of docs/migrating-from-verl.md (megarl/config/verl_doc.py writes them; a test compares).

A rule names a verl key (or a pattern of them, ``*`` for any part), verl's default, and either the
megarl keys it sets with a converter, or why megarl has none. Converters read the whole verl run
(a ``Verl`` view: the keys given over verl's defaults), because units differ: verl's
``ppo_mini_batch_size`` counts prompts where megarl's ``actor.mini_batch_size`` counts samples
(prompts x rollout.n), and a key may only mean something beside another (``kl_loss_coef`` only
with ``use_kl_loss``). Torch-free, like every config module.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.config.architectures import arch_for_model_name
from megarl.config.rollout_sections import LOOP_ALIASES
from megarl.config.sections import LOSS_AGGS

ACTOR, ROLLOUT, REF, MODEL = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.ref", "actor_rollout_ref.model"
PLACEHOLDER_MODEL = "~/models/deepseek-llm-7b-chat"  # verl's default model.path, a placeholder

# Why a key has no equivalent: the groups the table names.
FSDP_ONLY = "FSDP-only"
VLLM_ONLY = "vLLM-only"
NOT_YET = "not supported yet"
NONE = "no equivalent"


OMIT = object()  # a converter's value for a megarl key it leaves unset (megarl's default applies)


class Unused(Exception):
    """A verl key that has no effect in this run (``kl_loss_coef`` without ``use_kl_loss``), or no
    equivalent for this value: the table says why instead of a megarl key. ``quiet``: a default of
    a part the run does not have (the critic's without a critic) is not shown at all."""

    def __init__(self, reason: str, group: str = NONE, quiet: bool = False, differs: bool = False):
        super().__init__(reason)
        self.reason, self.group, self.quiet, self.differs = reason, group, quiet, differs


class Verl:
    """The verl run as the converters see it: a key's value as given, else verl's default."""

    def __init__(self, given: dict[str, Any], megatron: bool):
        self.given, self.megatron = given, megatron

    def get(self, key: str) -> Any:
        if key in self.given:
            return self.given[key]
        rule = exact_rule(key)
        default = rule.default if rule is not None else None
        return default(self) if callable(default) else default

    @property
    def n(self) -> int:
        return int(self.get(f"{ROLLOUT}.n"))

    @property
    def gpus(self) -> int:
        return int(self.get("trainer.nnodes")) * int(self.get("trainer.n_gpus_per_node"))

    @property
    def critic(self) -> bool:
        """verl trains a critic for GAE (critic.enable decides when set)."""
        enable = self.get("critic.enable")
        return bool(enable) if enable is not None else self.get("algorithm.adv_estimator") == "gae"


Convert = Callable[[Any, Verl], Any]  # the megarl value (a tuple for several keys), or raises Unused


@dataclass(frozen=True)
class Noted:
    """A converter's value with a note of its own for this row (instead of the rule's reason)."""

    value: Any
    note: str


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


def _same(value: Any, v: Verl) -> Any:
    return value


def _is_true(value: Any, v: Verl) -> bool:
    return bool(value)


def _needs(flag: str, what: str) -> Convert:
    """The value when the verl key ``flag`` is true, else Unused (verl reads it only then)."""
    def convert(value: Any, v: Verl) -> Any:
        if not v.get(flag):
            raise Unused(f"verl reads it only with {flag}=true ({what})")
        return value
    return convert


def _critic(convert: Convert = _same) -> Convert:
    """A critic key: used only when the run trains a critic."""
    def wrapped(value: Any, v: Verl) -> Any:
        if not v.critic:
            raise Unused(f"no critic in this run (algorithm.adv_estimator={v.get('algorithm.adv_estimator')})", quiet=True)
        return convert(value, v)
    return wrapped


def _same_wrap(convert: Convert = _same) -> Convert:
    return convert


def _prompts_to_samples(value: Any, v: Verl) -> int:
    """verl's mini-batches count prompts; megarl's count samples, prompts x rollout.n."""
    return int(value) * v.n


def _global_micro(value: Any, v: Verl) -> int:
    """verl's (deprecated) global micro-batch is split over its data-parallel ranks (every GPU under
    FSDP, GPUs / (TP x PP) under Megatron); megarl's is per DP rank."""
    dp = v.gpus
    if v.megatron:
        model_parallel = int(v.get(f"{ACTOR}.megatron.tensor_model_parallel_size") or 1)
        model_parallel *= int(v.get(f"{ACTOR}.megatron.pipeline_model_parallel_size") or 1)
        dp = max(1, dp // model_parallel)
    return max(1, int(value) // dp)


def _dynamic(value: Any, v: Verl, flag: str = f"{ACTOR}.use_dynamic_bsz") -> Any:
    if not v.get(flag):
        raise Unused(f"verl reads it only with {flag}=true")
    return int(value)


def _dynamic_flag(actor: str, section: str) -> Convert:
    """use_dynamic_bsz=true: the token budget of the same group (verl's default when not given:
    16384 for the actor, 32768 for the critic)."""
    def convert(value: Any, v: Verl) -> Any:
        if not value:
            raise Unused(f"false: micro-batches by count ({section}.micro_batch_size)")
        budget = v.get(f"{actor}.ppo_max_token_len_per_gpu")
        return int(budget) if budget is not None else _VERL_MAX_TOKENS * (2 if section == "critic" else 1)
    return convert


_ESTIMATORS = {"gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"}


def _estimator(value: Any, v: Verl) -> str:
    if value not in _ESTIMATORS:
        raise Unused(f"megarl has no {value} estimator (it has {', '.join(sorted(_ESTIMATORS))}, dr_grpo)", NOT_YET)
    return str(value)


_KL = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}


def _kl_estimator(flag: str) -> Convert:
    def convert(value: Any, v: Verl) -> str:
        if not v.get(flag):
            raise Unused(f"verl reads it only with {flag}=true")
        if value == "full":
            raise Unused("full (the whole-vocabulary KL) needs both models' distributions over the vocabulary at every "
                         "token; megarl's log-prob pass keeps only the sampled token's log-prob (verl does not "
                         "implement it either): k3 (low_var_kl), k1 (kl), k2 (mse) or abs")  # fmt: skip
        if isinstance(value, str) and value.endswith("+") and value[:-1] in _KL:
            raise Unused(f"{value}: verl's straight-through variant ({value[:-1]}'s value, k2's gradient); megarl's KL "
                         f"term takes its estimator's own gradient: {value[:-1]} without + is {_KL[value[:-1]]}", NOT_YET)  # fmt: skip
        if value not in _KL:
            raise Unused(f"megarl has no {value} KL estimator (k1, k2, k3, abs)", NOT_YET)
        return _KL[value]
    return convert


def _loss_mode(value: Any, v: Verl) -> str:
    if value not in ("vanilla", "gspo"):
        raise Unused(f"megarl's policy losses are ppo (verl's vanilla) and gspo; {value} is not one", NOT_YET)
    return "ppo" if value == "vanilla" else "gspo"


def _loss_agg(value: Any, v: Verl) -> str:
    if value not in LOSS_AGGS:
        raise Unused(f"megarl's loss_agg modes are {', '.join(LOSS_AGGS)}", NOT_YET)
    return str(value)


def _clip(side: str) -> Convert:
    """clip_ratio sets both sides unless clip_ratio_low / clip_ratio_high is given."""
    def convert(value: Any, v: Verl) -> Any:
        if side == "both":
            low, high = v.given.get(f"{ACTOR}.clip_ratio_low", value), v.given.get(f"{ACTOR}.clip_ratio_high", value)
            return float(low), float(high)
        return float(value)
    return convert


def _warmup_steps(value: Any, v: Verl, actor: str = ACTOR) -> int:
    """verl's scheduler steps once per RL step; megarl's once per optimizer step (per mini-batch and epoch)."""
    if int(value) < 0:
        raise Unused("-1: verl uses lr_warmup_steps_ratio")
    return int(value) * _optimizer_steps_per_step(v, actor)


def _optimizer_steps_per_step(v: Verl, actor: str) -> int:
    mini = int(v.get(f"{actor}.ppo_mini_batch_size"))
    return max(1, int(v.get("data.train_batch_size")) // mini) * int(v.get(f"{actor}.ppo_epochs"))


def _warmup_ratio(actor: str) -> Convert:
    """verl's ratio of its RL steps is megarl's of its optimizer steps (both scale by the optimizer
    steps per RL step); verl reads it only when lr_warmup_steps is null or <= 0."""
    def convert(value: Any, v: Verl) -> float:
        if not value:
            raise Unused("0: no warm-up (megarl's default)")
        if int(v.get(f"{actor}.optim.lr_warmup_steps") or -1) > 0:
            raise Unused(f"{actor}.optim.lr_warmup_steps is set and wins")
        return float(value)
    return convert


def _schedule(value: Any, v: Verl) -> str:
    if value not in ("constant", "cosine", "linear", "wsd"):
        raise Unused(f"megarl's schedules are constant, cosine, linear and wsd; {value} is not one", NOT_YET)
    return str(value)


def _min_lr_ratio(value: Any, v: Verl) -> float:
    if not value:
        raise Unused("0 or null: decay to 0 (megarl's min_lr default)")
    return float(value)


def _min_lr(actor: str) -> Convert:
    def convert(value: Any, v: Verl) -> float:
        if value and v.get(f"{actor}.optim.min_lr_ratio"):
            raise Unused(f"beside {actor}.optim.min_lr_ratio: megarl takes one of them, the ratio (min_lr_ratio x lr)")
        return float(value)
    return convert


def _recompute(value: Any, v: Verl) -> str:
    return "full" if value else "none"


def _granularity(value: Any, v: Verl) -> str:
    if value is None:
        raise Unused("null: no recomputation set here (enable_gradient_checkpointing decides)")
    return "full" if value == "full" else "selective"


def _offload(keys: tuple[str, ...]) -> Convert:
    """megarl offloads params, grads and optimizer state together: on when verl offloads any."""
    def convert(value: Any, v: Verl) -> bool:
        return any(bool(v.get(k)) for k in keys)
    return convert


def _null_is_one(value: Any, v: Verl) -> int:
    return 1 if value is None else int(value)


def _sequence_parallel(value: Any, v: Verl) -> bool | None:
    """verl's true means 'on when tp > 1' (Megatron refuses it at tp 1): megarl's None."""
    return None if value else False


def _engine(value: Any, v: Verl) -> Any:
    """verl's HF rollout generates with transformers inside its training workers (small and debug
    runs): megarl's torch engine, its engine in the policy's own processes, is the same design."""
    if value == "hf":
        return Noted("torch", "verl's HF rollout (transformers' generate in the training workers, for small and debug "
                     "runs) is megarl's torch engine, which generates in the policy's processes too; for a real run "
                     "set rollout.engine=sglang")  # fmt: skip
    if value not in ("sglang", "vllm"):
        raise Unused(f"{value} is not an engine megarl knows (it generates with SGLang, or its torch engine)")
    return Noted("sglang", "megarl generates with SGLang (vLLM is not supported)" if value == "vllm" else "")


def _rollout_tp(value: Any, v: Verl) -> int:
    if v.get(f"{ROLLOUT}.name") == "hf":
        raise Unused("verl's HF rollout generates with the training workers' model; megarl's torch engine runs in one "
                     "process (rollout.tp 1)", quiet=True)  # fmt: skip
    return int(value)


def _top_k(value: Any, v: Verl) -> Any:
    """verl's 0 ("0 for hf rollout") and -1 both mean no top-k: megarl's -1, the whole vocabulary."""
    if int(value) <= 0:
        return Noted(-1, f"verl's {value}: no top-k, the whole vocabulary (megarl's -1)")
    return int(value)


def _do_sample(value: Any, v: Verl) -> float:
    if value:
        raise Unused("true: sampling at rollout.sampling.temperature (megarl always samples)")
    return 0.0


def _val_greedy(value: Any, v: Verl) -> bool:
    return not value


def _val_sampling(kind: Convert) -> Convert:
    """A val_kwargs sampling value: verl reads it only with val_kwargs.do_sample=true (and megarl
    refuses rollout.val.temperature, top_p and top_k while rollout.val.greedy is true)."""
    def convert(value: Any, v: Verl) -> Any:
        if not v.get(f"{ROLLOUT}.val_kwargs.do_sample"):
            raise Unused("unused: verl's val_kwargs.do_sample is false and verl reads it only when true "
                         "(megarl validates greedily, rollout.val.greedy=true)")  # fmt: skip
        return kind(value, v)
    return convert


def _agent_loop(value: Any, v: Verl) -> str:
    return LOOP_ALIASES.get(str(value), str(value))


def _model_path(value: Any, v: Verl) -> Any:
    """model.path always; model.arch too when the path names a built-in architecture. A local
    directory with a config.json needs no model.arch (megarl plan reads its config); any other path
    keeps model.path alone, and plan reads config.json there (or give model.arch after the run)."""
    path = str(value)
    arch = arch_for_model_name(path)
    if arch is not None:
        return path, arch
    if (Path(path).expanduser() / "config.json").is_file():
        return Noted((path, OMIT), "a local model directory: megarl plan reads its config.json (no model.arch needed)")
    return Noted((path, OMIT), "not a built-in architecture's name and no config.json here: megarl plan reads config.json "
                 "from model.path where it runs; to plan without the weights, add model.arch=NAME after the run "
                 "(`megarl plan --list-archs`)")  # fmt: skip


def _critic_path(value: Any, v: Verl) -> Any:
    if not v.critic:
        raise Unused(f"no critic in this run (algorithm.adv_estimator={v.get('algorithm.adv_estimator')})", quiet=True)
    if value == PLACEHOLDER_MODEL or value == v.get(f"{MODEL}.path"):
        raise Unused("verl's placeholder (or the actor's model): the critic starts from the actor's model, megarl's "
                     "critic.path None")  # fmt: skip
    return str(value)


def _lora_rank(value: Any, v: Verl) -> int:
    if not value:
        raise Unused("0: no LoRA (megarl's actor.lora None)")
    return int(value)


def _differs(reason: str) -> Convert:
    """A key megarl has no equivalent for whose value changes what verl would train (set: the
    translation stops unless told to accept it); unset (null, 0, false): nothing to carry."""
    def convert(value: Any, v: Verl) -> Any:
        if not value:
            raise Unused(f"{value}: nothing to carry")
        raise Unused(f"{reason}: the megarl run would differ from verl's", NOT_YET, differs=True)
    return convert


def _lora(convert: Convert, rank: str = f"{MODEL}.lora_rank") -> Convert:
    def wrapped(value: Any, v: Verl) -> Any:
        if not v.get(rank):
            raise Unused(f"verl reads it only with {rank} > 0")
        return convert(value, v)
    return wrapped


# Megatron's module names in verl's Megatron LoRA (model.lora.target_modules) -> HF's.
_MCORE_MODULES = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                  "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}  # fmt: skip


def _mcore_modules(value: Any, v: Verl) -> list[str]:
    names = [value] if isinstance(value, str) else list(value)
    if set(names) >= set(_MCORE_MODULES) or "all-linear" in names:
        return ["all-linear"]
    unknown = [n for n in names if n not in _MCORE_MODULES]
    if unknown:
        raise Unused(f"megarl's LoRA targets linear_qkv, linear_proj, linear_fc1, linear_fc2 (HF's names); not {unknown}", NOT_YET)
    return [hf for n in names for hf in _MCORE_MODULES[n]]


def _router_replay(value: Any, v: Verl) -> str:
    """verl's R3 replays the engine's routing in training (megarl's experts); R2 is not megarl's."""
    if value in ("disabled", None):
        raise Unused("disabled: the trainer's router decides (megarl's default)")
    if value != "R3":
        raise Unused(f"{value}: megarl replays the engine's routing only (verl's R3)", NOT_YET)
    return "experts"


def _target_modules(value: Any, v: Verl) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def _steps(value: Any, v: Verl) -> int:
    """verl's -1 (never) is megarl's 0."""
    return max(0, int(value))


def _total_epochs(value: Any, v: Verl) -> int:
    if v.get("trainer.total_training_steps") is not None:
        raise Unused("trainer.total_training_steps is set and wins")
    return int(value)


def _critic_warmup(value: Any, v: Verl) -> int:
    """verl's critic_warmup=N trains the actor from step N (steps count from 1); megarl's N from step N+1."""
    return max(0, int(value) - 1)


_SINKS = ("console", "jsonl", "tensorboard", "wandb", "mlflow", "swanlab")


def _loggers(value: Any, v: Verl) -> list[str]:
    names = [value] if isinstance(value, str) else list(value or [])
    unknown = [n for n in names if n not in _SINKS]
    if unknown:
        raise Unused(f"megarl has no {', '.join(map(str, unknown))} sink (it has {', '.join(_SINKS)}); give "
                     "trainer.loggers", NOT_YET)  # fmt: skip
    return names


def _resume(value: Any, v: Verl) -> str:
    if value == "resume_path":
        path = v.get("trainer.resume_from_path")
        if not path:
            raise Unused("resume_path without trainer.resume_from_path")
        return str(path)
    if value not in ("auto", "disable"):
        raise Unused(f"{value} is not a resume mode megarl knows (auto, disable, a path)")
    return str(value)


def _resume_path(value: Any, v: Verl) -> str:
    if v.get("trainer.resume_mode") != "resume_path" or not value:
        raise Unused("verl reads it only with trainer.resume_mode=resume_path")
    return str(value)


def _output_dir(value: Any, v: Verl) -> str:
    return str(value)


def _default_output_dir(v: Verl) -> str:
    """checkpoints/PROJECT/EXPERIMENT"""
    return f"checkpoints/{v.get('trainer.project_name')}/{v.get('trainer.experiment_name')}"


def _default_critic_mini(v: Verl) -> Any:
    """actor's ppo_mini_batch_size"""
    return v.get(f"{ACTOR}.ppo_mini_batch_size")


def _default_critic_shuffle(v: Verl) -> Any:
    """actor's shuffle"""
    return v.get(f"{ACTOR}.shuffle")


def _default_response(v: Verl) -> Any:
    """data.max_response_length"""
    return v.get("data.max_response_length")


def _default_prompt(v: Verl) -> Any:
    """data.max_prompt_length"""
    return v.get("data.max_prompt_length")


def _default_ckpt(v: Verl) -> Any:
    """enable_gradient_checkpointing (actor's)"""
    return v.get(f"{MODEL}.enable_gradient_checkpointing")


def _reward_custom(value: Any, v: Verl) -> Any:
    if not v.get("custom_reward_function.path"):
        raise Unused("verl reads it only with custom_reward_function.path")
    return value


def _reward_manager(value: Any, v: Verl) -> Any:
    if value == "batch":
        if not v.get("custom_reward_function.path"):
            raise Unused("batch without custom_reward_function.path: megarl's built-in scorers score one sample at a time")
        return True
    raise Unused(f"{value}: megarl scores with its reward workers (reward.workers); DAPO's overlong shaping is "
                 "algorithm.overlong" if value == "dapo" else f"{value}: megarl scores with its reward workers (reward.workers)")


def _reward_model(convert: Convert = _same) -> Convert:
    def wrapped(value: Any, v: Verl) -> Any:
        if not v.get("reward_model.enable"):
            raise Unused("verl reads it only with reward_model.enable=true")
        return convert(value, v)
    return wrapped


def _reward_model_enable(value: Any, v: Verl) -> Any:
    if not value:
        raise Unused("false: rule-based rewards (megarl's default)")
    return str(v.get("reward_model.model.path"))


def _overlong(prefix: str, part: str) -> Convert:
    def convert(value: Any, v: Verl) -> Any:
        if not v.get(f"{prefix}.enable"):
            raise Unused(f"verl reads it only with {prefix}.enable=true")
        return int(value) if part == "len" else float(value)
    return convert


def _overlong_enable(prefix: str) -> Convert:
    def convert(value: Any, v: Verl) -> int:
        if not value:
            raise Unused("false: no overlong shaping (megarl's default)")
        return int(v.get(f"{prefix}.len") or 0)
    return convert


def _filter_rounds(value: Any, v: Verl) -> int:
    if not v.get("algorithm.filter_groups.enable"):
        raise Unused("verl reads it only with algorithm.filter_groups.enable=true")
    if int(value) <= 0:
        raise Unused("0 (no limit): megarl's dynamic sampling always stops after max_rounds; set algorithm.dynamic_sampling.max_rounds")
    return int(value)


def _truncation(value: Any, v: Verl) -> str:
    if value not in ("error", "left", "right"):
        raise Unused(f"megarl truncates error, left or right; not {value}", NOT_YET)
    return str(value)


def _device(value: Any, v: Verl) -> str:
    if value not in ("cuda", "cpu"):
        raise Unused(f"megarl runs on cuda (or cpu), not {value}", NOT_YET)
    return str(value)


def _keep(value: Any, v: Verl) -> int:
    if value is None:
        raise Unused("null: verl keeps every checkpoint; megarl keeps trainer.keep_last")
    return int(value)


def _ep_rollout(value: Any, v: Verl) -> Any:
    if int(value) > 1:
        raise Unused("megarl's SGLang engines split experts by rollout.tp; give SGLang's --ep-size in rollout.server_args", NOT_YET)
    raise Unused("1: no expert parallelism in the engines")


def _parallel_rules(engine: str, section: str) -> list[Rule]:
    """A Megatron layout group (actor's or critic's) -> megarl's {section}.parallel."""
    wrap = _critic if section == "critic" else _same_wrap
    keys = (f"{engine}.param_offload", f"{engine}.grad_offload", f"{engine}.optimizer_offload")
    return [
        Rule(f"{engine}.tensor_model_parallel_size", (f"{section}.parallel.tp",), wrap(_same)),
        Rule(f"{engine}.pipeline_model_parallel_size", (f"{section}.parallel.pp",), wrap(_same)),
        Rule(f"{engine}.virtual_pipeline_model_parallel_size", (f"{section}.parallel.vpp",), wrap(_null_is_one)),
        Rule(f"{engine}.context_parallel_size", (f"{section}.parallel.cp",), wrap(_same)),
        Rule(f"{engine}.expert_model_parallel_size", (f"{section}.parallel.ep",), wrap(_same)),
        Rule(f"{engine}.expert_tensor_parallel_size", (f"{section}.parallel.etp",), wrap(_null_is_one)),
        Rule(f"{engine}.sequence_parallel", (f"{section}.parallel.sequence_parallel",), wrap(_sequence_parallel)),
        Rule(f"{engine}.use_distributed_optimizer", (f"{section}.optimizer.distributed",), wrap(_same)),
        *[Rule(k, (f"{section}.offload",), wrap(_offload(keys)), reason="megarl offloads params, grads and "
               "optimizer state together, while the engines generate") for k in keys],  # fmt: skip
        Rule(f"{engine}.override_transformer_config.recompute_granularity", (f"{section}.recompute",), wrap(_granularity)),
        Rule(f"{engine}.dtype", ("model.dtype",) if section == "actor" else (), wrap(_same),
             reason="" if section == "actor" else "the critic takes model.dtype"),
    ]


def _optim_rules(actor: str, section: str) -> list[Rule]:
    """An optim group (verl's FSDP and Megatron names) -> megarl's {section}.optimizer."""
    wrap = _critic if section == "critic" else _same_wrap
    lr = 1e-5 if section == "critic" else 1e-6
    opt = f"{section}.optimizer"
    return [
        Rule(f"{actor}.optim.lr", (f"{opt}.lr",), wrap(_same), default=lr),
        Rule(f"{actor}.optim.weight_decay", (f"{opt}.weight_decay",), wrap(_same), default=0.01),
        Rule(f"{actor}.optim.lr_warmup_steps", (f"{opt}.warmup_steps",),
             wrap(lambda x, v: _warmup_steps(x, v, actor)), default=-1,
             reason="verl's scheduler steps once per RL step, megarl's once per optimizer step: x mini-batches x ppo_epochs"),
        Rule(f"{actor}.optim.lr_warmup_steps_ratio", (f"{opt}.warmup_ratio",), wrap(_warmup_ratio(actor)), default=0.0,
             reason="of the run's steps in both (verl's RL steps, megarl's optimizer steps: the same fraction); used "
             "when lr_warmup_steps is null or <= 0"),
        Rule(f"{actor}.optim.warmup_style", (f"{opt}.schedule",), wrap(_schedule),
             reason="wsd: megarl's wsd_decay_ratio 0.1 is verl's stable ratio 0.9"),
        Rule(f"{actor}.optim.lr_scheduler_type", (f"{opt}.schedule",), wrap(_schedule),
             reason="wsd: megarl's wsd_decay_ratio 0.1 is verl's stable ratio 0.9"),
        Rule(f"{actor}.optim.lr_decay_style", (f"{opt}.schedule",), wrap(_schedule)),
        Rule(f"{actor}.optim.min_lr_ratio", (f"{opt}.min_lr_ratio",), wrap(_min_lr_ratio), reason="x optim.lr in both"),
        Rule(f"{actor}.optim.min_lr", (f"{opt}.min_lr",), wrap(_min_lr(actor))),
        Rule(f"{actor}.optim.betas", (f"{opt}.betas",), wrap(lambda x, v: tuple(x))),
        Rule(f"{actor}.optim.clip_grad", (f"{opt}.clip_grad",), wrap(_same)),
        Rule(f"{actor}.grad_clip", (f"{opt}.clip_grad",), wrap(_same)),
        Rule(f"{actor}.optim.total_training_steps", reason="verl fills it in from trainer.total_training_steps"),
        Rule(f"{actor}.optim.num_cycles", reason="megarl's cosine decays once, from the peak to min_lr"),
        Rule(f"{actor}.optim.optimizer", reason="megarl trains with Adam (AdamW's decoupled weight decay)"),
        Rule(f"{actor}.optim.lr_decay_steps", reason="megarl decays over the run's optimizer steps"),
        Rule(f"{actor}.optim.lr_warmup_init", reason="megarl's warm-up starts from 0"),
        Rule(f"{actor}.optim.*", reason="megarl's optimizer keys are those of `megarl config actor.optimizer`", group=NOT_YET),
    ]


def _batch_rules(actor: str, section: str) -> list[Rule]:
    """Mini- and micro-batches, epochs, dynamic batch sizes of the actor or the critic."""
    wrap = _critic if section == "critic" else _same_wrap
    flag = f"{actor}.use_dynamic_bsz"
    return [
        Rule(f"{actor}.ppo_mini_batch_size", (f"{section}.mini_batch_size",), wrap(_prompts_to_samples),
             default=_default_critic_mini if section == "critic" else 256, reason="prompts x rollout.n: megarl counts samples"),
        Rule(f"{actor}.ppo_micro_batch_size_per_gpu", (f"{section}.micro_batch_size",), wrap(_same),
             reason="per GPU in verl, per DP rank (tp x pp GPUs) in megarl"),
        Rule(f"{actor}.ppo_micro_batch_size", (f"{section}.micro_batch_size",), wrap(_global_micro),
             reason="verl's global micro-batch / its data-parallel ranks"),
        Rule(flag, (f"{section}.max_tokens_per_gpu",), wrap(_dynamic_flag(actor, section))),
        Rule(f"{actor}.ppo_max_token_len_per_gpu", (f"{section}.max_tokens_per_gpu",),
             wrap(lambda x, v: _dynamic(x, v, flag))),
        Rule(f"{actor}.ppo_epochs", (f"{section}.ppo_epochs",), wrap(_same), default=1),
        Rule(f"{actor}.shuffle", (f"{section}.shuffle",), wrap(_is_true),
             default=_default_critic_shuffle if section == "critic" else False,
             reason="the step's samples shuffled before mini-batches are cut, seeded by trainer.seed and the step"),
        *([Rule(f"{actor}.forward_micro_batch_size_per_gpu", (f"{section}.logprob_micro_batch_size",), wrap(_same),
                reason="the values pass; per GPU in verl, per DP rank (tp x pp GPUs) in megarl"),
           Rule(f"{actor}.forward_micro_batch_size", (f"{section}.logprob_micro_batch_size",), wrap(_global_micro),
                reason="the values pass; verl's global micro-batch / its data-parallel ranks"),
           Rule(f"{actor}.forward_max_token_len_per_gpu", (f"{section}.logprob_max_tokens_per_gpu",),
                wrap(lambda x, v: _dynamic(x, v, flag)), reason="the values pass")] if section == "critic" else [
           Rule(f"{actor}.forward_micro_batch_size*", reason="megarl's log-prob passes take actor.logprob_micro_batch_size"),
           Rule(f"{actor}.forward_max_token_len_per_gpu", reason="megarl's log-prob passes take actor.logprob_max_tokens_per_gpu")]),
        Rule(f"{actor}.ulysses_sequence_parallel_size", reason="Ulysses sequence parallelism (megarl's context "
             "parallelism, actor.parallel.cp, is not supported yet)", group=FSDP_ONLY),  # fmt: skip
    ]


def _model_rules(model: str, section: str) -> list[Rule]:
    wrap = _critic if section == "critic" else _same_wrap
    return [
        Rule(f"{model}.enable_gradient_checkpointing", (f"{section}.recompute",), wrap(_recompute),
             default=True if section == "actor" else _default_ckpt),
        Rule(f"{model}.use_remove_padding", (f"{section}.pack_sequences",), wrap(_same)),
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


def _dict_entries(value: Any, v: Verl) -> dict[str, Any]:
    """A mapping given whole (a Hydra override's ``{a: 1}``): its entries, nulls left out as verl does."""
    if not isinstance(value, dict):
        raise TypeError("a mapping of names to values")
    return {str(k): x for k, x in value.items() if x is not None}


def _engine_arg(value: Any, v: Verl) -> Any:
    if value is None:
        raise Unused("null: left out, as verl does")
    return value


def _custom_cls(value: Any, v: Verl) -> dict[str, str]:
    """data.custom_cls given whole ({path, name})."""
    if not isinstance(value, dict) or not value.get("path"):
        raise Unused("no path: verl's own dataset class (megarl's reads verl-schema parquet files)")
    if not value.get("name"):
        raise Unused("a path without a name: verl needs both")
    return {"path": str(value["path"]), "name": str(value["name"])}


def _custom_cls_path(value: Any, v: Verl) -> str:
    if not value:
        raise Unused("null: verl's own dataset class (megarl's reads verl-schema parquet files)")
    if not v.get("data.custom_cls.name"):
        raise Unused("without data.custom_cls.name: verl needs both")
    return str(value)


def _custom_cls_name(value: Any, v: Verl) -> str:
    if not v.get("data.custom_cls.path"):
        raise Unused("verl reads it only with data.custom_cls.path")
    return str(value)


_VERL_MAX_TOKENS = 16384  # verl's default ppo_max_token_len_per_gpu, which the log-prob token budgets default to


def _has_reference(v: Verl) -> bool:
    """verl computes reference log-probs only for a KL loss or a KL reward penalty."""
    return bool(v.get(f"{ACTOR}.use_kl_loss")) or bool(v.get("algorithm.use_kl_in_reward"))


def _logprob_dynamic(v: Verl, prefix: str) -> bool:
    """A log-prob pass's log_prob_use_dynamic_bsz: as given, else verl's default, the actor's use_dynamic_bsz."""
    flag = f"{prefix}.log_prob_use_dynamic_bsz"
    return bool(v.given[flag]) if flag in v.given else bool(v.get(f"{ACTOR}.use_dynamic_bsz"))


def _logprob_micro_of(v: Verl, prefix: str) -> int | None:
    """A log-prob pass's micro-batch per GPU: the per-GPU key, else the deprecated global one split like
    ppo_micro_batch_size; None when neither is given."""
    per_gpu = v.given.get(f"{prefix}.log_prob_micro_batch_size_per_gpu")
    if per_gpu is not None:
        return int(per_gpu)
    total = v.given.get(f"{prefix}.log_prob_micro_batch_size")
    return None if total is None else _global_micro(total, v)


def _logprob_tokens_of(v: Verl, prefix: str) -> int | None:
    """A log-prob pass's token budget per GPU: None unless the pass batches dynamically; verl's
    default is the actor's ppo_max_token_len_per_gpu."""
    if not _logprob_dynamic(v, prefix):
        return None
    value = v.given.get(f"{prefix}.log_prob_max_token_len_per_gpu")
    if value is None:
        value = v.get(f"{ACTOR}.ppo_max_token_len_per_gpu") or _VERL_MAX_TOKENS
    return int(value)


_PASS_NAMES = {ROLLOUT: "rollout's", REF: "ref's"}


def _logprob_size(prefix: str, tokens: bool) -> Convert:
    """verl's old-log-prob (rollout) and reference (ref) passes each have a micro-batch size and a token
    budget; megarl has one setting for both forward passes: the smaller when they differ."""
    size_of = _logprob_tokens_of if tokens else _logprob_micro_of

    def convert(value: Any, v: Verl) -> Any:
        if value is None:
            return None
        if prefix == REF and not _has_reference(v):
            raise Unused(f"no reference in this run: verl computes reference log-probs only with {ACTOR}.use_kl_loss "
                         "or algorithm.use_kl_in_reward")  # fmt: skip
        if tokens and not _logprob_dynamic(v, prefix):
            raise Unused(f"verl reads it only with {prefix}.log_prob_use_dynamic_bsz=true (default: {ACTOR}.use_dynamic_bsz)")
        passes = (ROLLOUT, REF) if _has_reference(v) else (ROLLOUT,)
        sizes = {p: s for p in passes if (s := size_of(v, p)) is not None}
        smallest = min(sizes.values())
        if len(set(sizes.values())) > 1:
            shown = " and ".join(f"{_PASS_NAMES[p]} {s}" for p, s in sizes.items())
            return Noted(smallest, f"megarl has one setting for both log-prob passes: the smaller of {shown}")
        return smallest
    return convert


def _logprob_dynamic_flag(prefix: str) -> Convert:
    def convert(value: Any, v: Verl) -> Any:
        if not value:
            raise Unused("false: log-prob micro-batches by count (actor.logprob_micro_batch_size)")
        return _logprob_size(prefix, tokens=True)(v.given.get(f"{prefix}.log_prob_max_token_len_per_gpu",
                                                              _logprob_tokens_of(v, prefix)), v)  # fmt: skip
    return convert


def _logprob_rules(prefix: str) -> list[Rule]:
    """The log-prob micro-batching of verl's rollout (old log-probs) or ref (reference log-probs) pass."""
    per_gpu = "per GPU in verl, per DP rank (tp x pp GPUs) in megarl; one setting for both log-prob passes"
    return [
        Rule(f"{prefix}.log_prob_micro_batch_size_per_gpu", ("actor.logprob_micro_batch_size",),
             _logprob_size(prefix, tokens=False), reason=per_gpu),
        Rule(f"{prefix}.log_prob_micro_batch_size", ("actor.logprob_micro_batch_size",), _logprob_size(prefix, tokens=False),
             reason="verl's global micro-batch / its data-parallel ranks; one setting for both log-prob passes"),
        Rule(f"{prefix}.log_prob_use_dynamic_bsz", ("actor.logprob_max_tokens_per_gpu",), _logprob_dynamic_flag(prefix)),
        Rule(f"{prefix}.log_prob_max_token_len_per_gpu", ("actor.logprob_max_tokens_per_gpu",),
             _logprob_size(prefix, tokens=True), reason=per_gpu),
    ]


def _data_rules() -> list[Rule]:
    """verl's keys of data."""
    return [
        Rule("data.train_files", ("data.train_files",), _target_modules, default="~/data/rlhf/gsm8k/train.parquet"),
        Rule("data.val_files", ("data.val_files",), _target_modules, default="~/data/rlhf/gsm8k/test.parquet"),
        Rule("data.prompt_key", ("data.prompt_key",)),
        Rule("data.train_batch_size", ("data.prompts_per_step",), default=1024, reason="prompts per step in both"),
        Rule("data.max_prompt_length", ("data.max_prompt_length",), default=512),
        Rule("data.max_response_length", ("rollout.sampling.max_new_tokens",), default=512),
        Rule("data.filter_overlong_prompts", ("data.filter_overlong_prompts",), default=False),
        Rule("data.truncation", ("data.truncation",), _truncation),
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
        Rule("data.custom_cls", ("data.custom_cls",), _custom_cls, reason="your dataset class, built as verl builds it"),
        Rule("data.custom_cls.path", ("data.custom_cls.path",), _custom_cls_path,
             reason="the file of your dataset class, built as verl builds it"),
        Rule("data.custom_cls.name", ("data.custom_cls.name",), _custom_cls_name, reason="your dataset class's name"),
        Rule("data.sampler.*", reason="megarl samples with its own seeded, weighted sampler (data.train_files weights)", group=NOT_YET),
        Rule("data.datagen.*", reason="megarl's prompts are fixed files", group=NOT_YET),
    ]

def _policy_model_rules() -> list[Rule]:
    """verl's keys of the policy model."""
    return [
        Rule(f"{MODEL}.path", ("model.path", "model.arch"), _model_path,
             default=PLACEHOLDER_MODEL, show_default=True,
             reason="a hub id or a directory named after a built-in architecture also sets model.arch, so megarl plan "
             "runs without the weights; any other path sets model.path alone; launch needs the weights in a local directory"),
        Rule(f"{MODEL}.lora_rank", ("actor.lora.rank",), _lora_rank),
        Rule(f"{MODEL}.lora_alpha", ("actor.lora.alpha",), _lora(lambda x, v: float(x))),
        Rule(f"{MODEL}.target_modules", ("actor.lora.target_modules",), _lora(_target_modules)),
        Rule(f"{MODEL}.exclude_modules", reason="megarl's LoRA targets modules by name (actor.lora.target_modules)", group=NOT_YET),
        Rule(f"{MODEL}.lora_adapter_path", convert=_differs("megarl's LoRA starts from fresh adapters, not this adapter"),
             reason="megarl's LoRA starts from fresh adapters", group=NOT_YET),
        Rule(f"{MODEL}.use_dora", convert=_differs("megarl's LoRA is plain LoRA, not DoRA"), reason="DoRA", group=NOT_YET),
        Rule(f"{MODEL}.custom_chat_template", reason="megarl renders the tokenizer's own chat template", group=NOT_YET),
        Rule(f"{MODEL}.lora.rank", ("actor.lora.rank",), _lora_rank, reason="verl's Megatron LoRA"),
        Rule(f"{MODEL}.lora.alpha", ("actor.lora.alpha",), _lora(lambda x, v: float(x), f"{MODEL}.lora.rank"),
             default=32, reason="verl's Megatron LoRA default alpha is 32 (megarl's is 16)"),
        Rule(f"{MODEL}.lora.dropout", ("actor.lora.dropout",), _lora(lambda x, v: float(x), f"{MODEL}.lora.rank")),
        Rule(f"{MODEL}.lora.target_modules", ("actor.lora.target_modules",), _lora(_mcore_modules, f"{MODEL}.lora.rank"),
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
        Rule(f"{ACTOR}.clip_ratio", ("algorithm.clip.low", "algorithm.clip.high"), _clip("both"),
             reason="both sides, unless clip_ratio_low / clip_ratio_high is given"),
        Rule(f"{ACTOR}.clip_ratio_low", ("algorithm.clip.low",), _clip("low")),
        Rule(f"{ACTOR}.clip_ratio_high", ("algorithm.clip.high",), _clip("high")),
        Rule(f"{ACTOR}.clip_ratio_c", ("algorithm.clip.dual_c",)),
        Rule(f"{ACTOR}.loss_agg_mode", ("algorithm.loss_agg",), _loss_agg),
        Rule(f"{ACTOR}.entropy_coeff", ("algorithm.entropy_coef",)),
        Rule(f"{ACTOR}.use_kl_loss", ("algorithm.kl.use_in_loss",), _is_true),
        Rule(f"{ACTOR}.kl_loss_coef", ("algorithm.kl.loss_coef",), _needs(f"{ACTOR}.use_kl_loss", "the KL loss")),
        Rule(f"{ACTOR}.kl_loss_type", ("algorithm.kl.loss_estimator",), _kl_estimator(f"{ACTOR}.use_kl_loss"),
             reason="low_var_kl = k3, kl = k1, mse = k2"),
        Rule(f"{ACTOR}.policy_loss.loss_mode", ("algorithm.policy_loss",), _loss_mode),
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
        Rule(f"{ACTOR}.router_replay.mode", ("actor.moe.routing_replay",), _router_replay),
        Rule(f"{ACTOR}.router_replay.*", reason="megarl replays the routing of the samples it trains, kept in memory"),
        Rule(f"{ACTOR}.rollout_n", reason="verl derives it from rollout.n"),
        Rule(f"{ACTOR}.calculate_entropy", reason="megarl always computes the entropy (actor/entropy, algorithm.entropy_coef)"),
        Rule(f"{ACTOR}.tau_pos", reason="parameters of verl's SAPO loss", group=NOT_YET),
        Rule(f"{ACTOR}.tau_neg", reason="parameters of verl's SAPO loss", group=NOT_YET),
        Rule(f"{ACTOR}.loss_scale_factor", reason="megarl's loss scale is algorithm.loss_agg's", group=NOT_YET),
        Rule(f"{ACTOR}.use_prefix_grouper", reason="shared-prefix grouping", group=NOT_YET),
        Rule(f"{ACTOR}.*sum_pi_squared*", reason="verl's sum of pi squared statistics", group=NOT_YET),
        *_parallel_rules(f"{ACTOR}.megatron", "actor"),
        *[Rule(f"{actor}.fsdp_config.{k}", (f"{section}.offload",), wrap(_offload(tuple(
            f"{actor}.fsdp_config.{o}" for o in ("param_offload", "optimizer_offload")))),
            reason="megarl offloads params, grads and optimizer state while the engines generate")
          for actor, section, wrap in ((ACTOR, "actor", _same_wrap), ("critic.model", "critic", _critic), ("critic", "critic", _critic))
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
        Rule(f"{ROLLOUT}.agent.default_agent_loop", ("rollout.agent.default_agent",), _agent_loop,
             reason="verl's single_turn_agent is megarl's single_turn"),
        Rule(f"{ROLLOUT}.agent.num_workers", reason="rollout.agent.max_concurrent bounds trajectories in flight"),
        Rule(f"{ROLLOUT}.agent.agent_loop_config_path", reason="name your loops in rollout.agent.loops", group=NOT_YET),
        Rule(f"{ROLLOUT}.agent.*", reason="megarl's agent keys are those of `megarl config rollout.agent`", group=NOT_YET),
    ]


def _rollout_rules() -> list[Rule]:
    """verl's keys of the rollout."""
    return [
        Rule(f"{ROLLOUT}.name", ("rollout.engine",), _engine, reason="sglang and vllm: SGLang; hf (verl's HF rollout): "
             "the torch engine, megarl's engine in the policy's processes"),
        Rule(f"{ROLLOUT}.n", ("rollout.n",), default=1),
        Rule(f"{ROLLOUT}.temperature", ("rollout.sampling.temperature",)),
        Rule(f"{ROLLOUT}.top_p", ("rollout.sampling.top_p",)),
        Rule(f"{ROLLOUT}.top_k", ("rollout.sampling.top_k",), _top_k),
        Rule(f"{ROLLOUT}.do_sample", ("rollout.sampling.temperature",), _do_sample),
        Rule(f"{ROLLOUT}.response_length", ("rollout.sampling.max_new_tokens",), default=_default_response),
        Rule(f"{ROLLOUT}.prompt_length", ("data.max_prompt_length",), default=_default_prompt),
        Rule(f"{ROLLOUT}.tensor_model_parallel_size", ("rollout.tp",), _rollout_tp, default=2),
        Rule(f"{ROLLOUT}.gpu_memory_utilization", ("rollout.mem_fraction",), default=0.5,
             reason="SGLang's --mem-fraction-static"),
        Rule(f"{ROLLOUT}.max_num_seqs", ("rollout.max_running_requests",)),
        Rule(f"{ROLLOUT}.update_weights_bucket_megabytes", ("rollout.weight_sync.bucket_mb",)),
        Rule(f"{ROLLOUT}.val_kwargs.do_sample", ("rollout.val.greedy",), _val_greedy, default=False,
             reason="greedy = not do_sample"),
        Rule(f"{ROLLOUT}.val_kwargs.temperature", ("rollout.val.temperature",), _val_sampling(lambda x, v: float(x)), default=0,
             reason="used with do_sample=true only; verl ignores it otherwise"),
        Rule(f"{ROLLOUT}.val_kwargs.top_p", ("rollout.val.top_p",), _val_sampling(lambda x, v: float(x)), default=1.0,
             reason="used with do_sample=true only; verl ignores it otherwise"),
        Rule(f"{ROLLOUT}.val_kwargs.top_k", ("rollout.val.top_k",), _val_sampling(_top_k), default=-1,
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
        Rule(f"{ROLLOUT}.expert_parallel_size", convert=_ep_rollout, reason="megarl's SGLang engines split experts by "
             "rollout.tp; SGLang's --ep-size goes in rollout.server_args", group=NOT_YET),
        Rule(f"{ROLLOUT}.data_parallel_size", reason="megarl runs one engine per rollout.tp GPUs"),
        Rule(f"{ROLLOUT}.pipeline_model_parallel_size", reason="megarl's engines split by rollout.tp only", group=NOT_YET),
        Rule(f"{ROLLOUT}.engine_kwargs.sglang", ("rollout.engine_kwargs",), _dict_entries,
             reason="SGLang's ServerArgs by field name, checked against megarl's table; nulls left out as verl does"),
        Rule(f"{ROLLOUT}.engine_kwargs.sglang.*", ("rollout.engine_kwargs.*",), _engine_arg,
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
        Rule("critic.model.path", ("critic.path",), _critic_path, default=PLACEHOLDER_MODEL, show_default=True),
        *_model_rules("critic.model", "critic"),
        Rule("critic.model.lora_rank", convert=_critic(_differs("megarl trains the whole critic (its LoRA is the policy's)")),
             reason="megarl's LoRA is the policy's (actor.lora)", group=NOT_YET),
        Rule("critic.model.lora_*", reason="megarl's LoRA is the policy's (actor.lora)", group=NOT_YET),
        Rule("critic.model.target_modules", reason="megarl's LoRA is the policy's (actor.lora)", group=NOT_YET),
        *_batch_rules("critic", "critic"),
        *_optim_rules("critic", "critic"),
        Rule("critic.cliprange_value", ("algorithm.clip.value",), _critic(), default=0.5),
        Rule("critic.loss_agg_mode", reason="megarl's value loss takes algorithm.loss_agg"),
        Rule("critic.strategy", reason="megarl trains with Megatron-core whatever verl's strategy"),
        Rule("critic.rollout_n", reason="verl derives it from rollout.n"),
        Rule("critic.checkpoint.*", reason="megarl's checkpoints always hold the model, optimizer and loop state"),
        Rule("critic.model.lora.rank", convert=_critic(_differs("megarl trains the whole critic (its LoRA is the policy's)")),
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
        Rule("reward_model.enable", ("reward.model.path",), _reward_model_enable,
             reason="with reward_model.model.path"),
        Rule("reward_model.model.path", ("reward.model.path",), _reward_model()),
        Rule("reward_model.micro_batch_size_per_gpu", ("reward.model.batch_size",), _reward_model()),
        Rule("reward_model.reward_manager", ("reward.custom.batched",), _reward_manager),
        *[Rule(f"{p}.{part}", ("algorithm.overlong.penalty",), _overlong(p, part)) if part == "penalty_factor" else
          Rule(f"{p}.{part}", ("algorithm.overlong.length",), _overlong_enable(p) if part == "enable" else _overlong(p, part))
          for p in ("reward_model.overlong_buffer", "reward_model.reward_kwargs.overlong_buffer_cfg")
          for part in ("enable", "len", "penalty_factor")],  # fmt: skip
        Rule("reward_model.overlong_buffer.log", reason="megarl always logs reward/overlong_penalty_mean"),
        Rule("reward_model.reward_kwargs.overlong_buffer_cfg.log", reason="megarl always logs reward/overlong_penalty_mean"),
        Rule("reward_model.reward_kwargs.max_resp_len", reason="megarl's limit is rollout.sampling.max_new_tokens"),
        Rule("reward_model.launch_reward_fn_async", reason="megarl's reward workers score while the engines generate"),
        Rule("reward_model.sandbox_fusion.*", reason="sandboxed code execution", group=NOT_YET),
        Rule("reward_model.fsdp_config.*", reason="verl's FSDP reward model", group=FSDP_ONLY),
        Rule("reward_model.*", reason="megarl's reward model keys are those of `megarl config reward.model`", group=NOT_YET),
        Rule("custom_reward_function.path", ("reward.custom.path",), _custom_path),
        Rule("custom_reward_function.name", ("reward.custom.name",), _reward_custom, default="compute_score"),
        Rule("custom_reward_function.reward_kwargs*", reason="megarl calls your function with verl's arguments only", group=NOT_YET),
    ]

def _algorithm_rules() -> list[Rule]:
    """verl's keys of the algorithm."""
    return [
        Rule("algorithm.adv_estimator", ("algorithm.estimator",), _estimator, default="gae"),
        Rule("algorithm.gamma", ("algorithm.gamma",)),
        Rule("algorithm.lam", ("algorithm.lam",)),
        Rule("algorithm.norm_adv_by_std_in_grpo", ("algorithm.norm_by_std",)),
        Rule("algorithm.use_kl_in_reward", ("algorithm.kl.use_in_reward",), _is_true),
        Rule("algorithm.kl_penalty", ("algorithm.kl.reward_estimator",), _kl_estimator("algorithm.use_kl_in_reward"),
             default="kl", reason="kl = k1, low_var_kl = k3, mse = k2"),
        Rule("algorithm.kl_ctrl.kl_coef", ("algorithm.kl.reward_coef",), _needs("algorithm.use_kl_in_reward", "the KL reward penalty")),
        Rule("algorithm.kl_ctrl.type", ("algorithm.kl.controller",), _needs("algorithm.use_kl_in_reward", "the KL reward penalty")),
        Rule("algorithm.kl_ctrl.horizon", ("algorithm.kl.horizon",), _needs("algorithm.use_kl_in_reward", "the KL reward penalty")),
        Rule("algorithm.kl_ctrl.target_kl", ("algorithm.kl.target",), _needs("algorithm.use_kl_in_reward", "the KL reward penalty")),
        Rule("algorithm.filter_groups.enable", ("algorithm.dynamic_sampling.enabled",), _is_true),
        Rule("algorithm.filter_groups.max_num_gen_batches", ("algorithm.dynamic_sampling.max_rounds",), _filter_rounds),
        Rule("algorithm.filter_groups.metric", reason="megarl drops the groups whose rewards are all equal"),
        Rule("algorithm.use_pf_ppo", reason="preference-feedback PPO", group=NOT_YET),
        Rule("algorithm.pf_ppo.*", reason="preference-feedback PPO", group=NOT_YET),
        Rule("algorithm.rollout_correction.*", reason="megarl's corrections are algorithm.tis and algorithm.mis", group=NOT_YET),
        Rule("algorithm.*", reason="an algorithm setting megarl's config does not have (`megarl config algorithm`)", group=NOT_YET),
    ]

def _trainer_rules() -> list[Rule]:
    """verl's keys of the trainer."""
    return [
        Rule("trainer.total_epochs", ("trainer.total_epochs",), _total_epochs, default=30),
        Rule("trainer.total_training_steps", ("trainer.total_steps",)),
        Rule("trainer.project_name", ("trainer.project",), default="verl_examples"),
        Rule("trainer.experiment_name", ("trainer.experiment",), default="gsm8k"),
        Rule("trainer.logger", ("trainer.loggers",), _loggers),
        Rule("trainer.nnodes", ("cluster.nnodes",), default=1),
        Rule("trainer.n_gpus_per_node", ("cluster.gpus_per_node",), default=8),
        Rule("trainer.device", ("cluster.device",), _device),
        Rule("trainer.save_freq", ("trainer.save_freq",), _steps, reason="-1 (never) = 0 (at the end only)"),
        Rule("trainer.test_freq", ("trainer.eval_freq",), _steps, reason="-1 = 0 (no periodic validation)"),
        Rule("trainer.val_before_train", ("trainer.eval_before_train",), default=True),
        Rule("trainer.val_only", ("trainer.val_only",)),
        Rule("trainer.critic_warmup", ("trainer.critic_warmup_steps",), _critic_warmup,
             reason="verl's N trains the actor from step N, megarl's from step N+1"),
        Rule("trainer.default_local_dir", ("trainer.output_dir",), _output_dir, default=_default_output_dir),
        Rule("trainer.resume_mode", ("trainer.resume",), _resume),
        Rule("trainer.resume_from_path", ("trainer.resume",), _resume_path),
        Rule("trainer.max_actor_ckpt_to_keep", ("trainer.keep_last",), _keep),
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


def _custom_path(value: Any, v: Verl) -> Any:
    if not value:
        raise Unused("null: no custom reward function")
    return str(value)


RULES: list[Rule] = _verl_rules()
_EXACT: dict[str, Rule] = {}
for _rule in RULES:
    if "*" not in _rule.verl:
        _EXACT.setdefault(_rule.verl, _rule)


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
