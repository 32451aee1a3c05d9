"""`megarl data ...` through argparse, as the main CLI registers it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from megarl.commands.data import register


def _run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="megarl")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(list(argv))
    return args.handler(args)


def test_every_data_subcommand_has_help(capsys):
    for name in ("gsm8k", "math", "convert", "inspect", "demo"):
        with pytest.raises(SystemExit) as done:
            _run("data", name, "--help")
        assert done.value.code == 0
        assert "usage: megarl data " + name in capsys.readouterr().out


def test_demo_then_inspect_in_characters(tmp_path, capsys):
    assert _run("data", "demo", str(tmp_path), "--val-size", "100") == 0
    assert (tmp_path / "train.parquet").is_file() and (tmp_path / "val.parquet").is_file()
    capsys.readouterr()
    assert _run("data", "inspect", str(tmp_path / "val.parquet")) == 0
    out = capsys.readouterr().out
    assert f"{tmp_path / 'val.parquet'}: 100 rows" in out
    assert "  reverse_digits: 100" in out
    assert "prompt length (characters): p50=3  p90=3  p99=3  max=3  mean=3" in out
    assert "prompt: list<element: struct<role: string, content: string>>" in out


@pytest.mark.parametrize(("where", "expected"), [("nope", " does not exist; give an HF model (or tokenizer) directory"),
                                                ("empty", ": cannot load a tokenizer from it (")])
def test_a_tokenizer_path_that_holds_none_is_one_line(tmp_path, where, expected, capsys):
    (tmp_path / "empty").mkdir()
    assert _run("data", "demo", str(tmp_path / "d"), "--val-size", "10") == 0
    capsys.readouterr()
    assert _run("data", "inspect", str(tmp_path / "d" / "val.parquet"), "--tokenizer", str(tmp_path / where)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --tokenizer {tmp_path / where}{expected}") and err.count("\n") == 1, err


def test_inspect_percentiles_in_tokens(prompt_file, byte_tokenizer_dir, capsys):
    path = prompt_file("lens.parquet", ["x" * n for n in range(1, 101)], source="s")
    assert _run("data", "inspect", str(path), "--tokenizer", str(byte_tokenizer_dir), "--raw", "--max-prompt-length", "95", "--json") == 0
    summary = json.loads(capsys.readouterr().out)
    # ASCII under the byte-level tokenizer: one token per character, lengths 1..100
    assert summary["length_unit"] == "tokens"
    assert summary["lengths"] == {"p50": 50.0, "p90": 90.0, "p99": 99.0, "max": 100.0, "mean": 50.5}
    assert summary["over_limit"] == 5 and summary["rows"] == 100
    # With the chat template every prompt gains the same ChatML overhead.
    assert _run("data", "inspect", str(path), "--tokenizer", str(byte_tokenizer_dir), "--json") == 0
    templated = json.loads(capsys.readouterr().out)["lengths"]
    overhead = templated["max"] - 100
    assert overhead > 0 and templated["p50"] == 50 + overhead


def test_gsm8k_and_convert_commands(tmp_path, capsys):
    src = tmp_path / "g.jsonl"
    src.write_text(json.dumps({"question": "q", "answer": "#### 3"}) + "\n")
    assert _run("data", "gsm8k", str(src), str(tmp_path / "out" / "g.parquet")) == 0
    assert "wrote 1 rows" in capsys.readouterr().out
    csv = tmp_path / "qa.csv"
    csv.write_text("q,a\nhi,there\n")
    argv = ["data", "convert", str(csv), str(tmp_path / "qa.parquet"), "--prompt-field", "q", "--answer-field", "a", "--data-source", "qa"]
    assert _run(*argv) == 0
    assert _run("data", "inspect", str(tmp_path / "qa.parquet")) == 0
    assert "  qa: 1" in capsys.readouterr().out


def test_gsm8k_tools_writes_the_tool_agent_variant_the_shipped_config_trains_on(tmp_path, capsys):
    from megarl.config.loading import load_config
    from megarl.data.datasets import read_prompt_file
    from megarl.plan.planner import make_plan
    from megarl.rollout.agents.tools import load_tools

    src = tmp_path / "g.jsonl"
    src.write_text(json.dumps({"question": "What is 2+3?", "answer": "2+3=5\n#### 5"}) + "\n")
    assert _run("data", "gsm8k", "--tools", str(src), str(tmp_path / "g.parquet")) == 0
    (record,) = read_prompt_file(tmp_path / "g.parquet")
    assert record.agent_name == "tool_agent" and record.ground_truth == "5"
    assert record.prompt[0]["role"] == "system" and "calculator" in record.prompt[0]["content"]
    root = Path(__file__).resolve().parents[3]
    cfg = load_config(root / "configs" / "gsm8k_tool_agent.yaml", [])
    assert make_plan(cfg).memory is not None  # the shipped tool-agent config plans (a refusal raises)
    (tool,) = load_tools(root / cfg.rollout.agent.tools_file).values()
    assert tool.name == "calculator" and tool.execute("i", {"expression": "(48 / 2) + 48"}) == "72"


def test_bad_input_exits_2_with_a_located_message(tmp_path, capsys):
    src = tmp_path / "m.jsonl"
    src.write_text(json.dumps({"problem": "p", "solution": "s"}) + "\n")
    assert _run("data", "math", str(src), str(tmp_path / "m.parquet")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: m.jsonl: line 1: field 'solution' has no complete \\boxed{...} answer")
    assert not (tmp_path / "m.parquet").exists()
    assert _run("data", "inspect", str(tmp_path / "nothing.parquet")) == 2
    assert "does not exist" in capsys.readouterr().err


def test_inspect_cuts_the_long_texts_of_the_first_row(tmp_path, capsys):
    src = tmp_path / "long.jsonl"
    src.write_text(json.dumps({"q": "x" * 5000, "a": "42"}) + "\n")
    argv = ["data", "convert", str(src), str(tmp_path / "long.parquet"), "--prompt-field", "q", "--answer-field", "a",
            "--data-source", "qa"]  # fmt: skip
    assert _run(*argv) == 0
    capsys.readouterr()
    assert _run("data", "inspect", str(tmp_path / "long.parquet")) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("first row:")]
    assert "x" * 200 + "... [4800 more characters]" in line and "x" * 201 not in line
    assert line.endswith("ground_truth='42'") and len(line) < 400
    assert "max=5000" in out  # the lengths are the whole prompt's


def test_inspect_of_a_file_with_no_rows_says_training_refuses_it(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "empty.parquet"
    truth = pa.struct([("ground_truth", pa.string())])
    columns = {"data_source": pa.array([], pa.string()), "prompt": pa.array([], pa.string()), "reward_model": pa.array([], truth)}
    pq.write_table(pa.table(columns), path)
    assert _run("data", "inspect", str(path)) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"{path}: 0 rows  (megarl launch refuses a file with no rows)"
