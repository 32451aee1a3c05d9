"""The planner's checks of mixture-of-experts models: expert parallelism (ep, etp) against the
model and the layout, and the ``moe`` section of each trained model (routing replay against the
rollout engine, settings a dense model has no use for, token drops)."""

from __future__ import annotations

from megarl.config.architectures import ArchSpec
from megarl.config.sections import MegaRLConfig
from megarl.config.train_sections import ActorConfig, MoEConfig
from megarl.plan.issues import Issue, choices, divisors
from megarl.plan.rollout_checks import rollout_tp_choices

_DEFAULT_MOE = MoEConfig().model_dump()
# The HF model types whose bridge maps experts (megarl/models/qwen3_moe.py, deepseek_v3.py); the
# planner imports no torch.
MOE_MODEL_TYPES = ("qwen3_moe", "deepseek_v3")


def check_moe_settings(cfg: MegaRLConfig, arch: ArchSpec, sections: tuple[str, ...], issues: list[Issue], *,
                       rollout: bool = True) -> None:  # fmt: skip
    """``<section>.moe`` of each trained model: on a dense model any setting off its default is a
    mistake (it would be ignored); on an MoE model, replayed routing weights need an engine that
    reports them (``rollout``: the run has engines; `megarl sft` has none), and a capacity factor
    drops tokens the engine did not drop."""
    if arch.num_experts and arch.model_type not in MOE_MODEL_TYPES:
        issues.append(Issue("model", f"{arch.name} has {arch.num_experts} experts and megarl's {arch.model_type} bridge is "
                            f"dense; mixture-of-experts bridges: {', '.join(MOE_MODEL_TYPES)}"))  # fmt: skip
    for section in sections:
        moe: MoEConfig = getattr(cfg, section).moe
        if not arch.num_experts:
            for key, value in moe.model_dump().items():
                if value != _DEFAULT_MOE[key]:
                    issues.append(Issue(f"{section}.moe.{key}", f"({value}) applies to mixture-of-experts models and "
                                        f"{arch.name} is dense; remove it"))  # fmt: skip
            continue
        if rollout and moe.routing_replay == "experts_and_weights" and cfg.rollout.engine == "sglang":
            issues.append(Issue(f"{section}.moe.routing_replay", "(experts_and_weights) needs the engine's routing weights "
                                "and SGLang returns expert ids only; use experts (the trainer's own weights over the "
                                "engine's experts), or rollout.engine torch"))  # fmt: skip
        _check_trainer_side(cfg, section, moe, arch, issues)
        if moe.capacity_factor is not None:
            issues.append(Issue(f"{section}.moe.capacity_factor", f"({moe.capacity_factor:g}) drops the tokens an over-full "
                                "expert cannot take, and the engine drops none: those tokens' log-probs differ between "
                                "trainer and engine (a growing mismatch); remove it to train dropless", level="warning"))  # fmt: skip


def _check_trainer_side(cfg: MegaRLConfig, section: str, moe: MoEConfig, arch: ArchSpec, issues: list[Issue]) -> None:
    """What the MoE bridges and the update cannot do (they would refuse it in every worker, after
    the cluster started), and a critic replaying routing the rollout does not ask for (only
    actor.moe.routing_replay does)."""
    if moe.expert_bias_update_rate and not arch.router_bias:
        issues.append(Issue(f"{section}.moe.expert_bias_update_rate", f"({moe.expert_bias_update_rate:g}) moves a router's "
                            f"correction bias (DeepSeek-V3's e_score_correction_bias) and {arch.name}'s router has none; "
                            "remove it, or balance with aux_loss_coef"))  # fmt: skip
    if section == "critic" and moe.routing_replay != "none" and cfg.actor.moe.routing_replay == "none":
        issues.append(Issue("critic.moe.routing_replay", f"({moe.routing_replay}) replays the routing the rollout "
                            "returns, and the rollout asks the engines for it only with actor.moe.routing_replay set; set "
                            "both, or neither"))  # fmt: skip


def check_expert_parallel(section: str, cfg: ActorConfig, arch: ArchSpec, gpus: int, issues: list[Issue]) -> None:
    """ep and etp: dense models take neither; an MoE model's ep divides its experts and, with etp,
    tp x dp (Megatron's parallel_state builds the expert groups over the same ranks: etp x ep x
    pp must divide the world); at tp > 1 its MoE layers train only with sequence parallelism.
    Each fix names a layout the rules take (never "try none")."""
    par, field = cfg.parallel, f"{section}.parallel"
    if not arch.num_experts:
        for knob in ("ep", "etp"):
            if getattr(par, knob) != 1:
                issues.append(Issue(f"{field}.{knob}", f"({getattr(par, knob)}) splits the experts of a mixture-of-experts "
                                    f"model and {arch.name} is dense; set it to 1"))  # fmt: skip
        return
    experts, ep, etp, tp, pp = arch.num_experts, par.ep, par.etp, par.tp, par.pp
    tp_dp = gpus // pp if gpus % (tp * pp) == 0 else None  # None: the layout's own check refuses tp x pp
    _check_etp(field, cfg, arch, gpus, tp_dp, issues)
    if tp_dp is not None and (experts % ep or tp_dp % (ep * etp)):
        issues.append(Issue(f"{field}.ep", f"({ep}) must divide num_experts ({experts}) and, times etp ({etp}), tp x dp "
                            f"({tp} x {tp_dp // tp} = {tp_dp}): the expert-parallel groups lie across the tensor- and "
                            f"data-parallel ranks; {_ep_fix(cfg, arch, gpus, tp_dp)}"))  # fmt: skip
    if tp > 1 and par.sequence_parallel is False:
        issues.append(Issue(f"{field}.sequence_parallel", f"(false) at tp {tp}: Megatron's MoE layers train only with "
                            "sequence parallelism when tp > 1; remove it (on by default) or set it true"))  # fmt: skip


def _check_etp(field: str, cfg: ActorConfig, arch: ArchSpec, gpus: int, tp_dp: int | None, issues: list[Issue]) -> None:
    """etp on its own: 1 for DeepSeek-V3, a divisor of the experts' intermediate size, and tp at ep 1."""
    ep, etp, tp = cfg.parallel.ep, cfg.parallel.etp, cfg.parallel.tp
    f = arch.moe_ffn_hidden_size
    if etp != 1 and arch.model_type == "deepseek_v3":
        issues.append(Issue(f"{field}.etp", f"({etp}) is not supported for deepseek_v3 yet (each expert stays whole on its "
                            "rank); set it to 1"))  # fmt: skip
    elif f and f % etp:
        fits = [e for e in divisors(f) if tp_dp is not None and _expert_layout_ok(ep, e, tp, tp_dp)]
        issues.append(Issue(f"{field}.etp", f"({etp}) must divide moe_intermediate_size ({f}): expert tensor parallelism "
                            f"splits each expert's gate/up rows and down columns; try "
                            f"{choices(fits) + f' (at ep {ep})' if fits else choices(divisors(f))}"))  # fmt: skip
    elif ep == 1 and etp != tp:
        # Megatron marks expert parameters as its own only at ep > 1 (their "allreduce" attribute)
        ways = [f"set etp to {tp}"] + ([f"tp to {etp}"] if _tp_fits(cfg, arch, gpus, etp) else [])
        more = [d for d in divisors(arch.num_experts) if d > 1 and tp_dp is not None and tp_dp % (d * etp) == 0]
        ways += [f"ep to {choices(more)}"] if more else []
        issues.append(Issue(f"{field}.etp", f"({etp}) with ep 1 must equal tp ({tp}): at ep 1 Megatron trains the experts as "
                            "dense parameters and reduces their gradients over the data-parallel group only, which is right "
                            f"only when the experts split as the tensor-parallel layers do; {', or '.join(ways)}"))  # fmt: skip


def _expert_layout_ok(ep: int, etp: int, tp: int, tp_dp: int) -> bool:
    """ep x etp tiles tp x dp, and at ep 1 etp equals tp (the rules of check_expert_parallel)."""
    return tp_dp % (ep * etp) == 0 and (ep > 1 or etp == tp)


def _tp_fits(cfg: ActorConfig, arch: ArchSpec, gpus: int, tp: int) -> bool:
    """Whether ``tp`` (at the section's pp) splits the attention and tiles the GPUs."""
    pp = cfg.parallel.pp
    return arch.num_heads % tp == 0 and arch.num_kv_heads % tp == 0 and gpus % (tp * pp) == 0


def _ep_fix(cfg: ActorConfig, arch: ArchSpec, gpus: int, tp_dp: int) -> str:
    """A layout that takes the experts: another ep at this etp, else another etp at this ep, else
    tp = etp at ep 1, else whole experts (etp 1) and an ep that fits."""
    experts, ep, etp, tp = arch.num_experts, cfg.parallel.ep, cfg.parallel.etp, cfg.parallel.tp
    eps = [d for d in divisors(experts) if _expert_layout_ok(d, etp, tp, tp_dp)]
    if eps:
        return f"try {choices(eps)}"
    f = arch.moe_ffn_hidden_size or 1
    etps = [e for e in divisors(f) if _expert_layout_ok(ep, e, tp, tp_dp)] if experts % ep == 0 else []
    ways = [f"etp {choices(etps)} (at ep {ep})"] if etps else []
    if etp > 1 and _tp_fits(cfg, arch, gpus, etp):
        ways.append(f"tp {etp} with ep 1")
    if not ways:
        whole = [d for d in divisors(experts) if _expert_layout_ok(d, 1, tp, tp_dp)]
        ways = [f"etp 1 with ep {choices(whole)}"] if whole else [f"an ep x etp that divides tp x dp ({tp_dp})"]
    return "try " + ", or ".join(ways)


def ep_raise_knob(section: str, cfg: ActorConfig, arch: ArchSpec, gpus: int) -> str | None:
    """For an over-memory error: the larger ``<section>.parallel.ep`` values that follow the rules of
    :func:`check_expert_parallel` on ``gpus`` (each GPU then holds 1/ep of every layer's experts),
    None for a dense model or when none does."""
    par = cfg.parallel
    if not arch.num_experts or gpus % (par.tp * par.pp):
        return None
    tp_dp = gpus // par.pp
    more = [d for d in divisors(arch.num_experts) if d > par.ep and tp_dp % (d * par.etp) == 0]
    return f"raise {section}.parallel.ep to {choices(more)}" if more else None


def check_moe_serving(cfg: MegaRLConfig, arch: ArchSpec, issues: list[Issue]) -> None:
    """SGLang serves an MoE model with each expert split over the engine's TP ranks (its fused MoE
    divides moe_intermediate_size by tp, and refuses a remainder at load)."""
    if arch.model_type == "deepseek_v3" and cfg.rollout.engine == "sglang" and cfg.cluster.device == "cpu":
        # SGLang 0.5.23 on CPU (docs/moe.md): without rope_scaling its MLA rope asserts at load; with yarn
        # it loads a model whose config.json carries DeepSeek's moe_layer_freq / topk_method / scoring_func
        # and generates, but greedy tokens and log-probs differ from HF's from the first token (yarn factor
        # 1 and all-dense layers as well: its CPU MLA, not the rope or routing), so its outputs are not HF's
        issues.append(Issue("rollout.engine", "(sglang) cannot serve deepseek_v3 on CPU: SGLang 0.5.23's CPU path needs "
                            "rope_scaling (yarn) and, given it, generates other tokens than HF's model; use "
                            "rollout.engine=torch on CPU"))  # fmt: skip
    tp, f = cfg.rollout.tp, arch.moe_ffn_hidden_size
    if arch.num_experts and cfg.rollout.engine == "sglang" and f % tp:
        fits = [t for t in rollout_tp_choices(cfg, arch) if f % t == 0]
        issues.append(Issue("rollout.tp", f"({tp}) must divide moe_intermediate_size ({f}): SGLang splits each expert "
                            f"over the engine's TP ranks; try {choices(fits)}"))  # fmt: skip
