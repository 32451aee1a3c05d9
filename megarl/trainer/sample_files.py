"""JSONL files of generated samples: validation's first few (output_dir/samples, every eval) and,
with trainer.rollout_data_dir, every training step's rollouts (verl's dump: <dir>/<step>.jsonl).

Both go through :func:`write_sample_rows`, which keeps a file of an earlier history aside rather
than replacing it (a step trained again after a resume from an older checkpoint).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from megarl.data.batch import Batch
from megarl.disk_full import DiskFullError, writing
from megarl.kept_files import write_keeping

log = logging.getLogger(__name__)


def write_sample_rows(path: Path, rows: list[dict[str, Any]], step: int, what: str) -> None:
    """``rows`` as JSONL at ``path``; another history's file there is kept aside (logged as ``what``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    kept = write_keeping(path, "".join(json.dumps(row, default=str) + "\n" for row in rows))
    if kept:
        log.warning("%s: %s held other samples of step %d (from before the resume); kept as %s",
                    what, path.name, step, kept.name)  # fmt: skip


def rollout_rows(batch: Batch, texts: list[str], step: int) -> list[dict[str, Any]]:
    """One row per sample: verl's fields (input, output, gts, score, step), megarl's data_source,
    finish_reason, response_length, and the advantage (mean over the response's loss tokens; an
    outcome estimator's is the sample's)."""
    n = len(batch)
    scores = batch.scores.tolist() if batch.scores is not None else [None] * n
    if batch.advantages is None:
        advantages: list[float | None] = [None] * n
    else:
        mask = batch.response_mask
        advantages = ((batch.advantages * mask).sum(1) / mask.sum(1).clamp(min=1)).tolist()
    lengths = batch.response_lengths.tolist()
    return [{"step": step, "input": batch.prompt_text[i] if batch.prompt_text else None, "output": texts[i],
             "gts": batch.ground_truth[i] if batch.ground_truth else None, "score": scores[i],
             "data_source": batch.data_source[i] if batch.data_source else None, "advantage": advantages[i],
             "response_length": lengths[i], "finish_reason": batch.finish_reason[i] if batch.finish_reason else None}
            for i in range(n)]  # fmt: skip


class RolloutDumpError(RuntimeError):
    """A step's rollouts could not be written to trainer.rollout_data_dir (a user-facing, one-line
    error: megarl/cli.py USER_ERRORS, exit code 2)."""


class RolloutDump:
    """trainer.rollout_data_dir: each training step's samples as ``<dir>/<step>.jsonl``.

    Decoding and writing run in a thread of their own while the run goes on; a step first waits
    for the previous step's file (written long before, one step's work ago), so a failed write
    stops the run at the next step, and at most two steps' samples are held. ``close`` waits for
    the last file: the trainer calls it after the last step (before that step's checkpoint, so a
    failed write ends the run as an error, never as a finished run), shutdown again after any
    other ending (a clean stop's too), where it is a no-op once called."""

    def __init__(self, directory: str | Path, texts: Callable[[Batch], list[str]]):
        # absolute: relative to the directory the run was launched from, as trainer.output_dir
        self.directory, self._texts = Path(directory).absolute(), texts
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-dump")
        self._pending: Future[None] | None = None

    def __call__(self, batch: Batch, step: int) -> Batch:
        self._wait()
        # Decoded here: the tokenizer is the controller's, and an HF fast tokenizer used from two
        # threads at once can refuse ("Already borrowed"); only the rows' writing goes to the thread.
        rows = rollout_rows(batch, self._texts(batch), step)
        self._pending = self._pool.submit(self._write, rows, step)
        return batch

    def _write(self, rows: list[dict[str, Any]], step: int) -> None:
        path = self.directory / f"{step}.jsonl"
        with writing(path, f"the rollouts of step {step} (trainer.rollout_data_dir)"):
            write_sample_rows(path, rows, step, "trainer.rollout_data_dir")

    def _wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.result()
            except DiskFullError:  # said as every full disk is (megarl/disk_full.py)
                raise
            except OSError as e:
                raise RolloutDumpError(f"trainer.rollout_data_dir={self.directory}: writing a step's rollouts failed "
                                       f"({e}); free space or pick another directory, or unset it") from e  # fmt: skip

    def close(self) -> None:
        """Finish the last step's file (raises if it failed), then end the thread."""
        try:
            self._wait()
        finally:
            self._pool.shutdown(wait=True)
