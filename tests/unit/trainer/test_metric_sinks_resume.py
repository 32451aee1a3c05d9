"""Nothing lost in the metric sinks: a resumed run appends (cut back atomically to its checkpoint),
a new run keeps an earlier run's file, TensorBoard shows each step once, W&B continues the same
run id, reward failures show."""

from __future__ import annotations

import inspect
import io
import sys
import types

import pytest

from megarl.checkpoint.metrics_history import MetricsFileError, read_metrics
from megarl.cli import user_error_line
from megarl.config.sections import TrainerConfig
from megarl.trainer.metric_sinks import (
    ConsoleSink,
    JsonlSink,
    MetricsSinkError,
    MlflowSink,
    WandbSink,
    build_logger,
)


def test_a_new_run_keeps_an_earlier_runs_metrics(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "reward/mean": 0.5}\n')
    JsonlSink(path).close()
    kept = [p for p in tmp_path.glob("metrics.*.jsonl")]
    assert len(kept) == 1 and read_metrics(kept[0]) == [{"step": 1, "reward/mean": 0.5}]
    assert read_metrics(path) == []


def test_a_line_cut_off_by_a_kill_is_dropped_on_resume_and_left_out_when_read(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "actor/cl')  # killed while writing step 3
    assert read_metrics(path) == [{"step": 1}, {"step": 2}]
    assert "last line is cut off" in caplog.text
    sink = JsonlSink(path, resume_step=2)
    sink.log(3, {"reward/mean": 1.0})
    sink.close()
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n{"step": 3, "reward/mean": 1.0}\n'


def test_a_resume_into_a_new_output_dir_starts_its_metrics(tmp_path):
    sink = JsonlSink(tmp_path / "metrics.jsonl", resume_step=3)  # resumed from another run's checkpoint
    sink.log(4, {"reward/mean": 1.0})
    sink.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 4, "reward/mean": 1.0}]


def test_a_bad_line_before_the_last_is_an_error_naming_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    for read in (read_metrics, lambda p: JsonlSink(p, resume_step=3)):
        with pytest.raises(MetricsFileError, match=r"metrics.jsonl:2 is not a JSON record \('not json'\.\.\.\); mend"):
            read(path)
    assert path.read_text() == '{"step": 1}\nnot json\n{"step": 3}\n'  # untouched


def test_resume_appends_after_the_checkpoint_step_and_keeps_the_records_it_cuts(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(f'{{"step": {s}, "loss": {s / 10}}}\n' for s in (1, 2, 3, 4)))
    sink = JsonlSink(path, resume_step=2)
    sink.log(3, {"reward/mean": 1.0})
    sink.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    [kept] = tmp_path.glob("metrics.steps3-4.*.jsonl")
    assert read_metrics(kept) == [{"step": 3, "loss": 0.3}, {"step": 4, "loss": 0.4}]
    assert "steps 3-4 in metrics.jsonl come after the resumed step (2)" in caplog.text and kept.name in caplog.text
    JsonlSink(path, resume_step=2).close()  # cut again in the same second: a second file, the first one stays
    assert len(list(tmp_path.glob("metrics.steps3-3.*.jsonl"))) == 1 and read_metrics(kept)[1]["step"] == 4
    assert not list(tmp_path.glob(".metrics.jsonl.tmp*"))


def _lines(*steps: tuple[int, float]) -> str:
    return "".join(f'{{"step": {step}, "loss": {loss}}}\n' for step, loss in steps)


def test_a_resume_from_a_set_aside_checkpoint_takes_back_its_own_history(tmp_path, caplog):
    """History A ran steps 1-4 (step_4 saved its records); a resume from step 2 went on with
    history B (steps 3-4 again, other values) and set step_4 aside as .abandoned. Resuming from
    that one must not read B's steps 3-4 as A's."""
    path, ckpt = tmp_path / "metrics.jsonl", tmp_path / "checkpoints" / "step_000004.abandoned"
    ckpt.mkdir(parents=True)
    (ckpt / "metrics.jsonl").write_text(_lines((1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)))  # A
    other = _lines((1, 0.1), (2, 0.2), (3, 0.35), (4, 0.45))  # B
    path.write_text(other)
    sink = JsonlSink(path, resume_step=4, history=ckpt / "metrics.jsonl")
    sink.log(5, {"loss": 0.5})
    sink.close()
    assert path.read_text() == _lines((1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4), (5, 0.5))
    [kept] = tmp_path.glob("metrics.2*.jsonl")
    assert kept.read_text() == other
    assert f"kept as {kept.name}, and the checkpoint's records up to step 4 take its place" in caplog.text


def test_records_the_checkpoint_holds_within_the_file_are_its_history(tmp_path):
    """The common case: the file holds the checkpoint's records (and steps after it, or a
    validation-only run's records between them): cut back as before, nothing kept whole."""
    path, history = tmp_path / "metrics.jsonl", tmp_path / "step_000002" / "metrics.jsonl"
    history.parent.mkdir()
    history.write_text(_lines((1, 0.1), (2, 0.2)))
    path.write_text(_lines((1, 0.1), (2, 0.2), (2, 0.25), (3, 0.3)))  # (2, 0.25): a validation-only run's
    JsonlSink(path, resume_step=2, history=history).close()
    assert path.read_text() == _lines((1, 0.1), (2, 0.2), (2, 0.25))
    assert [p.name.split(".")[1][:6] for p in tmp_path.glob("metrics.*.jsonl")] == ["steps3"]
    fresh = tmp_path / "new" / "metrics.jsonl"  # a resume into a new output_dir starts its metrics
    JsonlSink(fresh, resume_step=2, history=history).close()
    assert fresh.read_text() == ""


def _checkpoint_copy(out, step: int, text: str):
    """The copy of metrics.jsonl a checkpoint of the run in ``out`` keeps (run_record.record_metrics)."""
    history = out / "checkpoints" / f"step_{step:06d}" / "metrics.jsonl"
    history.parent.mkdir(parents=True)
    history.write_text(text)
    return history


def test_a_deleted_metrics_file_is_restored_from_the_checkpoint_with_a_warning(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    history = _checkpoint_copy(tmp_path, 2, _lines((1, 0.1), (2, 0.2)))
    sink = JsonlSink(path, resume_step=2, history=history)  # the file was deleted after the save
    sink.log(3, {"loss": 0.3})
    sink.close()
    assert path.read_text() == _lines((1, 0.1), (2, 0.2), (3, 0.3))  # one uninterrupted history
    assert f"metrics: {path} was missing; its records up to step 2 are restored from the copy step_000002 keeps" in caplog.text


def test_a_file_missing_records_or_with_a_bad_line_is_kept_aside_whole_and_the_copy_takes_its_place(tmp_path, caplog):
    """Lines removed since the save, or a line that is no JSON record (not what a kill leaves):
    the file is kept as it is beside (nothing lost) and the run goes on from the copy's records,
    rather than stopping once the model is up; the steps after the checkpoint are trained again."""
    path = tmp_path / "metrics.jsonl"
    history = _checkpoint_copy(tmp_path, 2, _lines((1, 0.1), (2, 0.2)))
    for damaged, why in ((_lines((2, 0.2), (3, 0.3)), "does not hold the records step_000002 was saved with (lines removed or changed, or another history since set aside)"),
                         (_lines((1, 0.1)) + "{oops\n" + _lines((3, 0.3)), "has a bad line (line 2 is not a JSON record ('{oops'...))")):  # fmt: skip
        path.write_text(damaged)
        caplog.clear()
        JsonlSink(path, resume_step=2, history=history).close()
        assert path.read_text() == _lines((1, 0.1), (2, 0.2))
        kept = [p for p in tmp_path.glob("metrics.2*.jsonl") if p.read_text() == damaged]
        assert len(kept) == 1 and f"metrics: metrics.jsonl {why}; kept as {kept[0].name}, and the checkpoint's records " \
                                  "up to step 2 take its place" in caplog.text  # fmt: skip


def _real_signatures() -> dict[str, inspect.Signature]:
    """The installed W&B SDK's wandb.init, Run.log and Run.finish: the fakes take their calls as
    the real SDK would, or raise its TypeError. (Read before a test puts a fake in sys.modules.)"""
    import wandb

    return {name: inspect.signature(f) for name, f in (("init", wandb.init), ("log", wandb.sdk.wandb_run.Run.log),
                                                        ("finish", wandb.sdk.wandb_run.Run.finish))}


class FakeWandbRun:
    """A resumed W&B run as the real one behaves: ``step`` is the next step it takes, and a
    step below it is dropped (the real SDK warns per call)."""

    def __init__(self, run_id: str, next_step: int, real: dict[str, inspect.Signature]) -> None:
        self.id, self._real = run_id, real
        self.step = next_step
        self.logged: list[int] = []
        self.dropped: list[int] = []

    def log(self, *args, **kw):
        step = self._real["log"].bind(self, *args, **kw).arguments.get("step")
        assert step is not None, "the sink always gives the step"
        (self.dropped if step < self.step else self.logged).append(step)
        self.step = max(self.step, step + 1)

    def finish(self, *args, **kw):
        self._real["finish"].bind(self, *args, **kw)


class FakeWandb(types.ModuleType):
    """The `wandb` API surface the sink uses, with a resumed run that already holds the steps
    below ``next_step`` (offline, the real SDK cannot resume; it is tested below as far as it runs)."""

    def __init__(self, next_step: int = 0) -> None:
        super().__init__("wandb")
        self.inits: list[dict] = []
        self.runs: list[FakeWandbRun] = []
        self.next_step = next_step
        self._real = _real_signatures()

    def init(self, *args, **kw):
        self._real["init"].bind(*args, **kw)
        self.inits.append(kw)
        self.runs.append(FakeWandbRun(kw.get("id") or f"id{len(self.inits)}", self.next_step, self._real))  # None: a new id
        return self.runs[-1]


def test_wandb_resumes_the_same_run_id(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    WandbSink("p", "e", {}, tmp_path)
    WandbSink("p", "e", {}, tmp_path, resume_step=5)
    WandbSink("p", "e", {}, tmp_path)  # a new run: a new id
    ids = [run.id for run in fake.runs]
    assert ids[0] == ids[1] and ids[2] != ids[0] and fake.inits[1]["id"] == ids[0]
    assert all(kw["resume"] == "allow" for kw in fake.inits)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_bar_shows_reward_failures(monkeypatch):
    monkeypatch.setattr(sys, "stdout", _Terminal())  # the bar is for a terminal only
    sink = ConsoleSink(total_steps=3)
    sink._progress.console.file = io.StringIO()
    sink.log(1, {"reward/mean": 0.0, "reward/errors": 4.0, "reward/timeouts": 2.0})
    info = sink._progress.tasks[0].fields["info"]
    sink.close()
    assert "reward errors 4 timeouts 2" in info


def test_a_validation_only_run_appends_and_cuts_nothing(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(f'{{"step": {s}}}\n' for s in (1, 2, 3, 4)))
    sink = JsonlSink(path, resume_step=2, append=True)  # trainer.val_only of the step-2 checkpoint
    sink.log(2, {"val/reward/mean": 0.5})
    sink.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4, 2] and not list(tmp_path.glob("metrics.*.jsonl"))


def test_a_resume_does_not_resend_the_steps_wandb_already_holds(tmp_path, monkeypatch, caplog):
    """Stopped at step 7 after a checkpoint at 4: W&B holds 1-7 (next step 8); steps 5-7 trained
    again are not sent (one warning instead of W&B's per step), from 8 on they are."""
    fake = FakeWandb(next_step=8)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    (tmp_path / WandbSink.ID_FILE).write_text("run7\n")
    sink = WandbSink("p", "e", {}, tmp_path, resume_step=4)
    assert "run run7 already holds steps up to 7, logged before this resume from step 4" in caplog.text
    for step in range(5, 10):
        sink.log(step, {"loss": 0.1})
    run = fake.runs[0]
    assert run.logged == [8, 9] and run.dropped == []
    caplog.clear()
    WandbSink("p", "e", {}, tmp_path, resume_step=7)  # W&B holds exactly up to the checkpoint: nothing to say
    assert "already holds" not in caplog.text


def test_the_wandb_sink_runs_on_the_real_sdk_offline(tmp_path, monkeypatch, real_wandb):
    """The fake above only shows what the sink asks of W&B; this runs it on the real SDK
    (offline: no account, no network), a new run and its resume under the same id."""
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(tmp_path / "cfg"),
                        "WANDB_CACHE_DIR": str(tmp_path / "cache"), "WANDB_DATA_DIR": str(tmp_path / "data")}.items():
        monkeypatch.setenv(name, value)
    sink = WandbSink("p", "e", {"lr": 1e-6}, tmp_path)
    sink.log(1, {"loss": 0.5})
    sink.close()
    run_id = (tmp_path / WandbSink.ID_FILE).read_text().strip()
    sink = WandbSink("p", "e", {"lr": 1e-6}, tmp_path, resume_step=1)
    sink.log(2, {"loss": 0.4})
    sink.close()
    assert run_id and (tmp_path / WandbSink.ID_FILE).read_text().strip() == run_id
    runs = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(f"-{run_id}" in name for name in runs), runs


def _tensorboard_steps(log_dir, tag):
    """(step, value) of ``tag`` as TensorBoard shows it (its reader applies the purge marks)."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    reader = accumulator.EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    reader.Reload()
    return [(event.step, event.value) for event in reader.Scalars(tag)]


def _log_steps(out, steps, value, *, resume_step=0, val_only=False):
    cfg = TrainerConfig(loggers=["tensorboard"], output_dir=str(out), val_only=val_only)
    logger = build_logger(cfg, {}, total_steps=10, resume_step=resume_step)
    for step in steps:
        logger.log(step, {"reward/mean": value})
    logger.close()


def test_tensorboard_shows_each_step_once_after_a_resume(tmp_path):
    """Killed at step 5 after a checkpoint at 3: steps 4-5 are trained again; TensorBoard shows
    the new values once (not the stopped run's too, its line folding back to step 4)."""
    _log_steps(tmp_path, range(1, 6), 0.25)
    _log_steps(tmp_path, (4, 5), 0.75, resume_step=3)
    assert _tensorboard_steps(tmp_path / "tensorboard", "reward/mean") == [(1, 0.25), (2, 0.25), (3, 0.25), (4, 0.75), (5, 0.75)]
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2  # the earlier file stays


def test_tensorboard_of_a_new_run_hides_an_earlier_runs_curves_and_a_validation_run_adds(tmp_path):
    _log_steps(tmp_path, (1, 2), 0.25)  # a run stopped before its first checkpoint
    _log_steps(tmp_path, (1,), 0.5)  # launched again: from step 0
    assert _tensorboard_steps(tmp_path / "tensorboard", "reward/mean") == [(1, 0.5)]
    _log_steps(tmp_path, (2, 3), 0.5, resume_step=1)
    _log_steps(tmp_path, (1,), 0.75, resume_step=1, val_only=True)  # trainer.val_only of the step-1 checkpoint
    assert _tensorboard_steps(tmp_path / "tensorboard", "reward/mean") == [(1, 0.5), (2, 0.5), (3, 0.5), (1, 0.75)]


def test_wandb_without_a_login_is_one_line_naming_the_fixes(tmp_path, monkeypatch, real_wandb):
    """The real SDK, online, with no API key and no terminal to ask on (a Slurm job): W&B's
    UsageError used to end the run as an internal error (exit 1, a traceback) at step 0."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DISABLED", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"HOME": str(tmp_path), "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(tmp_path / "cfg"),
                        "WANDB_CACHE_DIR": str(tmp_path / "cache"), "WANDB_DATA_DIR": str(tmp_path / "data")}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "stdin", io.StringIO())  # no terminal: W&B cannot prompt for a key
    with pytest.raises(MetricsSinkError) as info:
        WandbSink("p", "e", {}, tmp_path)
    message = str(info.value)
    assert "\n" not in message and message.startswith("trainer.loggers includes wandb, and W&B did not start a run (")
    assert "`wandb login`" in message and "WANDB_MODE=offline" in message
    assert user_error_line(info.value) == message  # exit code 2, not a traceback


def test_the_mlflow_sink_continues_its_run_on_resume(tmp_path, monkeypatch, caplog):
    """On the real SDK (a local file store): a resume logs into the run it started, without
    logging its params again (MLflow refuses a changed one); a run id the store does not have
    starts a new run with a warning."""
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's file store is kept for tests like this one
    out = tmp_path / "out"
    out.mkdir()
    sink = MlflowSink("p", "e", {"actor": {"lr": 1e-6}, "trainer": {"total_steps": 4}}, out)
    sink.log(1, {"reward/mean": 0.1})
    sink.close()
    run_id = (out / MlflowSink.ID_FILE).read_text().strip()
    sink = MlflowSink("p", "e", {"actor": {"lr": 1e-6}, "trainer": {"total_steps": 8}}, out, resume_step=1)
    sink.log(2, {"reward/mean": 0.2})
    sink.close()
    assert (out / MlflowSink.ID_FILE).read_text().strip() == run_id
    run = mlflow.get_run(run_id)
    assert run.data.params["trainer.total_steps"] == "4" and run.data.metrics["reward/mean"] == 0.2
    history = mlflow.MlflowClient().get_metric_history(run_id, "reward/mean")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.1), (2, 0.2)]
    MlflowSink("q", "e", {}, out, resume_step=2).close()  # trainer.project changed: MLflow refuses the run there
    assert f"run {run_id} of this output_dir is in experiment 'p', and trainer.project is 'q'" in caplog.text
    assert (out / MlflowSink.ID_FILE).read_text().strip() != run_id
    (out / MlflowSink.ID_FILE).write_text("0" * 32 + "\n")  # a run of another store
    MlflowSink("p", "e", {}, out, resume_step=2).close()
    assert "is not in this tracking store" in caplog.text and (out / MlflowSink.ID_FILE).read_text().strip() != "0" * 32
