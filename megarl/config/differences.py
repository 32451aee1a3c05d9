"""What differs between two nested settings (config dumps, job records, HF configs): one walker;
each caller words the differences for its own message."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

ABSENT: Any = type("Absent", (), {"__repr__": lambda self: "absent"})()  # the side of a key one dict lacks


def differences(old: dict[str, Any], new: dict[str, Any], *, whole: Collection[str] = (),
                prefix: str = "") -> dict[str, tuple[Any, Any]]:  # fmt: skip
    """Every dotted key whose value differs, with (old, new) (ABSENT for a side that lacks it), in
    the order the keys first appear. Dicts on both sides are walked, but for the dotted keys in
    ``whole``, which are compared (and told) as one value."""
    out: dict[str, tuple[Any, Any]] = {}
    for key in dict.fromkeys([*old, *new]):
        a, b = old.get(key, ABSENT), new.get(key, ABSENT)
        dotted = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict) and dotted not in whole:
            out |= differences(a, b, whole=whole, prefix=f"{dotted}.")
        elif a != b:
            out[dotted] = (a, b)
    return out
