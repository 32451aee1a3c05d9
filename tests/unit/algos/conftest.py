"""Make the loop references (algos_reference.py beside this file) importable under any pytest
import mode (``--import-mode=importlib`` does not put test directories on sys.path)."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
