"""The controller's loop: one RL step, validation, checkpoints, resume.

``Trainer.rl_step`` is the whole algorithm, top to bottom; what differs between GRPO, PPO,
ReMax or DAPO was decided when the components were built (megarl/trainer/build.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megarl.checkpoint.manager import CheckpointManager, NoSpaceForCheckpoint, starts_new_history
from megarl.checkpoint.run_record import (
    METRICS_HISTORY,
    RUN_CONFIG,
    record_metrics,
    record_model_configs,
    run_metadata,
)
from megarl.checkpoint.trainer_state import TrainerState, capture_rng, restore_rng
from megarl.checkpoint.verification import step_dir_name
from megarl.config.loading import config_to_yaml
from megarl.config.sections import MegaRLConfig
from megarl.data.prompt_batch import PromptBatch
from megarl.disk_full import DiskFullError, disk_full_cause, quiet_threads, reason_of, writing
from megarl.engines.base import Engines, SamplingParams
from megarl.engines.routing import routing_replay
from megarl.engines.seeds import step_seed
from megarl.evaluation import add_components, as_metrics, scored_responses, summarize
from megarl.progress import PROGRESS, PhaseTimer, still_waiting
from megarl.rewards.combine import component_scores
from megarl.rollout.collect import Baseline, Scorer, rollout_metrics
from megarl.rollout.generate import GenerateFn
from megarl.trainer.metric_sinks import MetricsLogger
from megarl.trainer.phases import (
    Advantages,
    CriticPhase,
    EngineOldLogprobs,
    OldLogprobs,
    PolicyUpdate,
    ReferenceLogprobs,
    Skip,
    WeightPush,
)
from megarl.trainer.rollout_source import AsyncRollouts, SyncRollouts
from megarl.trainer.sample_files import RolloutDump, write_sample_rows
from megarl.trainer.watchdog import HangError, RunControl, Watchdog
from megarl.user_code import WaitAbandoned

log = logging.getLogger(__name__)


@dataclass
class Components:
    """Everything the loop calls, resolved from the config (see build.py)."""

    data: Any  # megarl.data.stream.PromptStream
    val_prompts: PromptBatch | None
    engines: Engines
    generate: GenerateFn  # rollout.generate_function: prompts -> Batch (training and validation)
    scorer: Scorer
    rollouts: SyncRollouts | AsyncRollouts  # generated in the step, or taken from the producer's buffer
    baseline: Baseline
    old_logprobs: OldLogprobs | EngineOldLogprobs | Skip
    reference: ReferenceLogprobs | Skip
    critic: CriticPhase | Skip
    advantages: Advantages
    policy: PolicyUpdate
    weight_push: WeightPush
    models: dict[str, Any]  # role -> client of a trained model (megarl.actors.clients: checkpoints, profiling)
    total_steps: int
    rollout_dump: RolloutDump | Skip = field(default_factory=Skip)  # trainer.rollout_data_dir: the step's samples as JSONL
    closers: list[Callable[[], None]] = field(default_factory=list)  # run in reverse order at shutdown


def sampling_params(cfg: MegaRLConfig, step: int, *, validation: bool = False) -> SamplingParams:
    """How step ``step`` samples (an asynchronous run: its draw ``step``), or validates."""
    s = cfg.rollout.sampling
    temperature, top_p, top_k = _validation_sampling(cfg) if validation else (s.temperature, s.top_p, s.top_k)
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_new_tokens=s.max_new_tokens,
        n=cfg.rollout.val.n if validation else cfg.rollout.n,
        stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        seed=step_seed(cfg.trainer.seed, -step - 1 if validation else step),
        # Training rollouts ask the engines for their expert routing when the trainer replays it.
        return_routing=routing_replay(cfg) != "none" and not validation,
    )


def _validation_sampling(cfg: MegaRLConfig) -> tuple[float, float, int]:
    """(temperature, top_p, top_k) of validation: greedy, or rollout.val's own where set (verl's
    val_kwargs), else the training rollouts'."""
    v, s = cfg.rollout.val, cfg.rollout.sampling
    if v.greedy:
        return 0.0, 1.0, -1
    return (s.temperature if v.temperature is None else v.temperature, s.top_p if v.top_p is None else v.top_p,
            s.top_k if v.top_k is None else v.top_k)  # fmt: skip


class Trainer:
    def __init__(self, cfg: MegaRLConfig, parts: Components, logger_factory: Any):
        self.cfg, self.parts = cfg, parts
        self.out = Path(cfg.trainer.output_dir)
        self.checkpoints = CheckpointManager(self.out, cfg.trainer.keep_last)
        self.step = 0
        self._logger_factory = logger_factory
        self._history: Path | None = None  # the resumed checkpoint's metrics.jsonl
        self.logger: MetricsLogger | None = None

    # ---- one RL step -----------------------------------------------------------------------
    def rl_step(self, step: int) -> dict[str, float]:
        p, timer = self.parts, PhaseTimer()
        start = time.perf_counter()
        params = self.sampling(step)
        batch, metrics = p.rollouts.batch(step, params, timer)  # generate + reward, or the producer's groups
        with timer.phase("baseline"):
            baseline = p.baseline.scores(batch, params)  # remax's greedy rollout, else None
        with timer.phase("old_logprobs"):
            batch = p.old_logprobs(batch)  # skipped when strictly on-policy; the engine's with old_logprobs=engine
        with timer.phase("ref_logprobs"):
            batch = p.reference(batch)  # skipped where the update computes them per micro-batch (cfg.reference_in_update)
        with timer.phase("values"):
            batch = p.critic(batch)
        with timer.phase("advantages"):
            batch, adv_metrics = p.advantages(batch, baseline)
        batch = p.rollout_dump(batch, step)  # written in a thread of its own while the step goes on
        with timer.phase("critic_update"):
            metrics |= p.critic.update(batch, step)
        with timer.phase("policy_update"):
            metrics |= p.policy.update(batch, step)
        with timer.phase("weight_sync"):
            metrics |= p.rollouts.push(p.weight_push, version=step)  # asynchronous: while the engines generate
        metrics |= adv_metrics | rollout_metrics(batch) | p.rollouts.metrics(batch) | timer.metrics()
        metrics["time/step_s"] = time.perf_counter() - start
        return metrics

    def sampling(self, step: int, *, validation: bool = False) -> SamplingParams:
        return sampling_params(self.cfg, step, validation=validation)

    # ---- the run ---------------------------------------------------------------------------
    def fit(self, control: RunControl | None = None) -> dict[str, float]:
        """Resume if asked, validate / train until total_steps, checkpoint; returns the last metrics.

        ``control`` (megarl/trainer/watchdog.py) carries the signal handling and the resume
        command; a signal ends the run in RunStopped, a hang in HangError, both after what the
        stop allows to save."""
        control = control or RunControl(save_on_signal=self.cfg.trainer.checkpoint_on_signal)
        with control.handlers():
            start = self.restore()
            if start >= self.parts.total_steps and not self.cfg.trainer.val_only:
                from megarl.plan.resume_checks import finished_note

                t = self.cfg.trainer
                epochs = t.total_epochs if t.total_steps is None else None
                log.info("%s", finished_note(self.out, step_dir_name(start), start, self.parts.total_steps, epochs=epochs))
                return {}
            with self._disk_full_ending(control):  # (it restores or cuts back metrics.jsonl)
                self.logger = self._logger_factory(start, history=self._history)
            self.step = self._start = start
            timeout = self.cfg.trainer.hang_timeout_s
            groups = {role: m.group for role, m in self.parts.models.items() if hasattr(m.group, "dump_stacks")}
            try:
                with self._disk_full_ending(control):
                    if not timeout:
                        return self._train(start, control)
                    with Watchdog(control, timeout, groups, self.out / "logs"):
                        return self._train(start, control)
            except KeyboardInterrupt as exc:  # a second signal, the watchdog, or user code past the stop's grace: the step is abandoned
                control.cleaning = True
                if control.hang:
                    raise HangError(control.hang) from None
                why = str(exc) if isinstance(exc, WaitAbandoned) else ""
                raise control.stopped(self._stopped_message(control, None, why=why)) from None

    def _train(self, start: int, control: RunControl) -> dict[str, float]:
        assert self.logger is not None  # fit() makes it before training
        t = self.cfg.trainer
        PROGRESS.mark("initial weight sync", start)
        log.info("first weight sync (trainer -> engines) ...")
        initial = self.parts.weight_push(version=start)  # engines start from what the trainer holds
        log.info("initial weight sync: %s", initial)
        # data/train_*: with a new run's first metrics (a resumed run's metrics.jsonl reads as one
        # that never stopped, and its sampler refuses other files)
        once = self.parts.data.load_report() if start == 0 else {}
        if t.val_only or (t.eval_before_train and start == 0):
            self.logger.log(start, once | self.validate(start))
            once = {}
            if t.val_only:
                return self.logger.last
        log.info("training steps %d to %d", start + 1, self.parts.total_steps)
        self.parts.rollouts.start(start, self.parts.total_steps - start)
        for step in range(start + 1, self.parts.total_steps + 1):
            self.step = step
            PROGRESS.mark("step start", step)
            control.deferred = True  # a first signal from here on waits for the end of the step
            self._profile(step, start=True)
            metrics = once | self.rl_step(step)
            once = {}
            if step == self.parts.total_steps and isinstance(self.parts.rollout_dump, RolloutDump):
                self.parts.rollout_dump.close()  # the last step's file written, or the run fails, before its save
            self._profile(step, start=False)
            if t.eval_freq and (step % t.eval_freq == 0 or step == self.parts.total_steps):
                metrics |= self.validate(step)
            saving = (t.save_freq and step % t.save_freq == 0) or step == self.parts.total_steps
            saving = saving or (control.stop_requested and control.save_on_signal)
            if saving:
                metrics["actor/param_checksum"] = self.parts.models["policy"].parameter_checksum()
            # Logged before the save: a crash in between resumes from the previous checkpoint and
            # re-runs this step, and metrics.jsonl is cut back to that checkpoint's step.
            self.logger.log(step, metrics)
            _log_reward_failures(step, metrics)
            if saving:
                self.save(step)
            elif control.stop_requested and control.save_on_signal:  # the signal came while the step was logged
                self.save(step)
                saving = True
            if control.stop_requested:
                control.cleaning = True
                raise control.stopped(self._stopped_message(control, step, saved=bool(saving)))
        return self.logger.last

    @contextmanager
    def _disk_full_ending(self, control: RunControl) -> Iterator[None]:
        """A full disk met anywhere in the run (a save, metrics, rollouts, samples, a library's
        write) ends it as one DiskFullError naming what was written, the last complete checkpoint
        (a save that failed left nothing: megarl/checkpoint/manager.py) and the resume command."""
        try:
            with quiet_threads():
                yield
        except NoSpaceForCheckpoint as exc:  # refused before writing: the same ending, in its own words
            kept, command = self._kept_and_resume(control)
            raise NoSpaceForCheckpoint(f"{exc}; kept: {kept}; resume with: {command}") from None
        except Exception as exc:
            cause = disk_full_cause(exc)
            if cause is None:
                raise
            filename = getattr(cause, "filename", None)
            full = cause if isinstance(cause, DiskFullError) else DiskFullError(
                filename if isinstance(filename, str) else self.out, f"the run's files at step {self.step}", reason_of(cause))  # fmt: skip
            kept, command = self._kept_and_resume(control)
            raise full.with_kept(kept, f"free space on that disk (megarl deletes nothing of yours to make room), then resume "
                                       f"with: {command}") from exc  # fmt: skip

    def _kept_and_resume(self, control: RunControl) -> tuple[str, str]:
        """What a run that cannot go on leaves (its last complete checkpoint) and the command that resumes it."""
        latest = self.checkpoints.latest_valid(quiet=True)
        kept = f"the last complete checkpoint, step {latest.step} ({latest.path})" if latest else "no checkpoint yet"
        return kept, control.resume_command or "the same command (trainer.resume=auto)"

    def _stopped_message(self, control: RunControl, step: int | None, saved: bool = False, why: str = "") -> str:
        """What a stop on a signal leaves behind (``step``: the last completed one, None when the
        step in progress was abandoned; ``why``: what it was abandoned for, when not a second
        signal: a second one of another kind is named by ``control``), and the command that goes on from there."""
        latest = self.checkpoints.latest_valid(quiet=True)
        if saved and step is not None:
            what = f"after step {step}; saved checkpoint {self.checkpoints.root / step_dir_name(step)}"
        else:
            kept = f"last checkpoint: step {latest.step} ({latest.path})" if latest else "no checkpoint yet (it starts again at step 0)"
            if step is not None:
                done = f"after step {step} (not saved: trainer.checkpoint_on_signal=false)"
            else:
                why = why or control.abandoned_by
                abandoned = f"abandoned: {why}" if why else "abandoned"
                done = f"during step {self.step} ({abandoned})" if self.step > self._start else f"before step {self._start + 1}"
            what = f"{done}; {kept}"
        command = control.resume_command or "the same command (trainer.resume=auto)"
        return f"stopped by {control.signal_name} {what}\nresume with: {command}"

    def validate(self, step: int) -> dict[str, float]:
        """Generate on every validation prompt, score, write a few samples; val/* metrics."""
        p = self.parts
        if p.val_prompts is None:
            return {}
        PROGRESS.mark("validate", step)
        start = time.perf_counter()
        batch = p.generate(p.engines, p.val_prompts, self.sampling(step, validation=True))
        batch, result = p.scorer.score_result(batch)
        # The numbers `megarl evaluate` reports, by the same code (megarl/evaluation.py).
        responses = scored_responses(batch.data_source, batch.group_id.tolist(), result.scores,
                                     batch.response_lengths.tolist(), batch.finish_reason,
                                     pass_threshold=self.cfg.rollout.val.pass_threshold,
                                     acc=result.extra.get("acc"), preds=result.preds)  # fmt: skip
        summary = summarize(responses)
        add_components(summary, batch.data_source, component_scores(self.cfg.reward, result.extra))  # reward.combine's
        metrics = as_metrics(summary)
        self._write_samples(step, batch)
        metrics["time/validate_s"] = time.perf_counter() - start
        return metrics

    def _write_samples(self, step: int, batch: Any) -> None:
        k = self.cfg.trainer.val_samples_logged
        if not k:
            return
        texts = self.parts.scorer.texts(batch)
        rows = [{"prompt": batch.prompt_text[i], "response": texts[i], "ground_truth": batch.ground_truth[i],
                 "score": float(batch.scores[i]), "finish_reason": batch.finish_reason[i]} for i in range(min(k, len(batch)))]
        path = self.out / "samples" / f"step_{step:06d}.jsonl"
        with writing(path, f"the validation samples of step {step}"):
            write_sample_rows(path, rows, step, "samples")

    # ---- checkpoints -----------------------------------------------------------------------
    def save(self, step: int) -> Path:
        PROGRESS.mark("save", step)
        # The launch directory: relative paths in the saved config (model.path, data files) are
        # relative to it, wherever `megarl convert` later runs.
        with still_waiting(f"saving checkpoint step {step}", done_line=False), \
                writing(self.checkpoints.root / step_dir_name(step), f"checkpoint step {step} (nothing of it is left)"), \
                self.checkpoints.saving(step, run_metadata(), expected_bytes=self._checkpoint_bytes()) as folder:  # fmt: skip
            for role, model in self.parts.models.items():
                model.save(str(folder / role))
            # The config this checkpoint was trained with (megarl convert reads it; output_dir's
            # config.yaml is the latest launch's and may have changed since).
            (folder / RUN_CONFIG).write_text(config_to_yaml(self.cfg))
            record_model_configs(folder, self.cfg)
            record_metrics(folder, self.out)  # the step's record is logged before the save
            sampler, rollouts = self.parts.rollouts.state_dict()
            TrainerState(
                step=step,
                sampler=sampler,
                rollouts=rollouts,
                kl_controller=self.parts.advantages.kl_controller.state_dict(),
                rng=capture_rng(),
                logprob_check=self.parts.weight_push.state_dict(),
            ).save(folder)
        return self.checkpoints.root / step_dir_name(step)

    def _checkpoint_bytes(self) -> int:
        """The planner's estimate of a checkpoint (the free-space check before a save)."""
        from megarl.plan.disk_space import checkpoint_bytes

        return checkpoint_bytes(self.cfg)

    def restore(self) -> int:
        """Load the checkpoint trainer.resume points at; returns the step to continue after."""
        PROGRESS.mark("restore")
        ckpt = self.checkpoints.resolve_resume(self.cfg.trainer.resume)
        if ckpt is None:
            return 0
        history = ckpt.path / METRICS_HISTORY  # (a checkpoint of an older megarl has none)
        self._history = history if history.is_file() else None
        with still_waiting(f"loading checkpoint {ckpt.path}"):
            for role, model in self.parts.models.items():
                model.load(str(ckpt.component(role)))
        state = TrainerState.load(ckpt.path)
        self.parts.rollouts.load_state_dict(state.sampler, state.rollouts, state.step)
        self.parts.advantages.kl_controller.load_state_dict(state.kl_controller)
        self.parts.weight_push.load_state_dict(state.logprob_check)
        restore_rng(state.rng)
        if starts_new_history(self.cfg.trainer.resume, self.cfg.trainer.val_only):
            self.checkpoints.set_aside_newer(ckpt)
        log.info("resumed from %s (step %d)", ckpt.path, state.step)
        return state.step

    def _profile(self, step: int, start: bool) -> None:
        """The torch profiler in every policy rank around the steps of trainer.profile_steps."""
        if step not in self.cfg.trainer.profile_steps:
            return
        policy = self.parts.models["policy"]
        if start:
            policy.start_profile()
        else:
            policy.stop_profile(str(self.out / "profile" / f"step_{step}"))

    def close(self) -> None:
        if self.logger is not None:
            self.logger.close()


def _log_reward_failures(step: int, metrics: dict[str, float]) -> None:
    errors, timeouts = int(metrics.get("reward/errors") or 0), int(metrics.get("reward/timeouts") or 0)
    if errors or timeouts:
        log.warning("step %d: reward functions raised on %d and timed out on %d samples (scored 0; "
                    "reward.max_failed_fraction stops the run)", step, errors, timeouts)
