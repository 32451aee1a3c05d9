"""What a check of the planner reports: an :class:`Issue` names the field path, the values and a
fix; :class:`PlanError` carries every error issue of a refused config; a :class:`Finding` is the
preflight's report of a file or directory. Shared by the planner
(megarl/plan/planner.py), its rollout checks (megarl/plan/rollout_checks.py) and the commands
that run single checks of their own (`megarl generate`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Issue:
    field: str
    message: str
    level: str = "error"  # error | warning

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class PlanError(ValueError):
    """The config cannot run; ``issues`` lists every reason, and ``warnings`` what the plan would
    warn of once they are fixed (said now, with them: not one round of fixes later)."""

    def __init__(self, issues: list[Issue], warnings: list[Issue] | None = None):
        self.issues, self.warnings = issues, warnings or []
        super().__init__("the plan is refused:\n" + "\n".join(f"  - {i}" for i in issues) + self.warned())

    def warned(self) -> str:
        """The refusal's warnings, as its message ends with them ("" for none)."""
        return "\nand warns (not a refusal):\n" + "\n".join(f"  - {w}" for w in self.warnings) if self.warnings else ""


@dataclass(frozen=True)
class Finding:
    """What the preflight (megarl/plan/preflight.py) finds in the files and directories a config
    names: the field, the problem and its fix, an error or a warning."""

    field: str
    message: str
    level: str = "error"  # error | warning


def divisors(n: int) -> list[int]:
    """Every divisor of ``n``, ascending: the values a parallel size may take."""
    return [d for d in range(1, n + 1) if n % d == 0]


def choices(values: list[int]) -> str:
    """``1, 2, 4 or 8``: the values a fix suggests ("none" when there is none)."""
    values = list(values)
    if len(values) <= 1:
        return str(values[0]) if values else "none"
    return ", ".join(str(v) for v in values[:-1]) + f" or {values[-1]}"


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``1 process``, ``2 processes``: a count with its noun in the right number (``plural``: when
    it is not the noun + s)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
