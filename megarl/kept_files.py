"""Names for the files megarl keeps aside instead of replacing them (an earlier run's metrics, a
user's own config.yaml, the metric records a resume cuts): ``<stem>.<tag><suffix>`` beside the
file, never one that exists (two files kept in one second must not replace one another); and
the one way a small text file is replaced whole (``write_atomically``: a failed write, a full
disk's, leaves the old file and no temporary one)."""

from __future__ import annotations

import os
import time
from pathlib import Path


def kept_name(path: Path, tag: str) -> Path:
    """``<stem>.<tag><suffix>`` beside ``path``, or ``<stem>.<tag>-N<suffix>`` when that is taken."""
    kept, n = path.with_name(f"{path.stem}.{tag}{path.suffix}"), 1
    while kept.exists():
        kept, n = path.with_name(f"{path.stem}.{tag}-{n}{path.suffix}"), n + 1
    return kept


def kept_tag(name: str) -> str:
    """The tag of a name :func:`kept_name` made (``step_000004.abandoned-1`` -> ``abandoned``), for
    a name without a suffix; "" for any other name."""
    _, dot, rest = name.partition(".")
    return rest.rsplit("-", 1)[0] if dot and rest.rsplit("-", 1)[-1].isdigit() else rest


def time_tag(seconds: float | None = None) -> str:
    """A local-time tag for a kept file's name: now, or ``seconds`` (e.g. the file's mtime)."""
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(seconds))


def write_keeping(path: Path, text: str) -> Path | None:
    """Write ``text`` to ``path``; a file already there with other content is first kept as
    ``<stem>.<its mtime><suffix>`` (returned), so that a step trained again after a resume from an
    older checkpoint does not replace what the first history wrote. The same content is simply
    written again (an exact resume repeats it); returns None then."""
    kept = None
    if path.exists() and path.read_text() != text:
        kept = kept_name(path, time_tag(path.stat().st_mtime))
        os.rename(path, kept)
    write_atomically(path, text)
    return kept


def write_atomically(path: Path | str, text: str, mode: int | None = None) -> None:
    """Replace ``path``'s content in one rename: a crash or a kill leaves the old file or the new
    one, never a cut one (a temporary file of this process beside it, at worst). ``mode``: the
    new file's permissions (an executable script's 0o755), set before it takes the name."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        if mode is not None:
            tmp.chmod(mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk cut it: no half-written file left beside
        raise
