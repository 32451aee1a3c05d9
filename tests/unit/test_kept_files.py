"""Files megarl keeps aside instead of replacing them (megarl/kept_files.py)."""

from __future__ import annotations

import os

from megarl.kept_files import time_tag, write_keeping


def test_write_keeping_keeps_other_content_and_rewrites_the_same(tmp_path):
    path = tmp_path / "step_000003.jsonl"
    assert write_keeping(path, "first\n") is None and path.read_text() == "first\n"
    assert write_keeping(path, "first\n") is None  # an exact resume writes the same samples again
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    os.utime(path, (0, 0))
    kept = write_keeping(path, "second\n")  # the step trained again after going back
    assert kept is not None and kept.read_text() == "first\n" and path.read_text() == "second\n"
    assert kept.name == f"step_000003.{time_tag(0)}.jsonl"  # named by when the first one was written
    again = write_keeping(path, "third\n")
    assert again not in (None, kept) and again.read_text() == "second\n" and kept.read_text() == "first\n"


def test_write_atomically_replaces_the_whole_file_and_leaves_no_temporary(tmp_path):
    from megarl.kept_files import write_atomically

    path = tmp_path / "summary.json"
    path.write_text("old, longer content\n")
    write_atomically(path, "new\n")
    write_atomically(str(tmp_path / "fresh.txt"), "x")
    assert path.read_text() == "new\n" and (tmp_path / "fresh.txt").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh.txt", "summary.json"]
