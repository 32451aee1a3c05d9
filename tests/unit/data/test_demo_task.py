"""The demo's reverse-digits data: disjoint split, full coverage, determinism, schema."""

from __future__ import annotations

from megarl.data.datasets import read_prompt_file
from megarl.data.tasks import REVERSE_DIGITS, reverse_digits_rows, write_reverse_digits


def _contents(rows):
    return [r["prompt"][0]["content"] for r in rows]


def test_split_is_disjoint_and_covers_every_string():
    train, val = reverse_digits_rows(num_digits=3, val_size=200, seed=0)
    train_s, val_s = _contents(train), _contents(val)
    assert len(train_s) == 800 and len(val_s) == 200
    assert not set(train_s) & set(val_s)
    assert sorted(train_s + val_s) == [f"{i:03d}" for i in range(1000)]


def test_rows_hold_the_reversed_string():
    train, _ = reverse_digits_rows(num_digits=3, val_size=10, seed=1)
    for r in train[:50]:
        s = r["prompt"][0]["content"]
        assert r["prompt"] == [{"role": "user", "content": s}]
        assert r["reward_model"] == {"ground_truth": s[::-1], "style": "rule"}
        assert r["data_source"] == REVERSE_DIGITS


def test_deterministic_from_the_seed():
    a = _contents(reverse_digits_rows(seed=4)[1])
    assert a == _contents(reverse_digits_rows(seed=4)[1])
    assert a != _contents(reverse_digits_rows(seed=5)[1])


def test_written_files_read_back_through_the_schema_checks(tmp_path):
    train_path, val_path = write_reverse_digits(tmp_path / "demo", num_digits=2, val_size=20, seed=0)
    train, val = read_prompt_file(train_path), read_prompt_file(val_path)
    assert (len(train), len(val)) == (80, 20)
    assert val[0].ground_truth == val[0].prompt[0]["content"][::-1]
    assert val[0].extra_info == {"split": "test", "index": 0}
