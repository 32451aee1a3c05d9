"""Test folders whose helper modules (run_helpers.py; tests/distributed has its own) are imported by
plain name: put them on sys.path (``--import-mode=importlib`` does not)."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
for _folder in ("e2e",):
    _path = os.path.join(_HERE, _folder)
    if _path not in sys.path:
        sys.path.insert(0, _path)
