"""Every command block of the manual (README.md, docs/*.md: a ```bash block, one with `$ `
lines, or a plain ``` block with a line that starts with a command such as `megarl plan`,
`make`, `python` or `sbatch`) says what it is, on the line before it: ``<!-- run by tests/unit/test_doc_commands.py -->``
(this test runs each of its `$ megarl ...` lines and compares the output the block shows, a
``...`` line standing for any lines, and the exit code: 2 where it shows an `error:`), or
``<!-- illustrative: why -->`` (it needs a GPU, a cluster, minutes, or files of the reader's own).
The site shows either mark as a note under the block's heading (docs/site_pages.py)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from megarl.cli import main

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = "<!-- run by tests/unit/test_doc_commands.py -->"
ILLUSTRATIVE = re.compile(r"<!-- illustrative: [^>]+ -->")
BLOCK = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", flags=re.S | re.M)
# A line of a plain block that is a command the reader types: a program and its first argument, not a
# message that starts with the program's name ("megarl demo: 500 steps ...", "error: ...").
COMMAND_LINE = re.compile(r"^\s*(?:megarl|make|python3?|pip|uv|sbatch|srun|bash|sh|docker|git|ray|torchrun|cd|export"
                          r"|\.venv/bin/\S+|launch/\S+|\./\S+) +(?!\S*: )\S", flags=re.M)  # fmt: skip


def command_blocks(page: Path) -> list[tuple[int, str, str]]:
    """(line number, the line before the block, the block's text) of each command block of ``page``."""
    text = page.read_text()
    blocks = []
    for m in BLOCK.finditer(text):
        shell = m.group(2) in ("bash", "sh", "shell", "console") or re.search(r"^\s*\$ ", m.group(3), flags=re.M)
        if shell or (m.group(2) in ("", "text") and COMMAND_LINE.search(m.group(3))):
            before = text[: m.start()].rstrip().splitlines()
            blocks.append((text.count("\n", 0, m.start()) + 1, before[-1].strip() if before else "", m.group(3)))
    return blocks


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_block_is_run_or_marked_illustrative(page: Path):
    unmarked = [line for line, mark, _ in command_blocks(page) if mark != RUN and not ILLUSTRATIVE.fullmatch(mark)]
    assert not unmarked, f"{page.name}: command blocks at lines {unmarked} need `{RUN}` or `<!-- illustrative: why -->` before them"


def _runs() -> list[tuple[str, str, list[str]]]:
    """(page:line, command, the output lines the block shows after it) of each `$ megarl` line of a block the test runs."""
    runs = []
    for page in PAGES:
        for line, mark, body in command_blocks(page):
            if mark != RUN:
                continue
            steps = re.split(r"^\$ ", body, flags=re.M)[1:]
            runs += [(f"{page.name}:{line}", s.split("\n", 1)[0], s.split("\n")[1:-1]) for s in steps if s.startswith("megarl ")]
    return runs


def _matches(shown: list[str], real: list[str]) -> bool:
    """``shown`` equals ``real``, each ``...`` line of ``shown`` standing for any number of lines."""
    pattern = "\n".join(".*?" if s.strip() == "..." else re.escape(s.rstrip()) for s in shown)
    return re.fullmatch(pattern.replace("\n.*?\n", "(?:\n.*?)?\n"), "\n".join(r.rstrip() for r in real), flags=re.S) is not None


def test_some_blocks_are_run():
    assert len(_runs()) >= 3


@pytest.mark.parametrize("where, command, shown", _runs(), ids=[r[0] for r in _runs()])
def test_run_blocks_show_what_the_command_prints(where, command, shown, tmp_path, monkeypatch, capsys):
    (tmp_path / "configs").symlink_to(ROOT / "configs")  # the block's relative paths, its outputs in tmp_path
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "200")
    code = main(shlex.split(command)[1:])
    out = capsys.readouterr()
    # stdout and stderr come apart here; the terminal shows them interleaved, warnings first
    orders = [(out.out + out.err).rstrip("\n").splitlines(), (out.err + out.out).rstrip("\n").splitlines()]
    assert any(_matches(shown, real) for real in orders), f"{where}: `{command}` prints\n" + "\n".join(orders[0])
    assert code == (2 if any(s.startswith("error:") for s in shown) else 0), f"{where}: `{command}` exited {code}"
