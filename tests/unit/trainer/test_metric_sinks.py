"""metrics.jsonl is cut back on resume; the plot reads it; phase timers add up."""

import json
import re
import time

import pytest

from megarl.checkpoint.metrics_history import read_metrics
from megarl.commands.curves import plot_run
from megarl.progress import PhaseTimer
from megarl.trainer.metric_sinks import JsonlSink, mlflow_name


def test_jsonl_resume_cuts_later_steps(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    for step in range(1, 6):
        sink.log(step, {"reward/mean": step / 10, "actor/kl": float("nan")})
    sink.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4, 5]
    assert read_metrics(path)[0]["actor/kl"] is None  # NaN is not valid JSON
    sink = JsonlSink(path, resume_step=3)
    sink.log(4, {"reward/mean": 0.9})
    sink.close()
    records = read_metrics(path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[-1]["reward/mean"] == 0.9
    assert list(json.loads(path.read_text().splitlines()[0]))[0] == "step"


def test_fresh_run_truncates(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n')
    JsonlSink(path).close()
    assert read_metrics(path) == []


def test_phase_timer_accumulates():
    timer = PhaseTimer()
    for _ in range(2):
        with timer.phase("generate"):
            time.sleep(0.01)
    assert timer.metrics()["time/generate_s"] >= 0.02


def test_plot_writes_png(tmp_path):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    for step in range(1, 11):
        metrics = {"reward/mean": step / 10, "actor/kl": 0.01 * step}
        if step % 5 == 0:
            metrics["val/reward/mean"] = step / 12
        sink.log(step, metrics)
    sink.close()
    png = plot_run(tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_refuses_empty_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_run(tmp_path)


def test_mlflow_names_hold_only_the_characters_mlflow_takes():
    """MLflow's own rule (mlflow.utils.validation: ``^[/\\w.\\- :]*$``, no ``:`` on Windows); a
    refused name raised at log time and stopped the run at that step."""
    assert mlflow_name("val/gsm8k(test)/pass@8") == "val/gsm8k_test_/pass_8"
    assert mlflow_name("val/数学/reward/mean") == "val/数学/reward/mean"  # \w is any letter
    assert mlflow_name("actor/grad_norm-x 1.0") == "actor/grad_norm-x 1.0"
    assert re.fullmatch(r"[/\w.\- ]*", mlflow_name("".join(map(chr, range(32, 127)))))
