"""Where the SGLang CPU server's own Python is on this checkout (`make sglang-cpu` builds it).
Imports nothing heavy: `megarl doctor` asks it on machines without torch."""

from __future__ import annotations

from pathlib import Path


def sglang_cpu_python() -> Path | None:
    """The interpreter of the venv `make sglang-cpu` built for this checkout, if it exists
    (its path comes from ci/sglang-cpu/venv_path.py, the build's own definition)."""
    import importlib.util

    script = Path(__file__).resolve().parents[2] / "ci" / "sglang-cpu" / "venv_path.py"
    if not script.is_file():  # megarl installed without its repository
        return None
    spec = importlib.util.spec_from_file_location("megarl_sglang_cpu_venv_path", script)
    assert spec is not None and spec.loader is not None  # a .py file's: a source file loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    python = module.venv_path() / "bin" / "python"
    return python if python.exists() else None
