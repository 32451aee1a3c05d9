"""Which megatron-core is installed, whether megarl can use it, and which one wrote a checkpoint.

megarl supports megatron-core 0.16 to 0.19 (docs/megatron.md says what differs). Two facts are
checked here, before anything imports ``megatron``:

- megatron-core >= 0.17 imports ``triton`` from ``megatron.core`` itself, unguarded; without
  triton the first Megatron import dies deep inside megatron-core. :func:`require_megatron_core`
  turns that into one line ("megatron-core 0.19.2 needs triton; pip install triton").
- Dist-checkpoints are not readable across versions backwards (0.16 cannot read what 0.19
  writes: 0.19 no longer writes ``common.pt``). :func:`write_checkpoint_versions` records the
  writer's versions next to the dist-checkpoint; :func:`check_checkpoint_readable` refuses a
  load under an older megatron-core with the version to use instead.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import warnings
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

SUPPORTED = ">=0.16,<0.20"  # the range pyproject.toml declares
_OLDEST, _NEWEST_TESTED = (0, 16), (0, 19)
_NEEDS_TRITON = (0, 17)  # the first megatron-core whose `import megatron.core` imports triton
VERSIONS_FILE = "megarl_versions.json"  # beside the dist-checkpoint's own metadata.json


def _minor(text: str) -> tuple[int, int]:
    """(major, minor) of a version string such as ``0.19.2`` or ``0.16.0rc0``."""
    parts = text.split(".")
    digits = ["".join(ch for ch in p if ch.isdigit()) or "0" for p in parts[:2]]
    return int(digits[0]), int(digits[1]) if len(digits) > 1 else 0


def installed_version() -> str | None:
    try:
        return version("megatron-core")
    except PackageNotFoundError:
        return None


def installed_minor() -> tuple[int, int] | None:
    """(major, minor) of the installed megatron-core, read without importing it; None when absent."""
    mcore = installed_version()
    return None if mcore is None else _minor(mcore)


def usability_error(mcore: str | None, has_triton: bool) -> str | None:
    """Why megarl cannot import this megatron-core (one line), or None when it can."""
    if mcore is None:
        return f"megatron-core is not installed; pip install 'megatron-core{SUPPORTED}'"
    if _minor(mcore) < _OLDEST:
        return f"megatron-core {mcore} is older than megarl supports; pip install 'megatron-core{SUPPORTED}'"
    if _minor(mcore) >= _NEEDS_TRITON and not has_triton:
        return (
            f"megatron-core {mcore} needs triton (megatron.core imports it); pip install triton, "
            f"or use megatron-core 0.16 (pip install 'megatron-core>=0.16,<0.17')"
        )
    return None


@functools.cache
def require_megatron_core() -> str:
    """The installed megatron-core version; raises ImportError (one line) when megarl cannot
    import it. Call before the first ``import megatron`` of a code path."""
    mcore = installed_version()
    error = usability_error(mcore, importlib.util.find_spec("triton") is not None)
    if error:
        raise ImportError(error)
    assert mcore is not None
    if _minor(mcore) > _NEWEST_TESTED:
        warnings.warn(
            f"megatron-core {mcore} is newer than megarl has been tested with ({SUPPORTED})",
            stacklevel=2,
        )
    return mcore


def write_checkpoint_versions(path: str | os.PathLike[str], **layout: int | str) -> None:
    """Record which megatron-core and torch wrote the dist-checkpoint in directory ``path``, and
    the ``layout`` values its state depends on (e.g. the gradient bucket size, the optimizer's format)."""
    import torch

    info = {"megatron_core": require_megatron_core(), "torch": torch.__version__} | layout
    (Path(path) / VERSIONS_FILE).write_text(json.dumps(info, indent=1) + "\n")


def checkpoint_record(path: str | os.PathLike[str]) -> dict:
    """What :func:`write_checkpoint_versions` recorded for ``path`` ({} for an older checkpoint)."""
    record = Path(path) / VERSIONS_FILE
    return json.loads(record.read_text()) if record.is_file() else {}


# The record's key of the distributed optimizer's checkpoint format (actor.optimizer.checkpoint_format
# at save), and the format of a training checkpoint without it: one written by a megarl that
# knew no other, or by the non-distributed optimizer (whose state no format change reshards).
OPTIMIZER_FORMAT_RECORD = "optimizer_format"
UNRECORDED_OPTIMIZER_FORMAT = "dp_reshardable"


# The record's key of whether the optimizer's state is keyed per parameter alone (True), not under
# the prefix of its member in Megatron's chain of optimizers (chained_0., chained_1.: an MoE model's
# dense and expert optimizers at ep > 1, one optimizer at ep 1). Only fully_reshardable state drops
# the prefix; a checkpoint without the record has it whenever it has a chain.
UNPREFIXED_OPTIMIZER_RECORD = "optimizer_state_unprefixed"


def checkpoint_optimizer_unprefixed(path: str | os.PathLike[str]) -> bool:
    """Whether the training checkpoint at ``path`` keys its optimizer state per parameter alone
    (see UNPREFIXED_OPTIMIZER_RECORD): then the chain of optimizers may differ at its load."""
    return bool(checkpoint_record(path).get(UNPREFIXED_OPTIMIZER_RECORD, False))


def checkpoint_optimizer_format(path: str | os.PathLike[str]) -> str:
    """The optimizer state's format in the training checkpoint at ``path``, as its save recorded."""
    return checkpoint_record(path).get(OPTIMIZER_FORMAT_RECORD, UNRECORDED_OPTIMIZER_FORMAT)


def checkpoint_version_error(path: str | os.PathLike[str], writer: str | None, reader: str) -> str | None:
    """Why megatron-core ``reader`` cannot load what ``writer`` wrote (one line), or None.

    A dist-checkpoint is loadable by the same or a newer megatron-core (0.19 reads 0.16's); an
    older one is refused (0.16 cannot read 0.19's). ``writer`` None: unknown, allowed."""
    if writer is None or _minor(reader) >= _minor(writer):
        return None
    major, minor = _minor(writer)
    upper = "" if writer.endswith("+") else f",<{major}.{minor + 1}"
    return (
        f"checkpoint {path} was written by megatron-core {writer} and cannot be read by the "
        f"installed megatron-core {reader}; load it with megatron-core {writer} "
        f"(pip install 'megatron-core>={major}.{minor}{upper}')"
    )


def checkpoint_writer(path: str | os.PathLike[str]) -> str | None:
    """The megatron-core version that wrote the dist-checkpoint in ``path``, as recorded; for a
    checkpoint without the record (written before megarl kept one), ``0.17+`` when it lacks the
    ``common.pt`` that 0.16 always writes, else None (unknown)."""
    recorded = checkpoint_record(path)
    if recorded:
        return recorded.get("megatron_core")
    return None if (Path(path) / "common.pt").is_file() else "0.17+"


def check_checkpoint_readable(path: str | os.PathLike[str]) -> None:
    """Raise ValueError when the installed megatron-core is older than the checkpoint's writer."""
    error = checkpoint_version_error(path, checkpoint_writer(path), require_megatron_core())
    if error:
        raise ValueError(error)
