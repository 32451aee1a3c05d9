"""Reading generated files (megarl/data/generated.py): what evaluate accepts and refuses."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.data.datasets import DataError
from megarl.data.generated import read_generated


def _write(path, **extra):
    rows = {"data_source": ["d", "d"], "prompt": ["p0", "p1"],
            "reward_model": [{"ground_truth": "1", "style": "rule"}, {"ground_truth": "2", "style": "rule"}]}  # fmt: skip
    pq.write_table(pa.table({**rows, **extra}), path)
    return path


def test_responses_with_and_without_the_optional_columns(tmp_path):
    full = read_generated(_write(tmp_path / "a.parquet", responses=[["x", "y"], ["z", "w"]], response_lengths=[[1, 2], [3, 4]],
                                 finish_reasons=[["stop", "length"], ["stop", "stop"]]))  # fmt: skip
    assert full.responses == [["x", "y"], ["z", "w"]] and full.lengths == [[1, 2], [3, 4]]
    assert [r.ground_truth for r in full.records] == ["1", "2"] and full.prompt_text is None
    bare = read_generated(_write(tmp_path / "b.parquet", responses=[["x"], ["y"]]))
    assert bare.lengths is None and bare.finish_reasons is None


def test_malformed_generated_files_name_row_and_column(tmp_path):
    with pytest.raises(DataError, match=r"no 'responses' column \(found: data_source, prompt, reward_model\)"):
        read_generated(_write(tmp_path / "a.parquet"))
    with pytest.raises(DataError, match="row 1, column 'responses': expected a non-empty list of strings, got \\[\\]"):
        read_generated(_write(tmp_path / "b.parquet", responses=[["x"], []]))
    with pytest.raises(DataError, match="row 0, column 'response_lengths': expected 2 token counts"):
        read_generated(_write(tmp_path / "c.parquet", responses=[["x", "y"], ["z"]], response_lengths=[[1], [1]]))


@pytest.mark.parametrize(("column", "values", "shown"), [
    ("response_lengths", [[1, 2], [3, None]], r"\[3, None\]"),  # the statistics stopped with a TypeError
    ("response_lengths", [[1.0, 2.0], [3.0, 1.5]], r"\[3.0, 1.5\]"),
    ("response_lengths", [[1, 2], [3, -1]], r"\[3, -1\]"),
    ("finish_reasons", [["stop", "stop"], ["stop", None]], r"\['stop', None\]"),
])  # fmt: skip
def test_null_or_odd_per_response_values_are_refused_naming_the_row(tmp_path, column, values, shown):
    with pytest.raises(DataError, match=rf"row 1, column '{column}': expected 2 (token counts|finish reasons) .*, got {shown}$"):
        read_generated(_write(tmp_path / "a.parquet", responses=[["x", "y"], ["z", "w"]], **{column: values}))
    whole = read_generated(_write(tmp_path / "b.parquet", responses=[["x", "y"], ["z", "w"]], response_lengths=[[1.0, 2.0], [3.0, 4.0]]))
    assert whole.lengths == [[1.0, 2.0], [3.0, 4.0]]  # a float column of whole counts (pandas beside a null) is fine
