"""`megarl doctor` on this machine, and in Pythons where megatron-core, torch and Ray are out of
reach (real subprocesses: an old megatron-core's metadata first on PYTHONPATH; no site-packages)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megarl.cli import main
from megarl.parallel.mcore_version import SUPPORTED

ROOT = Path(__file__).resolve().parents[3]
KEYS = {"name", "ok", "version", "detail", "disables", "fatal"}


def doctor_json(capsys) -> tuple[int, dict, dict[str, dict]]:
    code = main(["doctor", "--json"])
    report = json.loads(capsys.readouterr().out)
    return code, report, {c["name"]: c for c in report["checks"]}


def test_this_machine(capsys):
    import ray

    code, report, checks = doctor_json(capsys)
    assert code == 0 and report["launch_possible"] is True
    assert all(set(c) == KEYS for c in report["checks"])
    assert checks["torch"]["version"] == torch.__version__ and checks["torch"]["ok"]
    assert checks["ray"]["version"] == ray.__version__ and checks["ray"]["ok"]
    assert checks["megatron-core"]["ok"] and f"supported ({SUPPORTED})" in checks["megatron-core"]["detail"]
    assert checks["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    if torch.cuda.is_available():
        assert checks["CUDA"]["ok"] and len(report["gpus"]) == torch.cuda.device_count()
    else:
        cuda = checks["CUDA"]
        assert not cuda["ok"] and not cuda["fatal"] and report["gpus"] == []
        assert cuda["disables"].startswith("CPU only (gloo): `megarl demo`")
        assert "GPU configs (cluster.device=cuda) do not" in cuda["disables"]
        assert checks["NCCL"]["detail"].startswith("not checked: no CUDA")


def test_table(capsys):
    assert main(["doctor"]) == 0
    *rows, last = capsys.readouterr().out.splitlines()
    names = ["python", "torch", "CUDA", "driver", "NCCL", "megatron-core", "transformer-engine", "apex", "flash-attn",
             "C compiler", "C++ compiler", "sglang", "ray", "ray cluster", "slurm"]
    assert [row[: len(name)] for row, name in zip(rows, names)] == names and len(rows) == len(names)
    column = len("transformer-engine") + 2  # names are padded to the longest: the status column is aligned
    assert {row[column:].split()[0] for row in rows} <= {"ok", "no", "FAIL"}
    assert all(row[column - 2 : column] == "  " for row in rows)
    assert last.startswith("megarl launch can run here")


def test_ray_address_probed_not_joined(capsys, monkeypatch):
    with socket.socket() as server:  # a listener stands in for the GCS port: one TCP connect, nothing else
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
        _, _, checks = doctor_json(capsys)
        assert checks["ray cluster"]["ok"]
        assert checks["ray cluster"]["detail"] == f"127.0.0.1:{port} (from RAY_ADDRESS): `--address auto` attaches to it"
    code, _, checks = doctor_json(capsys)  # the listener is gone
    assert code == 0 and not checks["ray cluster"]["ok"] and "does not answer" in checks["ray cluster"]["detail"]
    assert checks["ray cluster"]["disables"].endswith("start the cluster (`ray start --head`), or correct or unset RAY_ADDRESS")
    monkeypatch.setenv("RAY_ADDRESS", "garbage")
    _, _, checks = doctor_json(capsys)
    assert checks["ray cluster"]["detail"] == "garbage (from RAY_ADDRESS) does not answer (not host:port)"


def test_slurm_job_variables(capsys, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[01-04]")
    monkeypatch.setenv("SLURM_NNODES", "4")
    _, _, checks = doctor_json(capsys)
    assert checks["slurm"]["detail"] == "SLURM_JOB_ID=4242 SLURM_JOB_NODELIST=gpu[01-04] SLURM_NNODES=4"


def test_c_compiler_for_torch_compile(capsys, monkeypatch):
    import shutil
    import sysconfig

    _, _, checks = doctor_json(capsys)
    if shutil.which("cc") and (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        assert checks["C compiler"]["ok"] and checks["C compiler"]["detail"].endswith("Python.h: torch.compile and Triton can build kernels")
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"include": "/nonexistent"})
    _, _, checks = doctor_json(capsys)
    compiler = checks["C compiler"]
    assert not compiler["ok"] and not compiler["fatal"]
    assert compiler["detail"] == "missing a C compiler (cc / gcc / clang on PATH) and /nonexistent/Python.h"
    assert "which CUDA runs need" in compiler["disables"] and "python3-dev" in compiler["disables"]


def test_cxx_compiler_for_torch_compile_on_cpu(capsys, monkeypatch):
    import shutil

    monkeypatch.delenv("CXX", raising=False)
    _, _, checks = doctor_json(capsys)
    if shutil.which("g++"):
        assert checks["C++ compiler"] == {**checks["C++ compiler"], "ok": True,
                                          "detail": f"{shutil.which('g++')}: torch.compile can build kernels for CPU tensors"}  # fmt: skip
    monkeypatch.setenv("CXX", "ccache g++")  # torch runs CXX as one program, which is not there
    _, _, checks = doctor_json(capsys)
    assert checks["C++ compiler"]["detail"] == "missing a C++ compiler (CXX=ccache g++ on PATH)"
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("PATH", "/nonexistent")
    _, _, checks = doctor_json(capsys)
    compiler = checks["C++ compiler"]
    assert not compiler["ok"] and not compiler["fatal"] and compiler["detail"] == "missing a C++ compiler (g++ on PATH)"
    assert compiler["disables"].endswith("apt-get install g++, or set CXX to a C++ compiler")


def fake_nvidia_smi(tmp_path: Path, monkeypatch, version: str) -> None:
    """An nvidia-smi first on PATH that answers the driver query as the real one does (a line per GPU)."""
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir(exist_ok=True)
    smi.write_text(f"#!/bin/sh\n[ \"$1\" = --query-gpu=driver_version ] || exit 9\necho {version}\necho {version}\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}{os.pathsep}{os.environ['PATH']}")


def test_a_driver_older_than_torchs_cuda_needs_fails(capsys, monkeypatch, tmp_path):
    from megarl.commands import doctor

    monkeypatch.setattr(torch.version, "cuda", "13.0")  # this torch as a CUDA 13 build; it sees no GPU
    fake_nvidia_smi(tmp_path, monkeypatch, "575.57.08")
    code, report, checks = doctor_json(capsys)
    driver = checks["driver"]
    assert code == 2 and report["launch_possible"] is False and driver["fatal"] and not driver["ok"]
    assert driver["version"] == "575.57.08" and driver["detail"] == "from nvidia-smi; torch's CUDA 13.0 needs 580 or newer"
    assert "upgrade the NVIDIA driver to 580 or newer" in driver["disables"] and "forward-compatibility" in driver["disables"]
    fake_nvidia_smi(tmp_path, monkeypatch, "580.65.06")
    code, _, checks = doctor_json(capsys)
    assert code == 0 and checks["driver"]["ok"] and checks["driver"]["version"] == "580.65.06"
    fake_nvidia_smi(tmp_path, monkeypatch, "535.230.02")  # CUDA 12 runs on 525 and later
    assert doctor._driver("12.8", cuda_usable=False).ok
    # Below the minimum, GPUs torch can use mean CUDA's forward-compatibility libraries stand in.
    fake_nvidia_smi(tmp_path, monkeypatch, "550.54.15")
    check = doctor._driver("13.0", cuda_usable=True)
    assert check.ok and not check.fatal and "forward-compatibility libraries stand in" in check.detail
    assert not doctor._driver("13.0", cuda_usable=False).ok


def test_the_driver_version_file_without_nvidia_smi_and_no_driver(capsys, monkeypatch, tmp_path):
    from megarl.commands import doctor

    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    version_file = tmp_path / "version"
    version_file.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.124.06  Release Build  "
                            "(dvs-builder@U16-I3-B03-4-3)  Wed Feb 26 2025\nGCC version:  gcc version 12.3.0\n")
    monkeypatch.setattr(doctor, "DRIVER_VERSION_FILE", str(version_file))
    check = doctor._driver("13.0", cuda_usable=False)
    assert check.fatal and check.version == "570.124.06" and check.detail.startswith(f"from {version_file};")
    assert doctor._driver(None, cuda_usable=False).ok  # a CPU torch needs no driver
    monkeypatch.setattr(doctor, "DRIVER_VERSION_FILE", str(tmp_path / "absent"))
    code, _, checks = doctor_json(capsys)  # no GPU: said, not a failure
    driver = checks["driver"]
    assert code == 0 and not driver["ok"] and not driver["fatal"] and driver["version"] is None
    assert driver["detail"] == f"no NVIDIA driver found (no nvidia-smi on PATH, no {tmp_path / 'absent'}): no NVIDIA GPU here"


def test_the_docs_table_of_minimum_drivers_is_doctors():
    import re

    from megarl.commands.doctor import MIN_DRIVER

    text = (ROOT / "docs" / "docker.md").read_text()
    rows = dict(re.findall(r"^\| (\d+)\.x[^|]*\| (\d+) \|", text, flags=re.M))
    assert {int(k): int(v) for k, v in rows.items()} == MIN_DRIVER, "docs/docker.md's driver table differs from doctor's"


def run_doctor(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, env=env, cwd=cwd)


def test_old_megatron_core_makes_launch_impossible(tmp_path):
    # What pip leaves for megatron-core 0.10, first on the path: launch's own version check reads it.
    dist = tmp_path / "site" / "megatron_core-0.10.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: megatron-core\nVersion: 0.10.0\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    proc = run_doctor(["-m", "megarl.cli", "doctor"], env, tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = next(line for line in proc.stdout.splitlines() if line.startswith("megatron-core "))
    assert line.split()[1:3] == ["FAIL", "0.10.0"]
    assert f"megatron-core 0.10.0 is older than megarl supports; pip install 'megatron-core{SUPPORTED}'" in line
    assert proc.stdout.splitlines()[-1] == "megarl launch cannot run here: fix megatron-core (the FAIL lines)"


def test_python_without_site_packages(tmp_path):
    # `python -S`: none of the installed packages is importable; megarl comes from the checkout.
    # The `megarl` CLI needs more than doctor does, so this is also the module's own entry point.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = run_doctor(["-S", "-m", "megarl.commands.doctor", "--json"], env, tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert report["launch_possible"] is False
    assert sorted(name for name, c in checks.items() if c["fatal"]) == ["megatron-core", "ray", "torch"]
    assert checks["megatron-core"]["detail"] == f"megatron-core is not installed; pip install 'megatron-core{SUPPORTED}'"
    assert "pip install 'torch" in checks["torch"]["disables"] and "pip install 'ray" in checks["ray"]["disables"]


def test_help_has_an_example(capsys):
    with pytest.raises(SystemExit):
        main(["doctor", "--help"])
    assert "megarl doctor --json" in capsys.readouterr().out
