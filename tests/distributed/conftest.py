"""Make this folder's helpers (spawn.py, *_cases.py) importable by plain name in any pytest
import mode (``--import-mode=importlib`` does not put test folders on sys.path)."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
