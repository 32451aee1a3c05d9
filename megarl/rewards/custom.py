"""User reward functions loaded from a Python file (``reward.custom``), and their return values.

A per-sample function has verl's signature::

    def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

and a batched one (``reward.custom.batched: true``) takes lists and returns a list::

    def compute_score(data_sources, solution_strs, ground_truths, extra_infos) -> list[float | dict]

A dict return needs a "score"; its other numeric keys become extra metrics, and a "pred" (the
answer the function extracted, verl's convention) is kept as text for majority voting (maj@k in
megarl/evaluation.py). Loading happens in
the reward workers (user code never runs in the trainer process); the scorer checks once at
start that the file loads and the name is a function, so a typo fails before training starts.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

Scored = tuple[float, dict[str, Any]]  # (score, extra metrics of this sample; "pred" as a string)


def load_function(path: str, name: str, field: str = "reward.custom") -> Callable[..., Any]:
    """Import ``path`` as a module and return its callable ``name``; errors name the field
    (``reward.custom``, or the ``reward.functions[...]`` entry) and the fix."""
    path_field, name_field = (f"{field}.path", f"{field}.name") if field == "reward.custom" else (field, field)
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(
            f"{path_field}: {path!r} is not a file; give the path of a Python file"
        )
    module_name = "megarl_reward_" + hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:12]
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, file)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # raises the user's own import errors, with their traceback
        sys.modules[module_name] = module
    module = sys.modules[module_name]
    fn = getattr(module, name, None)
    if not callable(fn):
        defined = sorted(
            k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
        )
        raise AttributeError(
            f"{name_field}: {name!r} is not a function in {path}; functions defined there: "
            f"{', '.join(defined) or 'none'}"
        )
    return fn


def to_scored(value: Any, where: str) -> Scored:
    """A reward function's return (number or {"score": ..., other metrics}) as (score, extras)."""
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"{where} returned a dict without 'score' (keys: {sorted(value)})")
        extras: dict[str, Any] = {str(k): float(v) for k, v in value.items() if k not in ("score", "pred") and _is_number(v)}
        if value.get("pred") is not None:
            extras["pred"] = str(value["pred"])
        return _finite(value["score"], where), extras
    return _finite(value, where), {}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) or (
        hasattr(value, "item") and getattr(value, "ndim", 1) == 0
    )


def _finite(value: Any, where: str) -> float:
    if not _is_number(value):
        raise TypeError(
            f"{where} returned {type(value).__name__} {str(value)[:80]!r}; return a float or a dict with 'score'"
        )
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"{where} returned a non-finite score {score}")
    return score
