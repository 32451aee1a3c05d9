"""The commands whose driver starts Ray run it under the supervisor as `megarl launch` does
(megarl/commands/supervision.py), with real `megarl` processes and no Ray: a mistake in the
arguments or the config is refused by the command's own process (no driver started); a driver
killed from outside ends in the supervisor's one `error:` line naming what the command keeps, and
exit code 2. (A raylet killed under `megarl convert`: tests/e2e/test_supervised_commands.py; a
generate function's os._exit: tests/e2e/test_generate_evaluate.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl.cli import EXIT_USER, main

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "configs" / "tiny_grpo.yaml"


@pytest.mark.parametrize("argv", [
    ["sft", str(TINY), "sft.batch_size=0"],
    ["generate", str(TINY), "--data", "d.parquet", "--out", "o.parquet", "rollout.n=0"],
    ["demo", "rollout.n=0"],
    ["launch", str(TINY), "rollout.n=0"],
])  # fmt: skip
def test_a_config_mistake_is_refused_by_the_command_s_own_process(argv, capsys):
    # capsys holds what this process printed: a driver child's line would not be in it.
    assert main(argv) == EXIT_USER
    err = capsys.readouterr().err
    assert err.startswith("error: ") and ("sft.batch_size" in err or "rollout.n" in err), err
    assert "driver process" not in err


def test_convert_s_missing_hf_directory_is_refused_by_the_command_s_own_process(tmp_path, capsys):
    assert main(["convert", "hf-to-megatron", "--hf", str(tmp_path / "nohf"), "--out", str(tmp_path / "o"), "--tp", "2"]) == EXIT_USER
    assert capsys.readouterr().err == f"error: --hf {tmp_path / 'nohf'} has no config.json; give a Hugging Face model directory\n"


def _children(pid: int) -> list[int]:
    """``pid``'s children that run megarl's CLI: its driver (not the sentinel of megarl/stop_origin.py)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid and b"megarl.cli" in cmdline:
                found.append(int(entry))
    return found


def _kill_the_driver(argv: list[str], cwd: Path) -> tuple[int, str, int]:
    """Start `megarl ARGV`, kill -9 its driver (the supervisor's child) once it runs: the exit
    code, stderr and the driver's pid."""
    proc = subprocess.Popen([sys.executable, "-m", "megarl.cli", *argv], cwd=cwd, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (children := _children(proc.pid)) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert children, proc.communicate()[1]
        time.sleep(0.2)  # the driver under way (importing: before it could end on its own)
        os.kill(children[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, err, children[0]


def test_a_killed_sft_driver_is_one_line_saying_what_sft_keeps(tmp_path):
    code, err, pid = _kill_the_driver(["sft", str(TINY), "--in-process", f"sft.output_dir={tmp_path / 'sft'}"], tmp_path)
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert lines == [err.splitlines()[-1]], err
    assert lines[0].startswith(f"error: the driver process (pid {pid}) was killed by SIGKILL without reporting an error: ")
    assert "Ray" not in lines[0]  # --in-process: no Ray to name
    assert lines[0].endswith(f"SFT keeps no checkpoint to resume from, and {tmp_path / 'sft' / 'model'} appears only once "
                             "written whole and verified (it is staged beside itself): run the same command again")  # fmt: skip


@pytest.mark.parametrize("user_code", [(), ("data.custom_cls.path=ds.py", "data.custom_cls.name=Rows")], ids=["reward-only", "dataset"])
def test_a_killed_launch_driver_names_only_the_user_code_its_config_runs_there(tmp_path, user_code):
    """The demo's config with reward.custom alone (run by the reward workers): a kill -9 of the
    driver, during its checks, blames no user code in the driver and names no driver's log, which
    does not exist yet; with a dataset class, the line names that class, not generate functions."""
    (tmp_path / "r.py").write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    argv = ["launch", str(TINY), "--in-process", "cluster.nnodes=1", "cluster.gpus_per_node=1", "rollout.engine=torch",
            f"trainer.output_dir={tmp_path / 'run'}", "reward.custom.path=r.py", "reward.custom.name=score", *user_code]  # fmt: skip
    code, err, pid = _kill_the_driver(argv, tmp_path)
    assert code == 2, err
    [line] = [line for line in err.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: the driver process (pid {pid}) was killed by SIGKILL without reporting an error"), line
    assert "driver.log" not in line and "its output is above" in line and "generate function" not in line, line
    if user_code:
        assert "user code in the driver (data.custom_cls Rows) calling os._exit" in line, line
    else:
        assert "user code" not in line and "(the command runs none of your code)" in line, line


def test_one_ctrl_c_to_a_supervised_sft_stays_one(tmp_path):
    """Ctrl-C reaches the terminal's whole process group: the driver, in a group of its own, gets
    it once, from the supervisor; whether it had its handlers up or was still importing, one line
    and exit code 130, no error and no traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "megarl.cli", "sft", str(TINY), "--in-process",
                             f"sft.output_dir={tmp_path / 'sft'}"], cwd=tmp_path, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not _children(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    said = ("stopped by SIGINT", "interrupted (Ctrl-C)")  # the driver's handlers up, or not yet (imports)
    assert [line for line in err.splitlines() if line.startswith((*said, "error:"))] == [err.splitlines()[-1]], err
    assert err.splitlines()[-1].startswith(said) and "Traceback" not in err, err


def test_a_killed_convert_driver_is_not_blamed_on_user_code(tmp_path):
    """convert runs none of the user's code: a kill -9 of its driver names a kill or the OOM
    killer, not a generate function or tool calling os._exit (which launch's line names)."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 32, '
                                    '"num_hidden_layers": 1, "intermediate_size": 64, "num_attention_heads": 2, '
                                    '"num_key_value_heads": 1, "vocab_size": 100, "max_position_embeddings": 64}')  # fmt: skip
    out = tmp_path / "out"
    code, err, pid = _kill_the_driver(["convert", "hf-to-megatron", "--hf", str(hf), "--out", str(out), "--in-process"], tmp_path)
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert lines == [err.splitlines()[-1]], err
    assert lines[0].startswith(f"error: the driver process (pid {pid}) was killed by SIGKILL without reporting an error: "
                               "a kill from outside or the OOM killer (the command runs none of your code) (check dmesg)"), lines  # fmt: skip
    assert "user code" not in lines[0] and "generate function" not in lines[0]
    assert lines[0].endswith(f"{out} is as it was (a conversion writes beside it and swaps it in only once verified; the next "
                             "convert to it removes the staging folder left): run the same command again")  # fmt: skip
