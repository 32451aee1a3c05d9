"""Where the TRL venv of bench/vs_trl.py lives; one definition for the build, the bench and its test.

``${MEGARL_CACHE:-$HOME/.cache/megarl}/trl-<key>``, ``<key>`` the first 16 hex digits of the
sha256 of requirements.lock beside this file. The build renames a finished venv into place, so
a path whose ``bin/python`` exists is a complete venv. Standard library only.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

LOCK = Path(__file__).resolve().parent / "requirements.lock"


def venv_path(lock: Path = LOCK) -> Path:
    cache = os.environ.get("MEGARL_CACHE") or os.path.join(Path.home(), ".cache", "megarl")
    return Path(cache) / f"trl-{hashlib.sha256(lock.read_bytes()).hexdigest()[:16]}"


if __name__ == "__main__":
    print(venv_path())
