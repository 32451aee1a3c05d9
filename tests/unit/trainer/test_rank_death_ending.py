"""A rank's death mid-run (its node's death included) ends `megarl launch` / `demo` with one line
that names the last complete checkpoint and the resume command, as a stop does: through the CLI's
own report, with a real checkpoint written by the CheckpointManager."""

from __future__ import annotations

import json

from megarl.checkpoint.manager import CheckpointManager
from megarl.cli import report
from megarl.ray_cluster.worker_error import WorkerError
from megarl.trainer.launch import add_kept_and_resume

RESUME = "megarl demo --output-dir /tmp/d trainer.resume=auto"
NODE_DIED = ("policy rank 1 on vm (192.0.2.2), pid 4242 died during PolicyRank.update: its node 192.0.2.2 (id 34a68784722e) "
             "died (the raylet was killed?)")  # fmt: skip


def _death() -> WorkerError:
    return WorkerError(NODE_DIED + "\nlast lines of its log: ...", "policy", 1)


def test_a_rank_death_mid_run_names_the_last_checkpoint_and_the_resume(tmp_path, capsys):
    manager = CheckpointManager(tmp_path, keep_last=3)
    with manager.saving(2) as d:
        (d / "policy").mkdir()
        (d / "policy" / "metadata.json").write_text(json.dumps({"step": 2}))
    exc = _death()
    add_kept_and_resume(exc, manager, RESUME)
    assert report(exc) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == f"error: {NODE_DIED}; last checkpoint: step 2 ({tmp_path}/checkpoints/step_000002); resume with: {RESUME}"


def test_before_the_first_checkpoint_the_line_says_so(tmp_path, capsys):
    exc = _death()
    add_kept_and_resume(exc, CheckpointManager(tmp_path), "")
    report(exc)
    assert capsys.readouterr().err.strip().endswith(
        "; no checkpoint yet (it starts again at step 0); resume with: the same command (trainer.resume=auto)")
