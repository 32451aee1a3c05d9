"""The machine description every benchmark records next to its numbers."""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe() -> dict:
    """CPU, cores, GPU (if torch is importable and sees one), versions (Python, torch, megatron-core),
    load and date (UTC)."""
    info = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    try:
        import torch
    except ImportError:
        return info
    info |= {"torch": torch.__version__, "threads": torch.get_num_threads(),
             "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    try:  # what the model code runs on (its unfused kernels' shape changes between versions)
        from importlib.metadata import version

        info["megatron_core"] = version("megatron-core")
    except ImportError:
        pass
    return info
