"""`megarl evaluate`'s checks before scoring (the scoring itself runs in
tests/e2e/test_generate_evaluate.py)."""

from __future__ import annotations

import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.commands.evaluate import evaluate
from megarl.config import preflight
from megarl.evaluation import EvaluationError


def test_a_reward_file_that_hangs_at_import_is_refused_in_bounded_time(tmp_path, monkeypatch):
    data = tmp_path / "gen.parquet"
    pq.write_table(pa.table({"prompt": ["2+2?"], "data_source": ["mine"], "reward_model": [{"ground_truth": "4"}],
                             "responses": [["4", "5"]]}), data)  # fmt: skip
    hangs = tmp_path / "hangs.py"
    hangs.write_text("import time\ntime.sleep(10000)\n\ndef compute_score(**kwargs):\n    return 1.0\n")
    monkeypatch.setattr(preflight, "CHILD_TIMEOUT_S", 2.0)  # launch's bound, shortened for the test
    start = time.monotonic()
    with pytest.raises(EvaluationError, match=rf"^reward.custom: loading 'compute_score' from {hangs} failed: the check "
                                              r"did not answer within 2 s \(its process died or hung\); fix the file"):  # fmt: skip
        evaluate(data, overrides=[f"reward.custom.path={hangs}"])
    assert time.monotonic() - start < 30
    hangs.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                     "    return float(solution_str == ground_truth)\n")  # fmt: skip
    summary = evaluate(data, overrides=[f"reward.custom.path={hangs}"])  # a file that loads is scored
    assert summary["per_data_source"]["all"]["reward/mean"] == 0.5
