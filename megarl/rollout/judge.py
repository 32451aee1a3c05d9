"""The LLM judge (reward.judge): a causal LM that reads each sample and says its score.

One generate call per scoring call holds every sample that uses the judge (batched across the
step): each instruction is ``reward.judge.prompt_template`` rendered with the sample's prompt,
response and ground truth (megarl/rewards/judge_prompt.py), then put in the judge model's own
chat template as a user turn, cut from the left to fit its context. The judge's engine
(reward.judge.engine) is the torch engine, in this process for an in-process run, else a Ray actor of
its own (megarl/engines/engine_actor.py); or SGLang servers of its own (megarl/rollout/judge_server.py:
on cpu one, a child process of this one; on cuda one per reward.judge.tp of the devices the plan
gives it, started through Ray; a call is one round of concurrent requests split over them, and one
past its deadline is aborted on every server). A torch engine in this process stops a call past its deadline
at its next decode step (a call made meanwhile waits for that within its own deadline); its Ray
actor cannot: the late call keeps running there, beside the next calls (the actor takes a few at
once), which share the CPU with it and may time out in turn.

Failures are counted as the reward workers count theirs (megarl/rewards/scorer.py): an output the
parser cannot read is an error, a call past ``timeout_s`` a timeout of each of its samples, an
engine error an error of each; each scores 0, is retried up to ``retries`` times (a timeout not
on the torch engine's actor, which cannot stop the late call: a retry would run beside it and
likely time out in turn, so a timeout there is final), and counted in
``reward/judge_errors`` / ``reward/judge_timeouts`` (the first few logged with the sample). When
they reach ``reward.max_failed_fraction`` of the call's samples, :class:`RewardError` stops the run.

Left out: several torch engines, judging multi-turn transcripts turn by turn.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.config.reward_sections import RewardJudgeConfig
from megarl.engines.base import Engines, GenerationResult, SamplingParams
from megarl.rewards.failures import check_failed_fraction, log_failures
from megarl.rewards.judge_prompt import JudgeOutputError, parse_score, render, template_text
from megarl.rewards.scorer import TRAINING_STOPS

log = logging.getLogger(__name__)

JUDGE_LOG = "judge_engine.log"  # in the run's log folder, for the judge's engine actor
_SEED = 0  # the judge samples reproducibly (temperature > 0); each retry with its own seed


@dataclass
class JudgeScores:
    """One judge call's scores (0 where it failed), aligned with its samples, and the failure counts."""

    scores: list[float]
    errors: int = 0
    timeouts: int = 0


class _WithDeadline:
    """An engine behind the ``Engines`` protocol, each call within a deadline.

    A call runs in a daemon thread of its own, not an executor's (which the interpreter joins at
    exit: ``megarl evaluate`` or a run would hang there until a late generate ended). A late call
    is stopped where the engine can: ``on_timeout`` (the SGLang server's abort), or, for a torch
    engine in this process, :meth:`stop_if_late` as its ``step_hook`` (the late call raises at its
    next decode step). Calls stay one at a time: a call made while a late one still runs waits for
    it first, and that wait counts within its own deadline."""

    def __init__(self, engine: Any, timeout_s: float, on_timeout: Callable[[], None] | None = None) -> None:
        self.engine, self.timeout_s, self.on_timeout = engine, timeout_s, on_timeout
        self._late: threading.Thread | None = None  # a call past its deadline, maybe still running

    def stop_if_late(self, step: int) -> None:
        """A torch engine's step_hook: end the call of a thread past its deadline (its thread only)."""
        if threading.current_thread() is self._late:
            raise TimeoutError(f"stopped at decode step {step}: past reward.judge.timeout_s")

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[GenerationResult]:
        deadline = time.monotonic() + self.timeout_s
        late = f"the judge's engine did not answer within {self.timeout_s:g} s (reward.judge.timeout_s)"
        if self._late is not None:
            self._late.join(timeout=self.timeout_s)  # all of this call's deadline at most
            if self._late.is_alive():
                raise TimeoutError(f"{late}: it was still running an earlier call past its deadline")
            self._late = None
        answer: dict[str, Any] = {}

        def call() -> None:
            try:
                answer["results"] = self.engine.generate(prompts, params)
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread below
                answer["error"] = exc

        thread = threading.Thread(target=call, name="judge", daemon=True)
        thread.start()
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            self._late = thread
            if self.on_timeout is not None:
                self.on_timeout()
            raise TimeoutError(late)
        if "error" in answer:
            raise answer["error"]
        return answer["results"]

    def close(self) -> None:
        late = self._late
        if late is not None and getattr(self.engine, "step_hook", None) == self.stop_if_late:
            late.join()  # it ends at its next decode step: torch is not left running while Python exits
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()


class Judge:
    """Scores samples with an LLM judge; ``engines`` generates (a torch engine, in this process or an actor)."""

    def __init__(self, cfg: RewardJudgeConfig, engines: Engines, tokenizer: Any, context_len: int, *,
                 max_failed_fraction: float = 1.0, stops: str = TRAINING_STOPS, close: Callable[[], None] | None = None,
                 retries_timeouts: bool = True) -> None:  # fmt: skip
        self.cfg, self.engines, self.tokenizer = cfg, engines, tokenizer
        self.template = template_text(cfg.prompt_template)
        self.max_prompt_tokens = max(1, context_len - cfg.max_new_tokens)
        self.max_failed_fraction, self.stops = max_failed_fraction, stops
        # An engine that cannot stop a late call (the torch engine's Ray actor) keeps running it,
        # so a retry would share the CPU with it and likely time out in turn: its timeouts are final.
        self.retries_timeouts = retries_timeouts
        self._close = close

    def instruction_ids(self, prompt: Any, response: str, ground_truth: Any) -> list[int]:
        """One sample's judge prompt as token ids: the template rendered, in the judge's chat template,
        cut from the left to leave room for the judge's output."""
        text = render(self.template, prompt, response, ground_truth)
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)  # fmt: skip
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return list(ids[-self.max_prompt_tokens :])

    def score(self, prompts: Sequence[Any], responses: Sequence[str], ground_truths: Sequence[Any],
              data_sources: Sequence[str]) -> JudgeScores:  # fmt: skip
        """Every sample's judge score; failures score 0 and are counted (RewardError past reward.max_failed_fraction)."""
        ids = [self.instruction_ids(p, r, t) for p, r, t in zip(prompts, responses, ground_truths, strict=True)]
        outcomes: list[tuple] = [("error", "not judged")] * len(ids)
        pending = list(range(len(ids)))
        for attempt in range(self.cfg.retries + 1):
            if not pending:
                break
            self._call([ids[i] for i in pending], pending, outcomes, attempt)
            pending = [i for i in pending if outcomes[i][0] == "error" or (outcomes[i][0] == "timeout" and self.retries_timeouts)]
        result = JudgeScores([o[1] if o[0] == "ok" else 0.0 for o in outcomes])
        result.errors = sum(o[0] == "error" for o in outcomes)
        result.timeouts = sum(o[0] == "timeout" for o in outcomes)
        self._report(outcomes, responses, data_sources)
        return result

    def _call(self, ids: list[list[int]], indices: list[int], outcomes: list[tuple], attempt: int) -> None:
        """One generate call for the samples ``indices``; their outcomes set in place."""
        params = SamplingParams(temperature=self.cfg.temperature, max_new_tokens=self.cfg.max_new_tokens, n=1,
                                seed=_SEED + attempt)  # fmt: skip
        try:
            results = self.engines.generate(ids, params)
        except TimeoutError as exc:
            for i in indices:
                outcomes[i] = ("timeout", str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - an engine error scores the call's samples 0, counted
            for i in indices:
                outcomes[i] = ("error", f"the judge's engine failed: {type(exc).__name__}: {exc}")
            return
        for i, res in zip(indices, results, strict=True):
            text = self.tokenizer.decode(res.response_ids, skip_special_tokens=True)
            try:
                outcomes[i] = ("ok", parse_score(text, self.cfg.parser, self.cfg.verdicts, self.cfg.score_range))
            except JudgeOutputError as exc:
                outcomes[i] = ("error", f"{exc} (reward.judge.parser {self.cfg.parser}): {text[:200]!r}")

    def _report(self, outcomes: list[tuple], responses: Sequence[str], data_sources: Sequence[str]) -> None:
        check_failed_fraction("reward.judge", outcomes, data_sources, limit=self.max_failed_fraction, stops=self.stops,
                              fix=lambda kind: "raise reward.judge.timeout_s" if kind == "timeout" else
                              "check reward.judge.prompt_template and reward.judge.parser against the judge's outputs")  # fmt: skip
        log_failures("reward.judge", outcomes, data_sources, responses)

    def close(self) -> None:
        if self._close is not None:
            self._close()
            self._close = None


def judge_context(cfg: RewardJudgeConfig) -> int:
    """The judge's context length: reward.judge.context_length, else the model's config.json
    max_position_embeddings (4096 when it has none)."""
    if cfg.context_length is not None:
        return cfg.context_length
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(cfg.model)
    return int(getattr(config, "max_position_embeddings", None) or 4096)


def start_judge(cfg: RewardJudgeConfig, *, in_process: bool, log_dir: str | Path, start_timeout_s: float,
                max_failed_fraction: float, stops: str = TRAINING_STOPS, server_python: str | None = None,
                server_log: str | Path | None = None, gpus: Sequence[int] = ()) -> Judge:  # fmt: skip
    """The judge with its engine started: reward.judge.engine sglang, its servers (run by
    ``server_python``, None = this interpreter) on ``gpus``, the plan's devices of the judge (a GPU
    cluster, through Ray; logs in ``log_dir``), or with none one server on CPU, a child of this
    process (its log ``server_log``, None = JUDGE_SERVER_LOG in ``log_dir``); torch, in this
    process (``in_process``: no Ray), else a Ray actor."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    context = judge_context(cfg)
    engines: Any
    if cfg.engine == "sglang" and gpus:
        from megarl.rollout.judge_server import start_judge_servers

        servers = start_judge_servers(cfg, gpus, context, log_dir, server_python, start_timeout_s)
        engines = _WithDeadline(servers, cfg.timeout_s, on_timeout=servers.abort)
    elif cfg.engine == "sglang":
        from megarl.rollout.judge_server import JUDGE_SERVER_LOG, start_judge_server

        server_log = Path(log_dir) / JUDGE_SERVER_LOG if server_log is None else server_log
        server = start_judge_server(cfg, context, server_log, server_python, start_timeout_s)
        engines = _WithDeadline(server, cfg.timeout_s, on_timeout=server.abort)
    elif in_process:
        from megarl.engines.torch_engine import TorchEngine

        engine = TorchEngine(cfg.model, device="cpu", max_running_requests=cfg.max_running_requests)
        engines = _WithDeadline(engine, cfg.timeout_s)
        engine.step_hook = engines.stop_if_late
    else:
        from megarl.engines.engine_actor import start_engine_actor

        engines = start_engine_actor(str(cfg.model), None, Path(log_dir) / JUDGE_LOG, "the judge's engine actor",
                                     max_running_requests=cfg.max_running_requests, partial=False,
                                     start_timeout_s=start_timeout_s, generate_timeout_s=cfg.timeout_s,
                                     call_timeout_s=cfg.timeout_s)  # fmt: skip
    return Judge(cfg, engines, tokenizer, context, max_failed_fraction=max_failed_fraction, stops=stops,
                 close=engines.close, retries_timeouts=cfg.engine == "sglang" or in_process)  # fmt: skip
