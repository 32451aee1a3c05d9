"""The trainer-facing stream: config -> checked files -> PromptBatch per step -> rollout samples."""

from __future__ import annotations

import json

import pytest

from megarl.config.sections import DataConfig
from megarl.data.datasets import DataError
from megarl.data.stream import build_train_stream, load_val_prompts


def _digits(n: int, width: int = 3) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": str(i).zfill(width)}] for i in range(n)]


def _config(**kw) -> DataConfig:
    base = dict(prompts_per_step=4, max_prompt_length=16, seed=5)
    return DataConfig(**(base | kw))


def test_stream_yields_aligned_prompt_batches(prompt_file, digit_tokenizer):
    a = prompt_file("a.parquet", _digits(6), source="a", truths=[f"t{i}" for i in range(6)])
    b = prompt_file("b.parquet", _digits(3), source="b")
    stream = build_train_stream(_config(train_files=[{"path": str(a), "weight": 1}, {"path": str(b), "weight": 1}]), digit_tokenizer)
    batch = stream.next_batch()
    assert len(batch) == 4 and batch.step == 0 and stream.step == 1
    assert sorted(batch.file_index) == [0, 0, 1, 1]
    for i in range(4):
        source = "ab"[batch.file_index[i]]
        row = batch.index[i]
        assert batch.data_source[i] == source
        assert batch.prompt_text[i] == f"<|im_start|>{str(row).zfill(3)}<|im_end|><|im_start|>"
        assert batch.prompt_ids[i] == digit_tokenizer(batch.prompt_text[i], add_special_tokens=False)["input_ids"]
        assert batch.extra_info[i] == {"index": row}
        if source == "a":
            assert batch.ground_truth[i] == f"t{row}"


def test_filter_overlong_drops_at_load_and_reports(prompt_file, digit_tokenizer):
    # template adds 3 tokens: "12" -> 5 tokens, "1234" -> 7 tokens
    path = prompt_file("mix.parquet", ["12", "1234", "34", "123456", "5"])
    stream = build_train_stream(_config(train_files=[str(path)], max_prompt_length=6), digit_tokenizer)
    assert len(stream) == 3
    assert stream.load_report() == {"data/train_rows_read": 5.0, "data/train_prompts": 3.0, "data/train_dropped_overlong": 2.0}
    rows = {r for _ in range(3) for r in stream.next_batch().index}
    assert rows == {0, 2, 4}


def test_a_run_of_epochs_counts_the_prompts_kept_and_refuses_a_longer_critic_warmup(prompt_file, digit_tokenizer):
    from pathlib import Path

    from megarl.config.loading import load_config
    from megarl.plan.planner import PlanError
    from megarl.trainer.build import _total_steps

    path = prompt_file("mix.parquet", ["12", "1234", "34", "123456", "5"])  # 3 of 5 kept at max_prompt_length 6

    def config(warmup: int):
        tiny = Path(__file__).resolve().parents[3] / "configs" / "tiny_grpo.yaml"
        return load_config(tiny, [f"data.train_files=[{path}]", "data.max_prompt_length=6", "data.prompts_per_step=1",
                                  "trainer.total_steps=null", "trainer.total_epochs=2", f"trainer.critic_warmup_steps={warmup}"])

    stream = build_train_stream(config(5).data, digit_tokenizer)
    assert _total_steps(config(5), stream) == 6
    # The files' 5 rows would allow 10 steps (the pre-launch bound); the 3 kept make 6.
    with pytest.raises(PlanError, match=r"critic_warmup_steps: \(6\) must be below the run's 6 steps \(trainer.total_epochs 2 "
                       r"x 3 steps per epoch over 3 training prompts\)"):
        _total_steps(config(6), stream)


def test_without_filtering_truncation_applies_when_drawn(prompt_file, digit_tokenizer):
    path = prompt_file("long.parquet", ["123456"])
    cfg = _config(train_files=[str(path)], max_prompt_length=6, filter_overlong_prompts=False, prompts_per_step=1)
    left = build_train_stream(cfg.model_copy(update={"truncation": "left"}), digit_tokenizer).next_batch()
    assert len(left.prompt_ids[0]) == 6 and left.prompt_text[0] == "3456<|im_end|><|im_start|>"
    with pytest.raises(DataError, match=r"data.train_files\[0\] \(long.parquet\): row 0: the prompt has 9 tokens"):
        build_train_stream(cfg, digit_tokenizer).next_batch()


def test_every_prompt_overlong_is_an_error(prompt_file, digit_tokenizer):
    path = prompt_file("all_long.parquet", ["123456", "654321"])
    with pytest.raises(DataError, match=r"data.train_files\[0\] \(all_long.parquet\): no usable prompts, all 2 prompts are longer"):
        build_train_stream(_config(train_files=[str(path)], max_prompt_length=4), digit_tokenizer)


def test_stream_resume_is_exact_across_epochs(prompt_file, digit_tokenizer):
    a = prompt_file("a.parquet", _digits(7))
    b = prompt_file("b.parquet", _digits(5))
    cfg = _config(train_files=[{"path": str(a), "weight": 3}, {"path": str(b), "weight": 1}], prompts_per_step=3)

    def batches(stream, n):
        return [(b.prompt_ids, b.index, b.file_index, b.step) for b in (stream.next_batch() for _ in range(n))]

    full = batches(build_train_stream(cfg, digit_tokenizer), 9)  # 27 prompts > 12 rows: >2 epochs
    first = build_train_stream(cfg, digit_tokenizer)
    batches(first, 4)  # stop mid-epoch (12 prompts drawn out of 7 + 5, unevenly per file)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = build_train_stream(cfg, digit_tokenizer)
    resumed.load_state_dict(state)
    assert batches(resumed, 5) == full[4:]


def test_val_prompts_come_whole_in_file_order(prompt_file, digit_tokenizer):
    v1 = prompt_file("v1.parquet", _digits(3), source="v1")
    v2 = prompt_file("v2.parquet", _digits(2), source="v2")
    val = load_val_prompts(_config(val_files=[str(v1), str(v2)]), digit_tokenizer)
    assert val is not None and val.step == -1
    assert list(zip(val.file_index, val.index, strict=True)) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert val.data_source == ["v1"] * 3 + ["v2"] * 2
    assert val.select([4, 0]).data_source == ["v2", "v1"]
    assert load_val_prompts(_config(), digit_tokenizer) is None
