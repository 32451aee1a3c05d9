"""A data.custom_cls class read slowly in the driver says where the read is, and a stop meanwhile
names the method it cut short (RunControl, real signals to the test process itself)."""

from __future__ import annotations

import logging
import os
import re
import signal
import textwrap
import threading

import pytest

from megarl import progress
from megarl.config.sections import CustomDatasetConfig, DataConfig
from megarl.data.stream import build_train_stream
from megarl.trainer.watchdog import RunControl

DATASET = textwrap.dedent(
    """
    import time

    class Slow:
        def __init__(self, data_files, tokenizer, config, processor=None):
            pass
        def __len__(self):
            return 12
        def __getitem__(self, i):
            time.sleep(0.05)
            return {"data_source": "gsm8k", "raw_prompt": [{"role": "user", "content": str(i)}],
                    "reward_model": {"ground_truth": "1"}}

    class Hangs(Slow):
        def __getitem__(self, i):
            if i == 3:
                time.sleep(600)
            return super().__getitem__(i)
    """
)


def _config(tmp_path, name: str) -> DataConfig:
    (tmp_path / "my_dataset.py").write_text(DATASET)
    (tmp_path / "train.jsonl").write_text("{}\n")
    return DataConfig(train_files=[str(tmp_path / "train.jsonl")], prompts_per_step=2, max_prompt_length=200,
                      custom_cls=CustomDatasetConfig(path=str(tmp_path / "my_dataset.py"), name=name))  # fmt: skip


def test_a_slow_read_says_where_it_is_and_when_it_is_done(tmp_path, byte_tokenizer, caplog, monkeypatch):
    monkeypatch.setattr(progress, "NOTE_FIRST_S", 0.1)
    monkeypatch.setattr(progress, "NOTE_EVERY_S", 0.1)
    with caplog.at_level(logging.INFO, logger="megarl.progress"):
        stream = build_train_stream(_config(tmp_path, "Slow"), byte_tokenizer)
    assert len(stream) == 12
    lines = [r.getMessage() for r in caplog.records if r.name == "megarl.progress"]
    ticks = [line for line in lines if re.fullmatch(r"data\.custom_cls Slow: reading rows \d+/12 \.\.\. \(\d+ s\)", line)]
    assert ticks, lines
    assert re.fullmatch(r"data\.custom_cls Slow: reading rows 12/12: done in \d+ s", lines[-1])


def test_a_quick_read_says_nothing(tmp_path, byte_tokenizer, caplog):
    with caplog.at_level(logging.INFO, logger="megarl.progress"):
        build_train_stream(_config(tmp_path, "Slow"), byte_tokenizer)  # 0.6 s, under the first line's 5 s
    assert not [r for r in caplog.records if r.name == "megarl.progress"]


def test_a_stop_while_a_row_hangs_names_the_row_and_how_long_it_ran(tmp_path, byte_tokenizer):
    control = RunControl()
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
    with control.handlers(), pytest.raises(KeyboardInterrupt):
        timer.start()
        build_train_stream(_config(tmp_path, "Hangs"), byte_tokenizer)
    timer.join()
    assert control.signal == signal.SIGTERM
    assert re.fullmatch(r" \(data\.custom_cls Hangs\.__getitem__\(3\) had run for \d+ s\)", control.meanwhile), control.meanwhile


def test_a_stop_outside_user_code_names_nothing():
    control = RunControl()
    with control.handlers(), pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Event().wait(5)
    assert control.meanwhile == ""
