"""Building the run from a checked config: Ray placement, worker groups, and one strategy
object per phase of the RL step (the step itself never branches on the config)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from megarl.actors.ray_groups.placement import place_roles, release, role_placements
from megarl.actors.ray_groups.worker_group import GroupOptions, WorkerGroup
from megarl.config.loading import config_to_yaml
from megarl.config.planner import Plan
from megarl.config.sections import MegaRLConfig
from megarl.rollout.collect import (
    DynamicSamplingCollector,
    GreedyBaseline,
    HandedOverEngines,
    NoBaseline,
    NoHandover,
    PlainCollector,
    Scorer,
    WorkerEngines,
)
from megarl.trainer.loop import Components, Trainer
from megarl.trainer.metric_sinks import build_logger
from megarl.trainer.phases import (
    Advantages,
    CriticPhase,
    OldLogprobs,
    PolicyUpdate,
    ReferenceLogprobs,
    Skip,
    WeightPush,
)

log = logging.getLogger(__name__)


def is_strictly_on_policy(cfg: MegaRLConfig) -> bool:
    """One epoch, one optimizer step per RL step, no KL-in-reward: the update's own forward gives
    the old log-probs (the ratio starts at exactly 1), so no separate forward is needed."""
    one_step = (cfg.actor.mini_batch_size or cfg.samples_per_step) == cfg.samples_per_step
    return cfg.actor.ppo_epochs == 1 and one_step and not cfg.algorithm.kl.use_in_reward


def build_trainer(cfg: MegaRLConfig, plan: Plan) -> Trainer:
    out = Path(cfg.trainer.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(config_to_yaml(cfg))
    tokenizer, eos_ids = _tokenizer(cfg.model.path)
    from megarl.data.stream import build_train_stream, load_val_prompts

    stream = build_train_stream(cfg.data, tokenizer)
    total_steps = cfg.trainer.total_steps or cfg.trainer.total_epochs * stream.steps_per_epoch()
    closers: list[Callable[[], None]] = []  # what was started, undone in reverse on failure or at shutdown
    try:
        groups = _start_groups(cfg, plan, total_steps, out / "logs", closers)
        sglang = _start_sglang(cfg, plan, groups, out / "logs")
        if sglang is not None:
            closers.append(sglang.close)  # servers first: colocated ones share the policy's GPUs
        from megarl.rewards.scorer import RewardScorer

        rewards = RewardScorer(cfg.reward)
        closers.append(rewards.close)
        scorer = Scorer(rewards, tokenizer, eos_ids)
        parts = _components(cfg, groups, stream, load_val_prompts(cfg.data, tokenizer), scorer, total_steps, sglang)
    except BaseException:
        _close_all(closers)
        raise
    parts.closers = closers
    config_dict = cfg.model_dump(mode="json")
    return Trainer(cfg, parts, partial(build_logger, cfg.trainer, config_dict, total_steps))


def _start_groups(cfg: MegaRLConfig, plan: Plan, total_steps: int, log_dir: Path, closers: list[Callable[[], None]]) -> dict[str, Any]:
    from megarl.actors.critic_rank import CriticRank
    from megarl.actors.policy_rank import PolicyRank

    placements, colocate = role_placements(cfg, plan)
    placed = place_roles(placements, colocate)
    closers.append(lambda: release(placed))
    options = GroupOptions(log_dir=log_dir)
    groups: dict[str, Any] = {}
    for role, cls, section in (("policy", PolicyRank, cfg.actor), ("critic", CriticRank, cfg.critic)):
        if role in placed:
            per_step = cfg.samples_per_step // (section.mini_batch_size or cfg.samples_per_step)
            # The LR schedule spans the steps that train this model (the policy waits out the critic's warm-up).
            steps = total_steps - (cfg.trainer.critic_warmup_steps if role == "policy" else 0)
            groups[role] = WorkerGroup(cls, placed[role], cfg, max(1, steps) * per_step * section.ppo_epochs, group_options=options)
            closers.append(groups[role].shutdown)
    return groups


def _start_sglang(cfg: MegaRLConfig, plan: Plan, groups: dict[str, Any], log_dir: Path) -> Any:
    """SGLang servers on their nodes, the policy connected to them (None with the torch engine)."""
    if cfg.rollout.engine != "sglang":
        return None
    from megarl.rollout_sglang.controller import start_sglang

    return start_sglang(cfg, plan, groups["policy"], log_dir, critic=groups.get("critic"))


def _components(cfg: MegaRLConfig, groups: dict[str, Any], stream: Any, val_prompts: Any, scorer: Scorer, total_steps: int,
                sglang: Any = None) -> Components:  # fmt: skip
    policy = groups["policy"]
    temperature = cfg.rollout.sampling.temperature
    # torch: engines inside the policy ranks; sglang: servers, with the memory hand-over around
    # every generation and push (megarl/rollout_sglang/controller.py).
    handover = sglang.handover if sglang is not None else NoHandover()
    engines = WorkerEngines(policy, policy.call("layout")) if sglang is None else HandedOverEngines(sglang.engines, handover)
    ds = cfg.algorithm.dynamic_sampling
    collector = DynamicSamplingCollector(engines, scorer, stream.next_batch, ds.max_rounds) if ds.enabled else PlainCollector(engines, scorer)
    return Components(
        data=stream,
        val_prompts=val_prompts,
        engines=engines,
        scorer=scorer,
        collector=collector,
        baseline=GreedyBaseline(engines, scorer) if cfg.algorithm.estimator == "remax" else NoBaseline(),
        old_logprobs=Skip() if is_strictly_on_policy(cfg) else OldLogprobs(policy, temperature),
        reference=ReferenceLogprobs(policy, temperature) if cfg.reference_enabled else Skip(),
        critic=CriticPhase(groups["critic"]) if "critic" in groups else Skip(),
        advantages=Advantages(cfg),
        policy=PolicyUpdate(policy, temperature, cfg.trainer.critic_warmup_steps),
        weight_push=WeightPush(policy, temperature, cfg.rollout.weight_sync.check_logprobs, handover),
        groups=groups,
        total_steps=total_steps,
    )


def _tokenizer(path: str | None) -> tuple[Any, list[int]]:
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(path)
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    try:
        gen_eos = GenerationConfig.from_pretrained(path).eos_token_id
        eos |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    except OSError:
        pass
    return tokenizer, sorted(eos)


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
        except Exception:  # noqa: BLE001 - cleanup must go on; the error is logged
            log.exception("shutdown step failed")
