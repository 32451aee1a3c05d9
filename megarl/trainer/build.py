"""Building the run from a checked config: Ray placement, worker groups, and one strategy
object per phase of the RL step (the step itself never branches on the config)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megarl.actors.clients import CriticClient, InProcessGroup, PolicyClient, TrainedClient
from megarl.config.loading import config_to_yaml
from megarl.config.sections import MegaRLConfig
from megarl.engines.base import SamplingParams, eos_token_ids
from megarl.kept_files import kept_name, time_tag
from megarl.memory.handover import CheckpointedModel, HandedOverEngines, HandedOverScorer, Handover
from megarl.memory.residency import residency_of
from megarl.plan.algorithm_checks import epochs_warmup_issue
from megarl.plan.planner import Plan, PlanError, resolved_config
from megarl.progress import still_waiting
from megarl.rollout.collect import (
    DynamicSamplingCollector,
    GreedyBaseline,
    NoBaseline,
    PlainCollector,
    Scorer,
    WorkerEngines,
)
from megarl.rollout.generate import GenerateFn
from megarl.rollout.producer import RolloutProducer
from megarl.rollout.single_turn import generate_batch
from megarl.trainer.loop import Components, Trainer, sampling_params
from megarl.trainer.metric_sinks import build_logger
from megarl.trainer.phases import (
    Advantages,
    CriticPhase,
    EngineOldLogprobs,
    OldLogprobs,
    PolicyForward,
    PolicyUpdate,
    ReferenceLogprobs,
    Skip,
    WeightPush,
)
from megarl.trainer.rollout_source import AsyncRollouts, SyncRollouts
from megarl.trainer.sample_files import RolloutDump
from megarl.weight_sync.logprob_check import PROBE_PROMPTS, LogprobBound, PostPushCheck
from megarl.weight_sync.lora_adapter import adapter_name

if TYPE_CHECKING:
    from megarl.data.stream import PromptStream

log = logging.getLogger(__name__)


def old_logprobs_phase(cfg: MegaRLConfig, forward: PolicyForward) -> OldLogprobs | EngineOldLogprobs | Skip:
    """Where the PPO ratio's old log-probs come from: the engine's (algorithm.old_logprobs=engine,
    no forward), none (strictly on-policy: the update's own forward), or the trainer's forward
    (with the reference's log-probs in the same pass where it can: ``cfg.reference_with_old_logprobs``)."""
    if cfg.algorithm.old_logprobs == "engine":
        return EngineOldLogprobs()
    if cfg.strictly_on_policy:
        return Skip()
    return OldLogprobs(forward, cfg.rollout.sampling.temperature, with_reference=cfg.reference_with_old_logprobs)


def reference_phase(cfg: MegaRLConfig, policy: Any, handover: Handover) -> ReferenceLogprobs | Skip:
    """The reference log-probs' own pass over the batch; none without a reference, or where
    another pass computes them: the policy update's (``cfg.reference_in_update``) or the old
    log-probs' (``cfg.reference_with_old_logprobs``)."""
    if not cfg.reference_enabled or cfg.reference_in_update or cfg.reference_with_old_logprobs:
        return Skip()
    return ReferenceLogprobs(policy, cfg.rollout.sampling.temperature, handover)


# The first line of the config.yaml megarl writes; a file is recognised as megarl's by its stable
# prefix, so that rewording the rest never makes a run's own config look foreign.
RUN_CONFIG_MARK = "# megarl:"
RUN_CONFIG_HEADER = f"{RUN_CONFIG_MARK} the resolved config of this run's latest launch (rewritten by each launch)\n"


def write_run_config(cfg: MegaRLConfig) -> Path:
    """``output_dir/config.yaml``, the config as run. A config.yaml that megarl did not write
    there (e.g. the user's own, launched with output_dir set to its folder) is kept, renamed."""
    path = Path(cfg.trainer.output_dir) / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and not path.read_text(errors="replace").startswith(RUN_CONFIG_MARK):
        kept = kept_name(path, time_tag(path.stat().st_mtime))
        os.replace(path, kept)
        log.warning("%s has no megarl header (a file of yours, or the run config of an older megarl); kept as %s",
                    path, kept.name)  # fmt: skip
    path.write_text(RUN_CONFIG_HEADER + config_to_yaml(cfg))
    return path


def build_trainer(cfg: MegaRLConfig, plan: Plan, *, in_process: bool = False) -> Trainer:
    """Start the workers (Ray worker groups, or in this process when ``in_process``: world size
    1, no Ray), the engines and the reward pool, and resolve every phase of the step. The
    workers get the config as the plan resolved it (``recompute: auto``)."""
    cfg = resolved_config(cfg, plan.resolved)
    out = write_run_config(cfg).parent
    tokenizer, eos_ids = _tokenizer(cfg.model.path)
    from megarl.data.stream import build_train_stream, load_val_prompts
    from megarl.rollout.agents.tools import prompt_tools
    from megarl.rollout.generate import make_generate

    generate = make_generate(cfg, tokenizer, eos_ids)  # builds the tools: a bad tool file fails before any worker
    tools = prompt_tools(cfg)  # the schemas the prompts' chat template shows
    stream = build_train_stream(cfg.data, tokenizer, tools)
    total_steps = _total_steps(cfg, stream)
    closers: list[Callable[[], None]] = []  # what was started, undone in reverse on failure or at shutdown
    try:
        start = _start_in_process if in_process else _start_groups
        pools: dict[str, Any] = {}  # role -> its Ray placement (a colocated reward model's actors share the policy's)
        models = start(cfg, plan, total_steps, out / "logs", closers, pools)
        reward_model = _start_reward_model(cfg, out / "logs", pools.get("reward_model"))
        if reward_model is not None:
            closers.append(reward_model.close)
        placement = cfg.reward.model.placement if cfg.reward.model is not None else None
        colocated = {"reward_model": reward_model} if placement == "colocated" else {}  # moved by the hand-over
        handover = Handover(residency_of(cfg), models | colocated)  # one memory hand-over per run (megarl/memory/)
        sglang = _start_sglang(cfg, plan, models, out / "logs", handover)
        if sglang is not None:
            closers.append(sglang.close)  # servers first: colocated ones share the policy's GPUs
        standalone = _start_standalone(cfg, models, out / "logs", closers)
        rewards = _start_rewards(cfg, in_process, out / "logs", reward_model, plan.judge.gpus if plan.judge else ())
        closers.append(rewards.close)
        scorer = Scorer(HandedOverScorer(rewards, handover) if colocated else rewards, tokenizer, eos_ids)
        val_prompts = load_val_prompts(cfg.data, tokenizer, tools)
        parts = _components(cfg, models, stream, val_prompts, scorer, generate, total_steps, handover, sglang or standalone)
        closers.append(parts.rollouts.stop)  # the producer stops before the engines it feeds on
        if isinstance(parts.rollout_dump, RolloutDump):
            closers.append(parts.rollout_dump.close)  # first at shutdown: the last step's file is finished
    except BaseException:
        _close_all(closers)
        raise
    parts.closers = closers
    config_dict = cfg.model_dump(mode="json")
    return Trainer(cfg, parts, partial(build_logger, cfg.trainer, config_dict, total_steps))


def _total_steps(cfg: MegaRLConfig, stream: PromptStream) -> int:
    """trainer.total_steps, else total_epochs passes over the prompts read (the count logged, as
    verl logs its computed total). Checked before any worker starts: the critic's warm-up must
    leave the policy steps (the planner could only bound it from the files' row counts)."""
    t = cfg.trainer
    if t.total_steps is not None:
        return t.total_steps
    assert t.total_epochs is not None  # the planner refuses a config without either
    per_epoch = stream.steps_per_epoch()
    issue = epochs_warmup_issue(t, len(stream), per_epoch)
    if issue is not None:
        raise PlanError([issue])
    log.info("%d steps: trainer.total_epochs %d x %d steps per epoch (%d prompts, data.prompts_per_step %d)",
             t.total_epochs * per_epoch, t.total_epochs, per_epoch, len(stream), cfg.data.prompts_per_step)
    return t.total_epochs * per_epoch


def _optimizer_steps(cfg: MegaRLConfig, role: str, total_steps: int) -> int:
    """Optimizer steps of a role over the run: its LR schedule's horizon (the policy waits out
    the critic's warm-up)."""
    section = cfg.actor if role == "policy" else cfg.critic
    per_step = cfg.samples_per_step // (section.mini_batch_size or cfg.samples_per_step)
    steps = total_steps - (cfg.trainer.critic_warmup_steps if role == "policy" else 0)
    return max(1, steps) * per_step * section.ppo_epochs


def _rank_args(cfg: MegaRLConfig, role: str, total_steps: int) -> tuple:
    """What a role's rank class is built with (PolicyRank, CriticRank): the config, its LR
    schedule's horizon, and for the policy the disk transport's directory resolved here."""
    args: tuple = (cfg, _optimizer_steps(cfg, role, total_steps))
    return (*args, str(Path(cfg.weight_disk_dir).resolve())) if role == "policy" else args


def _rank_classes(plan: Plan) -> dict[str, type]:
    from megarl.actors.critic_rank import CriticRank
    from megarl.actors.policy_rank import PolicyRank

    return {role: cls for role, cls in (("policy", PolicyRank), ("critic", CriticRank)) if role in plan.roles}


def _clients(cfg: MegaRLConfig, groups: dict[str, Any], push_timeout: float | None) -> dict[str, TrainedClient]:
    """The clients of the started groups; ``push_timeout``: the weight push's deadline (Ray groups only)."""
    return {role: PolicyClient(group, push_timeout, cfg) if role == "policy" else CriticClient(group)
            for role, group in groups.items()}  # fmt: skip


def _start_groups(cfg: MegaRLConfig, plan: Plan, total_steps: int, log_dir: Path, closers: list[Callable[[], None]],
                  pools: dict[str, Any]) -> dict[str, TrainedClient]:  # fmt: skip
    """One Ray worker group per trained role, placed as the plan says; ``pools`` gets every role's
    placement (a colocated reward model's too)."""
    # Imported here: they import Ray, which an in-process run (a one-GPU box under torchrun) lacks.
    from megarl.ray_cluster.placement import place_roles, release, role_placements
    from megarl.ray_cluster.worker_group import GroupOptions, WorkerGroup

    placements, colocate = role_placements(cfg, plan)
    placed = place_roles(placements, colocate)
    closers.append(lambda: release(placed))
    pools.update(placed)
    groups: dict[str, Any] = {}
    for role, cls in _rank_classes(plan).items():
        options = GroupOptions.of_run(cfg.cluster, log_dir, _shared_nccl_env(cfg) if role == "policy" else None)
        groups[role] = WorkerGroup(cls, placed[role], *_rank_args(cfg, role, total_steps), group_options=options)
        closers.append(groups[role].shutdown)
    return _clients(cfg, groups, cfg.rollout.weight_sync.timeout_s or None)


def _shared_nccl_env(cfg: MegaRLConfig) -> dict[str, str]:
    """The policy ranks' side of the NCCL settings they share with the SGLang servers, where one
    NCCL group joins them (the distributed transport): elsewhere NCCL keeps its own defaults."""
    if cfg.rollout.engine != "sglang" or cfg.weight_transport != "distributed":
        return {}
    from megarl.ray_cluster.rank_env import NCCL_CUMEM_ENV, nccl_cumem_enable

    return {NCCL_CUMEM_ENV: nccl_cumem_enable()}  # the controller's: the servers' specs read the same one


def _start_in_process(cfg: MegaRLConfig, plan: Plan, total_steps: int, log_dir: Path, closers: list[Callable[[], None]],
                      pools: dict[str, Any]) -> dict[str, TrainedClient]:  # fmt: skip
    """Every trained role in this process (a world of one: a one-GPU box without Ray; ``pools`` stays empty)."""
    groups: dict[str, Any] = {}
    for role, cls in _rank_classes(plan).items():
        assert len(plan.roles[role].gpus) == 1, "make_plan(in_process=True) refuses larger worlds"
        with still_waiting(f"{role}: building {cls.__qualname__} in this process (loads the model)"):
            groups[role] = InProcessGroup(cls, *_rank_args(cfg, role, total_steps))
        closers.append(groups[role].shutdown)
    return _clients(cfg, groups, None)  # one process cannot interrupt its own push


def _start_sglang(cfg: MegaRLConfig, plan: Plan, models: dict[str, Any], log_dir: Path, handover: Handover) -> Any:
    """SGLang servers on their nodes, started through the run's memory hand-over (colocated:
    with nothing of the trained models on their GPUs), the policy connected to them (None with
    the torch engine)."""
    if cfg.rollout.engine != "sglang":
        if not cfg.asynchronous:
            models["policy"].connect_engines(None)  # the torch engines live in the policy ranks
        return None
    from megarl.memory.sglang_memory import SGLangMemory
    from megarl.rollout_sglang.controller import prepare_sglang

    rollout = prepare_sglang(cfg, plan, models["policy"], log_dir, weights_cpu_backup=handover.table.weights_cpu_backup)
    try:
        handover.launch(lambda: SGLangMemory(rollout.start(), rollout.connect, restart_timeout=rollout.timeout))
        rollout.connect()
    except BaseException:
        rollout.close()
        raise
    return rollout


def _start_rewards(cfg: MegaRLConfig, in_process: bool, log_dir: Path, model: Any, judge_gpus: tuple[int, ...] = ()) -> Any:
    """The reward pool, or with reward.combine / reward.judge the pools and the judge that score its
    components; ``model``, the reward model's role (reward.model.placement disaggregated or
    colocated), in place of its pool; ``judge_gpus``: the plan's devices of the judge's SGLang
    servers (cluster.device cuda; none: its one server on CPU, or the torch engine)."""
    from megarl.rewards.scorer import REWARD_WORKERS_LOG, RewardScorer

    workers_log = log_dir / REWARD_WORKERS_LOG  # the user's reward functions' prints: not the terminal
    if not cfg.reward.combine:
        return model or RewardScorer(cfg.reward, log_path=workers_log)
    from megarl.rollout.judge import start_judge
    from megarl.rollout.reward_combine import CombinedScorer

    judge_cfg, judge = cfg.reward.judge, None
    try:
        judge = None if judge_cfg is None else start_judge(
            judge_cfg, in_process=in_process, log_dir=log_dir, start_timeout_s=cfg.cluster.build_timeout_s,
            max_failed_fraction=cfg.reward.max_failed_fraction, server_python=cfg.rollout.server_python,
            gpus=judge_gpus)  # fmt: skip
        return CombinedScorer(cfg.reward, judge, model=model, log_path=workers_log)
    except BaseException:
        for part in (judge, model):
            if part is not None:
                part.close()
        raise


def _start_reward_model(cfg: MegaRLConfig, log_dir: Path, placed: Any) -> Any:
    """The reward model's role when it is placed as one (the plan refused it for in-process runs), else
    None; ``placed``: its placement (colocated: its share of the policy's bundles; else its own)."""
    if cfg.reward.model is None or cfg.reward.model.placement == "workers":
        return None
    from megarl.rollout.reward_model_role import RewardModelRole

    return RewardModelRole(cfg.reward, cfg.cluster.device, log_dir, placed=placed)


def _start_standalone(cfg: MegaRLConfig, models: dict[str, Any], log_dir: Path, closers: list[Callable[[], None]]) -> Any:
    """An asynchronous run's torch engine as a process of its own, the policy's disk transport
    connected to it (None otherwise)."""
    if not (cfg.asynchronous and cfg.rollout.engine == "torch"):
        return None
    from megarl.engines.engine_actor import start_standalone_engines

    engines = start_standalone_engines(cfg, log_dir)
    closers.append(engines.close)
    models["policy"].connect_engines(engines.endpoints)
    return engines


def _components(cfg: MegaRLConfig, models: dict[str, Any], stream: Any, val_prompts: Any, scorer: Scorer, generate: GenerateFn,
                total_steps: int, handover: Handover, sglang: Any = None) -> Components:  # fmt: skip
    policy = models["policy"]
    temperature = cfg.rollout.sampling.temperature
    # Every phase below enters its phase of the run's residency table first (the hand-over).
    # torch: engines inside the policy ranks; sglang: servers, which the hand-over started.
    engines = _engines(cfg, policy, handover, sglang)
    forward = PolicyForward(policy, handover)
    plain = PlainCollector(engines, scorer, generate)
    return Components(
        data=stream,
        val_prompts=val_prompts,
        engines=engines,
        generate=generate,
        scorer=scorer,
        rollouts=_rollouts(cfg, plain, stream),
        baseline=(GreedyBaseline(engines, scorer, cfg.algorithm.overlong, cfg.rollout.sampling.max_new_tokens)
                  if cfg.algorithm.estimator == "remax" else NoBaseline()),
        old_logprobs=old_logprobs_phase(cfg, forward),
        reference=reference_phase(cfg, policy, handover),
        critic=CriticPhase(models["critic"], handover) if "critic" in models else Skip(),
        advantages=Advantages(cfg),
        policy=PolicyUpdate(policy, temperature, cfg.trainer.critic_warmup_steps, handover),
        weight_push=WeightPush(policy, handover, _post_push_check(cfg, engines, forward, stream, val_prompts),
                               pushed=_adapter_selection(cfg, sglang)),
        models={role: CheckpointedModel(client, handover) for role, client in models.items()},
        total_steps=total_steps,
        rollout_dump=RolloutDump(cfg.trainer.rollout_data_dir, scorer.texts) if cfg.trainer.rollout_data_dir else Skip(),
    )


def _engines(cfg: MegaRLConfig, policy: Any, handover: Handover, outside: Any) -> Any:
    """What the run generates with. Synchronous runs generate in the memory hand-over's generate
    phase: torch engines in the policy ranks, or SGLang servers. An asynchronous run's engines
    generate beside every phase, on devices of their own (the planner refuses colocated ones), so
    the hand-over never releases what they hold. The SGLang client opens a connection per request
    and counts its requests under a lock: the producer's thread and the post-push check (this
    thread) generate through it at once."""
    if cfg.asynchronous:
        return outside if cfg.rollout.engine == "torch" else outside.generator()
    return HandedOverEngines(WorkerEngines(policy) if outside is None else outside.generator(), handover)


def _rollouts(cfg: MegaRLConfig, plain: PlainCollector, stream: Any) -> SyncRollouts | AsyncRollouts:
    """Each step's own generation (synchronous), or the producer's buffer (rollout.max_staleness >= 1)."""
    ds = cfg.algorithm.dynamic_sampling
    if not cfg.asynchronous:
        collector = DynamicSamplingCollector(plain, stream.next_batch, ds.max_rounds) if ds.enabled else plain
        return SyncRollouts(collector, stream)
    log.info("asynchronous rollouts: samples up to %d policy versions stale, %s", cfg.rollout.max_staleness,
             "partial rollouts (a push pauses the requests in flight)" if cfg.partial_rollouts else "pushes wait for the requests in flight")
    # The step's wait ends a little before the hang watchdog would, so the line names the producer's state.
    hang = cfg.trainer.hang_timeout_s
    producer = RolloutProducer(plain.collect, stream, partial(sampling_params, cfg), groups_per_step=cfg.data.prompts_per_step,
                               max_staleness=cfg.rollout.max_staleness, dynamic_sampling=ds.max_rounds if ds.enabled else 0,
                               timeout_s=0.9 * hang if hang else None)  # fmt: skip
    return AsyncRollouts(producer, cfg.trainer.output_dir, cfg.algorithm)


def _adapter_selection(cfg: MegaRLConfig, sglang: Any) -> Callable[[int], None]:
    """After a push in adapter mode, the SGLang engines send the pushed version's adapter with
    every request; otherwise nothing to do."""
    if cfg.actor.lora is None or cfg.rollout.weight_sync.lora != "adapter" or sglang is None:
        return lambda version: None

    def select(version: int) -> None:
        for engine in sglang.engines:
            engine.active_adapter = adapter_name(version)

    return select


def _post_push_check(cfg: MegaRLConfig, engines: Any, policy: Any, stream: Any, val_prompts: Any) -> PostPushCheck | None:
    """The engines' and the trainer's log-probs of a few generated responses, after the first push and every
    rollout.weight_sync.check_logprobs_every-th."""
    ws = cfg.rollout.weight_sync
    if not ws.check_logprobs:
        return None
    prompts = val_prompts.select(range(min(PROBE_PROMPTS, len(val_prompts)))) if val_prompts else stream.first_prompts(PROBE_PROMPTS)
    s = cfg.rollout.sampling
    sampling = SamplingParams(temperature=s.temperature, max_new_tokens=s.max_new_tokens, stop=tuple(s.stop),
                              stop_token_ids=tuple(s.stop_token_ids), seed=cfg.trainer.seed)  # fmt: skip
    return PostPushCheck(partial(generate_batch, engines), policy, prompts, sampling, LogprobBound.of(ws),
                         every=ws.check_logprobs_every)


def _tokenizer(path: str | None) -> tuple[Any, tuple[int, ...]]:
    from transformers import AutoTokenizer

    assert path is not None  # a run needs model.path (preflight refuses one without)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return tokenizer, eos_token_ids(path, tokenizer)


def shutdown(trainer: Trainer | None) -> None:
    if trainer is None:
        return
    try:
        trainer.close()
    finally:
        _close_all(trainer.parts.closers)


def _close_all(closers: list[Callable[[], None]]) -> None:
    """Undo what was started, newest first; one failure does not stop the rest."""
    while closers:
        try:
            closers.pop()()
        except (Exception, KeyboardInterrupt):  # noqa: BLE001 - cleanup goes on (a second Ctrl-C too); logged
            log.exception("shutdown step failed")
