"""docs/migrating-from-verl.md (and docs/agents.md's multi-turn table) are generated from the mapping
`megarl config --from-verl` uses, and its worked example is the command's real output."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megarl.cli import main
from megarl.config.verl_doc import PAGES, generated
from tests.unit.config.test_from_verl import GRPO_GSM8K

DOCS = Path(__file__).resolve().parents[3] / "docs"


@pytest.mark.parametrize("name", sorted(PAGES))
def test_generated_part_is_the_mapping(name: str):
    shown = generated((DOCS / name).read_text())
    assert shown, f"docs/{name} lost its generated part"
    assert shown == PAGES[name](), f"docs/{name} and megarl/config/verl_keys.py differ: run `python -m megarl.config.verl_doc`"


def test_worked_example_is_the_commands_output(tmp_path: Path, monkeypatch, capsys):
    text = (DOCS / "migrating-from-verl.md").read_text()
    script = re.search(r"```bash\n(set -x\n.*?)```", text, flags=re.S)
    assert script is not None and script.group(1) == GRPO_GSM8K  # the same script the translation tests read
    shown = text.split("$ HOME=/home/user megarl config --from-verl run_qwen2-7b.sh --out megarl.yaml\n", 1)[1]
    shown = shown[: shown.index("```")]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", "/home/user")
    (tmp_path / "run_qwen2-7b.sh").write_text(GRPO_GSM8K)
    assert main(["config", "--from-verl", "run_qwen2-7b.sh", "--out", "megarl.yaml"]) == 0
    assert capsys.readouterr().out == shown
    assert main(["plan", "megarl.yaml"]) == 0
