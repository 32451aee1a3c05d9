"""The value converters of verl's keys (megarl/config/verl_keys.py holds the rules that name them):
each turns a verl value into megarl's, reading the whole verl run where units or meanings depend on
other keys, or raises ``Unused`` with why the value has no equivalent.

A converter takes ``(value, run)`` (a ``Verl`` view: the keys given over verl's defaults) and returns
the megarl value (a tuple when the rule sets several keys), a ``Noted`` value with a note of its own,
or raises ``Unused``. A value megarl cannot take where verl's run depends on it (an advantage
estimator, a policy loss, a KL estimator megarl lacks) raises ``Refused``: the translation stops
there with the key, the value and the values accepted. Torch-free, like every config module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.config.algorithm_sections import LOSS_AGGS
from megarl.config.architectures import arch_for_model_name
from megarl.config.rollout_sections import LOOP_ALIASES

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


class Refused(Exception):
    """A value megarl cannot take where the verl run depends on it (an advantage estimator, a
    policy loss, a KL estimator megarl lacks, or one verl does not know): leaving the key out would
    train something else under megarl's default, so the translation stops with one line naming the
    key, the value and the values accepted (verl_translate.py writes it)."""

    def __init__(self, value: Any, accepted: Iterable[str], why: str = ""):
        shown = ", ".join(accepted)
        super().__init__(f"{why or f'megarl has no {value}'}; the values megarl takes here are {shown}")
        self.reason = str(self)


def choice(value: Any, names: Mapping[str, Any], why: str = "") -> Any:
    """verl's ``value`` among ``names`` (verl's name -> megarl's value), else Refused naming them."""
    if not isinstance(value, str) or value not in names:
        raise Refused(value, names, why)
    return names[value]


class Verl:
    """The verl run as the converters see it: a key's value as given, else verl's default
    (``defaults``: verl key -> its default, a function of the run for an interpolated one;
    verl_keys.VERL_DEFAULTS, from the rules)."""

    def __init__(self, given: dict[str, Any], megatron: bool, defaults: Mapping[str, Any]):
        self.given, self.megatron, self.defaults = given, megatron, defaults

    def get(self, key: str) -> Any:
        if key in self.given:
            return self.given[key]
        default = self.defaults.get(key)
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


def same(value: Any, v: Verl) -> Any:
    return value


def is_true(value: Any, v: Verl) -> bool:
    return bool(value)


def needs(flag: str, what: str) -> Convert:
    """The value when the verl key ``flag`` is true, else Unused (verl reads it only then)."""
    def convert(value: Any, v: Verl) -> Any:
        if not v.get(flag):
            raise Unused(f"verl reads it only with {flag}=true ({what})")
        return value
    return convert


def critic(convert: Convert = same) -> Convert:
    """A critic key: used only when the run trains a critic."""
    def wrapped(value: Any, v: Verl) -> Any:
        if not v.critic:
            raise Unused(f"no critic in this run (algorithm.adv_estimator={v.get('algorithm.adv_estimator')})", quiet=True)
        return convert(value, v)
    return wrapped


def same_wrap(convert: Convert = same) -> Convert:
    return convert


def prompts_to_samples(value: Any, v: Verl) -> int:
    """verl's mini-batches count prompts; megarl's count samples, prompts x rollout.n."""
    return int(value) * v.n


def global_micro(value: Any, v: Verl) -> int:
    """verl's (deprecated) global micro-batch is split over its data-parallel ranks (every GPU under
    FSDP, GPUs / (TP x PP) under Megatron); megarl's is per DP rank."""
    dp = v.gpus
    if v.megatron:
        model_parallel = int(v.get(f"{ACTOR}.megatron.tensor_model_parallel_size") or 1)
        model_parallel *= int(v.get(f"{ACTOR}.megatron.pipeline_model_parallel_size") or 1)
        dp = max(1, dp // model_parallel)
    return max(1, int(value) // dp)


def dynamic(value: Any, v: Verl, flag: str = f"{ACTOR}.use_dynamic_bsz") -> Any:
    if not v.get(flag):
        raise Unused(f"verl reads it only with {flag}=true")
    return int(value)


def dynamic_flag(actor: str, section: str) -> Convert:
    """use_dynamic_bsz=true: the token budget of the same group (verl's default when not given:
    16384 for the actor, 32768 for the critic)."""
    def convert(value: Any, v: Verl) -> Any:
        if not value:
            raise Unused(f"false: micro-batches by count ({section}.micro_batch_size)")
        budget = v.get(f"{actor}.ppo_max_token_len_per_gpu")
        return int(budget) if budget is not None else _VERL_MAX_TOKENS * (2 if section == "critic" else 1)
    return convert


# verl's advantage estimators megarl has under the same name (megarl's dr_grpo is verl's grpo with
# norm_adv_by_std_in_grpo=false and seq-mean-token-sum-norm, translated key by key).
_ESTIMATORS = {n: n for n in ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax")}


def estimator(value: Any, v: Verl) -> str:
    return str(choice(value, _ESTIMATORS, f"megarl has no {value} advantage estimator"))


# verl's KL estimator names -> megarl's; "+": the straight-through variants (value of the named
# estimator, k2's gradient), k2+ / mse+ being k2 itself.
_KL = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}
_KL |= {f"{name}+": f"{ours}+" if ours != "k2" else "k2" for name, ours in _KL.items()}


def kl_estimator(flag: str) -> Convert:
    def convert(value: Any, v: Verl) -> str:
        if not v.get(flag):
            raise Unused(f"verl reads it only with {flag}=true")
        why = f"megarl has no {value} KL estimator"
        if value == "full":
            why = ("full (the whole-vocabulary KL) needs both models' distributions over the vocabulary at every token; "
                   "megarl's log-prob pass keeps only the sampled token's log-prob (verl does not implement it either)")  # fmt: skip
        return str(choice(value, _KL, why))
    return convert


def loss_mode(value: Any, v: Verl) -> str:
    """verl's vanilla is megarl's ppo; gspo is gspo."""
    return str(choice(value, {"vanilla": "ppo", "gspo": "gspo"}, f"megarl has no {value} policy loss"))


def loss_agg(value: Any, v: Verl) -> str:
    return str(choice(value, {m: m for m in LOSS_AGGS}, f"megarl has no {value} loss aggregation"))


def clip(side: str) -> Convert:
    """clip_ratio sets both sides unless clip_ratio_low / clip_ratio_high is given."""
    def convert(value: Any, v: Verl) -> Any:
        if side == "both":
            low, high = v.given.get(f"{ACTOR}.clip_ratio_low", value), v.given.get(f"{ACTOR}.clip_ratio_high", value)
            return float(low), float(high)
        return float(value)
    return convert


def warmup_steps(value: Any, v: Verl, actor: str = ACTOR) -> int:
    """verl's scheduler steps once per RL step; megarl's once per optimizer step (per mini-batch and epoch)."""
    if int(value) < 0:
        raise Unused("-1: verl uses lr_warmup_steps_ratio")
    return int(value) * _optimizer_steps_per_step(v, actor)


def _optimizer_steps_per_step(v: Verl, actor: str) -> int:
    mini = int(v.get(f"{actor}.ppo_mini_batch_size"))
    return max(1, int(v.get("data.train_batch_size")) // mini) * int(v.get(f"{actor}.ppo_epochs"))


def warmup_ratio(actor: str) -> Convert:
    """verl's ratio of its RL steps is megarl's of its optimizer steps (both scale by the optimizer
    steps per RL step); verl reads it only when lr_warmup_steps is null or <= 0."""
    def convert(value: Any, v: Verl) -> float:
        if not value:
            raise Unused("0: no warm-up (megarl's default)")
        if int(v.get(f"{actor}.optim.lr_warmup_steps") or -1) > 0:
            raise Unused(f"{actor}.optim.lr_warmup_steps is set and wins")
        return float(value)
    return convert


def schedule(value: Any, v: Verl) -> str:
    names = ("constant", "cosine", "linear", "wsd")
    return str(choice(value, {n: n for n in names}, f"megarl has no {value} learning-rate schedule"))


def min_lr_ratio(value: Any, v: Verl) -> float:
    if not value:
        raise Unused("0 or null: decay to 0 (megarl's min_lr default)")
    return float(value)


def min_lr(actor: str) -> Convert:
    def convert(value: Any, v: Verl) -> float:
        if value and v.get(f"{actor}.optim.min_lr_ratio"):
            raise Unused(f"beside {actor}.optim.min_lr_ratio: megarl takes one of them, the ratio (min_lr_ratio x lr)")
        return float(value)
    return convert


def recompute(value: Any, v: Verl) -> str:
    return "full" if value else "none"


def granularity(value: Any, v: Verl) -> str:
    if value is None:
        raise Unused("null: no recomputation set here (enable_gradient_checkpointing decides)")
    return "full" if value == "full" else "selective"


def offload(keys: tuple[str, ...]) -> Convert:
    """megarl offloads params, grads and optimizer state together: on when verl offloads any."""
    def convert(value: Any, v: Verl) -> bool:
        return any(bool(v.get(k)) for k in keys)
    return convert


def null_is_one(value: Any, v: Verl) -> int:
    return 1 if value is None else int(value)


def sequence_parallel(value: Any, v: Verl) -> bool | None:
    """verl's true means 'on when tp > 1' (Megatron refuses it at tp 1): megarl's None."""
    return None if value else False


def engine(value: Any, v: Verl) -> Any:
    """verl's HF rollout generates with transformers inside its training workers (small and debug
    runs): megarl's torch engine, its engine in the policy's own processes, is the same design."""
    if value == "hf":
        return Noted("torch", "verl's HF rollout (transformers' generate in the training workers, for small and debug "
                     "runs) is megarl's torch engine, which generates in the policy's processes too; for a real run "
                     "set rollout.engine=sglang")  # fmt: skip
    choice(value, {"sglang": "sglang", "vllm": "sglang", "hf": "torch"},
           f"{value} is not a rollout engine megarl knows (it generates with SGLang, or its torch engine)")  # fmt: skip
    return Noted("sglang", "megarl generates with SGLang (vLLM is not supported)" if value == "vllm" else "")


def rollout_tp(value: Any, v: Verl) -> int:
    if v.get(f"{ROLLOUT}.name") == "hf":
        raise Unused("verl's HF rollout generates with the training workers' model; megarl's torch engine runs in one "
                     "process (rollout.tp 1)", quiet=True)  # fmt: skip
    return int(value)


def top_k(value: Any, v: Verl) -> Any:
    """verl's 0 ("0 for hf rollout") and -1 both mean no top-k: megarl's -1, the whole vocabulary."""
    if int(value) <= 0:
        return Noted(-1, f"verl's {value}: no top-k, the whole vocabulary (megarl's -1)")
    return int(value)


def do_sample(value: Any, v: Verl) -> float:
    if value:
        raise Unused("true: sampling at rollout.sampling.temperature (megarl always samples)")
    return 0.0


def val_greedy(value: Any, v: Verl) -> bool:
    return not value


def val_sampling(kind: Convert) -> Convert:
    """A val_kwargs sampling value: verl reads it only with val_kwargs.do_sample=true (and megarl
    refuses rollout.val.temperature, top_p and top_k while rollout.val.greedy is true)."""
    def convert(value: Any, v: Verl) -> Any:
        if not v.get(f"{ROLLOUT}.val_kwargs.do_sample"):
            raise Unused("unused: verl's val_kwargs.do_sample is false and verl reads it only when true "
                         "(megarl validates greedily, rollout.val.greedy=true)")  # fmt: skip
        return kind(value, v)
    return convert


def agent_loop(value: Any, v: Verl) -> str:
    return LOOP_ALIASES.get(str(value), str(value))


def model_path(value: Any, v: Verl) -> Any:
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


def critic_path(value: Any, v: Verl) -> Any:
    if not v.critic:
        raise Unused(f"no critic in this run (algorithm.adv_estimator={v.get('algorithm.adv_estimator')})", quiet=True)
    if value == PLACEHOLDER_MODEL or value == v.get(f"{MODEL}.path"):
        raise Unused("verl's placeholder (or the actor's model): the critic starts from the actor's model, megarl's "
                     "critic.path None")  # fmt: skip
    return str(value)


def lora_rank(value: Any, v: Verl) -> int:
    if not value:
        raise Unused("0: no LoRA (megarl's actor.lora None)")
    return int(value)


def differs(reason: str) -> Convert:
    """A key megarl has no equivalent for whose value changes what verl would train (set: the
    translation stops unless told to accept it); unset (null, 0, false): nothing to carry."""
    def convert(value: Any, v: Verl) -> Any:
        if not value:
            raise Unused(f"{value}: nothing to carry")
        raise Unused(f"{reason}: the megarl run would differ from verl's", NOT_YET, differs=True)
    return convert


def lora(convert: Convert, rank: str = f"{MODEL}.lora_rank") -> Convert:
    def wrapped(value: Any, v: Verl) -> Any:
        if not v.get(rank):
            raise Unused(f"verl reads it only with {rank} > 0")
        return convert(value, v)
    return wrapped


# Megatron's module names in verl's Megatron LoRA (model.lora.target_modules) -> HF's.
_MCORE_MODULES = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                  "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}  # fmt: skip


def mcore_modules(value: Any, v: Verl) -> list[str]:
    names = [value] if isinstance(value, str) else list(value)
    if set(names) >= set(_MCORE_MODULES) or "all-linear" in names:
        return ["all-linear"]
    unknown = [n for n in names if n not in _MCORE_MODULES]
    if unknown:
        raise Refused(unknown[0], [*_MCORE_MODULES, "all-linear"], f"{unknown[0]} is not a Megatron linear megarl's LoRA targets")
    return [hf for n in names for hf in _MCORE_MODULES[n]]


def router_replay(value: Any, v: Verl) -> str:
    """verl's R3 replays the engine's routing in training (megarl's experts); R2 is not megarl's."""
    if value in ("disabled", None):
        raise Unused("disabled: the trainer's router decides (megarl's default)")
    return str(choice(value, {"R3": "experts", "disabled": None}, f"{value}: megarl replays the engine's routing "
                          "only (verl's R3), or none"))  # fmt: skip


def target_modules(value: Any, v: Verl) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def steps(value: Any, v: Verl) -> int:
    """verl's -1 (never) is megarl's 0."""
    return max(0, int(value))


def total_epochs(value: Any, v: Verl) -> int:
    if v.get("trainer.total_training_steps") is not None:
        raise Unused("trainer.total_training_steps is set and wins")
    return int(value)


def critic_warmup(value: Any, v: Verl) -> int:
    """verl's critic_warmup=N trains the actor from step N (steps count from 1); megarl's N from step N+1."""
    return max(0, int(value) - 1)


_SINKS = ("console", "jsonl", "tensorboard", "wandb", "mlflow", "swanlab")


def loggers(value: Any, v: Verl) -> list[str]:
    names = [value] if isinstance(value, str) else list(value or [])
    unknown = [n for n in names if n not in _SINKS]
    if unknown:
        raise Unused(f"megarl has no {', '.join(map(str, unknown))} sink (it has {', '.join(_SINKS)}); give "
                     "trainer.loggers", NOT_YET)  # fmt: skip
    return names


def resume(value: Any, v: Verl) -> str:
    if value == "resume_path":
        path = v.get("trainer.resume_from_path")
        if not path:
            raise Unused("resume_path without trainer.resume_from_path")
        return str(path)
    return str(choice(value, {"auto": "auto", "disable": "disable", "resume_path": None}, f"{value} is not a resume mode"))


def resume_path(value: Any, v: Verl) -> str:
    if v.get("trainer.resume_mode") != "resume_path" or not value:
        raise Unused("verl reads it only with trainer.resume_mode=resume_path")
    return str(value)


def output_dir(value: Any, v: Verl) -> str:
    return str(value)


def default_output_dir(v: Verl) -> str:
    """checkpoints/PROJECT/EXPERIMENT"""
    return f"checkpoints/{v.get('trainer.project_name')}/{v.get('trainer.experiment_name')}"


def default_critic_mini(v: Verl) -> Any:
    """actor's ppo_mini_batch_size"""
    return v.get(f"{ACTOR}.ppo_mini_batch_size")


def default_critic_shuffle(v: Verl) -> Any:
    """actor's shuffle"""
    return v.get(f"{ACTOR}.shuffle")


def default_response(v: Verl) -> Any:
    """data.max_response_length"""
    return v.get("data.max_response_length")


def default_prompt(v: Verl) -> Any:
    """data.max_prompt_length"""
    return v.get("data.max_prompt_length")


def default_ckpt(v: Verl) -> Any:
    """enable_gradient_checkpointing (actor's)"""
    return v.get(f"{MODEL}.enable_gradient_checkpointing")


def reward_custom(value: Any, v: Verl) -> Any:
    if not v.get("custom_reward_function.path"):
        raise Unused("verl reads it only with custom_reward_function.path")
    return value


def reward_manager(value: Any, v: Verl) -> Any:
    if value == "batch":
        if not v.get("custom_reward_function.path"):
            raise Unused("batch without custom_reward_function.path: megarl's built-in scorers score one sample at a time")
        return True
    raise Unused(f"{value}: megarl scores with its reward workers (reward.workers); DAPO's overlong shaping is "
                 "algorithm.overlong" if value == "dapo" else f"{value}: megarl scores with its reward workers (reward.workers)")


def reward_model(convert: Convert = same) -> Convert:
    def wrapped(value: Any, v: Verl) -> Any:
        if not v.get("reward_model.enable"):
            raise Unused("verl reads it only with reward_model.enable=true")
        return convert(value, v)
    return wrapped


def reward_model_enable(value: Any, v: Verl) -> Any:
    if not value:
        raise Unused("false: rule-based rewards (megarl's default)")
    return str(v.get("reward_model.model.path"))


def overlong(prefix: str, part: str) -> Convert:
    def convert(value: Any, v: Verl) -> Any:
        if not v.get(f"{prefix}.enable"):
            raise Unused(f"verl reads it only with {prefix}.enable=true")
        return int(value) if part == "len" else float(value)
    return convert


def overlong_enable(prefix: str) -> Convert:
    def convert(value: Any, v: Verl) -> int:
        if not value:
            raise Unused("false: no overlong shaping (megarl's default)")
        return int(v.get(f"{prefix}.len") or 0)
    return convert


def filter_rounds(value: Any, v: Verl) -> int:
    if not v.get("algorithm.filter_groups.enable"):
        raise Unused("verl reads it only with algorithm.filter_groups.enable=true")
    if int(value) <= 0:
        raise Unused("0 (no limit): megarl's dynamic sampling always stops after max_rounds; set algorithm.dynamic_sampling.max_rounds")
    return int(value)


def truncation(value: Any, v: Verl) -> str:
    return str(choice(value, {n: n for n in ("error", "left", "right")}, f"megarl has no {value} truncation"))


def device(value: Any, v: Verl) -> str:
    return str(choice(value, {"cuda": "cuda", "cpu": "cpu"}, f"megarl runs on cuda (or cpu), not {value}"))


def keep(value: Any, v: Verl) -> int:
    if value is None:
        raise Unused("null: verl keeps every checkpoint; megarl keeps trainer.keep_last")
    return int(value)


def ep_rollout(value: Any, v: Verl) -> Any:
    if int(value) > 1:
        raise Unused("megarl's SGLang engines split experts by rollout.tp; give SGLang's --ep-size in rollout.server_args", NOT_YET)
    raise Unused("1: no expert parallelism in the engines")


def dict_entries(value: Any, v: Verl) -> dict[str, Any]:
    """A mapping given whole (a Hydra override's ``{a: 1}``): its entries, nulls left out as verl does."""
    if not isinstance(value, dict):
        raise TypeError("a mapping of names to values")
    return {str(k): x for k, x in value.items() if x is not None}


def engine_arg(value: Any, v: Verl) -> Any:
    if value is None:
        raise Unused("null: left out, as verl does")
    return value


def custom_cls(value: Any, v: Verl) -> dict[str, str]:
    """data.custom_cls given whole ({path, name})."""
    if not isinstance(value, dict) or not value.get("path"):
        raise Unused("no path: verl's own dataset class (megarl's reads verl-schema parquet files)")
    if not value.get("name"):
        raise Unused("a path without a name: verl needs both")
    return {"path": str(value["path"]), "name": str(value["name"])}


def custom_cls_path(value: Any, v: Verl) -> str:
    if not value:
        raise Unused("null: verl's own dataset class (megarl's reads verl-schema parquet files)")
    if not v.get("data.custom_cls.name"):
        raise Unused("without data.custom_cls.name: verl needs both")
    return str(value)


def custom_cls_name(value: Any, v: Verl) -> str:
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
    return None if total is None else global_micro(total, v)


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


def logprob_size(prefix: str, tokens: bool) -> Convert:
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


def logprob_dynamic_flag(prefix: str) -> Convert:
    def convert(value: Any, v: Verl) -> Any:
        if not value:
            raise Unused("false: log-prob micro-batches by count (actor.logprob_micro_batch_size)")
        return logprob_size(prefix, tokens=True)(v.given.get(f"{prefix}.log_prob_max_token_len_per_gpu",
                                                              _logprob_tokens_of(v, prefix)), v)  # fmt: skip
    return convert


def custom_path(value: Any, v: Verl) -> Any:
    if not value:
        raise Unused("null: no custom reward function")
    return str(value)
