"""`megarl plot`: a run killed mid-write still plots, a corrupt line is named, --out is checked first."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.cli import EXIT_USER, main
from megarl.commands.curves import plot_run
from megarl.trainer.metric_sinks import JsonlSink

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def run(tmp_path: Path) -> Path:
    sink = JsonlSink(tmp_path / "run" / "metrics.jsonl")
    for step in range(1, 6):
        sink.log(step, {"reward/mean": step / 10, "actor/kl": 0.01 * step})
    sink.close()
    return tmp_path / "run"


def test_a_cut_off_last_line_is_left_out(run, caplog):
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "actor/clip')  # what a kill in the middle of a write leaves
    assert main(["plot", str(run)]) == 0
    assert (run / "curves.png").read_bytes()[:8] == PNG
    assert [r.levelname for r in caplog.records if "last line is cut off" in r.getMessage()] == ["WARNING"]


def test_a_corrupt_line_before_the_last_is_an_error_naming_it(run, capsys):
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join([*lines[:2], "garbage\n", *lines[2:]]))
    assert main(["plot", str(run)]) == EXIT_USER
    err = capsys.readouterr().err
    assert err.startswith(f"error: {run / 'metrics.jsonl'}:3 is not a JSON record") and err.count("\n") == 1


def test_an_out_format_matplotlib_cannot_write_is_refused_first(run, capsys):
    out = run / "notes.txt"
    assert main(["plot", str(run), "--out", str(out)]) == EXIT_USER
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out {out} has extension .txt; name an image file ending in one of: ")
    assert "png" in err and "pdf" in err and err.count("\n") == 1
    assert not out.exists()
    assert main(["plot", str(run), "--out", str(run)]) == EXIT_USER
    assert f"--out {run} is a directory" in capsys.readouterr().err


def test_an_existing_out_is_replaced_only_with_overwrite(run, capsys):
    out = run / "mine.png"
    out.write_bytes(b"my picture")
    assert main(["plot", str(run), "--out", str(out)]) == EXIT_USER
    assert capsys.readouterr().err == f"error: --out {out} exists; pass --overwrite to replace it, or give another path\n"
    assert out.read_bytes() == b"my picture"
    assert main(["plot", str(run), "--out", str(out), "--overwrite"]) == 0
    assert out.read_bytes()[:8] == PNG
    # the default RUN_DIR/curves.png is plot's own output: re-plotting replaces it
    assert plot_run(run) == plot_run(run) == run / "curves.png"
    assert plot_run(run, run / "curves.pdf").read_bytes()[:4] == b"%PDF"


def test_the_runs_metrics_file_is_taken_for_its_folder(run, capsys):
    assert main(["plot", str(run / "metrics.jsonl")]) == 0
    assert capsys.readouterr().out == f"{run / 'curves.png'}\n"
    assert (run / "curves.png").read_bytes()[:8] == PNG
    other = run / "notes.jsonl"  # another file: its folder may not be a run, whose curves.png plot replaces
    other.write_text((run / "metrics.jsonl").read_text())
    assert main(["plot", str(other)]) == EXIT_USER
    assert capsys.readouterr().err == (f"error: {other} is a file, not a run's folder or its metrics.jsonl; give the "
                                       "folder (trainer.output_dir or sft.output_dir)\n")


def test_a_file_with_none_of_the_drawn_metrics_is_one_error_line(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "foo": 1}\n')
    assert main(["plot", str(tmp_path)]) == EXIT_USER
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'metrics.jsonl'} has none of the metrics plot draws (reward/mean, ")
    assert err.count("\n") == 1 and "sft/val_loss)" in err
    assert not (tmp_path / "curves.png").exists()
