"""`megarl sft`'s refusals of its output, which come before any worker starts (the training
itself runs in tests/e2e/test_sft.py)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl.commands.demo import prepare_demo
from megarl.commands.sft import SFTError, run_sft
from megarl.config.loading import load_config
from megarl.data.datasets import DataError
from megarl.terminal import EXIT_SIGTERM
from megarl.trainer.run_lock import OutputDirInUse

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "tiny_grpo.yaml"


def test_an_output_dir_whose_model_folder_is_model_path_is_named_so(tmp_path):
    """<sft.output_dir>/model is where SFT writes: when that is the model it starts from, the
    refusal must not say to move it away (an earlier SFT's output) but to pick another folder."""
    model, _ = prepare_demo(tmp_path / "demo")  # model.path is demo/model
    before = sorted(p.name for p in model.iterdir())
    cfg = load_config(CONFIG, [f"model.path={model}", f"sft.output_dir={model.parent}", "cluster.gpus_per_node=1"])
    with pytest.raises(SFTError, match=rf"^{model} is model.path, the model SFT starts from, .*give another "
                                       rf"sft.output_dir than {model.parent}$"):  # fmt: skip
        run_sft(cfg, in_process=True)
    assert sorted(p.name for p in model.iterdir()) == before


def test_an_output_dir_that_is_a_file_is_named_so(tmp_path):
    model, _ = prepare_demo(tmp_path / "demo")
    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    cfg = load_config(CONFIG, [f"model.path={model}", f"sft.output_dir={afile}", "cluster.gpus_per_node=1"])
    with pytest.raises(SFTError, match=rf"^sft.output_dir \({afile}\) is a file; give a folder \(megarl sft writes model/ "
                                       r"and logs/ in it\)$"):  # fmt: skip
        run_sft(cfg, in_process=True)
    assert afile.read_text() == "mine"


def test_every_problem_of_the_checks_is_named_at_once(tmp_path):
    """The batch, the output folder and the plan's own problems in one refusal, not one per try."""
    model, _ = prepare_demo(tmp_path / "demo")
    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    odd = load_config(CONFIG, [f"model.path={model}", f"sft.output_dir={afile}", "sft.batch_size=63"])
    with pytest.raises(SFTError, match=r"^megarl sft cannot start \(2 problems\):\n") as refused:
        run_sft(odd)  # DP=2 (cluster.gpus_per_node=2): refused before Ray starts
    assert "\n  - sft.batch_size (63) must be a multiple of the data-parallel size (2); try 62\n" in str(refused.value)
    assert str(refused.value).endswith(f"\n  - sft.output_dir ({afile}) is a file; give a folder (megarl sft writes model/ "
                                       "and logs/ in it)")  # fmt: skip
    unplanned = load_config(CONFIG, [f"model.path={model}", f"sft.output_dir={afile}", "actor.parallel.tp=3"])
    with pytest.raises(SFTError, match=r"^megarl sft cannot start \(\d+ problems\):\n") as refused:
        run_sft(unplanned)
    assert "\n  - actor.parallel.tp: (3) must divide num_attention_heads" in str(refused.value)
    assert f"\n  - sft.output_dir ({afile}) is a file" in str(refused.value)
    assert afile.read_text() == "mine"


def test_sigterm_during_the_checks_ends_in_one_line(tmp_path):
    """A SIGTERM while `megarl sft` checks and reads (here: stuck reading the model's config.json,
    a FIFO the test holds open) ends in the stop line and SIGTERM's exit code, not in Python's
    default death (-15, no word)."""
    model, data = prepare_demo(tmp_path / "demo")
    (model / "config.json").unlink()
    os.mkfifo(model / "config.json")
    parent = subprocess.Popen([sys.executable, "-m", "megarl.cli", "sft", str(CONFIG), f"model.path={model}",
                               f"sft.train_files=[{data / 'train.parquet'}]", "sft.val_files=[]",
                               f"sft.output_dir={tmp_path / 'sft'}"], cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(CONFIG.parents[1])}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)  # fmt: skip
    writer = None
    try:
        deadline = time.monotonic() + 120
        while writer is None:  # a FIFO opens for writing (without blocking) once a reader waits in it
            assert parent.poll() is None, parent.communicate()
            assert time.monotonic() < deadline, "megarl sft never read the model's config.json"
            try:
                writer = os.open(model / "config.json", os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:
                assert exc.errno == errno.ENXIO, exc
                time.sleep(0.05)
        parent.send_signal(signal.SIGTERM)
        try:
            _, err = parent.communicate(timeout=120)
        except subprocess.TimeoutExpired:  # seen once on a loaded machine: the stacks say where it hung
            parent.send_signal(signal.SIGUSR1)  # passed on to the driver, which writes every thread's stack
            time.sleep(5)
            parent.kill()
            pytest.fail(f"megarl sft did not end within 120 s of its SIGTERM; its stderr:\n{parent.communicate()[1][-8000:]}")
    finally:
        if writer is not None:
            os.close(writer)
        if parent.poll() is None:
            parent.kill()
    assert parent.returncode == EXIT_SIGTERM, err
    assert err.strip().splitlines()[-1] == "stopped by SIGTERM while checking the config; nothing was started", err
    assert not (tmp_path / "sft").exists()


HOLD = """import sys
from megarl.trainer.run_lock import output_dir_lock
with output_dir_lock(sys.argv[1], "sft.output_dir"):
    print("held", flush=True)
    sys.stdin.read()
"""


def test_a_second_sft_into_one_output_dir_is_refused_before_reading_the_data(tmp_path):
    """The output folder is taken before the data is read (seconds of tokenizing): here the data is
    missing, which the reading would report; the refusal, naming the holder, comes first."""
    model, _ = prepare_demo(tmp_path / "demo")
    out = tmp_path / "sft"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(CONFIG.parents[1])})  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        cfg = load_config(CONFIG, [f"model.path={model}", f"sft.train_files=[{tmp_path / 'missing.parquet'}]",
                                   "sft.val_files=[]", f"sft.output_dir={out}", "cluster.gpus_per_node=1"])  # fmt: skip
        with pytest.raises(OutputDirInUse, match=rf"^sft.output_dir {out} is in use by pid {holder.pid} "):
            run_sft(cfg, in_process=True)
    finally:
        holder.communicate(input="", timeout=60)  # its stdin closed: it lets go and ends


def test_a_dataset_class_of_the_config_is_said_to_be_unused(tmp_path, caplog):
    # an RL config's data.custom_cls: SFT reads sft.train_files, which must not look as if it trained on the class
    model, _ = prepare_demo(tmp_path / "demo")
    (tmp_path / "ds.py").write_text("class DS:\n    pass\n")
    cfg = load_config(CONFIG, [f"model.path={model}", f"sft.train_files=[{tmp_path / 'missing.parquet'}]", "sft.val_files=[]",
                               f"sft.output_dir={tmp_path / 'sft'}", "cluster.gpus_per_node=1",
                               f"data.custom_cls.path={tmp_path / 'ds.py'}", "data.custom_cls.name=DS"])  # fmt: skip
    with pytest.raises(DataError, match="missing.parquet"):  # the data's own refusal, after the checks
        run_sft(cfg, in_process=True)
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert said == ["sft: data.custom_cls DS is not used: megarl sft trains on sft.train_files (parquet files with prompt + "
                    "response columns or chat messages); write your class's rows to such a file"]


@pytest.mark.parametrize(("command", "field"), [("sft", "sft.output_dir"), ("launch", "trainer.output_dir"),
                                                ("demo", "trainer.output_dir"), ("demo-elsewhere", "trainer.output_dir")])  # fmt: skip
def test_a_folder_a_run_holds_is_refused_by_the_command_before_its_driver_starts(tmp_path, capsys, command, field):
    # The refusal is the command process's own (captured here): a driver would have checked the
    # config for seconds first (and, with no training files, said that instead).
    from megarl.cli import EXIT_USER, main

    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(CONFIG.parents[1])})  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        args = {"demo": ["demo", "--config", str(CONFIG), "--root", str(tmp_path)],  # the demo's run: ROOT/run
                # a demo whose trainer.output_dir is given: its run goes there (the command holds what its driver will)
                "demo-elsewhere": ["demo", "--config", str(CONFIG), "--root", str(tmp_path / "root"), f"{field}={out}"],
                }.get(command, [command, str(CONFIG), f"{field}={out}"])  # fmt: skip
        assert main([*args, "sft.train_files=[]", "data.train_files=[]"]) == EXIT_USER
        err = capsys.readouterr().err
        assert err.startswith(f"error: {field} {out} is in use by pid {holder.pid} ") and err.count("\n") == 1, err
    finally:
        holder.communicate(input="", timeout=60)
