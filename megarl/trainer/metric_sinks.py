"""Where step metrics go: console progress, metrics.jsonl, TensorBoard, W&B, MLflow, SwanLab.

One ``MetricsLogger`` fans a step's flat ``{name: float}`` dict out to the sinks chosen by
``trainer.loggers``. On resume, metrics.jsonl is cut back to the resumed step (steps after
the checkpoint are re-run) and appended to, so the file always reads as one uninterrupted
run (the records cut are kept as metrics.steps<A>-<B>.<time>.jsonl; a validation-only run
appends, cutting nothing; a file that went on with another history since the checkpoint is
kept aside whole and the checkpoint's copy of its records takes its place); a run starting at step 0 keeps an earlier run's file as
metrics.<time>.jsonl; TensorBoard is told to hide what metrics.jsonl cuts or keeps aside;
a resumed run continues the same W&B run (its id is kept in
<output_dir>/wandb_run_id; the steps trained again keep their first values there), and the same
MLflow run (<output_dir>/mlflow_run_id), and the same SwanLab run (<output_dir>/swanlab_run_id).
The step's phases are timed by megarl/progress.py.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from megarl.checkpoint.metrics_history import MetricsFileError, owns_history, records
from megarl.config.sections import TrainerConfig
from megarl.disk_full import disk_full_cause, writing
from megarl.kept_files import kept_name, time_tag, write_atomically
from megarl.plan.logger_checks import WANDB_LOGIN_FIX
from megarl.progress import NOTE_EVERY_S
from megarl.std_streams import to_devnull

log = logging.getLogger(__name__)


class MetricsSinkError(ValueError):
    """A metric service that refuses to start a run (no login, no server): a user-facing, one-line error."""


class MetricsSink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """``<output_dir>/metrics.jsonl``: one JSON object per step, with ``step`` first."""

    def __init__(self, path: Path, resume_step: int = 0, *, append: bool = False, history: Path | None = None):
        """``append``: add to the file as it is (a validation-only run: it starts no history).
        ``history``: the resumed checkpoint's copy of the file (None: an older checkpoint's)."""
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step and not append:
            if history is not None:
                _take_history(path, resume_step, history)
            _cut_back(path, resume_step)
        elif not append and path.exists() and path.stat().st_size:  # a new run where an earlier run left metrics (no checkpoint of it)
            kept_as = kept_name(path, time_tag(path.stat().st_mtime))
            os.replace(path, kept_as)
            log.warning("metrics: %s of an earlier run kept as %s", path, kept_as.name)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: _jsonable(v) for k, v in sorted(metrics.items())}}
        with writing(self.path, f"the metrics of step {step}"):
            append_whole(self._fd, (json.dumps(record) + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)


def append_whole(fd: int, data: bytes) -> None:
    """Append ``data`` to the file ``fd`` whole or not at all: a write the disk cuts short (full)
    is taken back, so the file never ends in half a record."""
    size = os.fstat(fd).st_size
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        os.ftruncate(fd, size)  # shrinking needs no space
        raise


class TensorBoardSink:
    """``<output_dir>/tensorboard``. Event files are never rewritten: a resumed run writes a new
    one that starts with a purge mark at ``purge_step``, so TensorBoard drops the earlier files'
    values from that step on (the steps trained again, an earlier run's curves) instead of
    drawing both; the files stay on disk. ``purge_step`` None: nothing is hidden (a
    validation-only run adds to the history)."""

    def __init__(self, log_dir: Path, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        with writing(self._writer.log_dir, f"the TensorBoard events of step {step}"):
            for name, value in metrics.items():
                self._writer.add_scalar(name, value, step)
            self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """W&B; a resumed run (``resume_step`` > 0) continues the W&B run whose id is in ``<log_dir>/wandb_run_id``.

    W&B's steps only increase: the steps a resume trains again, which the stopped run had
    already logged, keep their first values there (rewinding a W&B run is a preview feature
    that self-hosted servers lack). They are not sent again, and one warning says so, instead
    of W&B's warning per dropped step; metrics.jsonl holds the values trained again."""

    ID_FILE = "wandb_run_id"

    def __init__(self, project: str, name: str, config: dict[str, Any], log_dir: Path, resume_step: int = 0):
        try:
            import wandb
        except ImportError:
            raise ImportError("trainer.loggers includes wandb but wandb is not installed: pip install wandb") from None
        id_file = Path(log_dir) / self.ID_FILE
        run_id = id_file.read_text().strip() if resume_step and id_file.is_file() else None  # None: W&B makes one
        try:
            self._run = wandb.init(project=project, name=name, config=config, dir=str(log_dir), id=run_id, resume="allow")
        except wandb.errors.Error as exc:  # e.g. no API key where W&B cannot ask for one (no terminal: Slurm, nohup)
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise MetricsSinkError(f"trainer.loggers includes wandb, and W&B did not start a run ({reason}); "
                                   f"{WANDB_LOGIN_FIX}") from exc
        run_id = self._run.id
        id_file.write_text(run_id + "\n")
        self._next_step = self._run.step if resume_step else 0  # the lowest step W&B still takes
        if self._next_step > resume_step + 1:
            last = self._next_step - 1
            log.warning("W&B: run %s already holds steps up to %d, logged before this resume from step %d; W&B keeps "
                        "those values (its steps only increase), so steps up to %d are not sent there again; "
                        "metrics.jsonl has this run's values", run_id, last, resume_step, last)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if step >= self._next_step:
            self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowSink:
    """MLflow; a resumed run (``resume_step`` > 0) continues the MLflow run whose id is in
    ``<log_dir>/mlflow_run_id``, with the params it started with (MLflow refuses to change a
    param; a changed config key is named by the resume's own warning). MLflow keeps every value
    of a step: the steps a resume trains again show both values there."""

    ID_FILE = "mlflow_run_id"

    def __init__(self, project: str, name: str, config: dict[str, Any], log_dir: Path, resume_step: int = 0):
        try:
            import mlflow
        except ImportError:
            raise ImportError("trainer.loggers includes mlflow but mlflow is not installed: pip install mlflow") from None
        self._mlflow = mlflow
        id_file = Path(log_dir) / self.ID_FILE
        run_id = id_file.read_text().strip() if resume_step and id_file.is_file() else None
        experiment = mlflow.set_experiment(project)
        run = self._resumed(run_id, experiment) if run_id else None
        if run is None:
            run = mlflow.start_run(run_name=name)
            mlflow.log_params({mlflow_name(k): str(v)[:250] for k, v in _flatten(config).items()})  # keys hold user names (reward.functions.<source>)
        id_file.write_text(run.info.run_id + "\n")

    def _resumed(self, run_id: str, experiment: Any) -> Any:
        """The run ``run_id`` started again, or None (said in a warning) where this tracking store
        has no such run or it is another experiment's (MLflow refuses to start it under this one)."""
        try:
            found = self._mlflow.MlflowClient().get_run(run_id)
        except self._mlflow.exceptions.MlflowException as exc:
            log.warning("MLflow: run %s of this output_dir is not in this tracking store (%s); starting a new MLflow "
                        "run", run_id, str(exc).splitlines()[0])
            return None
        if found.info.experiment_id != experiment.experiment_id:
            other = self._mlflow.MlflowClient().get_experiment(found.info.experiment_id).name
            log.warning("MLflow: run %s of this output_dir is in experiment %r, and trainer.project is %r; starting a new "
                        "MLflow run (set trainer.project=%s to continue it)", run_id, other, experiment.name, other)
            return None
        return self._mlflow.start_run(run_id=run_id)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._mlflow.log_metrics({mlflow_name(k): v for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        self._mlflow.end_run()


SWANLAB_FIX = "run `swanlab login` or set SWANLAB_API_KEY, or set SWANLAB_MODE=offline (`swanlab sync` later) or local"


class SwanlabSink:
    """SwanLab (verl's swanlab logger), its files in ``<log_dir>/swanlog``; the mode (cloud, offline,
    local) is SwanLab's own setting (SWANLAB_MODE). A resumed run (``resume_step`` > 0) continues the
    run whose id is in ``<log_dir>/swanlab_run_id``."""

    ID_FILE = "swanlab_run_id"

    def __init__(self, project: str, name: str, config: dict[str, Any], log_dir: Path, resume_step: int = 0):
        try:
            import swanlab
        except ImportError:
            raise ImportError("trainer.loggers includes swanlab but swanlab is not installed: pip install swanlab") from None
        id_file = Path(log_dir) / self.ID_FILE
        run_id = id_file.read_text().strip() if resume_step and id_file.is_file() else None
        try:
            self._run = swanlab.init(project=project, name=name, config=config, log_dir=str(Path(log_dir) / "swanlog"),
                                     id=run_id, resume="allow" if run_id else None)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - e.g. no API key where SwanLab cannot ask for one
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise MetricsSinkError(f"trainer.loggers includes swanlab, and SwanLab did not start a run ({reason}); "
                                   f"{SWANLAB_FIX}") from exc
        id_file.write_text(f"{self._run.id}\n")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


def mlflow_name(metric: str) -> str:
    """``metric`` (or a config key) as MLflow takes it: it refuses (and the run would stop at that step) any
    character but letters, digits, ``_ - . /``, space (and ``:`` off Windows); ``pass@8`` and
    data sources named like ``gsm8k(test)`` have others."""
    return re.sub(r"[^/\w.\- ]", "_", metric)


class ConsoleSink:
    """A rich progress bar: step, reward (or the SFT loss), KL, step time; validation results
    printed as lines. On stdout that is no terminal (a redirect, a pipe, Slurm's output), where a
    rich bar shows nothing until it stops, a plain line per step instead (:class:`_StepLines`)."""

    def __init__(self, total_steps: int, start_step: int = 0):
        import sys

        self._lines = None if sys.stdout.isatty() else _StepLines(total_steps)
        if self._lines is not None:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[info]}"), TimeRemainingColumn()
        )
        self._task = self._progress.add_task("train", total=total_steps, completed=start_step, info="")
        self._progress.start()
        from megarl.user_code import routed_again

        routed_again()  # user code's prints to their log as they are, not through the bar's console

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self._lines is not None:
            self._lines.log(step, metrics)
            return
        self._progress.update(self._task, completed=step, info=step_info(metrics, markup=True))
        for line in validation_lines(step, metrics):
            self._progress.console.print(line)

    def close(self) -> None:
        if self._lines is not None:
            self._lines.close()
        else:
            self._progress.stop()


class _StepLines:
    """The console's progress as plain lines (no bar, no terminal codes) for stdout that is no
    terminal: ``step 12/500  reward 0.410  kl 0.002  s/step 0.12``, for the first step, then at
    most every NOTE_EVERY_S, and always the last (at the last step, or when the run ends before
    it); validation results as they come."""

    def __init__(self, total_steps: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.clock = total_steps, clock
        self._last_said = -math.inf
        self._unsaid: str | None = None  # the latest step's line, when it was not printed

    def log(self, step: int, metrics: dict[str, float]) -> None:
        line = f"step {step}/{self.total}  {step_info(metrics, markup=False)}".rstrip()
        now = self.clock()
        if step >= self.total or now - self._last_said >= NOTE_EVERY_S:
            _say(line)
            self._last_said, self._unsaid = now, None
        else:
            self._unsaid = line
        for extra in validation_lines(step, metrics):
            _say(extra)

    def close(self) -> None:
        if self._unsaid is not None:
            _say(self._unsaid)
            self._unsaid = None


def _say(line: str) -> None:
    try:
        print(line, flush=True)
    except OSError as exc:  # stdout closed under the run (`| head`: EPIPE; a terminal gone: EIO)
        _stdout_to_devnull(exc)


def _stdout_to_devnull(exc: OSError) -> None:
    """A closed stdout ends no run: what is printed there from now on (and what is still buffered)
    goes nowhere, once said in the log; metrics.jsonl and logs/driver.log go on."""
    to_devnull(1)
    log.warning("stdout is closed (%s): the step lines stop there; the run goes on (metrics.jsonl, logs/driver.log)", exc)


def step_info(metrics: dict[str, float], *, markup: bool) -> str:
    """What the console shows of a step: reward (and failed reward calls), the SFT loss, KL, step
    time; ``markup``: rich's colour for the failures (the bar), else plain text."""
    parts = [f"reward {metrics['reward/mean']:.3f}" if "reward/mean" in metrics else ""]
    failed = {label: int(metrics.get(key) or 0) for key, label in (("reward/errors", "errors"), ("reward/timeouts", "timeouts"))}
    if any(failed.values()):  # reward functions that raised / timed out: visible at a glance
        text = "reward " + " ".join(f"{label} {n}" for label, n in failed.items() if n)
        parts.append(f"[red]{text}[/]" if markup else text)
    for key, label in (("sft/loss", "loss"), ("actor/kl", "kl"), ("time/step_s", "s/step")):
        if key in metrics and metrics[key] is not None and not math.isnan(metrics[key]):
            parts.append(f"{label} {metrics[key]:.3g}")
    return "  ".join(p for p in parts if p)


def validation_lines(step: int, metrics: dict[str, float]) -> list[str]:
    """The lines a step's validation results print as."""
    lines = []
    if "val/reward/mean" in metrics:
        lines.append(f"step {step}: validation reward {metrics['val/reward/mean']:.3f}")
    if metrics.get("sft/val_loss") is not None:
        lines.append(f"step {step}: held-out loss {metrics['sft/val_loss']:.4f}")
    return lines


class MetricsLogger:
    """Fans each step's metrics out to every sink; remembers the last record."""

    def __init__(self, sinks: list[MetricsSink]):
        self.sinks = sinks
        self.last: dict[str, float] = {}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.last = dict(metrics)
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        """Close every sink; one that cannot flush (a full disk) does not stop the others, and is
        logged, not raised: the run's own ending says what happened."""
        for sink in self.sinks:
            try:
                sink.close()
            except OSError as exc:  # (a full disk: the run's ending says it already)
                (log.debug if disk_full_cause(exc) else log.warning)("metrics: closing %s failed (%s)", type(sink).__name__, exc)


def build_logger(cfg: TrainerConfig, config_dict: dict[str, Any], total_steps: int, resume_step: int = 0,
                 history: Path | None = None) -> MetricsLogger:
    """The sinks of ``cfg.loggers``; ``history``: the resumed checkpoint's copy of metrics.jsonl."""
    out = Path(cfg.output_dir)
    sinks: list[MetricsSink] = []
    for name in dict.fromkeys(cfg.loggers):
        if name == "console":
            sinks.append(ConsoleSink(total_steps, resume_step))
        elif name == "jsonl":
            sinks.append(JsonlSink(out / "metrics.jsonl", resume_step, append=cfg.val_only, history=history))
        elif name == "tensorboard":
            purge_step = None if cfg.val_only else resume_step + 1 if resume_step else 0  # as metrics.jsonl is cut
            sinks.append(TensorBoardSink(out / "tensorboard", purge_step))
        elif name == "wandb":
            sinks.append(WandbSink(cfg.project, cfg.experiment, config_dict, out, resume_step))
        elif name == "mlflow":
            sinks.append(MlflowSink(cfg.project, cfg.experiment, config_dict, out, resume_step))
        elif name == "swanlab":
            sinks.append(SwanlabSink(cfg.project, cfg.experiment, config_dict, out, resume_step))
    return MetricsLogger(sinks)


def _take_history(path: Path, resume_step: int, history: Path) -> None:
    """Make ``path`` hold the records the resumed checkpoint was saved with (its copy ``history``).
    Missing or empty (deleted since): restored from the copy, when the checkpoint is this
    output_dir's (a resume from another run's checkpoint into a new output_dir starts its own
    metrics). Not holding them (lines removed or changed since, or another history: a resume
    from a checkpoint set aside as step_N.abandoned meets the records of the history that set it
    aside, and cutting them back would mix the two) or holding a line that is no JSON record:
    the file is kept aside whole, as it is, and the checkpoint's records take its place, so
    nothing is lost and the run goes on (a bad line with no copy to take its place is refused
    before Ray starts: megarl/plan/resume_checks.py). Records added to the checkpoint's (a
    validation-only run's) are no other history."""
    theirs = "".join(line + "\n" for line, record in records(history) if record.get("step", 0) <= resume_step)
    if not path.exists() or not path.stat().st_size:
        if theirs and owns_history(path, history):
            write_atomically(path, theirs)
            log.warning("metrics: %s was missing; its records up to step %d are restored from the copy %s keeps",
                        path, resume_step, history.parent.name)  # fmt: skip
        return
    try:
        if _in_order(theirs.splitlines(), [line for line, _ in records(path, quiet=True)]):  # (_cut_back warns of a cut line)
            return
        why = f"does not hold the records {history.parent.name} was saved with (lines removed or changed, or another history since set aside)"
    except MetricsFileError as exc:
        why = exc.problem.removeprefix(str(path)).removeprefix(":").join(("has a bad line (line ", ")"))
    kept_as = kept_name(path, time_tag(path.stat().st_mtime))
    write_atomically(kept_as, path.read_text())
    write_atomically(path, theirs)
    log.warning("metrics: %s %s; kept as %s, and the checkpoint's records up to step %d take its place", path.name, why,
                kept_as.name, resume_step)  # fmt: skip


def _in_order(lines: list[str], within: list[str]) -> bool:
    """Whether ``lines`` appear in ``within`` in their order (others may come between)."""
    rest = iter(within)
    return all(any(line == other for other in rest) for line in lines)


def _cut_back(path: Path, resume_step: int) -> None:
    """Cut ``path`` back to the resumed step: the steps after it are re-run now (and a cut-off
    last line goes). The records cut are kept beside it as metrics.steps<A>-<B>.<time>.jsonl: the
    steps a crashed run got through after its checkpoint, or the history a resume from an older
    checkpoint leaves, are evidence someone may want."""
    found = records(path)  # (a resume into a new output_dir has none)
    kept = "".join(line + "\n" for line, record in found if record.get("step", 0) <= resume_step)
    cut = [(line, record) for line, record in found if record.get("step", 0) > resume_step]
    if cut:
        steps = [int(record["step"]) for _, record in cut]
        aside = kept_name(path, f"steps{min(steps)}-{max(steps)}.{time_tag()}")
        write_atomically(aside, "".join(line + "\n" for line, _ in cut))
        log.warning("metrics: steps %d-%d in %s come after the resumed step (%d) and are trained again; their "
                    "records are kept in %s", min(steps), max(steps), path.name, resume_step, aside.name)
    if kept != (path.read_text() if path.exists() else ""):
        write_atomically(path, kept)


def _jsonable(value: Any) -> Any:
    value = float(value)
    return None if math.isnan(value) or math.isinf(value) else value


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
