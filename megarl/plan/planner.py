"""The planner: every check that can fail a run, done before anything starts.

`make_plan(cfg)` derives each role's data-parallel size and the GPU placement, estimates memory
per GPU, and collects every violation it finds (not just the first) as an issue naming the
field path, the values, and a fix. It raises PlanError when any issue is an error; warnings
(e.g. top-p sampling makes the rollout off-policy) are kept on the plan.

Deliberately torch-free: `megarl plan` must answer in well under two seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path

from megarl.config.architectures import ArchError, ArchSpec, resolve_arch
from megarl.config.sections import MegaRLConfig
from megarl.config.train_sections import ActorConfig
from megarl.memory.residency import (
    CRITIC_FORWARD,
    CRITIC_UPDATE,
    GENERATE,
    GENERATION_PHASES,
    POLICY_UPDATE,
    REWARD,
    START,
    TRAINED_STATES,
    WEIGHT_PUSH,
    Residency,
    owner_of,
    residency_of,
)
from megarl.plan.algorithm_checks import check_algorithm, check_run_length
from megarl.plan.async_checks import check_asynchronous
from megarl.plan.gpu_memory import (
    GIB,
    RolloutMemory,
    RuntimeMemory,
    TrainMemory,
    largest_hf_tensor_bytes,
    phase_working_bytes,
    rollout_memory,
    runtime_memory,
    sglang_free_at_launch,
    torch_engine_memory,
    train_memory,
)
from megarl.plan.host_memory import HostMemory, host_memory, host_over
from megarl.plan.issues import Issue, PlanError, choices, divisors
from megarl.plan.judge_plan import (
    JudgeMemory,
    check_judge,
    check_judge_memory,
    judge_layout,
    judge_memory,
)
from megarl.plan.lora_checks import check_lora, lora_resolved, policy_lora_params
from megarl.plan.moe_checks import (
    check_expert_parallel,
    check_moe_serving,
    check_moe_settings,
    ep_raise_knob,
)
from megarl.plan.own_devices import check_own_devices, own_devices, taken_note
from megarl.plan.push_model import PushEstimate, push_estimate
from megarl.plan.reward_model_plan import (
    RewardModelMemory,
    check_reward_model,
    check_reward_model_memory,
    colocated_reward_model,
    reward_model_gpus,
    reward_model_layout,
    reward_model_memory,
)
from megarl.plan.role_layout import RoleLayout
from megarl.plan.rollout_checks import (
    check_agent,
    check_in_process,
    check_nccl_versions,
    check_rollout,
    check_sampling,
    check_server_args,
    check_server_python,
    check_sglang_keys_used,
    check_validation,
    rollout_tp_choices,
)
from megarl.plan.trainer_checks import check_validation_files, check_watchdog
from megarl.rewards.combine import component_problems


@dataclass(frozen=True)
class MemoryPlan:
    policy: TrainMemory | None
    critic: TrainMemory | None
    reference_weights: float
    rollout: RolloutMemory | None
    train_peak: float  # bytes per training GPU in its heaviest phase (colocated: generation aside)
    rollout_peak: float  # bytes per GPU while the engines generate (disaggregated: the rollout pool's GPUs)
    gpu_bytes: float
    phases: dict[str, float]  # bytes per training GPU in each phase of the residency table
    states: dict[str, float]  # bytes per GPU of each state of the table
    residency: dict[str, dict[str, float]]  # phase -> {resident state: bytes per GPU} (megarl/memory/residency.py)
    host: HostMemory | None = None  # the busiest node's host memory that megarl's buffers take (a lower bound)
    runtime: RuntimeMemory | None = None  # the processes' own memory per GPU (colocated: the trainer's and SGLang's)
    reward_model: RewardModelMemory | None = None  # per device of the reward model's role (megarl/plan/reward_model_plan.py)
    judge: JudgeMemory | None = None  # per device of the judge's SGLang servers on devices of their own (megarl/plan/judge_plan.py)


@dataclass(frozen=True)
class Plan:
    arch: ArchSpec
    device: str
    placement: str
    roles: dict[str, RoleLayout]
    memory: MemoryPlan | None
    warnings: list[Issue] = field(default_factory=list)
    resolved: dict[str, str] = field(default_factory=dict)  # "actor.recompute" -> what "auto" became
    push: PushEstimate | None = None  # one weight push: bytes per GPU per link and time (megarl/plan/push_model.py)
    reward_model: RoleLayout | None = None  # the reward model's role (reward.model.placement disaggregated or colocated)
    judge: RoleLayout | None = None  # the judge's SGLang servers on devices of their own (engine sglang on cuda)

    def rows(self, nnodes: int, gpus_per_node: int) -> list[tuple[int, int, str]]:
        """(node, local gpu, roles text) for every GPU of the cluster."""
        cells: dict[int, list[str]] = {}
        for layout in self.roles.values():
            for rank, gpu in enumerate(layout.gpus):
                cells.setdefault(gpu, []).append(f"{layout.role} {layout.coords(rank, self.arch.num_experts)}")
        # The reward model's actor i is on bundle i of its pool (disaggregated: its own placement
        # groups; colocated: the policy's, beside policy rank i).
        if self.reward_model is not None:
            colocated = "policy" in self.roles and self.reward_model.gpus == self.roles["policy"].gpus
            for rank, gpu in enumerate(self.reward_model.gpus):
                text = "(on the device in phase reward only)" if colocated else "(a placement group of its own)"
                cells.setdefault(gpu, []).append(f"{self.reward_model.role} actor {rank} {text}")
        if self.judge is not None:  # server k on its own placement group's tp bundles
            for rank, gpu in enumerate(self.judge.gpus):
                cells.setdefault(gpu, []).append(f"judge {self.judge.coords(rank)} (SGLang, a placement group of its own)")
        total = nnodes * gpus_per_node
        return [(g // gpus_per_node, g % gpus_per_node, "; ".join(cells.get(g, ["idle"]))) for g in range(total)]

    def to_dict(self) -> dict:
        out = asdict(self)
        out["warnings"] = [str(w) for w in self.warnings]
        return out


def make_plan(cfg: MegaRLConfig, *, check_files: bool = False, in_process: bool = False, sft: bool = False) -> Plan:
    """Check ``cfg`` and derive the layout; raises PlanError listing every problem.
    ``in_process``: the run will hold every role in one process (`megarl launch|sft --in-process`).
    ``sft``: the plan of `megarl sft`: the policy alone on every GPU, its scope, model and
    micro-batch checks (rollout, critic, RL batches, algorithm and memory are not its business)."""
    issues: list[Issue] = []
    try:
        arch = resolve_arch(cfg.model.path, cfg.model.arch)
    except ArchError as exc:
        raise PlanError([Issue("model", str(exc))]) from None
    _check_scope(cfg, arch, issues, sft=sft)
    if sft:
        return _sft_plan(cfg, arch, issues)
    # first: the pools below are cut from what the reward roles leave
    check_reward_model(cfg, issues, in_process=in_process)
    check_judge(cfg, issues, in_process=in_process)
    if not in_process:  # (an in-process run refuses the roles above)
        check_own_devices(cfg, issues)
    roles = _layout_roles(cfg, arch, issues)
    _check_sections(cfg, arch, roles, issues, in_process=in_process)
    memory, resolved = None, _auto_recompute(cfg, "none")
    layout_ok = not any(i.level == "error" for i in issues)
    if layout_ok:  # the memory model needs a config the checks above accept; the files do not matter to it
        cfg, resolved = _resolve_recompute(cfg, arch, roles)
        memory = _plan_all_memory(cfg, arch, roles, issues)
    if check_files:  # reported with the config's problems, not after they are fixed
        _check_files(cfg, issues, bridge=layout_ok)
        check_server_python(cfg, issues)
        check_nccl_versions(cfg, issues)  # two subprocesses import torch: seconds, so only with these checks
    _raise_errors(issues)
    resolved |= lora_resolved(cfg)
    push = _push_plan(cfg, arch, roles["policy"], roles.get("rollout"), issues)
    warnings = [i for i in issues if i.level == "warning"]
    return Plan(arch, cfg.cluster.device, cfg.cluster.placement, roles, memory, warnings, resolved, push,
                reward_model_layout(cfg, roles.get("policy")), judge_layout(cfg))


def _sft_plan(cfg: MegaRLConfig, arch: ArchSpec, issues: list[Issue]) -> Plan:
    """`megarl sft`'s plan: the policy alone, on every GPU of the cluster (no rollout pool, no
    critic, no memory plan)."""
    policy = _train_layout("policy", cfg.actor, list(range(cfg.cluster.world_size)))
    _check_model_parallel("actor", cfg.actor, arch, cfg.cluster.world_size, issues)
    _check_sft(cfg, arch, issues)
    check_lora(cfg, arch, issues, rollout=False)
    _raise_errors(issues)
    assert policy is not None  # a layout problem is an error, raised above
    return Plan(arch, cfg.cluster.device, cfg.cluster.placement, {"policy": policy}, None,
                [i for i in issues if i.level == "warning"], _auto_recompute(cfg, "none") | lora_resolved(cfg))


def _check_sections(cfg: MegaRLConfig, arch: ArchSpec, roles: dict[str, RoleLayout], issues: list[Issue], *,
                    in_process: bool) -> None:  # fmt: skip
    """Every check of an RL config's sections on the roles' layout (each adds its issues)."""
    issues += [Issue("reward.combine", problem) for problem in component_problems(cfg.reward)]
    for role, section_name in (("policy", "actor"), ("critic", "critic")):
        if role == "policy" or cfg.critic_enabled:
            section = getattr(cfg, section_name)
            fit = partial(_fitting_layouts, cfg, arch, section_name)  # narrows a suggestion to the layouts that fit
            _check_model_parallel(section_name, section, arch, _train_pool_size(cfg), issues, fit, taken_note(cfg))
            if role in roles:
                _check_batches(section_name, section, roles[role], cfg, issues)
    if "rollout" in roles:
        check_rollout(cfg, arch, issues)
        check_server_args(cfg, issues)
        check_moe_serving(cfg, arch, issues)
    check_sglang_keys_used(cfg, issues)
    check_sampling(cfg, arch, issues)
    check_validation(cfg, issues)
    check_agent(cfg, issues)
    check_algorithm(cfg, issues)
    check_run_length(cfg.trainer, issues)
    check_validation_files(cfg, issues)
    check_watchdog(cfg, issues)
    check_asynchronous(cfg, issues, in_process=in_process)
    check_lora(cfg, arch, issues)
    _check_offload(cfg, issues)
    if in_process:
        check_in_process(cfg, issues, sft=False)


def _plan_all_memory(cfg: MegaRLConfig, arch: ArchSpec, roles: dict[str, RoleLayout], issues: list[Issue]) -> MemoryPlan:
    """The memory plan of every role, the reward model's and the judge's included, with their checks."""
    rm_memory = reward_model_memory(cfg) if reward_model_gpus(cfg) or colocated_reward_model(cfg) else None
    memory = _plan_memory(cfg, arch, roles, issues, reward_model=rm_memory)
    if reward_model_gpus(cfg):
        check_reward_model_memory(cfg, rm_memory, issues)
    judge_mem = judge_memory(cfg)
    check_judge_memory(cfg, judge_mem, issues)
    return replace(memory, reward_model=rm_memory, judge=judge_mem)


def _push_plan(cfg: MegaRLConfig, arch: ArchSpec, p: RoleLayout, rollout: RoleLayout | None, issues: list[Issue]) -> PushEstimate:
    """The estimate of one weight push from the policy's layout ``p``; a warning when the push
    deadline is below it on GPUs."""
    push = push_estimate(cfg, arch, p.tp, p.pp, p.dp, p.ep, rollout=rollout, writer_gpu=p.gpus[0])
    deadline, largest = cfg.rollout.weight_sync.timeout_s, _largest_push_seconds(cfg, arch, push, (p.tp, p.pp, p.dp, p.ep))
    if cfg.cluster.device == "cuda" and deadline and largest > deadline:
        issues.append(Issue("rollout.weight_sync.timeout_s", f"({deadline:g}) is shorter than the plan's estimate of one "
                            f"push ({largest:.2g} s, a lower bound): every push would stop the run; raise it",
                            level="warning"))  # fmt: skip
    return push


def _largest_push_seconds(cfg: MegaRLConfig, arch: ArchSpec, push: PushEstimate, layout: tuple[int, int, int, int]) -> float:
    """The longest push of the run: with LoRA adapter pushes, a connection's first push (and a
    re-push) also sends the whole base model (megarl/weight_sync/lora_adapter.py)."""
    ws = cfg.rollout.weight_sync
    if cfg.actor.lora is None or ws.lora != "adapter":
        return push.seconds
    whole = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"weight_sync": ws.model_copy(update={"lora": "merged"})})})
    return max(push.seconds, push_estimate(whole, arch, *layout).seconds)


def resolved_config(cfg: MegaRLConfig, resolved: dict[str, str]) -> MegaRLConfig:
    """``cfg`` with what a plan resolved (``Plan.resolved``, e.g. ``recompute: auto``): the config
    a run builds its workers from."""
    for key, value in resolved.items():
        section, field_name = key.split(".")
        cfg = cfg.model_copy(update={section: getattr(cfg, section).model_copy(update={field_name: value})})
    return cfg


def _auto_recompute(cfg: MegaRLConfig, choice: str) -> dict[str, str]:
    """``{"<section>.recompute": choice}`` for each trained section left at ``auto``."""
    return {f"{s}.recompute": choice for s in ("actor", "critic") if getattr(cfg, s).recompute == "auto"}


def _resolve_recompute(cfg: MegaRLConfig, arch: ArchSpec, roles: dict[str, RoleLayout]) -> tuple[MegaRLConfig, dict[str, str]]:
    """``recompute: auto`` becomes the least recompute whose memory plan fits: none, else full
    (selective saves nothing in this memory model: SDPA keeps no score matrix). Without a memory
    check (a CPU plan) none always fits."""
    resolved = _auto_recompute(cfg, "none")
    if resolved:
        probe: list[Issue] = []
        _plan_memory(resolved_config(cfg, resolved), arch, roles, probe, suggest=False)
        if any(i.level == "error" for i in probe):
            resolved = _auto_recompute(cfg, "full")
    return resolved_config(cfg, resolved), resolved


def sft_max_length(cfg: MegaRLConfig, arch: ArchSpec) -> int:
    """The longest row `megarl sft` keeps: sft.max_length, or the model's positions when fewer."""
    return min(cfg.sft.max_length, arch.max_positions)


def _check_sft(cfg: MegaRLConfig, arch: ArchSpec, issues: list[Issue]) -> None:
    """What `megarl sft` needs of the policy's micro-batches: room for its longest row."""
    a = cfg.actor
    if not _micro_batching_set("actor", a, issues):
        return
    longest = sft_max_length(cfg, arch)
    for key in ("max_tokens_per_gpu", "logprob_max_tokens_per_gpu"):
        budget = getattr(a, key)
        if budget is not None and budget < longest:
            issues.append(Issue(f"actor.{key}", f"({budget}) must hold one full row of {longest} tokens (sft.max_length, "
                                "at most the model's positions); raise it or lower sft.max_length"))  # fmt: skip


def _raise_errors(issues: list[Issue]) -> None:
    errors = [i for i in issues if i.level == "error"]
    if errors:
        raise PlanError(errors, [i for i in issues if i.level == "warning"])


# The HF model types megarl has a bridge for (megarl/models: dense.py, qwen3_moe.py, deepseek_v3.py);
# the planner imports no torch, so it keeps its own list.
BRIDGED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")


def _check_scope(cfg: MegaRLConfig, arch: ArchSpec, issues: list[Issue], *, sft: bool = False) -> None:
    later = "not supported yet (see docs/architecture.md, 'Scope'); set it to 1"
    sections = ("actor", "critic") if cfg.critic_enabled and not sft else ("actor",)
    for section in sections:
        par = getattr(cfg, section).parallel
        for knob, what in (("vpp", "virtual pipeline stages"), ("cp", "context parallelism")):
            value = getattr(par, knob)
            if value != 1:
                issues.append(Issue(f"{section}.parallel.{knob}", f"{what} ({value}) is {later}"))
        _check_packed_attention(cfg, section, issues)
    check_moe_settings(cfg, arch, sections, issues, rollout=not sft)
    if arch.model_type not in BRIDGED_MODEL_TYPES:
        issues.append(Issue("model", f"model_type {arch.model_type!r} has no bridge; supported: {', '.join(BRIDGED_MODEL_TYPES)}"))
    else:
        _check_rope(cfg.model.path, arch, issues)
    if cfg.model.layer_spec == "te" and cfg.cluster.device == "cpu":
        issues.append(Issue("model.layer_spec", "(te) needs CUDA and cluster.device is cpu: transformer-engine "
                            "does not run on CPU; use auto or local"))
    if not sft and cfg.rollout.engine == "sglang" and cfg.cluster.device == "cpu" and cfg.cluster.placement != "disaggregated":
        issues.append(Issue("cluster.placement", "SGLang on cpu runs as a server of its own (its CPU engine cannot release "
                            "memory): set cluster.placement=disaggregated and cluster.rollout_gpus, or rollout.engine=torch"))


def _check_rope(path: str | None, arch: ArchSpec, issues: list[Issue]) -> None:
    """model.path's rope settings as its bridge reads them (megarl/models/rope.py, torch-free): a
    setting the bridge refuses is named here, before the tokenizer (whose transformers may refuse
    the same config.json in words of its own) and before any worker starts."""
    import json
    from types import SimpleNamespace

    from megarl.models.rope import bridge_rope_types, read_rope

    config = Path(path, "config.json") if path is not None else None
    if config is None or not config.is_file():
        return  # planned from model.arch
    try:
        # transformers gives a config.json without rope_theta its model's default; only the check matters here
        values = {"rope_theta": 10000.0} | json.loads(config.read_text())
        read_rope(SimpleNamespace(**values), bridge_rope_types(arch.model_type))
    except (ValueError, TypeError) as exc:  # (a config.json that is no JSON object: resolve_arch named it)
        issues.append(Issue("model.path", f"({path}) is not a model megarl can train: {exc}; fix the rope settings "
                            f"in {config}"))  # fmt: skip


def _check_packed_attention(cfg: MegaRLConfig, section: str, issues: list[Issue]) -> None:
    """FlexAttention (``packed_attention: flex``) needs CUDA, packed micro-batches and the local spec."""
    actor = getattr(cfg, section)
    if actor.packed_attention != "flex":
        return
    field = f"{section}.packed_attention"
    if cfg.cluster.device == "cpu":
        issues.append(Issue(field, "(flex) needs CUDA and cluster.device is cpu: torch has no FlexAttention backward "
                            "on CPU; use auto"))  # fmt: skip
    if not actor.pack_sequences:
        issues.append(Issue(field, f"(flex) attends packed micro-batches and {section}.pack_sequences is false; "
                            "set pack_sequences true or packed_attention auto"))  # fmt: skip
    if cfg.model.layer_spec == "te":
        issues.append(Issue(field, "(flex) replaces the local spec's attention and model.layer_spec is te, whose own "
                            "attention takes packed sequences; use model.layer_spec local or packed_attention auto"))  # fmt: skip
    elif cfg.model.layer_spec == "auto" and cfg.cluster.device == "cuda":
        issues.append(Issue(field, "(flex) is used only where model.layer_spec auto resolves to local (no "
                            "transformer-engine installed); set model.layer_spec local to be sure", "warning"))  # fmt: skip


def _train_pool_size(cfg: MegaRLConfig) -> int:
    """GPUs of the training pool: the cluster, less the reward model's role's (when it has devices
    of its own and leaves some) and the rollout pool's when disaggregated (and valid)."""
    cl = cfg.cluster
    world = _shared_world(cfg)
    if cl.placement == "disaggregated" and 0 < cl.rollout_gpus < world:
        return world - cl.rollout_gpus
    return world


def _shared_world(cfg: MegaRLConfig) -> int:
    """The GPUs the training and rollout pools share out: the cluster less the reward roles' own
    (the reward model's, the judge's: megarl/plan/own_devices.py)."""
    world, taken = cfg.cluster.world_size, own_devices(cfg)
    return world - taken if taken < world else world  # (too many: check_own_devices says so)


def _layout_roles(cfg: MegaRLConfig, arch: ArchSpec, issues: list[Issue]) -> dict[str, RoleLayout]:
    """Split the cluster into the training pool and the rollout pool, derive DP sizes (a layout
    that does not divide its pool is left out: _check_model_parallel and check_rollout say why)."""
    cl = cfg.cluster
    world = _shared_world(cfg)  # the reward roles with devices of their own have the last ones
    train_gpus = list(range(world))
    rollout_gpus = list(range(world))
    if cl.placement == "disaggregated":
        if cl.rollout_gpus <= 0 or cl.rollout_gpus >= world:
            left = "" if world == cl.world_size else f", less the reward roles' devices = {cl.world_size - world}"
            issues.append(Issue("cluster.rollout_gpus", f"({cl.rollout_gpus}) must be between 1 and {world - 1} "
                                f"(nnodes x gpus_per_node = {cl.world_size}{left}) with placement=disaggregated"))
            return {}
        if cfg.rollout.engine == "torch":
            issues.append(Issue("cluster.placement", "the torch engine lives inside the policy ranks: use placement=colocated"))
        if cl.nnodes > 1 and cl.rollout_gpus % cl.gpus_per_node:
            issues.append(Issue("cluster.rollout_gpus", f"({cl.rollout_gpus}) must be whole nodes on a multi-node cluster "
                                f"(a multiple of gpus_per_node = {cl.gpus_per_node}), so each pool is placed node by node"))
            return {}
        pool = _train_pool_size(cfg)
        train_gpus, rollout_gpus = train_gpus[:pool], train_gpus[pool:]
    elif cl.rollout_gpus:
        issues.append(Issue("cluster.rollout_gpus", f"({cl.rollout_gpus}) is only used with placement=disaggregated; remove it or set the placement"))
    roles: dict[str, RoleLayout] = {}
    policy = _train_layout("policy", cfg.actor, train_gpus)
    if policy:
        roles["policy"] = policy
    if cfg.critic_enabled:
        critic = _train_layout("critic", cfg.critic, train_gpus)
        if critic:
            roles["critic"] = critic
    if cfg.rollout.engine == "sglang":
        tp = cfg.rollout.tp
        if len(rollout_gpus) % tp == 0:
            roles["rollout"] = RoleLayout("rollout", tp, 1, len(rollout_gpus) // tp, tuple(rollout_gpus))
        else:
            issues.append(Issue("rollout.tp", f"({tp}) must divide the {len(rollout_gpus)} GPUs of the rollout pool"
                                f"{taken_note(cfg, rollout_pool=True)}; "
                                f"try {choices(rollout_tp_choices(cfg, arch))}"))
    elif policy:
        # One torch engine in the first rank of each policy data-parallel replica.
        firsts = tuple(g for r, g in enumerate(policy.gpus) if r % policy.tp == 0 and r < policy.tp * policy.dp)
        roles["rollout"] = RoleLayout("rollout", 1, 1, len(firsts), firsts)
    return roles


def _train_layout(role: str, cfg: ActorConfig, gpus: list[int]) -> RoleLayout | None:
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    if len(gpus) % (tp * pp):
        return None  # _check_model_parallel reports it, with the layouts that fit
    return RoleLayout(role, tp, pp, len(gpus) // (tp * pp), tuple(gpus), cfg.parallel.ep, cfg.parallel.etp)


def _parallel_pairs(arch: ArchSpec, gpus: int) -> list[tuple[int, int]]:
    """Every (tp, pp) a model may train with on ``gpus`` GPUs: tp divides the attention and KV
    heads, pp the layers, tp x pp the GPUs. Each suggestion of a layout is drawn from these."""
    ok_tp = [d for d in divisors(arch.num_heads) if arch.num_kv_heads % d == 0]
    return [(t, p) for t in ok_tp for p in divisors(arch.num_layers) if gpus % (t * p) == 0]


def _check_model_parallel(section: str, cfg: ActorConfig, arch: ArchSpec, gpus: int, issues: list[Issue],
                          fit: Callable[[list[tuple[int, int]]], list[tuple[int, int]]] | None = None,
                          taken: str = "") -> None:  # fmt: skip
    """tp, pp and their product on the ``gpus`` of the training pool; each fix keeps the other
    knob when a layout with it exists (else any layout's values), so it satisfies every rule.
    ``fit``: the layouts whose batches and memory pass too (none of them: the rules alone); ``taken``:
    who took the devices the pool lacks (megarl/plan/own_devices.py taken_note)."""
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    pairs = _parallel_pairs(arch, gpus)
    if fit is not None and (gpus % (tp * pp) or (tp, pp) not in pairs):  # a fix will be suggested
        pairs = fit(pairs) or pairs
    tp_at_pp, pp_at_tp = [t for t, p in pairs if p == pp], [p for t, p in pairs if t == tp]
    some = " or ".join(f"{t} x {p}" for t, p in sorted(pairs, key=lambda lay: (lay[0] * lay[1], -lay[0]))[:4])
    if gpus % (tp * pp):
        keep = ([f"pp {choices(pp_at_tp)} (at tp {tp})"] if pp_at_tp else []) + ([f"tp {choices(tp_at_pp)} (at pp {pp})"] if tp_at_pp else [])
        issues.append(Issue(f"{section}.parallel", f"tp x pp ({tp} x {pp} = {tp * pp}) must divide the {gpus} GPUs "
                            f"of the training pool{taken}; try {', or '.join(keep) or 'tp x pp ' + some}"))  # fmt: skip
    if arch.num_heads % tp or arch.num_kv_heads % tp:
        fix = choices(tp_at_pp) if tp_at_pp else f"tp x pp {some} (no tp fits at pp {pp})"
        issues.append(Issue(f"{section}.parallel.tp", f"({tp}) must divide num_attention_heads ({arch.num_heads}) and "
                            f"num_key_value_heads ({arch.num_kv_heads}); try {fix}"))
    if arch.num_layers % pp:
        fix = choices(pp_at_tp) if pp_at_tp else f"tp x pp {some} (no pp fits at tp {tp})"
        issues.append(Issue(f"{section}.parallel.pp", f"({pp}) must divide num_layers ({arch.num_layers}); try {fix}"))
    if cfg.parallel.sequence_parallel and tp == 1:
        issues.append(Issue(f"{section}.parallel.sequence_parallel", "(true) has no effect at tp 1: sequence parallelism "
                            "splits the sequence over the tensor-parallel ranks", level="warning"))
    check_expert_parallel(section, cfg, arch, gpus, issues)


def _check_batches(section: str, cfg: ActorConfig, layout: RoleLayout, full: MegaRLConfig, issues: list[Issue]) -> None:
    samples = full.samples_per_step
    mini = cfg.mini_batch_size or samples
    tokens = cfg.max_tokens_per_gpu is not None
    unit = _batch_unit(cfg, layout.dp)
    what = f"dp ({layout.dp})" if tokens else f"dp x micro_batch_size = {layout.dp} x {cfg.micro_batch_size}"
    fitting = [m for m in divisors(samples) if m % unit == 0][-4:]  # the mini-batches both rules allow
    if samples % mini:
        fix = (f"try {choices(fitting)}" if fitting else f"none is divisible by {what} = {unit}: lower "
               f"{section}.micro_batch_size or change the layout")  # fmt: skip
        issues.append(Issue(f"{section}.mini_batch_size", f"({mini}) must divide the samples of a step, data.prompts_per_step x "
                            f"rollout.n = {full.data.prompts_per_step} x {full.rollout.n} = {samples}; {fix}"))
    if not _micro_batching_set(section, cfg, issues):
        return
    if mini % unit:
        issues.append(Issue(f"{section}.mini_batch_size", f"({mini}) must be divisible by {what} = {unit}; "
                            + _mini_batch_fix(section, cfg, layout, mini, samples, fitting)))
    seq = full.data.max_prompt_length + full.rollout.sampling.max_new_tokens
    for key in ("max_tokens_per_gpu", "logprob_max_tokens_per_gpu"):
        budget = getattr(cfg, key)
        if budget is not None and budget < seq:
            issues.append(Issue(f"{section}.{key}", f"({budget}) must hold one full sequence "
                                f"(max_prompt_length + max_new_tokens = {seq}); raise it to at least {seq}, or lower "
                                "data.max_prompt_length / rollout.sampling.max_new_tokens"))


def _batch_unit(cfg: ActorConfig, dp: int) -> int:
    """What a mini-batch must be a multiple of: dp x micro_batch_size, or dp under a token budget
    (any number of sequences per micro-batch)."""
    return dp * (1 if cfg.max_tokens_per_gpu is not None else cfg.micro_batch_size or 1)


def _mini_batch_fix(section: str, cfg: ActorConfig, layout: RoleLayout, mini: int, samples: int, fitting: list[int]) -> str:
    """The mini-batches that divide the step and the unit (``fitting``), or smaller micro-batches
    that make ``mini`` fit when it divides the step's ``samples``; else the layout must change."""
    fixes = [f"mini_batch_size {choices(fitting)}"] if fitting else []
    if cfg.max_tokens_per_gpu is None and cfg.micro_batch_size and samples % mini == 0 and mini % layout.dp == 0:
        micro = [u for u in divisors(mini // layout.dp) if u < cfg.micro_batch_size][-3:]
        fixes += [f"micro_batch_size {choices(micro)}"] if micro else []
    return f"try {section}." + f", or {section}.".join(fixes) if fixes else f"change {section}.parallel (dp is {layout.dp})"


def _micro_batching_set(section: str, cfg: ActorConfig, issues: list[Issue]) -> bool:
    if cfg.max_tokens_per_gpu is None and cfg.micro_batch_size is None:
        issues.append(Issue(f"{section}.micro_batch_size", "set micro_batch_size or max_tokens_per_gpu"))
        return False
    return True


def _check_files(cfg: MegaRLConfig, issues: list[Issue], *, bridge: bool) -> None:
    """What launch needs from the disk (megarl/plan/preflight.py), still before Ray starts.
    ``bridge``: the config's layouts passed, so model.path's bridge check can judge them too."""
    from megarl.plan.preflight import preflight

    issues += [Issue(f.field, f.message, f.level) for f in preflight(cfg, bridge=bridge)]


def _tokens_per_micro_batch(cfg: MegaRLConfig, section: ActorConfig) -> int:
    seq = cfg.data.max_prompt_length + cfg.rollout.sampling.max_new_tokens
    if section.max_tokens_per_gpu is not None:
        return section.max_tokens_per_gpu
    return (section.micro_batch_size or 1) * seq


def _forward_tokens_per_micro_batch(cfg: MegaRLConfig, section: ActorConfig) -> int | None:
    """The forward-only passes' tokens per micro-batch when set apart from the update's
    (MicroBatching.forward_only), else None."""
    if section.logprob_max_tokens_per_gpu is not None:
        return section.logprob_max_tokens_per_gpu
    if section.logprob_micro_batch_size is not None:
        return section.logprob_micro_batch_size * (cfg.data.max_prompt_length + cfg.rollout.sampling.max_new_tokens)
    return None


def _plan_memory(cfg: MegaRLConfig, arch: ArchSpec, roles: dict[str, RoleLayout], issues: list[Issue], *,
                 suggest: bool = True, reward_model: RewardModelMemory | None = None) -> MemoryPlan:  # fmt: skip
    """Bytes per GPU in every phase: the residency table's resident states (megarl/memory/residency.py)
    plus the phase's working memory and the processes' runtime memory (the trainer's and, on its
    GPUs, SGLang's outside mem_fraction); nothing else adds to a peak.
    ``suggest``: an over-budget error names the layouts that fit (a probe of one does not).
    ``reward_model``: a colocated reward model's memory (its weights are a state of the table, its
    activations the ``reward`` phase's working memory, its actor's runtime on the devices throughout)."""
    gpu = cfg.cluster.gpu_memory_gib * GIB
    table = residency_of(cfg)
    mems: dict[str, TrainMemory] = {}
    for role, section in (("policy", cfg.actor), ("critic", cfg.critic)):
        if role in roles:
            lay = roles[role]
            mems[role] = train_memory(
                arch, tp=lay.tp, pp=lay.pp, dp=lay.dp, tokens_per_micro_batch=_tokens_per_micro_batch(cfg, section),
                forward_tokens_per_micro_batch=_forward_tokens_per_micro_batch(cfg, section),
                dtype=cfg.model.dtype, recompute=section.recompute, sequence_parallel=section.parallel.uses_sequence_parallel,
                distributed_optimizer=section.optimizer.distributed, value_head=role == "critic",
                logprob_chunk_tokens=section.logprob_chunk_tokens, ep=lay.ep, etp=lay.etp,
                lora_params=policy_lora_params(cfg, arch, lay) if role == "policy" else None,
                lora_expert_params=(policy_lora_params(cfg, arch, lay, experts=True) or 0.0) if role == "policy" else 0.0,
            )
    runtime, rollout = _runtime_and_rollout(cfg, arch, table, issues)
    sizes = _state_bytes(cfg, arch, mems, rollout, runtime)
    ws, largest = cfg.rollout.weight_sync, largest_hf_tensor_bytes(arch, cfg.model.dtype)
    # A bucket holds up to bucket_mb, or one larger tensor alone; a TP gather group up to
    # gather_mb, or one larger tensor. A push holds the bucket being filled, with overlap the one
    # being sent, and with the tensor transport its flattened copy for CUDA IPC, with the
    # distributed one its flattened copy for the broadcast (SGLang >= 0.5.6; counted whatever the
    # server, which the planner cannot ask).
    held = (2 if ws.overlap else 1) + (cfg.weight_transport in ("tensor", "distributed"))
    bucket, gather = (max(mb * 1024**2, largest) for mb in (ws.bucket_mb, ws.gather_mb))
    working = phase_working_bytes(mems.get("policy"), mems.get("critic"), held * bucket, gather)
    # SGLang's graphs are its cuda_graph state (in sizes); its context stays on its GPUs in every phase.
    overhead = runtime.trainer + (runtime.sglang_context if table.engine_shares_devices else 0.0)
    if REWARD in table.rows:  # a colocated reward model (unreadable config.json: the preflight names it, 0 here)
        rm = reward_model or RewardModelMemory(0.0, 0.0, 0.0, (0, 0), "?")
        sizes["reward_model/weights"], working[REWARD] = rm.weights, rm.activations
        overhead += rm.runtime
    # As built, the optimizer holds its fp32 master copies only: the first step (or a checkpoint
    # load) allocates Adam's moments, in a phase that has room for them.
    at_build = sizes | {f"{role}/optimizer": m.optimizer_at_build for role, m in mems.items()}
    residency = {p: {s: (at_build if p == START else sizes)[s] for s in sorted(table.resident(p))} for p in table.phases}
    phases = {p: sum(b for s, b in residency[p].items() if table.on_training_devices(s)) + working.get(p, 0.0) + overhead
              for p in table.phases}  # fmt: skip
    generation = [p for p in GENERATION_PHASES if p in phases] if table.engine_shares_devices else []
    train_peak = max(b for p, b in phases.items() if p not in generation)
    rollout_peak = max(phases[p] for p in generation) if generation else (rollout.budget + runtime.sglang if rollout else 0.0)
    if cfg.cluster.device == "cuda":
        push_knobs = ["lower rollout.weight_sync.bucket_mb"]
        if gather > largest:  # the gather group, not one tensor, is what the push holds twice
            push_knobs.append("lower rollout.weight_sync.gather_mb")
        layouts = partial(_fitting_layouts, cfg, arch) if suggest else None
        _check_fits(cfg, table, {p: b for p, b in phases.items() if p not in generation}, rollout_peak, gpu, issues,
                    push_knobs, layouts, residency, arch)  # fmt: skip
    ref = sizes.get("reference/weights", 0.0)
    host = host_memory(cfg, arch, roles, table, sizes)
    if cfg.cluster.host_memory_gib is not None and host.peak > cfg.cluster.host_memory_gib * GIB:
        issues.append(Issue("cluster.host_memory_gib", host_over(cfg, host)))
    return MemoryPlan(mems.get("policy"), mems.get("critic"), ref, rollout, train_peak, rollout_peak, gpu, phases, sizes, residency,
                      host, runtime)  # fmt: skip


def _runtime_and_rollout(cfg: MegaRLConfig, arch: ArchSpec, table: Residency, issues: list[Issue]) -> tuple[RuntimeMemory, RolloutMemory | None]:
    """The runtime memory of a training GPU (with colocated SGLang: SGLang's too; disaggregated:
    that of the engines' own GPUs is ``sglang``), and SGLang's static memory, sized from what it
    sees free at launch (megarl/plan/gpu_memory.py)."""
    sglang = cfg.rollout.engine == "sglang"
    runtime = runtime_memory(trainer=True, sglang=sglang)
    if not sglang:
        return runtime, None
    seq = cfg.data.max_prompt_length + cfg.rollout.sampling.max_new_tokens
    free = sglang_free_at_launch(cfg.cluster.gpu_memory_gib * GIB, colocated=table.engine_shares_devices)
    rollout = rollout_memory(arch, tp=cfg.rollout.tp, free_bytes=free, mem_fraction=cfg.rollout.mem_fraction, dtype=cfg.model.dtype, seq_len=seq)
    _check_rollout_memory(cfg, rollout, issues)
    return runtime, rollout


def _state_bytes(cfg: MegaRLConfig, arch: ArchSpec, mems: dict[str, TrainMemory], rollout: RolloutMemory | None,
                 runtime: RuntimeMemory) -> dict[str, float]:  # fmt: skip
    """Bytes per GPU of every state of the residency table (on the GPU that holds most of it)."""
    sizes = {f"{role}/{what}": getattr(m, what) for role, m in mems.items() for what in TRAINED_STATES}
    if cfg.reference_model and "policy" in mems:  # with LoRA the policy itself, adapters off
        sizes["reference/weights"] = mems["policy"].weights  # the policy's layout, no grads or optimizer
    if rollout is not None:
        weights, kv = rollout.weights, rollout.kv_cache
    else:  # the torch engine, in each replica leader's process
        seq = cfg.data.max_prompt_length + cfg.rollout.sampling.max_new_tokens
        weights, kv = torch_engine_memory(arch, dtype=cfg.model.dtype, max_running_requests=cfg.rollout.max_running_requests, seq_len=seq)
    # SGLang's CUDA graphs (and allocator cache) come after its KV cache, outside mem_fraction; the torch engine has none.
    return sizes | {"engine/weights": weights, "engine/kv_cache": kv, "engine/cuda_graph": runtime.sglang_graphs}


def _check_rollout_memory(cfg: MegaRLConfig, mem: RolloutMemory, issues: list[Issue]) -> None:
    if mem.weights >= mem.budget:
        issues.append(Issue("rollout.mem_fraction", f"({cfg.rollout.mem_fraction}) leaves {mem.budget / GIB:.1f} GiB per GPU, less than "
                            f"the engine's weights ({mem.weights / GIB:.1f} GiB at rollout.tp={cfg.rollout.tp}); raise rollout.tp or mem_fraction"))
    elif mem.full_length_sequences < 1:
        issues.append(Issue("rollout.mem_fraction", f"the KV cache ({mem.kv_cache / GIB:.1f} GiB) holds no full-length sequence; raise "
                            "rollout.tp or mem_fraction, or shorten max_prompt_length / max_new_tokens"))


# The section an over-budget phase names (its knobs are that model's).
_PHASE_SECTION = {CRITIC_FORWARD: "critic", CRITIC_UPDATE: "critic"}


def _heaviest_section(cfg: MegaRLConfig, resident: dict[str, float], trainer: str) -> str:
    """The section of the trained model whose states take most of a phase (``trainer``'s on a tie)."""
    held = {sec: sum(b for s, b in resident.items() if owner_of(s) == role) for role, sec in (("policy", "actor"), ("critic", "critic"))}
    return max(held, key=lambda sec: (held[sec], sec == trainer)) if cfg.critic_enabled else trainer
_OFFLOAD_KNOBS = (("policy", "actor.offload"), ("critic", "critic.offload"), ("reference", "reference.offload"))


def _check_fits(cfg: MegaRLConfig, table: Residency, training: dict[str, float], rollout_peak: float, gpu: float,
                issues: list[Issue], push_knobs: list[str], layouts: _Layouts | None = None,
                resident: dict[str, dict[str, float]] | None = None, arch: ArchSpec | None = None) -> None:  # fmt: skip
    """The heaviest training phase and the generation must fit ``gpu``; an error names the knobs
    (``push_knobs``: those that shrink a weight push; ``layouts``: the section's tp x pp that fit).
    ``resident``: each phase's resident states' bytes, so that the error names the trained model
    that holds most in the phase (a critic resident in the policy's update is the critic's to
    shrink); ``arch``: an MoE model's error suggests a larger ep first."""
    over = f"over cluster.gpu_memory_gib ({cfg.cluster.gpu_memory_gib:g})"
    phase = max(training, key=training.get)  # type: ignore[arg-type]
    if training[phase] > gpu and phase == REWARD:
        knobs = [*_offload_knobs(cfg, table, phase), "lower reward.model.batch_size or reward.model.max_length"]
        issues.append(Issue("reward.model", f"the training devices need an estimated {training[phase] / GIB:.1f} GiB per GPU in "
                            f"phase reward (the colocated reward model's weights and one batch's activations), "
                            f"{(training[phase] - gpu) / GIB:.1f} GiB {over}; " + ", ".join(knobs)))  # fmt: skip
    elif training[phase] > gpu:
        trainer = _PHASE_SECTION.get(phase, "actor")  # whose forward or update the phase runs
        section = _heaviest_section(cfg, resident[phase], trainer) if resident else trainer
        knobs = _offload_knobs(cfg, table, phase)
        par = getattr(cfg, section).parallel
        fits = [lay for lay in layouts(section, None) if lay != (par.tp, par.pp)][:3] if layouts else []
        if phase in (POLICY_UPDATE, CRITIC_UPDATE):
            recompute = [] if getattr(cfg, trainer).recompute == "full" else [f"{trainer}.recompute=full"]
            knobs = [f"raise {section}.parallel.tp / pp", *recompute,
                     f"lower {trainer}.micro_batch_size / max_tokens_per_gpu"] + knobs  # fmt: skip
            if not getattr(cfg, section).optimizer.distributed:
                knobs.insert(1, f"set {section}.optimizer.distributed=true")
        elif section != trainer:
            knobs.insert(0, f"raise {section}.parallel.tp / pp")
        if fits:  # the layouts that fit as they are, in place of a vague "raise tp / pp"
            knobs = [k for k in knobs if not k.startswith(f"raise {section}.parallel")]
            knobs.insert(0, f"set {section}.parallel tp x pp to " + " or ".join(f"{t} x {p}" for t, p in fits))
        if arch is not None and (more_ep := ep_raise_knob(section, getattr(cfg, section), arch, _train_pool_size(cfg))):
            knobs.insert(0, more_ep)  # an MoE model's experts shard over ep: the cheapest memory
        if phase == WEIGHT_PUSH:
            knobs += push_knobs
        issues.append(Issue(section, f"training needs an estimated {training[phase] / GIB:.1f} GiB per GPU in phase {phase}, "
                            f"{(training[phase] - gpu) / GIB:.1f} GiB {over}; " + ", ".join(knobs or ["raise the GPU count"])))
    if rollout_peak > gpu:
        knobs = _offload_knobs(cfg, table, GENERATE) if table.engine_shares_devices else []
        knobs.append("lower rollout.mem_fraction" if cfg.rollout.engine == "sglang" else "lower rollout.max_running_requests")
        issues.append(Issue("rollout.mem_fraction", f"generation needs an estimated {rollout_peak / GIB:.1f} GiB per GPU, "
                            f"{(rollout_peak - gpu) / GIB:.1f} GiB {over}; " + ", ".join(knobs)))


_Layouts = Callable[[str, "list[tuple[int, int]] | None"], "list[tuple[int, int]]"]


def _fitting_layouts(cfg: MegaRLConfig, arch: ArchSpec, section: str, pairs: list[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
    """The (tp, pp) of ``pairs`` (default: every layout the rules allow on the training pool) with
    which ``section``'s mini-batch splits over its dp and its memory fits as well, fewest GPUs per
    replica first (more data parallelism), then the larger tp (inside a node). Problems no layout
    changes are not held against one. A CPU plan, or one whose other trained role has no layout,
    has no memory check."""
    if pairs is None:
        pairs = _parallel_pairs(arch, _train_pool_size(cfg))
    role = "policy" if section == "actor" else "critic"
    found = []
    for tp, pp in sorted(pairs, key=lambda lay: (lay[0] * lay[1], -lay[0])):
        conf = getattr(cfg, section)
        probe_cfg = cfg.model_copy(update={section: conf.model_copy(update={"parallel": conf.parallel.model_copy(update={"tp": tp, "pp": pp})})})
        probe: list[Issue] = []
        roles = _layout_roles(probe_cfg, arch, probe)
        if role not in roles:
            continue
        if (conf.mini_batch_size or cfg.samples_per_step) % _batch_unit(conf, roles[role].dp):
            continue
        if (tp * roles[role].dp) % (conf.parallel.ep * conf.parallel.etp):  # the expert groups would not tile
            continue
        if {"policy", "critic"} & roles.keys() == ({"policy", "critic"} if cfg.critic_enabled else {"policy"}):
            resolved, _ = _resolve_recompute(probe_cfg, arch, roles)  # (the memory needs every trained role's layout)
            _plan_memory(resolved, arch, roles, probe, suggest=False)
        if not any(i.level == "error" and i.field == section for i in probe):  # the section's memory
            found.append((tp, pp))
    return found


def _offload_knobs(cfg: MegaRLConfig, table: Residency, phase: str) -> list[str]:
    """``set <model>.offload=true`` for each model that keeps states in ``phase`` it does not use there."""
    resident = table.resident(phase) - table.needs(phase)
    return [f"set {flag}=true" for model, flag in _OFFLOAD_KNOBS
            if model in table.models and model not in table.offloaded and any(owner_of(s) == model for s in resident)]  # fmt: skip


def _check_offload(cfg: MegaRLConfig, issues: list[Issue]) -> None:
    """What the memory hand-over cannot do (the offload flags themselves work everywhere)."""
    if cfg.rollout.weights_cpu_backup and not (cfg.rollout.engine == "sglang" and cfg.cluster.placement == "colocated"):
        issues.append(Issue("rollout.weights_cpu_backup", "only colocated SGLang releases its weights (the torch engine and "
                            "disaggregated engines keep them); set it to false"))
