"""`megarl data` replaces an existing output file only with --overwrite; `megarl demo` reuses its data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.cli import EXIT_USER, main
from megarl.data.datasets import read_prompt_file


def _gsm8k_input(tmp_path: Path) -> Path:
    src = tmp_path / "g.jsonl"
    src.write_text(json.dumps({"question": "What is 40+2?", "answer": "40+2=42\n#### 42"}) + "\n")
    return src


def _convert_argv(tmp_path: Path, out: Path) -> list[str]:
    csv = tmp_path / "qa.csv"
    csv.write_text("q,a\nhi,there\n")
    return ["data", "convert", str(csv), str(out), "--prompt-field", "q", "--answer-field", "a", "--data-source", "qa"]


def _math_argv(tmp_path: Path, out: Path) -> list[str]:
    src = tmp_path / "m.jsonl"
    src.write_text(json.dumps({"problem": "1+1?", "solution": "\\boxed{2}"}) + "\n")
    return ["data", "math", str(src), str(out)]


@pytest.mark.parametrize("argv", [
    lambda tmp, out: ["data", "gsm8k", str(_gsm8k_input(tmp)), str(out)],
    _math_argv,
    _convert_argv,
])  # fmt: skip
def test_an_existing_output_is_replaced_only_with_overwrite(tmp_path, capsys, argv):
    out = tmp_path / "out.parquet"
    out.write_text("precious")
    args = argv(tmp_path, out)
    assert main(args) == EXIT_USER
    err = capsys.readouterr().err
    assert err == f"error: {out} exists; pass --overwrite to replace it, or give another OUT.parquet\n"
    assert out.read_text() == "precious"
    assert main([*args, "--overwrite"]) == 0
    assert len(read_prompt_file(out)) == 1


def test_data_demo_refuses_existing_files_and_megarl_demo_reuses_them(tmp_path, capsys):
    from megarl.commands.demo import prepare_demo

    data = tmp_path / "data"
    assert main(["data", "demo", str(data), "--val-size", "100"]) == 0
    train, val = data / "train.parquet", data / "val.parquet"
    before = {p: p.stat().st_mtime_ns for p in (train, val)}
    capsys.readouterr()
    assert main(["data", "demo", str(data), "--val-size", "50"]) == EXIT_USER
    assert capsys.readouterr().err == f"error: {train} exists; pass --overwrite to replace it, or give another OUT_DIR\n"
    assert len(read_prompt_file(val)) == 100
    # `megarl demo` (make demo) re-run on the same root takes the data as it is
    assert prepare_demo(tmp_path)[1] == data
    assert {p: p.stat().st_mtime_ns for p in (train, val)} == before
    assert main(["data", "demo", str(data), "--val-size", "50", "--overwrite"]) == 0
    assert len(read_prompt_file(val)) == 50


def test_a_directory_is_not_an_output_file(tmp_path, capsys):
    out = tmp_path / "out.parquet"
    out.mkdir()
    assert main(["data", "gsm8k", str(_gsm8k_input(tmp_path)), str(out), "--overwrite"]) == EXIT_USER
    assert capsys.readouterr().err == f"error: {out} is a directory; give another OUT.parquet\n"


def test_an_output_folder_that_is_a_file_is_named_before_the_input_is_read(tmp_path, capsys):
    (tmp_path / "notes").write_text("the user's")
    out = tmp_path / "notes" / "x.parquet"
    assert main(_convert_argv(tmp_path, out)) == EXIT_USER
    assert capsys.readouterr().err == f"error: {out}: {tmp_path / 'notes'} is not a folder; give another path\n"
    assert (tmp_path / "notes").read_text() == "the user's"


@pytest.mark.parametrize("argv", [
    lambda tmp, out: ["data", "gsm8k", str(tmp / "missing.jsonl"), str(out)],
    lambda tmp, out: ["data", "math", str(tmp / "missing.jsonl"), str(out)],
    lambda tmp, out: ["data", "convert", str(tmp / "missing.csv"), str(out), "--prompt-field", "q",
                      "--answer-field", "a", "--data-source", "qa"],
])  # fmt: skip
def test_an_output_that_is_no_parquet_file_is_named_before_the_input_is_read(tmp_path, capsys, argv):
    out = tmp_path / "train.jsonl"  # the input is missing: a refusal of it would come first if it were read
    assert main(argv(tmp_path, out)) == EXIT_USER
    assert capsys.readouterr().err == f"error: {out}: the output must be a .parquet file; give OUT.parquet\n"
    assert not out.exists()
