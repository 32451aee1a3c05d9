"""Refuse to run `make test-mcore-latest` against the wrong code: megarl must be the checkout's
(from PYTHONPATH, not an installed copy) and megatron-core the lock's version, with triton.

Usage: python check_env.py CHECKOUT_ROOT (exit 1 with a one-line reason otherwise).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def main(root: Path) -> int:
    from importlib.metadata import version

    import megarl

    lock = (Path(__file__).resolve().parent / "requirements.txt").read_text()
    wanted = re.search(r"^megatron-core==(\S+)$", lock, re.M)
    assert wanted is not None, "requirements.txt pins no megatron-core"
    where = Path(megarl.__file__).resolve()
    if root.resolve() not in where.parents:
        print(f"test-mcore-latest: megarl is imported from {where}, not the checkout {root}; "
              f"uninstall it from that venv", file=sys.stderr)
        return 1
    got = version("megatron-core")
    if got != wanted.group(1):
        print(f"test-mcore-latest: megatron-core {got} is installed, the lock pins {wanted.group(1)}; "
              f"remove the venv to rebuild it", file=sys.stderr)
        return 1
    import triton  # noqa: F401  (megatron-core >= 0.17 needs it)

    print(f"test-mcore-latest: megatron-core {got}, megarl from {where.parent}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
