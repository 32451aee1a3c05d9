"""`megarl generate`'s output checks, which run before any model is loaded (the generation
itself runs in tests/e2e/test_generate_evaluate.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.checkpoint.manager import CheckpointManager
from megarl.commands.generate import generate
from megarl.commands.outputs import OutputError

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "tiny_grpo.yaml"


def test_an_output_inside_the_runs_checkpoints_is_refused(tmp_path):
    run = tmp_path / "run"
    overrides = [f"model.path={tmp_path / 'model'}", f"trainer.output_dir={run}"]
    (run / "checkpoints").mkdir(parents=True)  # the config's run, before its first save
    out = run / "checkpoints" / "gen.parquet"
    with pytest.raises(OutputError, match=r"gen.parquet is inside the checkpoints folder of a run .*give a path outside it"):
        generate(CONFIG, overrides, tmp_path / "val.parquet", out)
    with CheckpointManager(tmp_path / "other").saving(2) as d:  # another run's, recognised by its step directory
        (d / "state").write_text("s")
    out = tmp_path / "other" / "checkpoints" / "step_000002" / "gen.parquet"
    with pytest.raises(OutputError, match=r"inside the checkpoints folder of a run"):
        generate(CONFIG, overrides, tmp_path / "val.parquet", out)
    assert sorted(p.name for p in out.parent.iterdir()) == ["manifest.json", "state"]  # nothing written there


def test_a_partial_generation_with_other_settings_names_each_old_and_new_value(tmp_path):
    import json

    from megarl.commands.generate import GenerateError, _open_partial

    before = {"data_sha256": "ab", "model": "/m", "n": 4, "sampling": {"temperature": 1.0, "top_p": 1.0}, "batch_size": 64}
    partial = tmp_path / "gen.parquet.partial"
    _open_partial(partial, before)
    (partial / "part-000000.parquet").write_bytes(b"a finished part")
    now = {**before, "data_sha256": "cd", "n": 2, "sampling": {"temperature": 0.5, "top_p": 1.0}}
    with pytest.raises(GenerateError, match=r"^\S+ holds a generation made with other settings \(the --data file's "
                                            r"contents differ; n was 4, now 2; sampling.temperature was 1.0, now 0.5\); "
                                            "run with the same settings to continue it, or move it away to start over$"):
        _open_partial(partial, now)
    assert json.loads((partial / "generate.json").read_text()) == before  # the record of the work there stays
