"""Where a step's scored batch comes from: generated in the step (synchronous, the default), or
taken from the rollout producer's buffer (``rollout.max_staleness`` >= 1, docs/async.md).

Both give the loop the same calls: ``batch(step, params, timer)``, ``push(weight_push,
version)``, ``metrics(batch)`` after the update, ``start`` / ``stop`` around the steps, and the
checkpointed state. The asynchronous source also keeps the prompt ledger
(``output_dir/prompt_ledger.jsonl``: per step, the prompts trained, dropped and re-issued), which
a resume cuts back to its checkpoint's step, as it does metrics.jsonl.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megarl.algos.mismatch import corrections_by_staleness, mismatch_by_staleness
from megarl.data.batch import Batch
from megarl.engines.base import SamplingParams
from megarl.kept_files import kept_name, time_tag
from megarl.progress import PhaseTimer
from megarl.rollout.collect import Collector
from megarl.rollout.producer import RolloutProducer, Taken

log = logging.getLogger(__name__)

PROMPT_LEDGER = "prompt_ledger.jsonl"


class SyncRollouts:
    """Each step generates and scores its own prompts (on-policy; the loop as it always was)."""

    def __init__(self, collector: Collector, data: Any) -> None:
        self.collector, self.data = collector, data

    def batch(self, step: int, params: SamplingParams, timer: PhaseTimer) -> tuple[Batch, dict[str, float]]:
        return self.collector.collect(self.data.next_batch(), params, timer)  # generate + reward

    def push(self, weight_push: Callable[..., dict[str, float]], version: int) -> dict[str, float]:
        return weight_push(version=version)

    def metrics(self, batch: Batch) -> dict[str, float]:
        return {}

    def start(self, version: int, steps_left: int) -> None:
        pass

    def stop(self) -> None:
        pass

    def state_dict(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the sampler's state, nothing pending)."""
        return self.data.state_dict(), {}

    def load_state_dict(self, sampler: dict[str, Any], state: dict[str, Any], step: int) -> None:
        self.data.load_state_dict(sampler)
        if state.get("pending"):
            log.warning("the checkpoint of step %d was asynchronous and %d of its prompts were drawn but not yet "
                        "trained; a synchronous resume (rollout.max_staleness=0) skips them", step, len(state["pending"]))


class AsyncRollouts:
    """The producer's buffer as the step's source; staleness and overlap metrics; the ledger."""

    def __init__(self, producer: RolloutProducer, output_dir: str | Path, corrections: Any = None) -> None:
        """``corrections``: the run's algorithm section (its tis and mis, reported per staleness)."""
        self.producer, self.corrections = producer, corrections
        self.ledger = Path(output_dir) / PROMPT_LEDGER
        self._last_take = time.monotonic()
        self._wait = 0.0

    def batch(self, step: int, params: SamplingParams, timer: PhaseTimer) -> tuple[Batch, dict[str, float]]:
        """``params`` is unused: each draw of the producer was sampled with its own."""
        since = self._last_take
        with timer.phase("rollout_wait"):
            taken = self.producer.take(step)
        self._last_take = time.monotonic()
        self._wait = timer.times["rollout_wait"]
        self._record(step, taken)
        for count in ("reward/errors", "reward/timeouts"):  # (no draw may have ended since the last step)
            taken.metrics.setdefault(count, 0.0)
        busy = self.producer.generating_overlap(since, self._last_take)
        taken.metrics["async/engine_idle_frac"] = max(0.0, 1.0 - busy / max(self._last_take - since, 1e-9))
        return taken.batch, taken.metrics

    def push(self, weight_push: Callable[..., dict[str, float]], version: int) -> dict[str, float]:
        """The push while the engines generate; then the producer may draw ahead again."""
        start = time.monotonic()
        metrics = weight_push(version=version)
        metrics["async/push_while_generating_s"] = self.producer.generating_overlap(start, time.monotonic())
        self.producer.pushed(version)
        return metrics

    def metrics(self, batch: Batch) -> dict[str, float]:
        """Staleness (mean, max, share per value), the mismatch and the corrections per staleness, trainer idle share."""
        assert batch.staleness is not None  # the producer's take sets it
        stale = batch.staleness.float()  # [B]
        out = {"async/staleness_mean": float(stale.mean()), "async/staleness_max": float(stale.max()),
               "async/trainer_idle_frac": self._wait / max(time.monotonic() - self._last_take + self._wait, 1e-9)}  # fmt: skip
        for s in range(self.producer.k + 1):
            out[f"async/staleness{s}_frac"] = float((batch.staleness == s).float().mean())
        # With algorithm.old_logprobs=engine the old log-probs are the engine's (the same tensor): no gap to report.
        if batch.old_logprobs is not None and batch.rollout_logprobs is not None and batch.old_logprobs is not batch.rollout_logprobs:
            out |= mismatch_by_staleness(batch.old_logprobs, batch.rollout_logprobs, batch.response_mask, batch.staleness)
            if self.corrections is not None:
                tis, mis = self.corrections.tis, self.corrections.mis
                out |= corrections_by_staleness(batch.old_logprobs, batch.rollout_logprobs, batch.response_mask,
                                                batch.staleness, (tis.level, tis.cap), (mis.level, mis.low, mis.high))  # fmt: skip
        return out

    def start(self, version: int, steps_left: int) -> None:
        if version == 0:
            self._new_ledger()
        self._last_take = time.monotonic()
        self.producer.start(version, steps_left)

    def stop(self) -> None:
        self.producer.stop()

    def state_dict(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return self.producer.state_dict()

    def load_state_dict(self, sampler: dict[str, Any], state: dict[str, Any], step: int) -> None:
        """The sampler's position and the pending prompts; the ledger cut back to ``step``."""
        self.producer.stream.load_state_dict(sampler)
        self.producer.load_state_dict(state)
        self._cut_ledger(step)

    # ---- the prompt ledger ----------------------------------------------------------------
    def _record(self, step: int, taken: Taken) -> None:
        line = {"step": step, "trained": [list(k) for k in taken.trained],
                "dropped": [[*k, reason] for k, reason in taken.dropped], "reissued": [list(k) for k in taken.reissued]}  # fmt: skip
        with self.ledger.open("a") as f:
            f.write(json.dumps(line) + "\n")

    def _cut_ledger(self, step: int) -> None:
        """Keep the ledger's lines up to ``step`` (a resume re-runs the later ones); the later
        lines are kept aside, as metrics.jsonl's are."""
        if not self.ledger.is_file():
            return
        lines = [ln for ln in self.ledger.read_text().splitlines() if ln.strip()]
        later = [ln for ln in lines if json.loads(ln)["step"] > step]
        if not later:
            return
        kept = kept_name(self.ledger, f"steps{json.loads(later[0])['step']}-{json.loads(later[-1])['step']}")
        kept.write_text("".join(ln + "\n" for ln in later))
        tmp = self.ledger.with_suffix(".tmp")
        tmp.write_text("".join(ln + "\n" for ln in lines if json.loads(ln)["step"] <= step))
        os.replace(tmp, self.ledger)
        log.warning("%s: the lines of steps after the checkpoint's %d are re-run by this resume; kept as %s",
                    self.ledger.name, step, kept.name)

    def _new_ledger(self) -> None:
        """A run from step 0: an older ledger in output_dir is kept aside, not appended to."""
        if self.ledger.is_file() and self.ledger.stat().st_size:
            kept = kept_name(self.ledger, time_tag(self.ledger.stat().st_mtime))
            os.replace(self.ledger, kept)
            log.warning("%s held an earlier run's prompts; kept as %s", self.ledger, kept.name)
