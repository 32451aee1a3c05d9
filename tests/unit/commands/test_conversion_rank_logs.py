"""`megarl convert`'s folder of rank logs (/tmp/megarl-convert-logs-*) after a failed conversion,
with a real conversion group of one rank in this process: kept when the error names a log in it
(a rank killed right after its start line: the file the line names must exist), or when a log
says more than its start line; removed otherwise."""

from __future__ import annotations

import logging
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


def test_a_ray_group_s_folder_of_logs_is_named_when_it_is_made(caplog, refused_port):
    """A `kill -9` of the command leaves the folder, and nothing can say so then: it is named as
    the group starts (here the cluster at --address does not answer, so no Ray starts; the folder,
    empty, goes)."""
    port = refused_port  # no cluster there
    caplog.set_level(logging.INFO, logger="megarl")
    with pytest.raises(ConnectionError):
        with _conversion_group(object, ConversionRanks(1, address=f"127.0.0.1:{port}"), (), "exporting"):
            pass
    named = [r.getMessage() for r in caplog.records if r.getMessage().startswith("the ranks' logs: ")]
    assert len(named) == 1, caplog.text
    folder = Path(named[0].removeprefix("the ranks' logs: ").split(" (")[0])
    assert folder.name.startswith("megarl-convert-logs-") and not folder.exists()
    assert named[0].endswith("(removed at the end unless a rank fails)")
