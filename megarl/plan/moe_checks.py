"""The planner's checks of mixture-of-experts models: expert parallelism (ep, etp) against the
model and the layout, and what MoE training still lacks (refused until it is built)."""

from __future__ import annotations

from megarl.config.architectures import ArchSpec
from megarl.config.sections import ActorConfig
from megarl.plan.issues import Issue, choices, divisors


def check_moe_training(arch: ArchSpec, issues: list[Issue]) -> None:
    """An MoE model builds and converts, but is not trained yet: refused, saying what is missing."""
    if arch.num_experts:
        issues.append(Issue("model", f"{arch.name} is a mixture-of-experts model ({arch.num_experts} experts): megarl builds "
                            "it with expert parallelism and converts it (megarl convert), but does not train it yet: routing "
                            "replay, the load-balancing loss, the experts' memory in this plan and weight pushes of experts "
                            "to the engines are still missing; train a dense model (llama, qwen2, qwen3) for now, and convert this "
                            "one with megarl convert --ep"))  # fmt: skip


def check_expert_parallel(section: str, cfg: ActorConfig, arch: ArchSpec, gpus: int, issues: list[Issue]) -> None:
    """ep and etp: dense models take neither; an MoE model's ep divides its experts and, with etp,
    tp x dp (Megatron's parallel_state builds the expert groups over the same ranks: etp x ep x
    pp must divide the world); at tp > 1 its MoE layers train only with sequence parallelism."""
    par, field = cfg.parallel, f"{section}.parallel"
    if not arch.num_experts:
        for knob in ("ep", "etp"):
            if getattr(par, knob) != 1:
                issues.append(Issue(f"{field}.{knob}", f"({getattr(par, knob)}) splits the experts of a mixture-of-experts "
                                    f"model and {arch.name} is dense; set it to 1"))  # fmt: skip
        return
    experts, ep, etp, tp, pp = arch.num_experts, par.ep, par.etp, par.tp, par.pp
    if etp != 1:
        issues.append(Issue(f"{field}.etp", f"({etp}) is not supported yet (each expert stays whole on its rank); set it to 1"))
    if gpus % (tp * pp) == 0:
        dp = gpus // (tp * pp)
        fits = [d for d in divisors(experts) if (tp * dp) % (d * etp) == 0]
        if experts % ep or (tp * dp) % (ep * etp):
            issues.append(Issue(f"{field}.ep", f"({ep}) must divide num_experts ({experts}) and, times etp ({etp}), tp x dp "
                                f"({tp} x {dp} = {tp * dp}): the expert-parallel groups lie across the tensor- and "
                                f"data-parallel ranks; try {choices(fits)}"))  # fmt: skip
    if tp > 1 and par.sequence_parallel is False:
        issues.append(Issue(f"{field}.sequence_parallel", f"(false) at tp {tp}: Megatron's MoE layers train only with "
                            "sequence parallelism when tp > 1; remove it (on by default) or set it true"))  # fmt: skip
