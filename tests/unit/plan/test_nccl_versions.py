"""The pre-launch check that the trainer and the SGLang servers load one NCCL version where the
weight push joins them in an NCCL group (rollout.weight_sync.transport distributed on GPUs):
each side's Python is probed in a subprocess; fake interpreters (scripts that print a version)
stand in for both."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from megarl.config.loading import load_config
from megarl.plan.planner import PlanError, make_plan
from megarl.plan.rollout_checks import NCCL_PROBE, check_nccl_versions, nccl_mismatch, probe_nccl

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny_grpo.yaml"
DISAGGREGATED = ["rollout.engine=sglang", "cluster.placement=disaggregated", "cluster.gpus_per_node=3",
                 "cluster.rollout_gpus=1", "cluster.device=cuda"]  # fmt: skip


def fake_python(tmp_path: Path, name: str, nccl: str) -> str:
    """An interpreter that answers the NCCL probe with ``nccl`` and any other -c (the sglang probe)
    with exit code 0."""
    path = tmp_path / name
    path.write_text(f'#!/bin/sh\ncase "$2" in *nccl*) echo "{nccl}" ;; esac\nexit 0\n')
    path.chmod(0o755)
    return str(path)


def test_same_version_passes_and_a_difference_is_refused_naming_both(tmp_path):
    trainer = fake_python(tmp_path, "trainer", "2.31.1")
    assert nccl_mismatch(trainer, fake_python(tmp_path, "same", "2.31.1")) is None
    server = fake_python(tmp_path, "server", "2.30.7")
    issue = nccl_mismatch(trainer, server)
    assert issue is not None and issue.level == "error" and "\n" not in str(issue)
    assert str(issue).startswith(f"rollout.server_python: ({server}) loads NCCL 2.30.7 and the trainer ({trainer}) "
                                 "NCCL 2.31.1: NCCL refuses a group whose ranks differ in version")  # fmt: skip
    assert "make the servers' torch load NCCL 2.31.1" in str(issue) and "docs/docker.md" in str(issue)


def test_a_side_without_nccl_is_a_warning(tmp_path):
    trainer, server = fake_python(tmp_path, "trainer", "2.31.1"), fake_python(tmp_path, "cpu-torch", "none")
    issue = nccl_mismatch(trainer, server)
    assert issue is not None and issue.level == "warning"
    assert f"NCCL versions not compared (the trainer's {trainer}: NCCL 2.31.1; the servers' {server}: no NCCL" in str(issue)
    mute = tmp_path / "mute"  # answers nothing a version looks like
    mute.write_text("#!/bin/sh\necho Traceback; exit 1\n")
    mute.chmod(0o755)
    issue = nccl_mismatch(trainer, str(mute))
    assert issue is not None and issue.level == "warning" and "unknown (exit code 1, printed 'Traceback')" in str(issue)


def test_the_probe_runs_each_python_the_same_way_without_torch_here(tmp_path):
    # This machine's CPU torch has no NCCL: the probe says "none" (torch.cuda.nccl.version() raises).
    assert probe_nccl([sys.executable, fake_python(tmp_path, "gpu", "2.30.7")]) == ["none", "2.30.7"]
    assert probe_nccl([str(tmp_path / "absent")])[0].startswith("unknown (")
    assert "torch.cuda.nccl.version()" in NCCL_PROBE  # (the planner imports no torch: tests/unit/test_layout.py)


@pytest.fixture
def no_files(monkeypatch):
    """make_plan(check_files=True) without the data and model files (their own tests check them)."""
    from megarl.plan import planner

    monkeypatch.setattr(planner, "_check_files", lambda cfg, issues, bridge: None)


def test_the_plan_compares_before_launch_only_where_an_nccl_group_joins_the_sides(tmp_path, no_files):
    server = fake_python(tmp_path, "server", "2.30.7")
    # this test's Python (a CPU torch) is the trainer: nothing to compare, a warning on the plan
    warned = make_plan(load_config(TINY, [*DISAGGREGATED, f"rollout.server_python={server}"]), check_files=True)
    assert any(str(w).startswith("rollout.server_python: NCCL versions not compared") for w in warned.warnings)
    assert not any("NCCL" in str(w) for w in make_plan(load_config(TINY, DISAGGREGATED[:-1] + [
        f"rollout.server_python={server}"]), check_files=True).warnings)  # a CPU run: the group is gloo

    def checked(*overrides: str) -> list:
        issues: list = []
        check_nccl_versions(load_config(TINY, [*DISAGGREGATED, *overrides]), issues)
        return issues

    assert checked(f"rollout.server_python={server}")  # distributed (auto, disaggregated): probed
    assert not checked(f"rollout.server_python={server}", "rollout.weight_sync.transport=disk")
    assert not checked()  # the servers run this Python: one NCCL
    colocated = load_config(TINY, ["rollout.engine=sglang", "cluster.device=cuda", f"rollout.server_python={server}"])
    issues: list = []
    check_nccl_versions(colocated, issues)  # tensor (CUDA IPC): no NCCL group across the sides
    assert colocated.weight_transport == "tensor" and issues == []


def test_a_mismatch_refuses_the_plan(tmp_path, monkeypatch, no_files):
    server = fake_python(tmp_path, "server", "2.30.7")
    monkeypatch.setattr(sys, "executable", fake_python(tmp_path, "trainer", "2.31.1"))
    with pytest.raises(PlanError) as refused:
        make_plan(load_config(TINY, [*DISAGGREGATED, f"rollout.server_python={server}"]), check_files=True)
    assert [i.field for i in refused.value.issues] == ["rollout.server_python"]
    assert "loads NCCL 2.30.7 and the trainer" in str(refused.value) and "NCCL 2.31.1" in str(refused.value)
