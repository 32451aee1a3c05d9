"""A full disk ends a run (or a command) in one `error:` line naming what was written, where,
and what is kept, with nothing half-written: injected ENOSPC for the metrics writer and a
checkpoint save, /dev/full for the driver's log file, and a real full tmpfs (skipped where
`mount` is refused) for the plan's free-space check and the writers' leftovers."""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from megarl.checkpoint.manager import CheckpointManager, NoSpaceForCheckpoint
from megarl.checkpoint.verification import verify_checkpoint
from megarl.cli import report
from megarl.disk_full import DiskFullError, writing
from megarl.trainer.metric_sinks import JsonlSink, MetricsLogger

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny_grpo.yaml"
FULL = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _one_error_line(exc: BaseException) -> str:
    """What the command line prints for ``exc``, asserted to be one `error:` line and exit code 2."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert report(exc) == 2
    lines = err.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the disk is full: writing "), err.getvalue()
    return lines[0]


def test_a_metrics_record_the_disk_cuts_short_is_taken_back_and_said_in_one_line(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    logger = MetricsLogger([sink])
    logger.log(1, {"loss": 0.5})
    real_write, calls = os.write, []

    def disk_fills(fd: int, data: bytes) -> int:
        if fd != sink._fd:
            return real_write(fd, data)
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[:7]))  # part of the record fits
        raise FULL

    monkeypatch.setattr(os, "write", disk_fills)
    with pytest.raises(DiskFullError) as info:
        logger.log(2, {"loss": 0.25})
    monkeypatch.undo()
    assert path.read_text() == '{"step": 1, "loss": 0.5}\n'  # no half record left
    assert _one_error_line(info.value) == (
        f"error: the disk is full: writing the metrics of step 2 to {path} failed (No space left on device); free space "
        "on that disk (megarl deletes nothing of yours to make room), then run the same command again")  # fmt: skip
    logger.close()


def test_a_save_the_disk_cannot_hold_leaves_nothing_and_the_last_checkpoint_whole(tmp_path):
    """As Trainer.save wraps it: a rank's failed write comes back as its WorkerError's cause."""
    from megarl.ray_cluster.worker_error import WorkerError

    manager = CheckpointManager(tmp_path)
    with manager.saving(2) as d:
        (d / "state").write_bytes(b"step 2")
    for failure in (FULL, WorkerError("policy rank 0 raised OSError", "policy", 0, cause=FULL)):
        with pytest.raises(DiskFullError, match=r"^the disk is full: writing checkpoint step 4 to \S+step_000004 failed "
                                                r"\(No space left on device\)"):  # fmt: skip
            with writing(manager.root / "step_000004", "checkpoint step 4"), manager.saving(4) as d:
                (d / "policy").mkdir()
                (d / "policy" / "shard").write_bytes(b"half a sha")
                raise failure
        assert sorted(p.name for p in manager.root.iterdir()) == ["step_000002"]  # no .tmp_ left
        assert verify_checkpoint(manager.root / "step_000002").step == 2


def test_the_run_names_the_last_complete_checkpoint_and_the_resume_command(tmp_path):
    from megarl.config.loading import load_config
    from megarl.trainer.loop import Trainer
    from megarl.trainer.watchdog import RunControl

    cfg = load_config(CONFIG, [f"trainer.output_dir={tmp_path}"])
    trainer = Trainer(cfg, parts=None, logger_factory=None)  # (parts: not used by the ending)
    with trainer.checkpoints.saving(3) as d:
        (d / "state").write_bytes(b"step 3")
    trainer.step = 5
    with pytest.raises(DiskFullError) as info:
        with trainer._disk_full_ending(RunControl("megarl launch run.yaml")):
            with writing(tmp_path / "rollouts" / "5.jsonl", "the rollouts of step 5 (trainer.rollout_data_dir)"):
                raise FULL
    assert _one_error_line(info.value) == (
        f"error: the disk is full: writing the rollouts of step 5 (trainer.rollout_data_dir) to {tmp_path}/rollouts/5.jsonl "
        f"failed (No space left on device); kept: the last complete checkpoint, step 3 ({tmp_path}/checkpoints/"
        "step_000003); free space on that disk (megarl deletes nothing of yours to make room), then resume with: "
        "megarl launch run.yaml")  # fmt: skip
    with pytest.raises(DiskFullError, match=r"writing the run's files at step 5 to \S+ failed .*kept: the last complete"):
        with trainer._disk_full_ending(RunControl()):
            raise RuntimeError("a library's write failed") from FULL  # a write no megarl writer wrapped
    # a save refused before it writes (the disk cannot hold it) ends the same way: kept, and how to resume
    with pytest.raises(NoSpaceForCheckpoint) as refused:
        with trainer._disk_full_ending(RunControl("megarl launch run.yaml")):
            trainer.checkpoints.check_free_space(6, expected_bytes=10 * shutil.disk_usage(tmp_path).free)
    assert str(refused.value).startswith(f"not enough disk space to save step 6 in {tmp_path}/checkpoints: ")
    assert str(refused.value).endswith(f"; kept: the last complete checkpoint, step 3 ({tmp_path}/checkpoints/step_000003); "
                                       "resume with: megarl launch run.yaml")  # fmt: skip


def test_a_log_file_on_a_full_disk_prints_no_logging_errors(capfd):
    """/dev/full: every write fails with ENOSPC. Before, each record printed a '--- Logging
    error ---' traceback to the terminal (about 230 lines for one full disk)."""
    from megarl.trainer.launch import driver_log

    log = logging.getLogger("megarl.test_disk_full")
    with pytest.raises(RuntimeError) as info:
        with driver_log(Path("/dev/full")):
            for i in range(50):
                log.warning("record %d", i)
            raise RuntimeError("the run's end")
    out, err = capfd.readouterr()
    assert "Logging error" not in err and "Traceback" not in err
    assert not hasattr(info.value, "megarl_log")  # no "(traceback: driver.log)" pointing at what was not written


# ---- a real full disk: a tmpfs ------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (skipped where mount is refused: not root, a container without the right)."""
    where = tmp_path / "small"
    where.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"mount refused: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _fill(disk: Path) -> None:
    with open(disk / "filler", "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"x" * 65536)
            f.flush()


def test_on_a_full_tmpfs_writers_leave_the_old_files_and_no_half_written_ones(small_disk):
    from megarl.kept_files import write_atomically

    summary, metrics = small_disk / "summary.json", small_disk / "metrics.jsonl"
    summary.write_text("the old summary\n")
    sink = JsonlSink(metrics)
    sink.log(1, {"loss": 0.5})
    _fill(small_disk)
    with pytest.raises(OSError) as info:
        write_atomically(summary, "x" * 1_000_000)
    assert info.value.errno == errno.ENOSPC
    with pytest.raises(DiskFullError, match="writing the metrics of step 2"):
        sink.log(2, {"text": 1.0, **{f"m{i}": float(i) for i in range(20000)}})  # a record larger than what is left
    sink.close()
    assert summary.read_text() == "the old summary\n" and metrics.read_text() == '{"step": 1, "loss": 0.5}\n'
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler", "metrics.jsonl", "summary.json"]


def test_the_plan_refuses_a_disk_too_small_for_a_checkpoint_with_the_numbers(small_disk):
    from megarl.config.loading import load_config
    from megarl.plan.disk_space import check_disk_space, checkpoint_bytes

    cfg = load_config(CONFIG, [f"trainer.output_dir={small_disk / 'run'}"])
    findings: list = []
    check_disk_space(cfg, findings)
    [finding] = findings
    size = checkpoint_bytes(cfg) / 2**20
    assert finding.field == "trainer.output_dir" and finding.message.startswith(
        f"{small_disk / 'run'} has no room for a checkpoint: a checkpoint takes about {size:.3g} MiB and a save needs "
        f"{(size * 1.05 + 64):.3g} MiB free (it, 5% more and 64 MiB kept for the run's logs and metrics), but ")  # fmt: skip
    assert finding.message.endswith("MiB are free; free some space there, or point trainer.output_dir at a larger disk")
    assert not (small_disk / "run").exists()  # the check creates nothing


def test_the_checkpoint_estimate_counts_what_each_trained_model_saves():
    """Weights plus 12 B of optimizer state per trained parameter; a critic doubles it; under
    LoRA the policy saves its adapters only (the whole model's size would refuse a disk that holds it)."""
    from megarl.config.architectures import resolve_arch
    from megarl.config.loading import load_config
    from megarl.plan.disk_space import checkpoint_bytes
    from megarl.plan.gpu_memory import DTYPE_BYTES, lora_params

    cfg = load_config(CONFIG, [])
    arch = resolve_arch(cfg.model.path, cfg.model.arch)
    per_param = DTYPE_BYTES[cfg.model.dtype] + 12
    assert checkpoint_bytes(cfg) == arch.num_params * per_param
    assert checkpoint_bytes(load_config(CONFIG, ["algorithm.estimator=gae"])) == 2 * arch.num_params * per_param
    lora = load_config(CONFIG, ["actor.lora={rank: 4}"])
    assert checkpoint_bytes(lora) == lora_params(arch, 4, lora.actor.lora.modules) * per_param < checkpoint_bytes(cfg) / 4


def test_an_output_whose_lock_cannot_be_written_on_a_full_disk_is_named_and_leaves_no_lock(small_disk, capsys):
    """`megarl evaluate --out` (and generate, convert) on a full disk: the lock's holder line is the
    command's first write; one line naming the lock file of --out, and the file made for it goes."""
    from megarl.cli import main

    data = small_disk.parent / "scored.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["2+2?"], "data_source": ["openai/gsm8k"], "reward_model": [{"ground_truth": "4"}],
                             "responses": [["#### 4", "5"]]}), data)  # fmt: skip
    _fill(small_disk)
    out = small_disk / "summary.json"
    assert main(["evaluate", "--data", str(data), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"error: the disk is full: writing the lock file of --out {out} to {small_disk / '.summary.json.megarl.lock'} "
                       "failed (No space left on device); kept: nothing: the command had written nothing yet; free space on "
                       "that disk (megarl deletes nothing of yours to make room), then run the same command again")  # fmt: skip
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]


def test_a_run_folder_whose_lock_cannot_be_written_on_a_full_disk_is_named_and_not_left_behind(small_disk):
    """`megarl launch` / `sft` into a new trainer.output_dir on a full disk: one DiskFullError naming
    the lock file, and the folders made for it go (they held an empty lock file)."""
    from megarl.disk_full import DiskFullError
    from megarl.trainer.run_lock import output_dir_lock

    _fill(small_disk)
    run = small_disk / "runs" / "x"
    with pytest.raises(DiskFullError, match=rf"writing the lock file of trainer.output_dir {run} to {run / '.megarl.lock'} "):
        with output_dir_lock(run):
            pass
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]


def test_a_partial_generation_s_job_record_on_a_full_disk_is_named_and_never_cut(small_disk):
    """`megarl generate` whose job record meets a full disk: one DiskFullError naming the record, no
    empty generate.json for the next run to choke on."""
    from megarl.commands.generate_partial import open_partial

    _fill(small_disk)
    partial = small_disk / "gen.parquet.partial"
    record = partial / "generate.json"
    with pytest.raises(DiskFullError) as info:
        open_partial(partial, {"data_sha256": "ab", "model": "/m", "padding": "x" * 100_000})
    assert str(info.value).startswith(f"the disk is full: writing the partial generation's job record to {record} failed")
    assert not record.exists() and not list(partial.glob(".generate.json.tmp*"))
