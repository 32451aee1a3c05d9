"""`megarl doctor [--json]`: what this machine and Python can run, and what each missing piece disables.

One row per check: Python, torch and its CUDA build, the GPUs, the NVIDIA driver, NCCL,
megatron-core (through megarl.parallel.mcore_version, the check `megarl launch` itself runs),
transformer-engine, apex, flash-attn, the C and C++ compilers torch.compile needs, SGLang in this Python (or the venv
``rollout.server_python`` can name), Ray and the cluster ``--address auto`` would attach to,
and the Slurm job around us. Exit code 2 only when `megarl launch` cannot work here (no
torch, no usable megatron-core, no Ray, a Python older than megarl's, an NVIDIA driver older
than torch's CUDA needs); else 0. Where
`megarl` itself does not start (a dependency of another command is missing),
``python -m megarl.commands.doctor`` runs the same report.

Deliberately light: versions come from package metadata and ``find_spec`` (nothing is
imported to learn its version), except torch, which is imported because whether it imports
and what it sees (CUDA, GPUs, NCCL) is the point. Nothing starts or joins Ray: the cluster is
found from RAY_ADDRESS or the address file `ray start` writes, and probed with one TCP connect.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

CPU_ONLY = "CPU only (gloo): `megarl demo` and cluster.device=cpu configs work, GPU configs (cluster.device=cuda) do not"
# The oldest NVIDIA driver (its major version) that runs each CUDA major version of torch's build:
# CUDA's minor-version compatibility lets every 12.x run on 525 and later, every 13.x on 580 and
# later. The one place this is written (docs/docker.md refers to it).
MIN_DRIVER = {12: 525, 13: 580}
DRIVER_VERSION_FILE = "/proc/driver/nvidia/version"  # the kernel module's, where nvidia-smi is missing
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_JOB_NAME", "SLURM_JOB_NODELIST", "SLURM_NNODES", "SLURM_NTASKS",
              "SLURM_GPUS_ON_NODE", "SLURM_CPUS_ON_NODE", "SLURMD_NODENAME")  # fmt: skip


@dataclass
class Check:
    """One row of the report (and one object of --json's ``checks``; the keys are stable)."""

    name: str
    ok: bool
    version: str | None = None
    detail: str = ""
    disables: str = ""  # what is off because this is missing ("" when nothing is)
    fatal: bool = False  # not ok, and `megarl launch` cannot work without it


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="report what this machine can run: Python, torch, CUDA, NCCL, megatron-core, SGLang, Ray, Slurm",
        description="Check the software and devices megarl uses, in a few seconds, without starting anything: "
        "one line per piece with its version, and for each missing piece what it disables. Exits 2 when "
        "`megarl launch` cannot work here (no torch, no supported megatron-core, no Ray, Python too old, an NVIDIA "
        "driver older than torch's CUDA needs), else 0.",
        epilog="examples:\n  megarl doctor            the table\n"
        "  megarl doctor --json     one JSON object: {megarl, python, launch_possible, checks: [{name, ok, "
        "version, detail, disables, fatal}], gpus}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    checks, gpus = collect()
    launch_possible = not any(c.fatal for c in checks)
    if args.json:
        from megarl import __version__

        report = {"megarl": __version__, "python": sys.executable, "launch_possible": launch_possible,
                  "checks": [asdict(c) for c in checks], "gpus": gpus}  # fmt: skip
        print(json.dumps(report, indent=1))
    else:
        print_table(checks)
    return 0 if launch_possible else 2


def collect() -> tuple[list[Check], list[dict[str, Any]]]:
    """Every check, in report order, and the GPUs torch sees ({index, name, memory_gib})."""
    torch_check, torch = _torch()
    cuda_check, gpus = _cuda(torch)
    cuda = getattr(getattr(torch, "version", None), "cuda", None)
    checks = [_python(), torch_check, cuda_check, _driver(cuda, bool(gpus)), _nccl(torch, bool(gpus)), _megatron_core(),
              _transformer_engine(), _apex(), _flash_attn(), _compiler(), _cxx_compiler(), _sglang(), _ray(), _ray_cluster(),
              _slurm()]  # fmt: skip
    return checks, gpus


def print_table(checks: list[Check]) -> None:
    width = max(len(c.name) for c in checks)
    vwidth = max(len(c.version or "-") for c in checks)
    for c in checks:
        status = "ok" if c.ok else "FAIL" if c.fatal else "no"
        text = c.detail + (f" — {c.disables}" if c.disables else "")
        print(f"{c.name:<{width}}  {status:<4}  {c.version or '-':<{vwidth}}  {text}")
    fatal = [c.name for c in checks if c.fatal]
    if fatal:
        print(f"megarl launch cannot run here: fix {', '.join(fatal)} (the FAIL lines)")
    else:
        print("megarl launch can run here" + ("" if any(c.name == "CUDA" and c.ok for c in checks) else " (CPU only)"))


# --- helpers -------------------------------------------------------------------------------


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _requirement(dist: str) -> str:
    """megarl's own requirement on ``dist`` (``ray[default]>=2.40``), from its installed metadata,
    so the fixes printed here follow pyproject.toml; the bare name when megarl is not installed."""
    try:
        requires = metadata.requires("megarl") or []
    except metadata.PackageNotFoundError:
        requires = []
    for req in requires:
        name = re.match(r"[A-Za-z0-9_.-]+", req)
        if name and name.group(0).lower().replace("_", "-") == dist:
            return req.split(";")[0].strip()
    return dist


def _outside(requirement: str, version: str) -> bool:
    """Whether ``version`` misses ``requirement``'s range (False when that cannot be told:
    ``packaging``, which Ray and torch bring, is absent)."""
    try:
        from packaging.requirements import Requirement
        from packaging.version import InvalidVersion
    except ImportError:
        return False
    try:
        return not Requirement(requirement).specifier.contains(version, prereleases=True)
    except (InvalidVersion, ValueError):
        return False


# --- the checks ----------------------------------------------------------------------------


def _python() -> Check:
    version = ".".join(map(str, sys.version_info[:3]))
    try:
        needed = metadata.metadata("megarl")["Requires-Python"]
    except metadata.PackageNotFoundError:
        needed = None
    found = re.search(r">=\s*(\d+)\.(\d+)", needed or "")
    if found and sys.version_info[:2] < (int(found.group(1)), int(found.group(2))):
        return Check("python", False, version, f"{sys.executable}; megarl needs Python {needed}",
                     "everything: install megarl under a newer Python", fatal=True)  # fmt: skip
    where = f"{sys.executable} (megarl needs {needed})" if needed else f"{sys.executable} (megarl is not pip-installed)"
    return Check("python", True, version, where)


def _torch() -> tuple[Check, Any]:
    req = _requirement("torch")
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - an unimportable torch (missing libs, ABI) is a finding
        found = _version("torch")
        detail = f"torch {found} does not import ({type(exc).__name__}: {exc})" if found else "not installed"
        return Check("torch", False, found, detail, f"training and `megarl launch`: pip install '{req}'", fatal=True), None
    if _outside(req, torch.__version__):
        return Check("torch", False, torch.__version__, f"megarl needs {req}", f"`megarl launch`: pip install '{req}'",
                     fatal=True), torch  # fmt: skip
    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else (
        f"ROCm {torch.version.hip} build" if getattr(torch.version, "hip", None) else "CPU build")
    return Check("torch", True, torch.__version__, build), torch


def _cuda(torch: Any) -> tuple[Check, list[dict[str, Any]]]:
    if torch is None:
        return Check("CUDA", False, None, "not checked (no torch)"), []
    if not torch.version.cuda and not getattr(torch.version, "hip", None):
        return Check("CUDA", False, None, f"none: torch {torch.__version__} is a CPU build", CPU_ONLY), []
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        why = f"CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "no GPU or driver found"
        return Check("CUDA", False, None, f"none visible ({why})", CPU_ONLY), []
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        gpus.append({"index": i, "name": props.name, "memory_gib": round(props.total_memory / 2**30, 1)})
    kinds: dict[str, int] = {}
    for g in gpus:
        key = f"{g['name']} ({g['memory_gib']} GiB)"
        kinds[key] = kinds.get(key, 0) + 1
    listed = ", ".join(f"{n} x {k}" for k, n in kinds.items())
    return Check("CUDA", True, torch.version.cuda or torch.version.hip, listed), gpus


def driver_version() -> tuple[str | None, str]:
    """The NVIDIA driver's version (torch does not expose it publicly) and where it was read:
    nvidia-smi, else the kernel module's version file; (None, why) where neither tells."""
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        try:
            out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10)  # fmt: skip
            lines = out.stdout.split()
            if out.returncode == 0 and lines and re.fullmatch(r"\d+\.\d+(\.\d+)?", lines[0]):
                return lines[0], "nvidia-smi"
        except (OSError, subprocess.TimeoutExpired):
            pass  # the version file may still tell
    try:
        text = Path(DRIVER_VERSION_FILE).read_text()
    except OSError:
        where = "nvidia-smi did not answer" if smi else "no nvidia-smi on PATH"
        return None, f"{where}, no {DRIVER_VERSION_FILE}"
    # "NVRM version: NVIDIA UNIX [Open ]Kernel Module [for x86_64]  580.65.06  Release Build ..."
    found = re.search(r"Kernel Module.*?\s(\d+\.\d+(?:\.\d+)?)\s", text)
    return (found[1], DRIVER_VERSION_FILE) if found else (None, f"no version in {DRIVER_VERSION_FILE}")


def _driver(cuda: str | None, cuda_usable: bool) -> Check:
    """The driver against what torch's CUDA build needs (:data:`MIN_DRIVER`). ``cuda``: torch's
    CUDA version (None: not a CUDA build); ``cuda_usable``: torch sees GPUs, which it does below
    the minimum only through CUDA's forward-compatibility libraries."""
    version, source = driver_version()
    if version is None:
        return Check("driver", False, None, f"no NVIDIA driver found ({source}): no NVIDIA GPU here")
    if cuda is None:
        return Check("driver", True, version, f"from {source}; torch is not a CUDA build, so it needs none")
    major = int(cuda.split(".")[0])
    need = MIN_DRIVER.get(major)
    if need is None:
        return Check("driver", True, version, f"from {source}; no minimum known here for CUDA {cuda}")
    if int(version.split(".")[0]) >= need:
        return Check("driver", True, version, f"from {source}; torch's CUDA {cuda} needs {need} or newer")
    if cuda_usable:
        return Check("driver", True, version, f"from {source}; older than the {need} torch's CUDA {cuda} needs, but "
                     "torch uses the GPUs: CUDA's forward-compatibility libraries stand in")  # fmt: skip
    return Check("driver", False, version, f"from {source}; torch's CUDA {cuda} needs {need} or newer",
                 f"GPU runs (torch cannot use the GPUs): upgrade the NVIDIA driver to {need} or newer, or install "
                 f"CUDA {major}'s forward-compatibility package (cuda-compat; docs/docker.md)", fatal=True)  # fmt: skip


def _nccl(torch: Any, has_gpus: bool) -> Check:
    if not has_gpus:
        return Check("NCCL", False, None, "not checked: no CUDA (CPU runs use gloo)")
    try:
        found = torch.cuda.nccl.version()
    except Exception as exc:  # noqa: BLE001 - a torch built without NCCL raises here
        return Check("NCCL", False, None, f"unavailable ({exc})",
                     "multi-GPU collectives: only single-GPU runs (`megarl launch --in-process`) work")  # fmt: skip
    version = ".".join(map(str, found)) if isinstance(found, tuple) else str(found)
    return Check("NCCL", True, version, "torch's NCCL (the collectives of GPU runs)")


def _megatron_core() -> Check:
    """The check `megarl launch` runs before its first Megatron import (megarl.parallel.mcore_version),
    so doctor and launch cannot disagree; it reads metadata only, never imports megatron."""
    import warnings

    from megarl.parallel.mcore_version import SUPPORTED, installed_version, require_megatron_core

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            mcore = require_megatron_core()
        except ImportError as exc:
            return Check("megatron-core", False, installed_version(), str(exc), "training (`megarl launch`)", fatal=True)
    if importlib.util.find_spec("megatron") is None:
        return Check("megatron-core", False, mcore, f"installed ({mcore}) but `megatron` is not importable; "
                     f"pip install --force-reinstall 'megatron-core{SUPPORTED}'", "training (`megarl launch`)",
                     fatal=True)  # fmt: skip
    detail = str(caught[0].message) if caught else f"supported ({SUPPORTED})"
    return Check("megatron-core", True, mcore, detail)


def _transformer_engine() -> Check:
    # TE changes which Adam Megatron builds, and makes model.layer_spec te (or auto on CUDA) possible.
    found = _version("transformer-engine") or _version("transformer-engine-torch")
    if found and importlib.util.find_spec("transformer_engine") is not None:
        return Check("transformer-engine", True, found, "Megatron's optimizer is TE's FusedAdam; model.layer_spec "
                     "te (or auto) builds TE's layers on CUDA")  # fmt: skip
    return Check("transformer-engine", False, None, "not installed",
                 "no TE FusedAdam: Megatron uses apex's or torch's Adam (same results); model.layer_spec te is "
                 f"refused (local runs); for TE: pip install '{_requirement('transformer-engine')}'")  # fmt: skip


def _apex() -> Check:
    if importlib.util.find_spec("apex") is not None:
        return Check("apex", True, _version("apex"), "Megatron's optimizer is apex's FusedAdam unless TE is installed")
    return Check("apex", False, None, "not installed", "no apex FusedAdam: TE's or torch's Adam is used (same results)")


def _flash_attn() -> Check:
    # megarl's attention is torch SDPA (megarl/models/attention.py), which has a flash kernel of its own.
    if importlib.util.find_spec("flash_attn") is not None:
        return Check("flash-attn", True, _version("flash-attn") or _version("flash_attn"), "installed; megarl does not use it")
    return Check("flash-attn", False, None, "not installed", "nothing: megarl's attention is torch SDPA")


def _compiler() -> Check:
    # torch.compile (inductor) and Triton build each kernel with a C compiler against Python.h.
    import sysconfig

    names = [shlex.split(os.environ["CC"])[-1]] if os.environ.get("CC") else ["cc", "gcc", "clang"]  # CC="ccache gcc"
    compiler = next((found for found in map(shutil.which, names) if found), None)
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    missing = [what for what, ok in ((f"a C compiler ({' / '.join(names)} on PATH)", compiler), (str(header), header.is_file()))
               if not ok]  # fmt: skip
    if not missing:
        return Check("C compiler", True, None, f"{compiler} and {header}: torch.compile and Triton can build kernels")
    return Check("C compiler", False, None, f"missing {' and '.join(missing)}",
                 "torch.compile / Triton cannot build kernels, which CUDA runs need (Megatron compiles its fused "
                 "bias-activation and bias-dropout functions, actor.packed_attention=flex its attention); install gcc "
                 "and this Python's headers (python3-dev)")  # fmt: skip


def _cxx_compiler() -> Check:
    # inductor writes the kernels of CPU tensors in C++ and builds them with $CXX, else g++ (clang++ on
    # macOS), which it runs as one program: CXX="ccache g++" does not work there.
    name = os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")
    compiler = shutil.which(name)
    if compiler:
        return Check("C++ compiler", True, None, f"{compiler}: torch.compile can build kernels for CPU tensors")
    source = f"CXX={name}" if os.environ.get("CXX") else name
    return Check("C++ compiler", False, None, f"missing a C++ compiler ({source} on PATH)",
                 "torch.compile cannot build kernels for CPU tensors (inductor writes them in C++; the CPU test of "
                 "actor.packed_attention=flex compiles on CPU); apt-get install g++, or set CXX to a C++ compiler")  # fmt: skip


def _sglang() -> Check:
    req = _requirement("sglang")
    if importlib.util.find_spec("sglang") is not None:
        found = _version("sglang")
        if found and req != "sglang" and _outside(req, found):
            return Check("sglang", False, found, f"importable here, but megarl supports {req}",
                         f"rollout.engine=sglang may fail: pip install '{req}'")  # fmt: skip
        return Check("sglang", True, found, "importable in this Python: rollout.server_python can stay unset")
    venv = _sglang_cpu_venv()
    where = (f"the venv `make sglang-cpu` built is {venv[0]} (sglang {venv[1]})" if venv
             else "`make sglang-cpu` builds one for CPU")  # fmt: skip
    return Check("sglang", False, None, "not importable in this Python",
                 "rollout.engine=sglang (the default) needs rollout.server_python=<an SGLang venv>/bin/python, "
                 f"or pip install -e '.[sglang]' here; {where}; rollout.engine=torch works without it")  # fmt: skip


def _sglang_cpu_venv() -> tuple[str, str] | None:
    """The interpreter of the `make sglang-cpu` venv and its sglang version (read from the venv's
    metadata, without running it), or None."""
    try:
        from megarl.rollout_sglang.cpu_venv import sglang_cpu_python
    except ImportError:  # a dependency is missing: doctor reports the rest
        return None
    python = sglang_cpu_python()
    if python is None:
        return None
    site = [str(p) for p in Path(python).parents[1].glob("lib/python3*/site-packages")]
    dist = next(iter(metadata.distributions(name="sglang", path=site)), None)
    return str(python), dist.version if dist else "?"


def _ray() -> Check:
    req = _requirement("ray")
    found = _version("ray")
    if found is None or importlib.util.find_spec("ray") is None:
        return Check("ray", False, found, "not installed", f"`megarl launch` (Ray drives every run): pip install '{req}'",
                     fatal=True)  # fmt: skip
    if _outside(req, found):
        return Check("ray", False, found, f"megarl needs {req}", f"`megarl launch`: pip install '{req}'", fatal=True)
    return Check("ray", True, found, "`megarl launch` without --address starts an embedded Ray")


def _ray_cluster() -> Check:
    """The cluster `megarl launch --address auto` would attach to, as Ray finds it: RAY_ADDRESS,
    else the address file the last `ray start` on this machine wrote. (Plain `megarl launch`
    ignores both: it always starts its own Ray.)"""
    from megarl.ray_cluster.address import find_cluster, unanswered

    found = find_cluster("auto")
    if found is None:
        return Check("ray cluster", True, None, "none running here: `--address auto` has nothing to attach to")
    source, address = found
    answer = unanswered(address)
    if answer is None:
        return Check("ray cluster", True, None, f"{address} (from {source}): `--address auto` attaches to it")
    fix = "correct or unset RAY_ADDRESS" if source == "RAY_ADDRESS" else f"remove {source}, which an earlier Ray left"
    return Check("ray cluster", False, None, f"{address} (from {source}) does not answer ({answer})",
                 f"`megarl launch --address auto`: start the cluster (`ray start --head`), or {fix}")  # fmt: skip


def _slurm() -> Check:
    if "SLURM_JOB_ID" not in os.environ:
        return Check("slurm", True, None, "not inside a Slurm job")
    found = " ".join(f"{k}={os.environ[k]}" for k in SLURM_VARS if k in os.environ)
    return Check("slurm", True, None, found)


if __name__ == "__main__":  # without the `megarl` CLI, whose other commands import more
    _parser = argparse.ArgumentParser(prog="python -m megarl.commands.doctor")
    register(_parser.add_subparsers(dest="command", required=True))
    sys.exit(run(_parser.parse_args(["doctor", *sys.argv[1:]])))
