"""megarl's version has one source, megarl/__init__.py (``__version__``): pyproject.toml reads it
(``dynamic``), the installed metadata and ``megarl --version`` report it, every checkpoint's
manifest and every ``megarl convert`` output record it, and it is usable as an image tag (the
images take it as a build argument checked against it: tests/unit/test_docker.py)."""

from __future__ import annotations

import importlib.metadata
import json
import re
import tomllib
from pathlib import Path

import pytest

import megarl
from megarl.checkpoint.manager import CheckpointManager
from megarl.checkpoint.model_checkpoint import RECORD, write_record
from megarl.checkpoint.verification import MANIFEST, step_dir_name
from megarl.cli import build_parser
from megarl.commands.conversion import _write_manifest
from megarl.commands.model_outputs import EXPORT_MANIFEST

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_takes_the_version_from_the_package():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = pyproject["project"]
    assert "version" not in project, "pyproject.toml writes a version: megarl/__init__.py is its one source"
    assert "version" in project.get("dynamic", []), "pyproject.toml: dynamic = [\"version\"]"
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "megarl.__version__"}


def test_the_version_is_an_image_tag():
    # Docker tags: [A-Za-z0-9_][A-Za-z0-9_.-]{0,127} (no '+': a PEP 440 local version would not do).
    assert re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}", megarl.__version__), megarl.__version__


def test_the_command_line_reports_it(capsys):
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"megarl {megarl.__version__}"


def test_the_installed_metadata_reports_it():
    try:
        installed = importlib.metadata.version("megarl")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("megarl is not installed here (the checkout comes from PYTHONPATH)")
    assert installed == megarl.__version__, (
        f"installed metadata says {installed}, megarl/__init__.py says {megarl.__version__}: pip install -e .")


def test_checkpoints_and_converted_models_record_it(tmp_path):
    manager = CheckpointManager(tmp_path / "run")
    with manager.saving(3, metadata={"config": {"seed": 1}}) as d:
        (d / "trainer_state.pt").write_bytes(b"state")
    manifest = json.loads((manager.root / step_dir_name(3) / MANIFEST).read_text())
    assert manifest["megarl_version"] == megarl.__version__
    ckpt = manager.resolve_resume("auto")
    assert ckpt.manifest["megarl_version"] == megarl.__version__

    exported = tmp_path / "model"
    exported.mkdir()
    (exported / "config.json").write_text("{}")
    _write_manifest(exported, str(ckpt.path), ckpt.step, checked=0)
    assert json.loads((exported / EXPORT_MANIFEST).read_text())["megarl_version"] == megarl.__version__
    write_record(exported, source="hf", tp=1, pp=1, dtype="float32", hf_config={}, verified_parameters=0)
    assert json.loads((exported / RECORD).read_text())["megarl_version"] == megarl.__version__
