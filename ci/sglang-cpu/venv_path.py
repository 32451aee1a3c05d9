"""Where the SGLang CPU venv of `make sglang-cpu` lives; one definition for the build and the tests.

``${MEGARL_CACHE:-$HOME/.cache/megarl}/sglang-cpu-<key>``, where ``<key>`` is the first 16 hex
digits of the sha256 of requirements.lock beside this file: a clean checkout with the same lock
finds the venv another checkout built, and editing the lock names a new one. The build renames
a finished venv into place, so a path whose ``bin/python`` exists is a complete venv.

Run as a script it prints the path (what build-venv.sh does); tests import :func:`venv_path`.
Standard library only: it runs under any Python 3.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

LOCK = Path(__file__).resolve().parent / "requirements.lock"


def lock_key(lock: Path = LOCK) -> str:
    return hashlib.sha256(lock.read_bytes()).hexdigest()[:16]


def venv_path(lock: Path = LOCK) -> Path:
    cache = os.environ.get("MEGARL_CACHE") or os.path.join(Path.home(), ".cache", "megarl")
    return Path(cache) / f"sglang-cpu-{lock_key(lock)}"


if __name__ == "__main__":
    print(venv_path())
