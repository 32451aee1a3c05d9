"""Where the SGLang CPU server's own Python is on this checkout (`make sglang-cpu` builds it).
Imports nothing heavy: `megarl doctor` asks it on machines without torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any


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


def with_cpu_server_python(cfg: Any) -> Any:
    """``cfg`` (a MegaRLConfig) with ``rollout.server_python`` set to the venv `make sglang-cpu`
    built, as `megarl demo` sets it, when it runs SGLang servers on CPU (the rollout's or the
    judge's) and names no interpreter; unchanged otherwise (and when no such venv exists: the
    server check then says how to build one)."""
    judge = cfg.reward.judge
    sglang = cfg.rollout.engine == "sglang" or (judge is not None and judge.engine == "sglang")
    if not sglang or cfg.cluster.device != "cpu" or cfg.rollout.server_python is not None:
        return cfg
    python = sglang_cpu_python()
    if python is None:
        return cfg
    return cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"server_python": str(python)})})
