"""The planner's checks of LoRA (``actor.lora``, ``rollout.weight_sync.lora``; docs/lora.md), what
the plan resolves for it (``model.layer_spec``), and the plan report's line on it. Torch-free,
like the planner.

What LoRA changes in the plan's numbers lives beside the numbers: the adapters' parameters and
the policy's memory in megarl/plan/gpu_memory.py, the push in megarl/plan/push_model.py, the
residency table without a reference model in megarl/memory/residency.py.
"""

from __future__ import annotations

from megarl.config.architectures import ArchSpec
from megarl.config.sections import MegaRLConfig
from megarl.plan.gpu_memory import (
    LORA_MLP_MODULES,
    lora_expert_params_per_gpu,
    lora_module_shapes,
    lora_params,
    lora_params_per_gpu,
)
from megarl.plan.issues import Issue
from megarl.plan.push_model import push_bytes
from megarl.plan.role_layout import RoleLayout


def policy_lora_params(cfg: MegaRLConfig, arch: ArchSpec, layout: RoleLayout, *, experts: bool = False) -> float | None:
    """The policy's adapter parameters per GPU under actor.lora (None: full fine-tuning);
    ``experts``: the experts' adapters among them only."""
    lora = cfg.actor.lora
    if lora is None:
        return None
    count = lora_expert_params_per_gpu if experts else lora_params_per_gpu
    return count(arch, lora.rank, lora.modules, tp=layout.tp, pp=layout.pp, ep=layout.ep)


def expert_modules(cfg: MegaRLConfig, arch: ArchSpec) -> tuple[str, ...]:
    """The targeted modules that adapt each expert of the model's MoE layers (none on a dense model)."""
    lora = cfg.actor.lora
    if lora is None or not arch.num_moe_layers:
        return ()
    return tuple(m for m in lora.modules if m in LORA_MLP_MODULES)


def lora_resolved(cfg: MegaRLConfig) -> dict[str, str]:
    """``model.layer_spec: auto`` is local under LoRA: the adapters wrap the local spec's separate
    norm and linear layers, and transformer-engine's spec fuses the norm into the QKV and fc1
    linears (so auto, which would pick te on CUDA with transformer-engine installed, cannot)."""
    return (
        {"model.layer_spec": "local"}
        if cfg.actor.lora is not None and cfg.model.layer_spec == "auto"
        else {}
    )


def check_lora(
    cfg: MegaRLConfig, arch: ArchSpec, issues: list[Issue], *, rollout: bool = True
) -> None:
    """actor.lora against the layout, the model, the layer spec and the engine (``rollout``: the
    run has engines; `megarl sft` has none); critic.lora is refused outright."""
    if cfg.critic.lora is not None:
        issues.append(
            Issue(
                "critic.lora",
                "LoRA trains the policy only (the critic is trained whole); remove critic.lora",
            )
        )
    lora, push = cfg.actor.lora, cfg.rollout.weight_sync.lora
    if lora is None:
        if rollout and push == "adapter":
            issues.append(Issue("rollout.weight_sync.lora", "(adapter) applies with actor.lora only and this run trains "
                                "the whole model; remove it", level="warning"))  # fmt: skip
        return
    tp = cfg.actor.parallel.tp
    if lora.dropout > 0 and tp > 1:
        # A column-parallel linear's A is replicated: each TP rank would drop its own mask of the same
        # input, and the shards of B A x would come from different inputs.
        issues.append(Issue("actor.lora.dropout", f"({lora.dropout:g}) needs actor.parallel.tp=1 and tp is {tp} (the "
                            "tensor-parallel ranks would drop different inputs); set dropout to 0, or tp to 1"))  # fmt: skip
    if rollout and push == "adapter" and cfg.rollout.engine == "torch":
        issues.append(Issue("rollout.weight_sync.lora", "(adapter) needs SGLang's LoRA serving and rollout.engine is "
                            "torch; use rollout.weight_sync.lora=merged (the default), or rollout.engine=sglang"))  # fmt: skip
    if rollout and push == "adapter" and cfg.asynchronous:
        # A request in flight keeps the adapter it started with across a push, so its tokens after
        # the push would be labelled with a version that did not generate them.
        issues.append(Issue("rollout.weight_sync.lora", "(adapter) is not supported yet with asynchronous training "
                            f"(rollout.max_staleness={cfg.rollout.max_staleness}); use rollout.weight_sync.lora=merged"))  # fmt: skip
    _check_modules_adaptable(cfg, arch, issues)
    experts = expert_modules(cfg, arch)
    if experts and cfg.actor.parallel.etp > 1:  # the adapters sit whole beside each expert (megarl/models/lora.py)
        issues.append(Issue("actor.parallel.etp", f"({cfg.actor.parallel.etp}) splits each expert, and actor.lora adapts "
                            f"the experts ({', '.join(experts)}), whose adapters need them whole; set etp to 1, or target "
                            "the attention only"))  # fmt: skip
    if rollout and push == "adapter" and experts:
        # transformers holds Qwen3-MoE experts as fused parameters: an HF PEFT adapter cannot name them.
        issues.append(Issue("rollout.weight_sync.lora", f"(adapter) cannot carry the adapters on {arch.name}'s experts "
                            f"({', '.join(experts)}: an HF PEFT adapter cannot hold them); use rollout.weight_sync.lora="
                            "merged, or target the attention only"))  # fmt: skip
    narrowest = _narrowest_module(arch, lora.modules)
    if narrowest is not None and lora.rank > narrowest[1]:
        # B A (out x in) has rank at most min(in, out): the rank past that adds parameters, and
        # their gradients and Adam state, and nothing the adapter can express.
        module, width = narrowest
        issues.append(Issue("actor.lora.rank", f"({lora.rank}) exceeds the {width} features of {module} on "
                            f"{arch.name} (hidden size {arch.hidden_size}): an adapter's update B A has rank at most "
                            "min(in, out), so the rank past it adds adapter parameters, their gradients and Adam "
                            f"state (GPU memory) and nothing the adapters can learn; set actor.lora.rank to {width} "
                            "or less", level="warning"))  # fmt: skip
    if cfg.model.layer_spec == "te":
        issues.append(Issue("model.layer_spec", "(te) fuses the norm into the QKV and fc1 linears, which LoRA cannot "
                            "wrap; use model.layer_spec local (or auto, which is local with actor.lora)"))  # fmt: skip
    if cfg.reference_enabled and cfg.reference.offload:
        issues.append(Issue("reference.offload", "(true) moves nothing with actor.lora: there is no reference model (the "
                            "policy with its adapters off gives the reference log-probs); remove it", level="warning"))  # fmt: skip


def _check_modules_adaptable(cfg: MegaRLConfig, arch: ArchSpec, issues: list[Issue]) -> None:
    """Refuse target modules megarl cannot adapt on the model: multi-latent attention (DeepSeek-V3)
    has no k_proj/v_proj but low-rank q and kv pairs (q_proj when q_lora_rank is null), which
    megarl's adapters do not wrap (megarl/models/lora.py); all-linear includes them."""
    valid = tuple(lora_module_shapes(arch))
    lora = cfg.actor.lora
    assert lora is not None
    absent = [m for m in lora.modules if m not in valid]
    if absent:
        verb = "includes" if "all-linear" in lora.target_modules else "names"
        issues.append(Issue("actor.lora.target_modules", f"({', '.join(lora.target_modules)}) {verb} "
                            f"{', '.join(absent)}, which LoRA cannot adapt on {arch.name} ({arch.model_type}: multi-latent "
                            "attention, whose q and kv projections take no adapters yet); target any of "
                            f"{', '.join(valid)}"))  # fmt: skip


def _narrowest_module(arch: ArchSpec, modules: tuple[str, ...]) -> tuple[str, int] | None:
    """The targeted module with the fewest input or output features, and that number (an
    expert's gate/up/down at the experts' width on an MoE model)."""
    shapes = lora_module_shapes(arch)
    widths = {m: min(shapes[m]) for m in modules if m in shapes}
    if arch.num_moe_layers:
        for m in (m for m in modules if m in LORA_MLP_MODULES):
            widths[f"the experts' {m}"] = min(arch.hidden_size, arch.moe_ffn_hidden_size)
            if arch.num_moe_layers == arch.num_layers:  # no dense MLP to adapt
                widths.pop(m)
    return min(widths.items(), key=lambda kv: kv[1]) if widths else None


def lora_summary(cfg: MegaRLConfig, arch: ArchSpec) -> str | None:
    """The plan report's line on LoRA (None: full fine-tuning): rank, alpha, the modules that get
    adapters, the trainable parameters, the reference and what a push carries."""
    lora = cfg.actor.lora
    if lora is None:
        return None
    trainable = lora_params(arch, lora.rank, lora.modules)
    experts = expert_modules(cfg, arch)
    moe = f" ({', '.join(experts)} on each of the {arch.num_experts} experts of the MoE layers)" if experts else ""
    reference = ("no reference model (the policy with its adapters off gives the reference log-probs)"
                 if cfg.reference_enabled else "no reference")  # fmt: skip
    pushed = push_bytes(cfg, arch)[0] / 1e9
    push = (f"push adapter: the adapters only, {pushed:.3g} GB" if cfg.rollout.weight_sync.lora == "adapter" else
            f"push merged: base + alpha/rank x B A, the whole model, {pushed:.3g} GB")  # fmt: skip
    spec = (
        "model.layer_spec auto -> local"
        if lora_resolved(cfg)
        else f"model.layer_spec {cfg.model.layer_spec}"
    )
    return (f"[bold]LoRA[/] rank {lora.rank}, alpha {lora.alpha:g} (scale {lora.scale:g}), modules {', '.join(lora.modules)}{moe}; "
            f"trainable {_count(trainable)} params ({_share(trainable, arch.num_params)}), base frozen; {reference}; "
            f"{push}; {spec}")  # fmt: skip


def _share(trainable: float, model: float) -> str:
    """``0.58% of the model's 72.7B``; a wide adapter on a tiny model can outgrow it (201%)."""
    percent = 100 * trainable / model
    share = f"{percent:.2g}%" if percent < 10 else f"{percent:.0f}%"
    larger = ": the adapters are larger than the model" if percent > 100 else ""
    return f"{share} of the model's {_count(model)}{larger}"


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:g}"
