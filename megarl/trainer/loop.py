"""The controller's loop: one RL step, validation, checkpoints, resume.

``Trainer.rl_step`` is the whole algorithm, top to bottom; what differs between GRPO, PPO,
ReMax or DAPO was decided when the components were built (megarl/trainer/build.py).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megarl.checkpoint.manager import CheckpointManager, step_dir_name
from megarl.checkpoint.trainer_state import TrainerState, capture_rng, restore_rng
from megarl.config.loading import config_to_yaml
from megarl.config.sections import MegaRLConfig
from megarl.data.prompt_batch import PromptBatch
from megarl.rollout.collect import (
    Baseline,
    Collector,
    Engines,
    Scorer,
    generate_batch,
    rollout_metrics,
)
from megarl.rollout.engine import SamplingParams
from megarl.rollout.seeds import step_seed
from megarl.trainer.metric_sinks import MetricsLogger, PhaseTimer
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


@dataclass
class Components:
    """Everything the loop calls, resolved from the config (see build.py)."""

    data: Any  # megarl.data.stream.PromptStream
    val_prompts: PromptBatch | None
    engines: Engines
    scorer: Scorer
    collector: Collector
    baseline: Baseline
    old_logprobs: OldLogprobs | Skip
    reference: ReferenceLogprobs | Skip
    critic: CriticPhase | Skip
    advantages: Advantages
    policy: PolicyUpdate
    weight_push: WeightPush
    groups: dict[str, Any]  # role -> WorkerGroup (checkpoints, profiling, shutdown)
    total_steps: int
    closers: list[Callable[[], None]] = field(default_factory=list)  # run in reverse order at shutdown


class Trainer:
    def __init__(self, cfg: MegaRLConfig, parts: Components, logger_factory: Any):
        self.cfg, self.parts = cfg, parts
        self.out = Path(cfg.trainer.output_dir)
        self.checkpoints = CheckpointManager(self.out, cfg.trainer.keep_last)
        self.step = 0
        self._logger_factory = logger_factory
        self.logger: MetricsLogger | None = None

    # ---- one RL step -----------------------------------------------------------------------
    def rl_step(self, step: int) -> dict[str, float]:
        p, timer = self.parts, PhaseTimer()
        start = time.perf_counter()
        params = self.sampling(step)
        batch, metrics = p.collector.collect(p.data.next_batch(), params, timer)  # generate + reward
        with timer.phase("baseline"):
            baseline = p.baseline.scores(batch, params)  # remax's greedy rollout, else None
        with timer.phase("old_logprobs"):
            batch = p.old_logprobs(batch)  # skipped when strictly on-policy
        with timer.phase("ref_logprobs"):
            batch = p.reference(batch)
        with timer.phase("values"):
            batch = p.critic(batch)
        with timer.phase("advantages"):
            batch, adv_metrics = p.advantages(batch, baseline)
        with timer.phase("critic_update"):
            metrics |= p.critic.update(batch, step)
        with timer.phase("policy_update"):
            metrics |= p.policy.update(batch, step)
        with timer.phase("weight_sync"):
            metrics |= p.weight_push(version=step)
        metrics |= adv_metrics | rollout_metrics(batch) | timer.metrics()
        metrics["time/step_s"] = time.perf_counter() - start
        return metrics

    def sampling(self, step: int, *, validation: bool = False) -> SamplingParams:
        s = self.cfg.rollout.sampling
        greedy = validation and self.cfg.rollout.val.greedy
        return SamplingParams(
            temperature=0.0 if greedy else s.temperature,
            top_p=1.0 if greedy else s.top_p,
            top_k=-1 if greedy else s.top_k,
            max_new_tokens=s.max_new_tokens,
            n=self.cfg.rollout.val.n if validation else self.cfg.rollout.n,
            stop=tuple(s.stop),
            stop_token_ids=tuple(s.stop_token_ids),
            seed=step_seed(self.cfg.trainer.seed, -step - 1 if validation else step),
        )

    # ---- the run ---------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        """Resume if asked, validate / train until total_steps, checkpoint; returns the last metrics."""
        t = self.cfg.trainer
        start = self.restore()
        self.logger = self._logger_factory(start)
        initial = self.parts.weight_push(version=start)  # engines start from what the trainer holds
        log.info("initial weight sync: %s", initial)
        if t.val_only or (t.eval_before_train and start == 0):
            self.logger.log(start, self.validate(start))
            if t.val_only:
                return self.logger.last
        for step in range(start + 1, self.parts.total_steps + 1):
            self.step = step
            self._profile(step, "start_profile")
            metrics = self.rl_step(step)
            self._profile(step, "stop_profile")
            if t.eval_freq and (step % t.eval_freq == 0 or step == self.parts.total_steps):
                metrics |= self.validate(step)
            saving = (t.save_freq and step % t.save_freq == 0) or step == self.parts.total_steps
            if saving:
                metrics["actor/param_checksum"] = self.parts.groups["policy"].call("parameter_checksum")[0]
            # Logged before the save: a crash in between resumes from the previous checkpoint and
            # re-runs this step, and metrics.jsonl is cut back to that checkpoint's step.
            self.logger.log(step, metrics)
            if saving:
                self.save(step)
        return self.logger.last

    def validate(self, step: int) -> dict[str, float]:
        """Generate on every validation prompt, score, write a few samples; val/* metrics."""
        p = self.parts
        if p.val_prompts is None:
            return {}
        start = time.perf_counter()
        batch = generate_batch(p.engines, p.val_prompts, self.sampling(step, validation=True))
        batch, _ = p.scorer.score(batch)
        metrics = {"val/reward/mean": float(batch.scores.mean()), "time/validate_s": 0.0}
        for source in sorted(set(batch.data_source)):
            rows = [i for i, s in enumerate(batch.data_source) if s == source]
            metrics[f"val/{source}/reward/mean"] = float(batch.scores[rows].mean())
        self._write_samples(step, batch)
        metrics["time/validate_s"] = time.perf_counter() - start
        return metrics

    def _write_samples(self, step: int, batch: Any) -> None:
        k = self.cfg.trainer.val_samples_logged
        if not k:
            return
        texts = self.parts.scorer.texts(batch)
        folder = self.out / "samples"
        folder.mkdir(parents=True, exist_ok=True)
        with (folder / f"step_{step:06d}.jsonl").open("w") as f:
            for i in range(min(k, len(batch))):
                row = {"prompt": batch.prompt_text[i], "response": texts[i], "ground_truth": batch.ground_truth[i],
                       "score": float(batch.scores[i]), "finish_reason": batch.finish_reason[i]}
                f.write(json.dumps(row, default=str) + "\n")

    # ---- checkpoints -----------------------------------------------------------------------
    def save(self, step: int) -> Path:
        with self.checkpoints.saving(step) as folder:
            for role, group in self.parts.groups.items():
                group.call("save", str(folder / role))
            # The config this checkpoint was trained with (megarl convert reads it; output_dir's
            # config.yaml is the latest launch's and may have changed since).
            (folder / "config.yaml").write_text(config_to_yaml(self.cfg))
            TrainerState(
                step=step,
                sampler=self.parts.data.state_dict(),
                kl_controller=self.parts.advantages.kl_controller.state_dict(),
                rng=capture_rng(),
            ).save(folder)
        return self.checkpoints.root / step_dir_name(step)

    def restore(self) -> int:
        """Load the checkpoint trainer.resume points at; returns the step to continue after."""
        ckpt = self.checkpoints.resolve_resume(self.cfg.trainer.resume)
        if ckpt is None:
            return 0
        for role, group in self.parts.groups.items():
            group.call("load", str(ckpt.component(role)))
        state = TrainerState.load(ckpt.path)
        self.parts.data.load_state_dict(state.sampler)
        self.parts.advantages.kl_controller.load_state_dict(state.kl_controller)
        restore_rng(state.rng)
        log.info("resumed from %s (step %d)", ckpt.path, state.step)
        return state.step

    def _profile(self, step: int, method: str) -> None:
        if step not in self.cfg.trainer.profile_steps:
            return
        folder = str(self.out / "profile" / f"step_{step}")
        args = () if method == "start_profile" else (folder,)
        self.parts.groups["policy"].call(method, *args)

    def close(self) -> None:
        if self.logger is not None:
            self.logger.close()
