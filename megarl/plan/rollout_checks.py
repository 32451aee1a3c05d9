"""The planner's checks of the rollout side: engines and their weight transport, the SGLang
servers' interpreter, its NCCL and arguments, what a run without Ray can hold, sampling, positions and agent loops. Each appends :class:`Issue` s to the
list it is given (megarl/plan/planner.py collects them); `megarl generate` runs
:func:`check_positions` alone. Torch-free, like the planner."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from collections.abc import Mapping

from megarl.config.architectures import ArchSpec
from megarl.config.rollout_sections import engine_kwargs_args
from megarl.config.sections import MegaRLConfig
from megarl.plan.gpu_memory import GIB, rollout_memory, sglang_free_at_launch
from megarl.plan.issues import Issue, choices, divisors
from megarl.plan.own_devices import own_devices
from megarl.ray_cluster.rank_env import nccl_cumem_enable

# Which weight transports reach which engines (see megarl/weight_sync/transports.py).
_TRANSPORTS = {("torch", "colocated"): ("in_process", "disk"), ("sglang", "colocated"): ("tensor", "disk"),
               ("sglang", "disaggregated"): ("distributed", "disk")}  # fmt: skip


def check_transport(cfg: MegaRLConfig, issues: list[Issue]) -> None:
    chosen = cfg.weight_transport
    possible = _TRANSPORTS.get((cfg.rollout.engine, cfg.cluster.placement), ())
    if possible and chosen not in possible:
        issues.append(Issue("rollout.weight_sync.transport", f"({chosen}) cannot reach {cfg.rollout.engine} engines placed "
                            f"{cfg.cluster.placement}; use {' or '.join(possible)} (or auto)"))


def check_in_process(cfg: MegaRLConfig, issues: list[Issue], *, sft: bool = False) -> None:
    """A run without Ray: one process holds every role, so a world of one and (RL, not
    ``sft``) the torch engine."""
    if cfg.cluster.world_size != 1:
        issues.append(Issue("cluster", f"--in-process runs a world of one process, the config has {cfg.cluster.world_size} "
                            "(nnodes x gpus_per_node); set cluster.nnodes=1 cluster.gpus_per_node=1"))
    if cfg.rollout.engine != "torch" and not sft:
        issues.append(Issue("rollout.engine", f"({cfg.rollout.engine}) needs Ray to place its servers; --in-process runs "
                            "the torch engine (rollout.engine=torch)"))
    if os.environ.get("WORLD_SIZE", "1") != "1":
        issues.append(Issue("cluster", f"--in-process runs one process, but WORLD_SIZE is {os.environ['WORLD_SIZE']} "
                            "(a launcher started several); run it with torchrun --nproc_per_node 1, or without --in-process"))


def check_server_python(cfg: MegaRLConfig, issues: list[Issue]) -> None:
    """The interpreter that runs the SGLang servers (the rollout's, the judge's) exists and (this one) has SGLang."""
    judge = cfg.reward.judge
    if cfg.rollout.engine != "sglang" and (judge is None or judge.engine != "sglang"):
        return
    python = cfg.rollout.server_python
    if python is not None and not os.access(python, os.X_OK):
        issues.append(Issue("rollout.server_python", f"({python}) is not an executable Python interpreter"))
    elif python is not None and not imports_sglang(python):
        issues.append(Issue("rollout.server_python", f"({python}) cannot import sglang; point it at the Python of an "
                            "SGLang environment (on a CPU machine `make sglang-cpu` builds one)"))  # fmt: skip
    elif python is None and importlib.util.find_spec("sglang") is None:
        fix = ("on a CPU machine `make sglang-cpu` builds one; then set rollout.server_python=<that venv>/bin/python"
               if cfg.cluster.device == "cpu" else "pip install -e .[sglang], or point rollout.server_python at a Python that has it")
        issues.append(Issue("rollout.server_python", f"(unset: this interpreter, {sys.executable}) cannot import sglang; {fix}"))


def imports_sglang(python: str) -> bool:
    """Whether ``python`` has SGLang installed (found, not imported: that would take seconds)."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') is None)"
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


# Prints this Python's torch NCCL version ("2.30.7"), or "none" where torch has no NCCL (a CPU
# build: torch.cuda.nccl.version() raises) or does not import. Both sides run it the same way.
NCCL_PROBE = "try:\n    import torch\n    print(*torch.cuda.nccl.version(), sep='.')\nexcept Exception:\n    print('none')"
_NCCL_ANSWER = re.compile(r"\d+(\.\w+)+|none")


def check_nccl_versions(cfg: MegaRLConfig, issues: list[Issue]) -> None:
    """The trainer and the SGLang servers run one NCCL version where the weight push joins them in
    one NCCL group: the ``distributed`` transport on GPUs (NCCL refuses a communicator whose ranks
    differ in version, patch level included). ``tensor`` (CUDA IPC) and ``disk`` form no group
    across the two sides, and on CPU the group is gloo. Skipped when the servers run this Python
    (rollout.server_python unset) or theirs is not executable (check_server_python says so)."""
    server = cfg.rollout.server_python
    if (cfg.rollout.engine != "sglang" or cfg.weight_transport != "distributed" or cfg.cluster.device != "cuda"
            or server is None or not os.access(server, os.X_OK)):  # fmt: skip
        return
    issue = nccl_mismatch(sys.executable, server)
    if issue is not None:
        issues.append(issue)


def nccl_mismatch(trainer_python: str, server_python: str) -> Issue | None:
    """An error when the two interpreters' torch load different NCCL versions; a warning when
    either has none (or does not answer), so nothing could be compared; else None."""
    trainer, server = probe_nccl([trainer_python, server_python])
    versions = [a for a in (trainer, server) if _NCCL_ANSWER.fullmatch(a) and a != "none"]
    if len(versions) == 2 and trainer == server:
        return None
    if len(versions) == 2:
        return Issue("rollout.server_python", f"({server_python}) loads NCCL {server} and the trainer ({trainer_python}) "
                     f"NCCL {trainer}: NCCL refuses a group whose ranks differ in version, so every weight push "
                     f"(rollout.weight_sync.transport distributed) would fail; make the servers' torch load NCCL {trainer} "
                     "(the cluster image links the trainer's libnccl into its SGLang venv: docs/docker.md; or install "
                     "the nvidia-nccl-cu12/-cu13 wheel of that version there), or set rollout.weight_sync.transport=disk")  # fmt: skip

    def said(answer: str) -> str:
        return "no NCCL (a CPU torch, or no torch)" if answer == "none" else (
            f"NCCL {answer}" if _NCCL_ANSWER.fullmatch(answer) else answer)  # fmt: skip

    return Issue("rollout.server_python", f"NCCL versions not compared (the trainer's {trainer_python}: {said(trainer)}; "
                 f"the servers' {server_python}: {said(server)}): the distributed weight push needs one NCCL version on "
                 "both sides; `megarl doctor` in each environment shows its NCCL", level="warning")  # fmt: skip


def probe_nccl(pythons: list[str], timeout: float = 120) -> list[str]:
    """Each interpreter's answer to :data:`NCCL_PROBE` ("2.30.7" or "none"), or "unknown (why)";
    one subprocess each, run at once (each imports torch: seconds). No torch in this process."""
    started: list[subprocess.Popen | str] = []
    for python in pythons:
        try:
            started.append(subprocess.Popen([python, "-c", NCCL_PROBE], stdout=subprocess.PIPE,
                                            stderr=subprocess.DEVNULL, text=True))  # fmt: skip
        except OSError as exc:
            started.append(f"unknown ({exc.strerror or exc})")
    answers = []
    for proc in started:
        if isinstance(proc, str):
            answers.append(proc)
            continue
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            answers.append(f"unknown (no answer in {timeout:g} s)")
            continue
        last = (out.strip().splitlines() or [""])[-1].strip()
        answers.append(last if _NCCL_ANSWER.fullmatch(last) else f"unknown (exit code {proc.returncode}, printed {last!r})")
    return answers


def check_rollout(cfg: MegaRLConfig, arch: ArchSpec, issues: list[Issue]) -> None:
    """The engines' tensor parallelism and weight transport."""
    tp = cfg.rollout.tp
    check_transport(cfg, issues)
    if cfg.rollout.engine == "torch":
        if tp != 1:
            issues.append(Issue("rollout.tp", f"({tp}) must be 1 with the torch engine (it runs in one process)"))
        return
    check_deterministic(cfg, issues)
    if tp > cfg.cluster.gpus_per_node or cfg.cluster.gpus_per_node % tp:
        issues.append(Issue("rollout.tp", f"({tp}) must divide gpus_per_node ({cfg.cluster.gpus_per_node}) so that no engine "
                            f"spans two nodes; try {choices(rollout_tp_choices(cfg, arch))}"))
    if not heads_split(arch, tp):
        issues.append(Issue("rollout.tp", f"({tp}) must divide num_attention_heads ({arch.num_heads}), and divide or be a "
                            f"multiple of num_key_value_heads ({arch.num_kv_heads}); try {choices(rollout_tp_choices(cfg, arch))}"))


def check_deterministic(cfg: MegaRLConfig, issues: list[Issue]) -> None:
    """SGLang's deterministic inference needs GPU attention kernels: on CPU (SGLang 0.5.23) the
    server refuses to start ("only [...] attention backends are supported for deterministic
    inference")."""
    if cfg.rollout.engine == "sglang" and cfg.rollout.deterministic and cfg.cluster.device == "cpu":
        issues.append(Issue("rollout.deterministic", "(true) needs SGLang's deterministic GPU attention kernels, and a CPU "
                            "server refuses to start with it; set rollout.deterministic=false, or rollout.engine=torch "
                            "(always seeded)"))  # fmt: skip


# Server arguments under which SGLang 0.5.23 sets NCCL_CUMEM_ENABLE=1 in its server even where the
# variable is set (sglang/srt/entrypoints/engine.py, _set_envs_and_config: `"NCCL_CUMEM_ENABLE" not
# in os.environ or cfg.enable_symm_mem`). Its other cases only fill the variable in where it is
# unset (--enable-kv-cache-sharding's symmetric gather, multi-node NVLink with --nnodes > 1), and
# megarl always sets it (megarl/ray_cluster/rank_env.py), so they keep the run's value.
CUMEM_FORCING_SERVER_ARGS = ("--enable-symm-mem",)


# Server flags megarl sets from the config (megarl/rollout_sglang/server.py build_launch_command),
# with the key that sets each: a later copy in rollout.server_args would win in SGLang's parser and
# break what megarl relies on (the health probe's port, the GPU mapping, dummy-loaded weights that
# the first push fills, the KV-cache plan).
OWNED_SERVER_ARGS = {
    "--model-path": "model.path", "--tp-size": "rollout.tp", "--tp": "rollout.tp",
    "--mem-fraction-static": "rollout.mem_fraction", "--host": "(the node's address)", "--port": "(a free port)",
    "--base-gpu-id": "(the engine's GPUs)", "--device": "cluster.device", "--load-format": "(dummy when a push follows)",
    "--max-running-requests": "rollout.max_running_requests", "--random-seed": "trainer.seed", "--dtype": "model.dtype",
    "--enable-memory-saver": "cluster.placement", "--enable-weights-cpu-backup": "rollout.weights_cpu_backup",
    "--enable-deterministic-inference": "rollout.deterministic",
}  # fmt: skip


def check_sglang_keys_used(cfg: MegaRLConfig, issues: list[Issue]) -> None:
    """A warning for SGLang's server keys set with another engine, which ignores them."""
    if cfg.rollout.engine == "sglang":
        return
    for key, value in (("engine_kwargs", cfg.rollout.engine_kwargs), ("server_args", cfg.rollout.server_args)):
        if value:
            issues.append(Issue(f"rollout.{key}", f"is set, and it is SGLang's: rollout.engine={cfg.rollout.engine} "
                                "ignores it; drop it, or set rollout.engine=sglang", level="warning"))  # fmt: skip


def check_server_args(cfg: MegaRLConfig, issues: list[Issue], environ: Mapping[str, str] | None = None) -> None:
    """rollout.server_args that repeat a flag megarl sets from the config, or that would make the
    SGLang servers' NCCL_CUMEM_ENABLE differ from the policy ranks' (the run's value: the user's
    in ``environ``, default this process's, else 0): the distributed push's NCCL group, which
    joins both, then fails."""
    for flag in dict.fromkeys(a.split("=", 1)[0] for a in cfg.rollout.server_args):
        if flag in OWNED_SERVER_ARGS:
            issues.append(Issue("rollout.server_args", f"({flag}) is set by megarl from {OWNED_SERVER_ARGS[flag]}; "
                                f"drop it from rollout.server_args (set the config key instead)"))  # fmt: skip
    cumem = nccl_cumem_enable(environ)
    if cfg.rollout.engine != "sglang" or cfg.cluster.device != "cuda" or cfg.weight_transport != "distributed" or cumem == "1":
        return
    for flag in dict.fromkeys(a.split("=", 1)[0] for a in (*engine_kwargs_args(cfg.rollout.engine_kwargs), *cfg.rollout.server_args)):
        if flag in CUMEM_FORCING_SERVER_ARGS:
            issues.append(Issue("rollout.server_args", f"({flag}) makes SGLang set NCCL_CUMEM_ENABLE=1 in its servers while "
                                f"the policy ranks run with {cumem}, and the weight push's NCCL group between them fails; drop "
                                f"{flag}, or export NCCL_CUMEM_ENABLE=1 where megarl launch runs (both sides then use 1)"))


def heads_split(arch: ArchSpec, tp: int) -> bool:
    """Whether SGLang splits the heads over ``tp`` ranks (KV heads are replicated past their count)."""
    kv = arch.num_kv_heads
    return arch.num_heads % tp == 0 and (kv % tp == 0 if tp <= kv else tp % kv == 0)


def rollout_tp_choices(cfg: MegaRLConfig, arch: ArchSpec) -> list[int]:
    """The rollout.tp values every rollout rule accepts: dividing the rollout pool and a node
    (no engine spans two), splitting the heads, and holding the weights and one full-length
    sequence in rollout.mem_fraction (the values that pass the rest when none does)."""
    cl = cfg.cluster
    pool = cl.rollout_gpus if cl.placement == "disaggregated" and cl.rollout_gpus > 0 else cl.world_size - own_devices(cfg)
    ok = [t for t in divisors(math.gcd(pool, cl.gpus_per_node)) if heads_split(arch, t)]
    seq = cfg.data.max_prompt_length + cfg.rollout.sampling.max_new_tokens
    free = sglang_free_at_launch(cl.gpu_memory_gib * GIB, colocated=cl.placement == "colocated")
    mems = {t: rollout_memory(arch, tp=t, free_bytes=free, mem_fraction=cfg.rollout.mem_fraction,
                              dtype=cfg.model.dtype, seq_len=seq) for t in ok}  # fmt: skip
    return [t for t in ok if mems[t].weights < mems[t].budget and mems[t].full_length_sequences >= 1] or ok


def check_validation(cfg: MegaRLConfig, issues: list[Issue]) -> None:
    """The pass threshold of validation (pass@k) against the reward's range (megarl evaluate's rule), and
    several greedy samples per prompt (identical)."""
    from megarl.evaluation import greedy_copies_note, threshold_problem

    problem = threshold_problem(cfg.rollout.val.pass_threshold, cfg.reward)
    if problem:
        issues.append(Issue("rollout.val.pass_threshold", problem))
    val = cfg.rollout.val
    if (val.greedy or val.temperature == 0) and val.n > 1 and cfg.data.val_files:  # (no validation files: nothing is validated)
        fix = "rollout.val.greedy=false" if val.greedy else "rollout.val.temperature > 0"
        issues.append(Issue("rollout.val.n", f"({val.n}): {greedy_copies_note(val.n)}; set {fix} to "
                            "sample them, or rollout.val.n=1", level="warning"))


def check_sampling(cfg: MegaRLConfig, arch: ArchSpec, issues: list[Issue]) -> None:
    s = cfg.rollout.sampling
    if s.temperature <= 0:
        issues.append(Issue("rollout.sampling.temperature", f"({s.temperature}) must be > 0 for training rollouts (log-probs "
                            "are taken at this temperature); greedy validation is rollout.val.greedy=true"))
    if s.top_p < 1 or s.top_k > 0:
        issues.append(Issue("rollout.sampling", f"top_p={s.top_p}, top_k={s.top_k}: the rollout samples from a truncated "
                            "distribution while the trainer's ratio uses the full one (off-policy); consider algorithm.tis",
                            level="warning"))
    positions = check_positions(cfg, arch)
    if positions is not None:
        issues.append(positions)


def check_positions(cfg: MegaRLConfig, arch: ArchSpec, new_tokens: str = "rollout.sampling.max_new_tokens") -> Issue | None:
    """The longest prompt (data.max_prompt_length) plus max_new_tokens must fit the model's
    positions, or responses are cut short. ``new_tokens``: how the fix names max_new_tokens
    (`megarl generate` has a shortcut for it)."""
    prompt, new = cfg.data.max_prompt_length, cfg.rollout.sampling.max_new_tokens
    if prompt + new <= arch.max_positions:
        return None
    room = arch.max_positions - prompt
    fix = f"lower {new_tokens} to at most {room}, or data.max_prompt_length" if room > 0 else "lower data.max_prompt_length"
    return Issue("data.max_prompt_length", f"max_prompt_length + rollout.sampling.max_new_tokens ({prompt} + {new} = "
                 f"{prompt + new}) exceeds the model's max_position_embeddings ({arch.max_positions}); {fix}")


def check_agent(cfg: MegaRLConfig, issues: list[Issue]) -> None:
    """Agent loops append turns through the chat template; reproducible rounds need no overlap."""
    agent = cfg.rollout.agent
    if cfg.rollout.generate_function != "default":
        return
    if agent.overlap_tools and cfg.rollout.deterministic:
        issues.append(Issue("rollout.agent.overlap_tools", "(true) lets tool timing decide which turns generate together, "
                            "so rollout.deterministic (true) would not make runs reproducible; set overlap_tools=false "
                            "or leave it unset"))
    uses_agents = agent.default_agent != "single_turn" or agent.tools_file or agent.interactions_file
    if uses_agents and not cfg.data.apply_chat_template:
        issues.append(Issue("data.apply_chat_template", "(false) but rollout.agent appends tool answers and user turns "
                            "through the chat template; set data.apply_chat_template=true"))
