"""`megarl convert`'s folder of rank logs (/tmp/megarl-convert-logs-*) after a failed conversion,
with a real conversion group of one rank in this process: kept when the error names a log in it
(a rank killed right after its start line: the file the line names must exist), or when a log
says more than its start line; removed otherwise."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from megarl.commands.conversion import ConversionRanks, _conversion_group
from megarl.rank_logs import START_LINE

START = START_LINE.format(rank=0, pid=1, name="ExportRank") + "\n"


class _Rank:
    """A rank that leaves ``log`` as its log and fails, naming it or not."""

    def __init__(self, log: str, named: bool, *, progress_file: str) -> None:
        path = Path(progress_file).parent / "policy_rank0.log"
        path.write_text(log)
        raise RuntimeError(f"policy rank 0 died during ExportRank.__init__ (log: {path})" if named else "placement failed")


@pytest.mark.parametrize(("log", "named", "kept"), [("", True, True), (START, True, True), (START + "Traceback ...\n", False, True),
                                                   (START, False, False)],
                         ids=["killed-before-its-start-line", "killed-after-it", "log-says-more", "start-line-only"])  # fmt: skip
def test_a_failed_conversion_keeps_the_rank_logs_its_error_names(log, named, kept):
    folders: list[Path] = []

    def make(*args: Any, progress_file: str) -> _Rank:
        folders.append(Path(progress_file).parent)
        return _Rank(*args, progress_file=progress_file)

    with pytest.raises(RuntimeError) as failed:
        with _conversion_group(make, ConversionRanks(1, in_process=True), (log, named), "exporting"):
            pass
    assert folders[0].exists() == kept, failed.value
    if named:
        assert str(folders[0] / "policy_rank0.log") in str(failed.value)
    shutil.rmtree(folders[0], ignore_errors=True)
