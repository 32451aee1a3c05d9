"""ci/gpu/probe_cluster_paths.py on a machine without a GPU (CUDA hidden where there is one): --help
needs no torch; the dry run runs what CPU tensors can (cuda_init, ipc_push, offload, nccl_group)
and reports the rest skipped with the reason; --only picks sections; a section past its time
limit fails alone and the summary is still written."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "ci" / "gpu" / "probe_cluster_paths.py"
SECTIONS = ["cuda_init", "ipc_push", "offload", "nccl_group", "packed_rope"]


def _probe(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)  # fmt: skip


def _record(out: Path, section: str) -> dict:
    return json.loads((out / f"probe_{section}.json").read_text())


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One CPU dry run of every section (about 30 s on 2 busy cores)."""
    out = tmp_path_factory.mktemp("probe")
    started = time.monotonic()
    done = _probe("--out", str(out), "--budget-s", "150", timeout=170)
    return done, out, time.monotonic() - started


def test_help_lists_the_sections_and_imports_no_torch():
    code = (f"import runpy, sys; sys.argv = ['probe', '--help']\n"
            f"try:\n    runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
            f"except SystemExit as e:\n    print('exit', e.code, 'torch' in sys.modules)")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert done.stdout.strip().endswith("exit 0 False"), done.stdout + done.stderr
    for name in [*SECTIONS, "--only", "--out", "--budget-s"]:
        assert name in done.stdout


def test_only_takes_repeated_and_comma_lists(monkeypatch):
    spec = importlib.util.spec_from_file_location("probe_cluster_paths", SCRIPT)
    probe = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, probe)  # its dataclass looks its module up
    spec.loader.exec_module(probe)
    assert probe.parse_args(["--only", "packed_rope,cuda_init", "--only", "offload"]).sections == [
        "cuda_init", "offload", "packed_rope"]  # fmt: skip
    assert probe.parse_args([]).sections == SECTIONS
    assert list(probe.SECTIONS) == SECTIONS
    with pytest.raises(SystemExit):
        probe.parse_args(["--only", "cuda_init,nope"])


@pytest.mark.slow
def test_dry_run_runs_what_cpu_can_and_says_why_not_for_the_rest(dry_run):
    done, out, _ = dry_run
    assert done.returncode == 0, done.stdout + done.stderr
    statuses = {s: _record(out, s)["status"] for s in SECTIONS}
    assert statuses == {"cuda_init": "ok", "ipc_push": "ok", "offload": "ok", "nccl_group": "ok", "packed_rope": "skipped"}
    assert _record(out, "packed_rope")["reason"].startswith("no CUDA")
    for section in ("cuda_init", "ipc_push", "offload", "nccl_group"):  # their GPU parts, each named
        record = _record(out, section)
        assert record["skipped_parts"] and all(r.startswith("no CUDA") for r in record["skipped_parts"].values()), record
        assert record["checks"] and all(c["ok"] for c in record["checks"]), record["checks"]
    summary = json.loads((out / "probe_summary.json").read_text())
    assert {s: r["status"] for s, r in summary["sections"].items()} == statuses
    assert (out / "probe_summary.md").read_text().count("\n| ") >= len(SECTIONS)
    assert json.loads((out / "probe_results.json").read_text())["records"]["offload"] == _record(out, "offload")


@pytest.mark.slow
def test_dry_run_checks_are_the_real_ones(dry_run):
    _, out, _ = dry_run
    checks = {c["check"] for s in SECTIONS for c in _record(out, s)["checks"]}
    for needed in ("CUDA is not initialised after unpickling", "control: its is_available() call is caught",
                   "default allocator, overlap_on: every tensor arrived bit for bit",
                   "default allocator, overlap_off: every tensor arrived bit for bit",
                   "default allocator, after_offload_onload: megarl's export check passed",
                   "weights and optimizer bit for bit after onload", "second update after offload/onload finite",
                   "gloo (cpu tensors), rejoin: the engine received every tensor bit for bit"):  # fmt: skip
        assert needed in checks
    push = _record(out, "ipc_push")["results"]["default allocator, overlap_on"]
    assert push["logprob_diff_before"]["mean"] > push["max_logprob_diff"]  # the receiver's weights really changed
    assert push["metrics"]["weight_sync/buckets"] > 1


def test_only_writes_only_its_sections(tmp_path):
    done = _probe("--out", str(tmp_path), "--only", "packed_rope", timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in tmp_path.glob("probe_*.json")) == ["probe_packed_rope.json", "probe_results.json",
                                                                      "probe_summary.json"]  # fmt: skip
    assert list(json.loads((tmp_path / "probe_summary.json").read_text())["sections"]) == ["packed_rope"]


def test_a_section_past_its_limit_fails_alone_and_the_summary_is_written(tmp_path):
    started = time.monotonic()
    done = _probe("--out", str(tmp_path), "--only", "ipc_push", "--timeout-s", "1", timeout=60)
    assert time.monotonic() - started < 20  # killed with the processes it started, not waited for
    assert done.returncode == 1
    record = _record(tmp_path, "ipc_push")
    assert record["status"] == "failed" and record["reason"].startswith("timed out after 1 s"), record
    assert json.loads((tmp_path / "probe_summary.json").read_text())["sections"]["ipc_push"]["status"] == "failed"


def test_the_offload_feed_names_constants_the_plan_has(tmp_path):
    """The GPU-only write-up of the offload section (never reached on CPU) runs on fake
    measurements, and every constant it feeds exists where it says."""
    spec = importlib.util.spec_from_file_location("probe_cluster_paths", SCRIPT)
    assert spec is not None and spec.loader is not None
    probe = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = probe  # its dataclasses look their module up
    try:
        spec.loader.exec_module(probe)
    finally:
        del sys.modules[spec.name]
    rep = probe.Report("offload", tmp_path, limit_s=60)
    gib = 1 << 30
    cycle = {"trainer_outside_allocator": gib, "trainer_residual_allocated": gib // 2, "engine": {"context_bytes": gib // 2},
             "d2h_gb_per_s": 11.0, "h2d_gb_per_s": 13.0}  # fmt: skip
    probe._feed_offload(rep, cycle)
    feeds = {f["constant"]: f for f in rep.data["feeds"]}
    for constant in feeds:
        if constant.startswith("megarl/"):
            path, name = constant.split(":")
            assert name in (ROOT / path).read_text(), constant
    assert feeds["megarl/plan/gpu_memory.py:TRAINER_RUNTIME_GIB"]["measured"] == 1.5
    assert min(f["measured"] for f in feeds.values() if "host_gb_per_s" in f["constant"]) == 11.0
