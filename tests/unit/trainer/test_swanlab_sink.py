"""The swanlab logger (verl's trainer.logger=swanlab): on the real SDK offline where it is
installed (no account, no network), and one line where it is not."""

from __future__ import annotations

import sys

import pytest

from megarl.cli import user_error_line
from megarl.config.sections import TrainerConfig
from megarl.trainer.metric_sinks import SwanlabSink, build_logger


def test_swanlab_is_a_logger_and_missing_its_sdk_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "swanlab", None)  # as if not installed
    cfg = TrainerConfig(loggers=["swanlab"], output_dir=str(tmp_path))
    with pytest.raises(ImportError) as info:
        build_logger(cfg, {}, total_steps=2)
    assert str(info.value) == "trainer.loggers includes swanlab but swanlab is not installed: pip install swanlab"


def test_the_swanlab_sink_runs_on_the_real_sdk_offline(tmp_path, monkeypatch):
    pytest.importorskip("swanlab")
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # its settings and the login it does not need
    cfg = TrainerConfig(loggers=["swanlab"], output_dir=str(tmp_path), project="p", experiment="e")
    logger = build_logger(cfg, {"actor": {"optimizer": {"lr": 1e-6}}}, total_steps=2)
    logger.log(1, {"reward/mean": 0.5, "pass@8": 1.0})
    logger.close()
    run_id = (tmp_path / SwanlabSink.ID_FILE).read_text().strip()
    sink = SwanlabSink("p", "e", {}, tmp_path, resume_step=1)
    sink.log(2, {"reward/mean": 0.7})
    sink.close()
    assert run_id and (tmp_path / SwanlabSink.ID_FILE).read_text().strip() == run_id
    records = list((tmp_path / "swanlog").glob(f"run-*-{run_id}/run-{run_id}.swanlab"))
    assert records and b"reward/mean" in b"".join(r.read_bytes() for r in records), list((tmp_path / "swanlog").iterdir())


def test_swanlab_that_refuses_to_start_is_one_line(tmp_path, monkeypatch):
    """Whatever SwanLab raises at init (online, no key) ends the run as a user error naming the fixes."""
    import types

    def init(**_):
        raise RuntimeError("api key not configured\n(call swanlab.login())")

    monkeypatch.setitem(sys.modules, "swanlab", types.SimpleNamespace(init=init))
    with pytest.raises(Exception) as info:
        SwanlabSink("p", "e", {}, tmp_path)
    message = str(info.value)
    assert message.startswith("trainer.loggers includes swanlab, and SwanLab did not start a run (api key not configured")
    assert "\n" not in message and "SWANLAB_MODE=offline" in message and user_error_line(info.value) == message
