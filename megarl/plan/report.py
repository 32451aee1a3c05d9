"""Printing a Plan for people: the placement table, the memory budget, the warnings."""

from __future__ import annotations

from collections.abc import Callable

from rich.console import Console
from rich.table import Table

from megarl.config.sections import MegaRLConfig
from megarl.plan.async_checks import async_summary
from megarl.plan.gpu_memory import GIB, RuntimeMemory
from megarl.plan.host_memory import host_memory_text
from megarl.plan.issues import counted
from megarl.plan.lora_checks import lora_summary
from megarl.plan.planner import Plan
from megarl.plan.reward_checks import reward_roles
from megarl.plan.reward_model_plan import colocated_reward_model
from megarl.plan.routing_bytes import routing_bytes, routing_text
from megarl.plan.step_timeline import timeline_text


def print_plan(cfg: MegaRLConfig, plan: Plan, console: Console | None = None) -> None:
    console = console or Console()
    a = plan.arch
    console.print(
        f"[bold]model[/] {a.name} ({a.model_type}, {_count(a.num_params)} params, {a.num_layers} layers, "
        f"{a.num_heads} heads / {a.num_kv_heads} kv, vocab {a.vocab_size})"
        + (f"; its {counted(a.num_mtp_layers, 'multi-token-prediction layer')} not counted, not trained" if a.num_mtp_layers else "")
    )
    layouts = ", ".join(
        f"{r.role}: tp{r.tp} pp{r.pp} dp{r.dp}{_model_flags(cfg, plan, r.role)}"
        if r.role != "rollout"
        else ("rollout: 1 torch engine process of its own" if cfg.asynchronous and cfg.rollout.engine == "torch"
              else f"rollout: {r.dp} x {cfg.rollout.engine} engine tp{r.tp}")
        for r in plan.roles.values()
    ) + (f", reward model: {counted(plan.reward_model.dp, 'actor')} "
         f"{'on the training devices' if colocated_reward_model(cfg) else 'of its own'}" if plan.reward_model else "") + (
        f", LLM judge: {plan.judge.dp} x sglang server tp{plan.judge.tp} of its own" if plan.judge else "")
    console.print(f"[bold]placement[/] {plan.placement} on {cfg.cluster.nnodes} x {cfg.cluster.gpus_per_node} {plan.device}; {layouts}")
    console.print(
        f"[bold]step[/] {cfg.data.prompts_per_step} prompts x n={cfg.rollout.n} = {cfg.samples_per_step} samples; "
        f"mini-batch {cfg.actor.mini_batch_size or cfg.samples_per_step}, ppo_epochs {cfg.actor.ppo_epochs}"
    )
    console.print(f"[bold]step timeline[/] {timeline_text(cfg)}")
    table = Table(show_lines=False, header_style="bold")
    for col in ("node", "gpu" if plan.device == "cuda" else "proc", "roles (ranks)"):
        table.add_column(col)
    mem = plan.memory
    if mem is not None and plan.device == "cuda":
        table.add_column("train GiB", justify="right")
        table.add_column("rollout GiB", justify="right")
    held = _held_by_own_roles(cfg, plan)
    for node, gpu, roles in plan.rows(cfg.cluster.nnodes, cfg.cluster.gpus_per_node):
        cells = [str(node), str(gpu), roles]
        if mem is not None and plan.device == "cuda" and node * cfg.cluster.gpus_per_node + gpu in held:
            text = held[node * cfg.cluster.gpus_per_node + gpu]
            cells += [text, text]  # a reward role on devices of its own holds the same in every phase
        elif mem is not None and plan.device == "cuda":
            cells += [f"{mem.train_peak / GIB:.1f}", f"{mem.rollout_peak / GIB:.1f}" if mem.rollout else "-"]
        table.add_row(*cells)
    console.print(table)
    for line in expert_placement(cfg, plan):
        console.print(line)
    overlap = async_summary(cfg, plan.roles["rollout"].dp if "rollout" in plan.roles else 0)
    if overlap is not None:
        console.print(overlap)
    lora = lora_summary(cfg, plan.arch)
    if lora is not None:
        console.print(lora)
    for role in reward_roles(cfg, cfg.samples_per_step, plan.roles.get("policy")):
        gib = "size unknown (no readable config.json)" if role["memory_gib"] is None else f"~{role['memory_gib']:.2f} GiB {role['per']}"
        console.print(f"[bold]{role['role']}[/] {role['where']}; {gib} ({role['what']})")
    if mem is not None:
        _print_memory(cfg, plan, console)
    if plan.push is not None:
        _print_push(cfg, plan, console)
    for w in plan.warnings:
        console.print(f"[yellow]warning[/] {w}")
    console.print("[green]ok[/]: the plan fits")


def _held_by_own_roles(cfg: MegaRLConfig, plan: Plan) -> dict[int, str]:
    """GiB per device of the reward roles on devices of their own (the reward model's actors, the
    judge's servers), by global device ("?": a size unknown)."""
    mem, held = plan.memory, dict[int, str]()
    if plan.reward_model and not colocated_reward_model(cfg):
        rm = mem.reward_model if mem is not None else None
        held |= dict.fromkeys(plan.reward_model.gpus, f"{rm.total / GIB:.1f}" if rm else "?")
    if plan.judge:
        judge = mem.judge if mem is not None else None
        held |= dict.fromkeys(plan.judge.gpus, f"{judge.total / GIB:.1f}" if judge else "?")
    return held


def _print_memory(cfg: MegaRLConfig, plan: Plan, console: Console) -> None:
    mem = plan.memory
    assert mem is not None

    def g(x: float) -> str:
        return f"{x / GIB:.1f}" if x >= GIB / 10 or x == 0 else f"{x / GIB:.2g}"

    per = "GPU" if plan.device == "cuda" else "device"  # a CPU plan has processes, not GPUs
    for role, m in (("policy", mem.policy), ("critic", mem.critic)):
        if m is not None:
            console.print(
                f"[bold]{role} memory/{per}[/] weights {g(m.weights)} + grads {g(m.grads)} + optimizer {g(m.optimizer)} "
                f"+ activations {g(m.activations)} + {'value head' if role == 'critic' else 'LM head'} {g(m.logits + m.head_grad)} "
                f"= {g(m.peak)} GiB"
            )
    if mem.reward_model is not None:
        rm = mem.reward_model
        where = ("on the training devices in phase reward only (offloaded to host memory otherwise; its runtime in every phase)"
                 if colocated_reward_model(cfg) else "on its own devices in every phase (it scores after generate)")
        console.print(f"[bold]reward model memory/{per}[/] weights {g(rm.weights)} ({rm.dtype}) + activations {g(rm.activations)} "
                      f"(one batch of {rm.tokens[0]} x {rm.tokens[1]} tokens) + runtime {g(rm.runtime)} = {g(rm.total)} GiB, "
                      f"{where}")  # fmt: skip
    if mem.judge is not None:
        j, fraction = mem.judge, cfg.reward.judge.server_mem_fraction("cuda")  # type: ignore[union-attr]
        console.print(f"[bold]judge memory/GPU[/] {g(j.server.budget)} GiB (reward.judge.mem_fraction {fraction:g} of the "
                      f"{g(j.server.free_at_launch)} GiB free at launch): weights {g(j.server.weights)} ({j.dtype}) + KV cache "
                      f"{g(j.server.kv_cache)} = {j.server.full_length_sequences} sequences of its context ({j.context} "
                      f"tokens) at once, for max_running_requests {j.max_running_requests}; + SGLang outside mem_fraction "
                      f"{g(j.outside)} = {g(j.total)} GiB, on its own devices in every phase")  # fmt: skip
    if mem.reference_weights:
        console.print(f"[bold]reference[/] weights {g(mem.reference_weights)} GiB{' (offloaded)' if cfg.reference.offload else ''}")
    if mem.rollout is not None:
        r = mem.rollout
        console.print(
            f"[bold]rollout memory/{per}[/] {g(r.budget)} GiB (mem_fraction {cfg.rollout.mem_fraction} of the {g(r.free_at_launch)} "
            f"GiB free at launch): weights {g(r.weights)} + KV cache {g(r.kv_cache)} = {r.full_length_sequences} sequences of "
            "full length at once"
        )
    if plan.device == "cuda" and mem.runtime is not None:
        console.print(f"[bold]runtime memory/GPU[/] {runtime_text(cfg, mem.runtime, g)}")
    routing = routing_bytes(cfg, plan.arch, plan.roles["policy"].dp) if "policy" in plan.roles else None
    if routing is not None:
        console.print(f"[bold]routing replay[/] {routing_text(routing)}")
    if plan.device == "cuda" and mem.host is not None and mem.host.peak:
        node = f" (node {mem.host.node})" if cfg.cluster.nnodes > 1 else ""
        console.print(f"[bold]host memory/node[/]{node} at least {g(mem.host.peak)} GiB: {host_memory_text(mem.host)} "
                      "(megarl's buffers; the processes' own memory not counted)")  # fmt: skip
    if plan.device == "cuda":
        # Per phase of the residency table (docs/architecture.md, 'Memory between training and generation').
        console.print("[bold]by phase/GPU[/] " + ", ".join(f"{p} {g(b)}" for p, b in mem.phases.items()) + " GiB")
        console.print(f"[bold]peak/GPU[/] training {g(mem.train_peak)} GiB, generation {g(mem.rollout_peak)} GiB of {g(mem.gpu_bytes)} GiB")


def expert_placement(cfg: MegaRLConfig, plan: Plan) -> list[str]:
    """A trained mixture-of-experts model's experts: how each role splits them, and which experts
    each node holds per pipeline stage (its GPUs' expert-parallel ranks)."""
    experts, lines = plan.arch.num_experts, list[str]()
    if not experts:
        return lines
    for lay in (r for r in plan.roles.values() if r.role != "rollout"):
        lines.append(f"[bold]experts[/] {lay.role}: {experts} per MoE layer over ep {lay.ep} x etp {lay.etp}, "
                     f"{experts // lay.ep} whole experts per GPU; expert-data-parallel {lay.expert_dp} (the copies of "
                     "each expert, over which its optimizer state is sharded)")  # fmt: skip
        per_node = cfg.cluster.gpus_per_node
        for node in sorted({g // per_node for g in lay.gpus}):
            stages: dict[int, set[int]] = {}
            for rank, gpu in enumerate(lay.gpus):
                if gpu // per_node == node:
                    stages.setdefault(rank // (lay.tp * lay.dp), set()).add(lay.expert_rank(rank))
            held = "; ".join(f"pp{pp} ep {_spans(sorted(eps))} (experts {_spans(_experts(eps, experts // lay.ep))})"
                             for pp, eps in sorted(stages.items()))  # fmt: skip
            lines.append(f"  node {node}: {held}")
    engines = plan.roles.get("rollout")
    if engines is not None and cfg.rollout.engine == "sglang":
        f = plan.arch.moe_ffn_hidden_size
        lines.append(f"[bold]experts[/] rollout: each of the {engines.dp} engines splits every expert over its tp "
                     f"{engines.tp} ({f // engines.tp} of its {f} intermediate columns per GPU)")  # fmt: skip
    return lines


def _experts(ep_ranks: set[int], per_rank: int) -> list[int]:
    return sorted(e for r in ep_ranks for e in range(r * per_rank, (r + 1) * per_rank))


def _spans(values: list[int]) -> str:
    """``0-15, 32-47``: sorted integers as runs."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def runtime_text(cfg: MegaRLConfig, runtime: RuntimeMemory, g: Callable[[float], str]) -> str:
    """The processes' own memory per GPU (megarl/plan/gpu_memory.py's estimates): the trainer's,
    and SGLang's outside mem_fraction on its GPUs (colocated: the same GPUs)."""
    trainer = f"trainer {g(runtime.trainer)}"
    if not runtime.sglang:
        return f"{trainer} GiB (an estimate, not measured)"
    sglang = (f"SGLang outside mem_fraction {g(runtime.sglang)} (CUDA context and NCCL {g(runtime.sglang_context)}, "
              f"CUDA graphs and allocator cache {g(runtime.sglang_graphs)})")  # fmt: skip
    if cfg.cluster.placement == "colocated":
        return f"{trainer} + {sglang} = {g(runtime.trainer + runtime.sglang)} GiB (estimates, not measured)"
    return f"{trainer} GiB; on the engines' GPUs, {sglang} GiB (estimates, not measured)"


_CPU_LINKS = {"nvlink": "gloo within the node", "network": "gloo across nodes", "host": "host memory"}


def _print_push(cfg: MegaRLConfig, plan: Plan, console: Console) -> None:
    """One line: what a weight push moves per GPU on each link, and (on GPUs) its time at the
    cluster's bandwidths (megarl/plan/push_model.py)."""
    push = plan.push
    assert push is not None
    # On CPU the processes of a node exchange through gloo over loopback TCP, not NVLink
    names = _CPU_LINKS if plan.device == "cpu" else {}
    parts = " + ".join(f"{name} {b / 1e9:.3g} GB ({names.get(link, link)})" for name, b, link in push.parts) or "nothing over a link"
    per = "GPU" if plan.device == "cuda" else "process"
    line = f"[bold]weight push[/] (transport {push.transport}) received per {per}: {parts}"
    if push.transport == "adapter":  # policy rank 0 serves each server in turn: whole bytes, not per GPU
        line = f"[bold]weight push[/] (LoRA adapters, not through the transport) moved: {parts}"
    if plan.device == "cuda":
        cl = cfg.cluster
        line += (f"; about {push.seconds:.2g} s at {cl.nvlink_gb_per_s:g} / {cl.network_gb_per_s:g} / {cl.host_gb_per_s:g} GB/s "
                 "(cluster.nvlink_gb_per_s / network_gb_per_s / host_gb_per_s; a lower bound)")  # fmt: skip
    console.print(line)


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _model_flags(cfg: MegaRLConfig, plan: Plan, role: str) -> str:
    """The layout's flags of the role's model: `` sp`` under sequence parallelism, ``
    recompute X`` (`` (auto)`` when the plan chose X); the reference shares the policy's section."""
    section = "critic" if role == "critic" else "actor"
    conf = getattr(cfg, section)
    flags = " sp" if conf.parallel.uses_sequence_parallel else ""
    if f"{section}.recompute" in plan.resolved:
        return f"{flags} recompute {plan.resolved[section + '.recompute']} (auto)"
    return flags if conf.recompute == "none" else f"{flags} recompute {conf.recompute}"
