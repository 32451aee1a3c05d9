"""The LLM judge's SGLang servers on devices of their own (``reward.judge.engine: sglang`` on
``cluster.device: cuda``): their devices, their memory per device, and what the planner refuses.

Devices: ``reward.judge.gpus`` of the cluster's last (megarl/plan/own_devices.py: after the reward
model's role's, if it has some; that module refuses too many), one SGLang server per
``reward.judge.tp`` of them: server k on ``gpus[k * tp : (k + 1) * tp]``, the rollout pool's rule
(megarl/rollout_sglang/hosts.py engine_slots). At run time each server's devices are a placement
group of their own (``tp`` one-GPU bundles on one node), as a disaggregated rollout engine's.
The judge holds them in every phase of the step and works in ``reward`` only.

Memory per device (:func:`judge_memory`), the planner's SGLang rollout model
(megarl/plan/gpu_memory.py) with the judge's own numbers: a server sees the GPU free but for its
own CUDA context at launch, takes ``mem_fraction`` of that for its weights (the model's size from
its config.json, megarl/plan/model_size.py, in the dtype it was saved in, over ``tp``) and its KV
cache, and holds its CUDA graphs and allocator cache on top. Refused: weights that leave no KV
cache, a KV cache that holds no full context (``context_length``, else the model's positions), a
server over ``cluster.gpu_memory_gib``; a warning when it holds fewer full contexts than
``max_running_requests`` (the rest of a call's requests queue).

Also refused: a ``context_length`` above the model's max_position_embeddings (any engine or device),
``gpus`` / ``tp`` set where they mean nothing (the torch engine; cluster.device cpu,
where the one server is a child of the controller), --in-process runs (the servers are placed
through Ray), ``gpus`` not a multiple of ``tp``, a ``tp`` that does not divide a node's devices or
split the judge's attention heads. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.config.sections import MegaRLConfig
from megarl.plan.gpu_memory import (
    DTYPE_BYTES,
    GIB,
    RolloutMemory,
    rollout_memory,
    runtime_memory,
    sglang_free_at_launch,
)
from megarl.plan.issues import Issue, divisors
from megarl.plan.model_size import model_size
from megarl.plan.own_devices import JUDGE_ROLE, judge_on_devices, own_gpus
from megarl.plan.role_layout import RoleLayout
from megarl.plan.rollout_checks import heads_split


def judge_layout(cfg: MegaRLConfig) -> RoleLayout | None:
    """The judge's servers (``dp``) of ``tp`` devices each (None: it has no devices of its own, or
    its gpus and tp are refused)."""
    gpus, judge = own_gpus(cfg, JUDGE_ROLE), cfg.reward.judge
    if not gpus or judge is None or len(gpus) % judge.tp:
        return None
    return RoleLayout(JUDGE_ROLE, judge.tp, 1, len(gpus) // judge.tp, gpus)


def check_judge(cfg: MegaRLConfig, issues: list[Issue], *, in_process: bool) -> None:
    """What the planner refuses about the judge's devices (module docstring)."""
    judge, cl = cfg.reward.judge, cfg.cluster
    if judge is None:
        return
    for key in ("gpus", "tp"):
        if key not in judge.model_fields_set:
            continue
        if judge.engine == "torch":
            issues.append(Issue(f"reward.judge.{key}", f"({getattr(judge, key)}) is used with reward.judge.engine=sglang "
                                "only (the torch engine runs on CPU); remove it or set the engine"))  # fmt: skip
        elif cl.device == "cpu":
            issues.append(Issue(f"reward.judge.{key}", f"({getattr(judge, key)}) is used on cluster.device cuda only (on cpu "
                                "the judge's one SGLang server is a child process of the controller); remove it"))  # fmt: skip
    _check_context_length(judge.model, judge.context_length, issues)
    if not judge_on_devices(cfg):
        return
    if in_process:
        issues.append(Issue("reward.judge.engine", "(sglang) on cluster.device cuda runs its servers on devices of their "
                            "own, placed through Ray, and --in-process runs without Ray; use reward.judge.engine=torch"))  # fmt: skip
        return
    if judge.gpus % judge.tp:
        fits = [t for t in divisors(judge.gpus) if cl.gpus_per_node % t == 0]
        issues.append(Issue("reward.judge.gpus", f"({judge.gpus}) must be a multiple of reward.judge.tp ({judge.tp}): one "
                            f"server per tp devices; set gpus to a multiple of {judge.tp}, or tp to one of {fits}"))  # fmt: skip
    if cl.gpus_per_node % judge.tp:
        issues.append(Issue("reward.judge.tp", f"({judge.tp}) must divide cluster.gpus_per_node ({cl.gpus_per_node}): "
                            "a server's devices are on one node"))  # fmt: skip
    size = model_size(judge.model)
    if size is not None and not heads_split(size.arch, judge.tp):
        a = size.arch
        issues.append(Issue("reward.judge.tp", f"({judge.tp}) must divide the judge's num_attention_heads ({a.num_heads}), "
                            f"and divide or be a multiple of its num_key_value_heads ({a.num_kv_heads})"))  # fmt: skip


def _check_context_length(model: str, context_length: int | None, issues: list[Issue]) -> None:
    """reward.judge.context_length within the judge's positions (config.json's max_position_embeddings):
    SGLang refuses a longer --context-length at launch, on cpu and cuda alike, and the torch engine
    would run past the positions the model was trained on."""
    size = model_size(model) if context_length is not None else None
    positions = size.arch.max_positions if size is not None else None
    if context_length is not None and positions and context_length > positions:
        issues.append(Issue("reward.judge.context_length", f"({context_length}) is above the judge model's "
                            f"max_position_embeddings ({positions}, {model}/config.json); lower it to {positions} or "
                            "leave it null (the model's own)"))  # fmt: skip


@dataclass(frozen=True)
class JudgeMemory:
    """Bytes per device of one judge server rank (module docstring)."""

    server: RolloutMemory  # mem_fraction x what it sees free: weights + KV cache
    outside: float  # SGLang outside mem_fraction: its CUDA context, graphs and allocator cache
    context: int  # the judge's context length (tokens of one sequence)
    max_running_requests: int
    dtype: str

    @property
    def total(self) -> float:
        return self.server.budget + self.outside


def judge_memory(cfg: MegaRLConfig) -> JudgeMemory | None:
    """A judge server rank's memory from its config.json; None without devices of its own, or when
    config.json is unreadable (the preflight names it)."""
    judge = cfg.reward.judge
    size = model_size(judge.model) if judge is not None and judge_on_devices(cfg) else None
    if judge is None or size is None:
        return None
    context = judge.context_length or size.arch.max_positions
    dtype = size.dtype if size.dtype in DTYPE_BYTES else "float32"
    free = sglang_free_at_launch(cfg.cluster.gpu_memory_gib * GIB, colocated=False)
    server = rollout_memory(size.arch, tp=judge.tp, free_bytes=free, mem_fraction=judge.server_mem_fraction("cuda"),
                            dtype=dtype, seq_len=context)  # fmt: skip
    return JudgeMemory(server, runtime_memory(trainer=False, sglang=True).sglang, context, judge.max_running_requests, dtype)


def check_judge_memory(cfg: MegaRLConfig, mem: JudgeMemory | None, issues: list[Issue]) -> None:
    """A server's weights and one full context fit its mem_fraction, the server fits its GPU; a
    warning when fewer than max_running_requests contexts fit at once."""
    judge = cfg.reward.judge
    if mem is None or judge is None:
        return
    s, fraction, gpu = mem.server, judge.server_mem_fraction("cuda"), cfg.cluster.gpu_memory_gib * GIB
    if s.weights >= s.budget:
        issues.append(Issue("reward.judge.mem_fraction", f"({fraction:g}) leaves {s.budget / GIB:.1f} GiB per GPU, less than "
                            f"the judge's weights ({s.weights / GIB:.1f} GiB at reward.judge.tp={judge.tp}); raise "
                            "reward.judge.tp or mem_fraction"))  # fmt: skip
    elif s.full_length_sequences < 1:
        issues.append(Issue("reward.judge.mem_fraction", f"({fraction:g}): the judge's KV cache ({s.kv_cache / GIB:.1f} GiB "
                            f"per GPU) holds no sequence of its context ({mem.context} tokens); raise reward.judge.mem_fraction "
                            "or tp, or lower reward.judge.context_length"))  # fmt: skip
    elif s.full_length_sequences < mem.max_running_requests:
        issues.append(Issue("reward.judge.max_running_requests", f"({mem.max_running_requests}): the judge's KV cache holds "
                            f"{s.full_length_sequences} sequences of its context ({mem.context} tokens) at once; requests "
                            "past those wait (SGLang admits by tokens in use, so short ones fit more); raise "
                            "reward.judge.mem_fraction or tp, or lower context_length", level="warning"))  # fmt: skip
    if mem.total > gpu:
        issues.append(Issue("reward.judge.mem_fraction", f"({fraction:g}): a judge server needs an estimated "
                            f"{mem.total / GIB:.1f} GiB per GPU (mem_fraction's {s.budget / GIB:.1f} + SGLang's own "
                            f"{mem.outside / GIB:.1f} outside it), over cluster.gpu_memory_gib ({cfg.cluster.gpu_memory_gib:g}); "
                            "lower reward.judge.mem_fraction"))  # fmt: skip
