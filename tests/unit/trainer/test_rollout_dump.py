"""trainer.rollout_data_dir (verl's trainer.rollout_data_dir): every training step's samples as
<dir>/<step>.jsonl, one line per sample with verl's fields (input, output, gts, score, step) and
megarl's (data_source, advantage, ...), written in a thread of its own by the controller, the last
file finished at close; the step's loop calls it with the step's scored, advantaged batch."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megarl.config.sections import MegaRLConfig
from megarl.data.batch import Batch
from megarl.trainer.loop import Components, Trainer
from megarl.trainer.phases import Skip
from megarl.trainer.sample_files import RolloutDump


def _batch() -> Batch:
    return Batch(prompt_ids=torch.ones(4, 2, dtype=torch.long), prompt_mask=torch.ones(4, 2, dtype=torch.long),
                 response_ids=torch.tensor([[5, 6, 0], [7, 0, 0], [5, 5, 5], [6, 0, 0]]),
                 response_lengths=torch.tensor([2, 1, 3, 1]),
                 response_mask=torch.tensor([[1.0, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]]),
                 group_id=torch.tensor([0, 0, 1, 1]), data_source=["gsm8k", "gsm8k", "math", "math"],
                 ground_truth=["1", "1", "2", "2"], finish_reason=["stop", "stop", "length", "stop"],
                 prompt_text=["q0", "q0", "q1", "q1"], scores=torch.tensor([1.0, 0.0, 0.5, 0.5]))  # fmt: skip


def _texts(batch: Batch) -> list[str]:
    return [" ".join(map(str, ids[:n])) for ids, n in zip(batch.response_ids.tolist(), batch.response_lengths.tolist())]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_step_is_one_file_of_one_line_per_sample_with_verls_fields(tmp_path):
    dump = RolloutDump(tmp_path / "rollouts", _texts)
    adv = torch.tensor([[0.5, 0.5, 9.0], [-0.5, 9, 9], [0.0, 0, 0], [1.0, 9, 9]])  # 9: past the response
    dump(_batch().replace(advantages=adv), 3)
    dump(_batch(), 4)
    dump.close()  # finishes the last step's file
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == ["3.jsonl", "4.jsonl"]
    rows = _lines(tmp_path / "rollouts" / "3.jsonl")
    assert rows[0] == {"step": 3, "input": "q0", "output": "5 6", "gts": "1", "score": 1.0, "data_source": "gsm8k",
                       "advantage": 0.5, "response_length": 2, "finish_reason": "stop"}  # fmt: skip
    assert [r["advantage"] for r in rows] == [0.5, -0.5, 0.0, 1.0] and [r["output"] for r in rows][2] == "5 5 5"
    assert {r["advantage"] for r in _lines(tmp_path / "rollouts" / "4.jsonl")} == {None}


def test_the_decode_runs_in_the_step_and_the_write_in_the_dumps_thread(tmp_path, monkeypatch):
    """The controller's tokenizer decodes on the step's thread (an HF fast tokenizer used from two
    threads at once can refuse); the file is written by the dump's thread, and close waits for it."""
    import megarl.trainer.sample_files as sample_files

    decoders, writers = [], []
    write = sample_files.write_sample_rows

    def texts(batch: Batch) -> list[str]:
        decoders.append(threading.current_thread().name)
        return _texts(batch)

    def recorded_write(*args, **kwargs):
        writers.append(threading.current_thread().name)
        return write(*args, **kwargs)

    monkeypatch.setattr(sample_files, "write_sample_rows", recorded_write)
    dump = RolloutDump(tmp_path, texts)
    dump(_batch(), 1)
    dump.close()
    assert decoders == [threading.current_thread().name] and writers[0].startswith("rollout-dump")
    assert (tmp_path / "1.jsonl").exists()


def test_a_failed_write_stops_the_run_naming_the_key(tmp_path):
    (tmp_path / "file").write_text("")
    dump = RolloutDump(tmp_path / "file" / "under_a_file", _texts)
    dump(_batch(), 1)
    with pytest.raises(RuntimeError, match=r"trainer.rollout_data_dir=.*under_a_file: writing a step's rollouts failed"):
        dump(_batch(), 2)
    dump.close()


def test_the_step_hands_its_advantaged_batch_to_the_dump(tmp_path):
    cfg = MegaRLConfig(model={"arch": "qwen3-8b"}, trainer={"output_dir": str(tmp_path / "run"),
                                                            "rollout_data_dir": str(tmp_path / "dump")})  # fmt: skip
    adv = torch.full((4, 3), 0.25)
    rollouts = SimpleNamespace(batch=lambda step, params, timer: (_batch(), {}), push=lambda push, version: {},
                               metrics=lambda batch: {})  # fmt: skip
    dump = RolloutDump(cfg.trainer.rollout_data_dir, _texts)
    parts = Components(data=None, val_prompts=None, engines=None, generate=None, scorer=None, rollouts=rollouts,  # type: ignore[arg-type]
                       baseline=SimpleNamespace(scores=lambda batch, params: None), old_logprobs=Skip(),
                       reference=Skip(), critic=Skip(), policy=Skip(), weight_push=None,
                       advantages=lambda batch, baseline: (batch.replace(advantages=adv), {}),
                       models={}, total_steps=2, rollout_dump=dump)  # fmt: skip
    Trainer(cfg, parts, None).rl_step(2)
    dump.close()
    rows = _lines(tmp_path / "dump" / "2.jsonl")
    assert len(rows) == 4 and {r["step"] for r in rows} == {2} and {r["advantage"] for r in rows} == {0.25}


def test_a_relative_directory_is_the_launch_directorys(tmp_path, monkeypatch):
    """Relative to the directory the run was launched from (as trainer.output_dir), fixed when the
    dump is made: a later change of the working directory does not move the files."""
    monkeypatch.chdir(tmp_path)
    dump = RolloutDump("rollouts", _texts)
    assert dump.directory == tmp_path / "rollouts"
    monkeypatch.chdir(tmp_path.parent)
    dump(_batch(), 1)
    dump.close()
    assert (tmp_path / "rollouts" / "1.jsonl").is_file()
