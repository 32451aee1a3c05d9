"""Reading a run's metrics.jsonl, and what a resume can take back from the copy a checkpoint keeps
of it (megarl/checkpoint/run_record.py writes that copy with every save). The trainer's sink
(megarl/trainer/metric_sinks.py) restores and cuts the file; the resume check before Ray
(megarl/plan/resume_checks.py) asks :func:`unrepairable` so that a file the resume cannot mend is
refused before anything starts. Left out: writing records, which is the sink's."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
METRICS_FILE = "metrics.jsonl"


class MetricsFileError(ValueError):
    """A metrics.jsonl that cannot be read (a user-facing, one-line error): ``problem`` and its fix
    (or a message that says both)."""

    def __init__(self, problem: str, fix: str = ""):
        super().__init__(f"{problem}; {fix}" if fix else problem)
        self.problem = problem


def records(path: Path, *, quiet: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """Each line of a metrics.jsonl with its record (none when it does not exist). A cut-off last
    line (a run killed while writing it) is left out with a warning (``quiet``: without):
    resuming re-runs that step. A bad line elsewhere is not something a kill leaves, so it is an
    error naming the line."""
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.splitlines()
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append((line, json.loads(line)))
        except json.JSONDecodeError:
            if number == len(lines) and not text.endswith("\n"):
                if not quiet:
                    log.warning("%s: its last line is cut off (a run killed while writing it); it is left out", path)
                continue
            raise MetricsFileError(f"{path}:{number} is not a JSON record ({line[:40]!r}...)", "mend or delete that line") from None
    return out


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl (none when it does not exist); see :func:`records`."""
    return [record for _, record in records(path)]


def owns_history(path: Path, history: Path) -> bool:
    """Whether the checkpoint copy ``history`` (``<output_dir>/checkpoints/<step>/metrics.jsonl``)
    is of the run whose file is ``path`` (``<output_dir>/metrics.jsonl``): a resume from another
    run's checkpoint into a new output_dir starts its own metrics instead."""
    parents = history.absolute().resolve().parents
    return len(parents) > 2 and parents[2] == path.absolute().resolve().parent


def unrepairable(path: Path, history: Path | None) -> str | None:
    """Why resuming with the metrics.jsonl ``path`` would fail (a bad line, with no readable copy in
    the resumed checkpoint, ``history``, to take its place), or None. Reads, writes nothing."""
    try:
        records(path, quiet=True)
        return None
    except MetricsFileError as exc:
        problem = exc.problem
    if history is None or not history.is_file():
        return f"{problem}, and the resumed checkpoint keeps no copy of the file to take its place; mend or delete that line"
    try:
        records(history, quiet=True)
    except MetricsFileError as exc:
        return f"{problem}, and so is a line of the resumed checkpoint's copy ({exc.problem}); mend or delete those lines"
    return None
