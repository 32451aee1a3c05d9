"""What a data.custom_cls class prints while it is built and its rows read goes to the run's
user-code log, not the terminal; its error quotes the head of it."""

from __future__ import annotations

import textwrap

import pytest

from megarl.config.sections import CustomDatasetConfig, DataConfig
from megarl.data.datasets import DataError
from megarl.data.stream import build_train_stream
from megarl.user_code import user_output_to

DATASET = textwrap.dedent(
    """
    class Chatty:
        def __init__(self, data_files, tokenizer, config, processor=None):
            print("building from", len(data_files), "files")
        def __len__(self):
            return 2
        def __getitem__(self, i):
            print("row", i, "x" * 200_000)
            if i == 1 and self.__class__.__name__ == "Broken":
                raise KeyError("question")
            return {"data_source": "gsm8k", "raw_prompt": [{"role": "user", "content": str(i)}],
                    "reward_model": {"ground_truth": "1"}, "extra_info": {"i": i}}

    class Broken(Chatty):
        pass
    """
)


def _config(tmp_path, name: str) -> DataConfig:
    (tmp_path / "my_dataset.py").write_text(DATASET)
    (tmp_path / "train.jsonl").write_text("{}\n")
    return DataConfig(train_files=[str(tmp_path / "train.jsonl")], prompts_per_step=2, max_prompt_length=200,
                      custom_cls=CustomDatasetConfig(path=str(tmp_path / "my_dataset.py"), name=name))  # fmt: skip


def test_a_dataset_classs_prints_go_to_the_log(tmp_path, byte_tokenizer, capsys):
    log = tmp_path / "user_code.log"
    with user_output_to(log):
        stream = build_train_stream(_config(tmp_path, "Chatty"), byte_tokenizer)
        print("megarl: data ready")
    assert len(stream.next_batch().prompt_text) == 2
    assert capsys.readouterr().out == "megarl: data ready\n"
    assert log.read_text() == "building from 1 files\n" + "".join(f"row {i} {'x' * 200_000}\n" for i in range(2))


def test_a_dataset_classs_error_quotes_the_head_of_what_it_printed(tmp_path, byte_tokenizer, capsys):
    log = tmp_path / "user_code.log"
    with user_output_to(log), pytest.raises(DataError) as info:
        build_train_stream(_config(tmp_path, "Broken"), byte_tokenizer)
    assert capsys.readouterr().out == ""
    message = str(info.value)
    assert "KeyError: 'question'" in message and "it printed: 'building from 1 files\\nrow 0 xxx" in message
    assert message.endswith(f"... (all of it in {log})") and "\n" not in message
