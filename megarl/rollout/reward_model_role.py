"""The reward model as a role (``reward.model.placement: disaggregated`` or ``colocated``).

Disaggregated: one Ray actor per device of ``reward.model.gpus`` holds the model once, each on a
bundle of the role's own placement groups (``placed``, megarl/ray_cluster/placement.py
role_placements: one GPU and one CPU per bundle; on cpu a process and one CPU, the config's
virtual device). Colocated (``placed``: the role's share of the policy's placement-group
bundles): one actor on each policy rank's bundle, so on its device; it loads the model on the host, and the memory hand-over moves it to the device for the step's
``reward`` phase and back after (:meth:`RewardModelRole.onload` / :meth:`offload`: the residency
table's ``reward_model/weights``, megarl/memory/residency.py). A scoring call cuts its samples into batches of ``reward.model.batch_size``, deals
them round-robin to the actors (one call per actor holding its batches), and each batch is one
padded forward in the reward model's own template, as the reward workers do it
(megarl/rewards/reward_model.py: the same functions, so the same scores).

Deadlines and failures, as the reward workers count theirs (megarl/rewards/scorer.py): an actor's
call may take ``reward.timeout_s`` per batch it holds; past that its samples are timeouts, one that
raised gives its samples an error each, one whose actor died too. Either way they score 0, are
counted in ``reward/errors`` / ``reward/timeouts``, and an actor that timed out or died is killed
and started again (the model reloaded) before the next call. When failures reach
``reward.max_failed_fraction`` of a call's samples, RewardError stops the run.

Left out: a Megatron reward model, tensor
parallelism inside the role (each actor holds the whole model), `megarl evaluate` (it scores in the
reward workers whatever the placement).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from megarl.config.sections import RewardConfig
from megarl.ray_cluster.worker_group import output_to_log
from megarl.rewards.failures import RewardError, check_failed_fraction, log_failures
from megarl.rewards.scorer import (
    MODEL_LOAD_TIMEOUT_S,
    TRAINING_STOPS,
    ScoreResult,
)

log = logging.getLogger(__name__)

ROLE_LOG = "reward_model_{index}.log"  # in the run's log folder, one per actor


class _RewardModelHost:
    """The actor's body: the reward model loaded once, scoring batches of samples."""

    def __init__(self, path: str, device: str, chat_template: bool, max_length: int | None, log_path: str,
                 on_host: bool = False) -> None:  # fmt: skip
        """``on_host``: load on the host (colocated: :meth:`place` brings it to ``device``)."""
        output_to_log(log_path)
        from megarl.rewards.reward_model import load_reward_model

        self.path, self.chat_template, self.max_length = path, chat_template, max_length
        self.target, self.device = device, "cpu" if on_host else device  # where it goes to score; where it is
        self.on_device = not on_host
        load_reward_model(path, self.device)

    def ready(self) -> bool:
        return True

    def place(self, on_device: bool) -> bool:
        """Move the model to the device (True) or the host; returns where it is now (True: the device)."""
        from megarl.rewards.reward_model import move_reward_model

        device = self.target if on_device else "cpu"
        move_reward_model(self.path, self.device, device)
        self.device, self.on_device = device, on_device
        return self.on_device

    def where(self) -> tuple[bool, str]:
        """Whether the model was last moved to the device, and the device its parameters are on (the
        tests ask; on cpu the device and the host are one)."""
        from megarl.rewards.reward_model import load_reward_model

        model, _ = load_reward_model(self.path, self.device)
        return self.on_device, str(next(model.parameters()).device)

    def score(self, batches: list[list[tuple]]) -> list[list[float]]:
        """Each batch of (raw prompt or None, prompt text, response) in one forward, where the model is; its scores."""
        from megarl.rewards.reward_model import score_samples

        return [score_samples(self.path, self.device, batch, self.chat_template, self.max_length) for batch in batches]


_RewardModelActor = ray.remote(_RewardModelHost)


class RewardModelRole:
    """The reward model's actors behind RewardScorer's ``score(...) -> ScoreResult``; use as a
    context manager. ``device``: cluster.device (cuda: one GPU per actor); ``placed``: the role's
    PlacedRole, one actor per bundle (colocated: in the policy's bundles, the model on the host until
    :meth:`onload`); None: reward.model.gpus actors wherever Ray has a GPU (on cpu a CPU) for each."""

    def __init__(self, cfg: RewardConfig, device: str, log_dir: str | Path, *, placed: Any = None,
                 start_timeout_s: float = MODEL_LOAD_TIMEOUT_S, stops: str = TRAINING_STOPS) -> None:  # fmt: skip
        if cfg.model is None:
            raise ValueError("RewardModelRole needs reward.model")
        self.cfg, self.model, self.device, self.stops, self.placed = cfg, cfg.model, device, stops, placed
        self.log_dir, self.start_timeout_s = Path(log_dir), start_timeout_s
        self._actors: list[Any] = [None] * (placed.placement.world_size if placed is not None else self.model.gpus)
        self.on_device = self.model.placement != "colocated"  # colocated: where the hand-over last put the model
        try:
            self._start_missing()
        except BaseException:
            self.close()
            raise

    def _start_missing(self) -> None:
        """Start every actor that is not running (at first, and after a timeout or a death), each
        loading the model within the start deadline."""
        started = {}
        for i, actor in enumerate(self._actors):
            if actor is None:
                self._actors[i] = _RewardModelActor.options(**self._options(i)).remote(
                    self.model.path, self.device, self.model.chat_template, self.model.max_length, str(self._log(i)),
                    not self.on_device)  # fmt: skip
                started[i] = self._actors[i].ready.remote()
        for i, ref in started.items():
            try:
                ray.get(ref, timeout=self.start_timeout_s)
            except GetTimeoutError:
                raise RewardError(f"reward.model: actor {i} did not load {self.model.path} within {self.start_timeout_s:g} s "
                                  f"(a Ray cluster without a free {'GPU' if self.device == 'cuda' else 'CPU'} for it, or a slow "
                                  f"disk); see {self._log(i)}; {self.stops}") from None  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - the load's own error, on one line
                cause = (str(exc).strip().splitlines() or [""])[-1][:300]
                raise RewardError(f"reward.model: actor {i} failed to load {self.model.path}: {cause}; see {self._log(i)}; "
                                  f"{self.stops}") from exc  # fmt: skip

    def _options(self, index: int) -> dict[str, Any]:
        """Ray options of actor ``index``: pinned to its bundle when placed; else one GPU (on cpu, one
        CPU) wherever Ray has it."""
        retries = {"max_restarts": 0, "max_task_retries": 0}
        if self.placed is not None:
            return self.placed.scheduling(index) | retries
        return {"num_cpus": 1, "num_gpus": 1 if self.device == "cuda" else 0} | retries

    # ---- the memory hand-over's side (colocated: the residency table's reward_model/weights) -----
    def onload(self, states: Sequence[str]) -> None:
        self._place(True)

    def offload(self, states: Sequence[str]) -> None:
        self._place(False)

    def _place(self, on_device: bool) -> None:
        """Every actor's model to the device or the host; an actor that died is dropped (the next
        score starts it again, where the last move put the others)."""
        self.on_device = on_device
        calls = {i: a.place.remote(on_device) for i, a in enumerate(self._actors) if a is not None}
        for i, ref in calls.items():
            try:
                ray.get(ref, timeout=self.start_timeout_s)
            except (RayActorError, GetTimeoutError):
                log.warning("reward.model actor %d did not move its model (%s); it is started again before the next "
                            "score; see %s", i, "to the device" if on_device else "to the host", self._log(i))  # fmt: skip
                self._drop(i)

    def _log(self, index: int) -> Path:
        return self.log_dir / ROLE_LOG.format(index=index)

    def score(self, data_sources: Sequence[str], solution_strs: Sequence[str], ground_truths: Sequence[Any],
              extra_infos: Sequence[dict | None] | None = None, prompts: Sequence[str] | None = None,
              scorers: Sequence[str | None] | None = None, raw_prompts: Sequence[Any] | None = None) -> ScoreResult:  # fmt: skip
        """RewardScorer.score's contract (``scorers`` and ``extra_infos`` unused: the model reads the
        prompt and the response); failures score 0 and are counted, RewardError past the limit."""
        if prompts is None:
            raise ValueError("reward.model scores prompt + response: pass prompts=[...] to RewardModelRole.score")
        n = len(solution_strs)
        raws = list(raw_prompts) if raw_prompts else [None] * n
        samples = [(raw, str(p), s) for raw, p, s in zip(raws, prompts, solution_strs, strict=True)]
        self._start_missing()
        size, count = self.model.batch_size, len(self._actors)
        batches = [list(range(k, min(k + size, n))) for k in range(0, n, size)]
        shares = [batches[i::count] for i in range(count)]  # round-robin: actor i gets batches i, i + count, ...
        calls = {i: self._actors[i].score.remote([[samples[j] for j in b] for b in share]) for i, share in enumerate(shares) if share}
        outcomes: list[tuple] = [("error", "not scored")] * n
        start = time.monotonic()
        for i, ref in calls.items():
            self._collect(i, ref, shares[i], outcomes, start + self.cfg.timeout_s * len(shares[i]))
        return self._result(outcomes, list(data_sources), list(solution_strs))

    def _collect(self, index: int, ref: Any, share: list[list[int]], outcomes: list[tuple], deadline: float) -> None:
        """Actor ``index``'s scores into ``outcomes``, or its failure for each of its samples."""
        rows = [j for batch in share for j in batch]
        try:
            scores = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except GetTimeoutError:
            self._drop(index)  # it may still be busy with this call: the next one gets a fresh actor
            failure: tuple = ("timeout", f"timed out after {self.cfg.timeout_s:g} s per batch of {self.model.batch_size} "
                              "(reward.timeout_s)")  # fmt: skip
        except RayActorError as exc:
            self._drop(index)
            failure = ("error", f"reward.model actor {index} died: {(str(exc).strip().splitlines() or [''])[0][:200]}; "
                       f"see {self._log(index)}")  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - the forward raised in the actor: its samples score 0, counted
            failure = ("error", (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:300])
        else:
            for j, value in zip(rows, (v for batch in scores for v in batch), strict=True):
                outcomes[j] = ("ok", value)
            return
        for j in rows:
            outcomes[j] = failure

    def _drop(self, index: int) -> None:
        actor, self._actors[index] = self._actors[index], None
        if actor is not None:
            ray.kill(actor, no_restart=True)

    def _result(self, outcomes: list[tuple], data_sources: list[str], responses: list[str]) -> ScoreResult:
        n = len(outcomes)
        result = ScoreResult(scores=[o[1] if o[0] == "ok" else 0.0 for o in outcomes], preds=[None] * n)
        failed = [j for j, o in enumerate(outcomes) if o[0] != "ok"]
        result.errors = sum(outcomes[j][0] == "error" for j in failed)
        result.timeouts = sum(outcomes[j][0] == "timeout" for j in failed)
        check_failed_fraction("reward.model", outcomes, data_sources, limit=self.cfg.max_failed_fraction, stops=self.stops,
                              fix=lambda kind: "raise reward.timeout_s or lower reward.model.batch_size" if kind == "timeout"
                              else "see the actor's log")  # fmt: skip
        log_failures("reward.model", outcomes, data_sources, responses)
        return result

    def close(self) -> None:
        """Kill the actors (a call in flight is abandoned); closing twice is harmless."""
        for i in range(len(self._actors)):
            self._drop(i)

    def __enter__(self) -> RewardModelRole:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
