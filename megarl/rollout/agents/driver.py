"""The agent rollout: a step's prompts -> one trajectory per sample -> a Batch, with the engines.

``AgentRollout`` is the default generate function (``rollout.generate_function: default``,
megarl/rollout/generate.py). A
step whose samples are all ``single_turn`` takes the one-request path of
megarl/rollout/single_turn.py ``generate_batch`` (what every single-turn step always did). Otherwise
the driver below runs every sample's loop (megarl/rollout/agents/loops.py) in rounds:

1. every loop that wants the engine contributes one request; the round's requests go to the
   engines in one call, so each engine batches them;
2. tool calls start in threads the moment a loop asks for them, each with
   ``rollout.agent.tool_timeout_s``;
3. with ``overlap_tools`` off (the torch engine's default) a round waits for every tool call it
   started, so the rounds, and with them the per-round seeds, do not depend on timing: a
   resumed run regenerates exactly. With it on (SGLang's default) a loop whose tools answered
   generates in the next round while slower tools still run.

The Batch rows are the trajectories: ``response_mask`` is 1 exactly on the ids the engine
sampled, ``rollout_logprobs`` are the engine's there (0 on context), and the trainer scores the
very ids the engine returned (nothing is re-tokenized).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future
from typing import Any

import torch

from megarl.algos.registry import load_import_path
from megarl.config.rollout_sections import loop_name
from megarl.data.batch import ROUTING_FIELDS, Batch
from megarl.data.prompt_batch import PromptBatch
from megarl.data.routing_ids import unrouted_id
from megarl.engines.base import Engines, GenerationResult, SamplingParams
from megarl.engines.seeds import step_seed
from megarl.rollout.agents.chat import TurnEncoder
from megarl.rollout.agents.errors import AgentError
from megarl.rollout.agents.loops import (
    LOOPS,
    AgentEnv,
    AgentLoop,
    AgentSample,
    CallTools,
    Generate,
    Trajectory,
)
from megarl.rollout.agents.tool_calls import PARSERS, ToolCall
from megarl.rollout.agents.tools import ToolOutcome, start_tool_call, timed_out
from megarl.rollout.batching import batch_from_generations
from megarl.rollout.single_turn import generate_batch
from megarl.user_code import process_state_kept, wait_for_user

log = logging.getLogger(__name__)
ROUND_SEED_SALT = 0xA6E7  # round r samples with step_seed(seed ^ salt, r): never the single-turn streams


class AgentRollout:
    """The default generate function: each sample's agent loop, chosen by its ``agent_name``."""

    def __init__(self, agent_cfg: Any, env: AgentEnv | None, overlap_tools: bool, routing: str = "none"):
        """``routing``: what the Batch carries of the engines' expert routing (megarl/engines/routing.py
        ``routing_replay``): none, experts (ids) or experts_and_weights."""
        self.cfg, self.env, self.overlap_tools, self.routing = agent_cfg, env, overlap_tools, routing
        self.loops = {**LOOPS, **{name: loop_class(path) for name, path in agent_cfg.loops.items()}}

    def __call__(self, engines: Engines, prompts: PromptBatch, params: SamplingParams) -> Batch:
        """The rollout; with the engines' routing when ``params.return_routing`` asks for it (the
        trainer's training steps under routing replay; not validation)."""
        batch = self._rollout(engines, prompts, params)
        if not params.return_routing or self.routing == "none":
            return batch
        if self.routing == "experts":  # the trainer's router weighs the replayed experts itself
            return batch.replace(routing_weights=None)
        if batch.routing_weights is None:
            raise AgentError("actor.moe.routing_replay 'experts_and_weights' needs the engine's routing weights, and "
                             "this engine returns expert ids alone (SGLang); set it to 'experts' or use rollout.engine: torch")  # fmt: skip
        return batch

    def _rollout(self, engines: Engines, prompts: PromptBatch, params: SamplingParams) -> Batch:
        names = agent_names(prompts, self.cfg.default_agent)
        if all(name == "single_turn" for name in names):
            return generate_batch(engines, prompts, params)
        bad = next((p for p, name in enumerate(names) if name not in self.loops), None)
        if bad is not None:
            raise AgentError(f"agent_name {names[bad]!r} (row {prompts.index[bad]} of data file {prompts.file_index[bad]} "
                             f"in data.train_files / val_files) is not a loop; known: {', '.join(self.loops)}; "
                             "add yours under rollout.agent.loops")  # fmt: skip
        if self.env is None:
            raise AgentError(f"agent loop {sorted(set(names) - {'single_turn'})[0]!r} appends turns through the chat "
                             "template, and the tokenizer of model.path has none; use a model whose tokenizer has one")  # fmt: skip
        samples = [_sample(prompts, p, params.max_new_tokens) for p in range(len(prompts)) for _ in range(params.n)]
        loops = [self.loops[names[i // params.n]](s, self.env) for i, s in enumerate(samples)]
        # tools run in threads of their own, which leave the streams to their calls: what they changed is put back here, once all are done
        with process_state_kept(_agent_code(self.cfg)):
            finish = _Driver(engines, params, self.env, self.cfg, self.overlap_tools).run(loops)
        return batch_from_trajectories(prompts, samples, finish, params.n, turn_rewards=self.cfg.turn_rewards)


def _agent_code(cfg: Any) -> str:
    """The user code an agent rollout runs, named by its keys (as the command's supervisor names it)."""
    named = [f"the tools of rollout.agent.tools_file {cfg.tools_file}" if cfg.tools_file else "",
             f"the interactions of rollout.agent.interactions_file {cfg.interactions_file}" if cfg.interactions_file else "",
             "the agent loops of rollout.agent.loops" if cfg.loops else ""]  # fmt: skip
    return ", ".join(n for n in named if n) or "the agent loops"


def agent_names(prompts: PromptBatch, default: str) -> list[str]:
    """Each prompt's loop: its agent_name (verl's names mapped to ours), else ``default``."""
    return [loop_name(name, default) for name in prompts.agent_name or [""] * len(prompts)]  # "": no agent_name


def _sample(prompts: PromptBatch, p: int, budget: int) -> AgentSample:
    raw = prompts.raw_prompt[p] if prompts.raw_prompt else prompts.prompt_text[p]
    return AgentSample(Trajectory(list(prompts.prompt_ids[p]), budget), raw, prompts.extra_info[p])


def loop_class(path: str) -> type[AgentLoop]:
    cls = load_import_path(path, "agent loop", what="class")
    if not (isinstance(cls, type) and issubclass(cls, AgentLoop)):
        raise TypeError(f"agent loop {path!r} is not a subclass of megarl.rollout.agents.loops.AgentLoop; derive your loop from it")
    return cls


class _Driver:
    """Runs loops in rounds: batched generation, concurrent tools (module docstring)."""

    def __init__(self, engines: Engines, params: SamplingParams, env: AgentEnv, cfg: Any, overlap_tools: bool):
        self.engines, self.params, self.env, self.cfg = engines, params, env, cfg
        self.overlap_tools = overlap_tools
        self.steps: dict[int, Any] = {}  # loop index -> its running generator
        self.wants: dict[int, Generate] = {}  # loops waiting for the engine
        self.tools: dict[int, list[tuple[ToolCall, Future[ToolOutcome], float]]] = {}  # waiting for tools
        self.finish: dict[int, str] = {}
        self.calls: dict[str, list] = {}  # tool name -> [calls, failures, the first failure's text] (logged per rollout)

    def run(self, loops: list[AgentLoop]) -> list[str]:
        try:
            self._run(loops)
        finally:  # a failure mid-step (or a stop) closes every loop still running, now, not at garbage collection
            self._close_loops()
        for name, (calls, failures, first) in self.calls.items():
            if failures:  # the model is told; the user is told too, once per tool and rollout
                log.warning("tool %s failed %d of %d calls in this rollout; the first: %s", name, failures, calls, first)
        return [self.finish[i] for i in range(len(loops))]

    def _close_loops(self) -> None:
        """Close the loops still running: the error that got here is the one to report, so a loop
        whose own ``finally`` fails on the way out (a user's loop) does not replace it."""
        steps, self.steps = list(self.steps.values()), {}
        for loop_steps in steps:
            try:
                loop_steps.close()
            except Exception as exc:  # noqa: BLE001 - the rollout already failed or stops
                log.debug("an agent loop failed while it was closed: %r", exc)

    def _run(self, loops: list[AgentLoop]) -> None:
        queue = list(range(len(loops)))[::-1]
        rounds = 0
        while queue or self.steps:
            while queue and len(self.steps) < self.cfg.max_concurrent:
                i = queue.pop()
                steps = loops[i].run()
                if not inspect.isgenerator(steps):
                    raise TypeError(f"agent loop {type(loops[i]).__name__}.run() must be a generator that yields "
                                    "Generate / CallTools requests (docs/agents.md)")  # fmt: skip
                self.steps[i] = steps
                self._advance(i, loops[i], None)
            if self.wants:
                self._generate_round(loops, rounds)
                rounds += 1
            self._collect_tools(loops, block=not self.wants or not self.overlap_tools)

    def _advance(self, i: int, loop: AgentLoop, answer: Any) -> None:
        """Send ``answer`` to loop ``i`` and file its next request (or its finish reason)."""
        try:
            request = self.steps[i].send(answer)
            while isinstance(request, CallTools) and not request.calls:  # nothing to run: answered at once
                request = self.steps[i].send([])
        except StopIteration as stop:
            del self.steps[i]
            self.finish[i] = str(stop.value)
            loop.trajectory.drop_trailing_context()
            return
        if isinstance(request, Generate):
            if request.max_new_tokens < 1:
                raise ValueError(f"agent loop {type(loop).__name__} asked for {request.max_new_tokens} new tokens")
            self.wants[i] = request
        elif isinstance(request, CallTools):
            self.tools[i] = [self._start(call, loop) for call in request.calls]
        else:
            raise TypeError(f"agent loop {type(loop).__name__} yielded {request!r}; yield Generate or CallTools")

    def _start(self, call: ToolCall, loop: AgentLoop) -> tuple[ToolCall, Future[ToolOutcome], float]:
        tool = self.env.tools.get(call.name)
        if tool is None:
            done: Future[ToolOutcome] = Future()
            known = ", ".join(self.env.tools) or "none"
            done.set_result(ToolOutcome(f"Error: there is no tool {call.name!r} (tools: {known})", error="error"))
            return call, done, 0.0
        kwargs = loop.sample.tools_kwargs.get(call.name) or {}
        return call, start_tool_call(tool, call.arguments, kwargs), time.monotonic() + self.cfg.tool_timeout_s

    def _generate_round(self, loops: list[AgentLoop], round_index: int) -> None:
        """One engine call for the round's requests, in loop order (deterministic rounds, so
        deterministic seeds), each turn with its own budget (``prompt_max_new_tokens``). An
        engine that samples further anyway is cut to the budget (a prefix of a sample is a sample)."""
        wants, self.wants = self.wants, {}
        rows = sorted(wants)
        budget = max(w.max_new_tokens for w in wants.values())
        seed = None if self.params.seed is None else step_seed(self.params.seed ^ ROUND_SEED_SALT, round_index)
        # Each turn gets its own budget: the largest one for all would let a trajectory near its
        # end overrun the context length the plan checked (SGLang refuses such a request).
        params = dataclasses.replace(self.params, n=1, max_new_tokens=budget, seed=seed,
                                     prompt_max_new_tokens=tuple(wants[i].max_new_tokens for i in rows))  # fmt: skip
        results = self.engines.generate([loops[i].trajectory.context() for i in rows], params)
        for i, result in zip(rows, results, strict=True):
            result = _cut(result, wants[i].max_new_tokens)
            loops[i].trajectory.add_generated(result)
            self._advance(i, loops[i], result)

    def _collect_tools(self, loops: list[AgentLoop], *, block: bool) -> None:
        """Answer the loops whose tool calls all finished or passed their deadline. ``block``:
        wait until every call did, or with overlap until some loop wants the engine again."""
        while self.tools:
            now = time.monotonic()
            for i in [i for i, calls in self.tools.items() if all(f.done() or now >= d for _, f, d in calls)]:
                calls = self.tools.pop(i)
                outcomes = [f.result() if f.done() else timed_out(c.name, self.cfg.tool_timeout_s) for c, f, _ in calls]
                for (call, _, _), outcome in zip(calls, outcomes, strict=True):
                    book = self.calls.setdefault(call.name, [0, 0, ""])
                    book[0] += 1
                    if outcome.error:
                        book[1] += 1
                        book[2] = book[2] or outcome.text[:200]
                self._advance(i, loops[i], outcomes)
            if not block or not self.tools or (self.overlap_tools and self.wants):
                return
            running = [(c, f, d) for calls in self.tools.values() for c, f, d in calls if not f.done() and d > now]
            if running:  # sleep until a call ends or the first deadline passes (after a stop: a few seconds at most)
                timeout = max(0.0, min(d for _, _, d in running) - time.monotonic())
                names = ", ".join(sorted({repr(c.name) for c, _, _ in running}))
                wait_for_user([f for _, f, _ in running], timeout, f"tool {names}", return_when=FIRST_COMPLETED)


def _cut(result: GenerationResult, budget: int) -> GenerationResult:
    if len(result.response_ids) <= budget:
        return result
    dropped = len(result.response_ids) - budget
    routing = {name: getattr(result, name)[:-dropped] for name in ROUTING_FIELDS if getattr(result, name) is not None}
    versions = None if result.token_versions is None else result.token_versions[:budget]
    return dataclasses.replace(result, response_ids=result.response_ids[:budget], logprobs=result.logprobs[:budget],
                               finish_reason="length", token_versions=versions, **routing)  # fmt: skip


def batch_from_trajectories(prompts: PromptBatch, samples: Sequence[AgentSample], finish: Sequence[str], n: int, *,
                            turn_rewards: bool = False) -> Batch:  # fmt: skip
    """One Batch row per trajectory: ids as sampled, mask 1 on generated ids, agent counts in
    extra_info; with ``turn_rewards`` each turn's reward on its last generated token."""
    results = [
        GenerationResult(i // n, s.trajectory.ids, s.trajectory.logprobs, reason, 0, *_trajectory_routing(s.trajectory),
                         token_versions=None if s.trajectory.versions is None else tuple(s.trajectory.versions))
        for i, (s, reason) in enumerate(zip(samples, finish, strict=True))
    ]
    batch = batch_from_generations(
        prompts.prompt_ids, results, n, data_source=prompts.data_source, ground_truth=prompts.ground_truth,
        prompt_text=prompts.prompt_text, raw_prompt=prompts.raw_prompt,
    )  # fmt: skip
    mask = torch.zeros_like(batch.response_mask)  # [B, R]
    rewards = torch.zeros_like(batch.response_mask)  # [B, R]
    for row, s in enumerate(samples):
        mask[row, : len(s.trajectory.mask)] = torch.tensor(s.trajectory.mask, dtype=mask.dtype)
        for position, value in s.trajectory.turn_rewards.items():
            rewards[row, position] = value
    assert batch.rollout_logprobs is not None  # batch_from_generations always fills it
    return batch.replace(response_mask=mask, rollout_logprobs=batch.rollout_logprobs * mask,
                         turn_rewards=rewards if turn_rewards else None,
                         extra_info=[_with_agent_counts(s) for s in samples])  # fmt: skip


def _trajectory_routing(t: Trajectory) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The trajectory's routing over prompt + response ([T, L, k]): the latest turn's, cut to the
    trajectory (context it dropped) or extended with -1 / 0 rows (context no turn routed)."""
    if t.routed_experts is None:
        return None, None
    tokens = len(t.prompt_ids) + len(t.ids)
    weights = None if t.routing_weights is None else _fit_rows(t.routing_weights, tokens, 0)
    return _fit_rows(t.routed_experts, tokens, unrouted_id(t.routed_experts.dtype)), weights


def _fit_rows(rows: torch.Tensor, count: int, fill: int) -> torch.Tensor:
    """``rows`` [T, ...] cut or extended with ``fill`` to [count, ...]."""
    if rows.shape[0] >= count:
        return rows[:count]
    return torch.cat([rows, rows.new_full((count - rows.shape[0], *rows.shape[1:]), fill)])


def _with_agent_counts(sample: AgentSample) -> dict[str, Any]:
    t = sample.trajectory
    extra = copy.deepcopy(sample.extra_info)
    extra["agent"] = {"turns": t.turns, "tool_calls": t.tool_calls, "tool_failures": t.tool_failures,
                      "turn_scores": list(t.turn_scores), "tool_rewards": list(t.tool_rewards)}  # fmt: skip
    return extra


def _user_classes(agent: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tools and interactions of rollout.agent's files, built. Their modules are imported
    here again (the pre-launch check imported them in a process of its own): one that takes long
    at import says so, as the check did, rather than leave the run silent."""
    from megarl.progress import still_waiting
    from megarl.rollout.agents.interactions import load_interactions
    from megarl.rollout.agents.tools import load_tools

    files = [f"rollout.agent.{key} ({path})" for key, path in
             (("tools_file", agent.tools_file), ("interactions_file", agent.interactions_file)) if path]  # fmt: skip
    if not files:
        return {}, {}
    with still_waiting(f"importing and building the classes of {' and '.join(files)}"):
        tools = load_tools(agent.tools_file) if agent.tools_file else {}
        interactions = load_interactions(agent.interactions_file, agent.interaction_timeout_s) if agent.interactions_file else {}
    return tools, interactions


def build_env(agent: Any, tokenizer: Any, eos_token_ids: Sequence[int],
              chat_template_kwargs: dict[str, Any] | None = None) -> AgentEnv | None:
    """Tools, interactions, parser and template of ``rollout.agent`` (None for a tokenizer without a
    chat template: single-turn rollouts only); ``chat_template_kwargs``: data.apply_chat_template_kwargs."""
    from megarl.rollout.agents.tools import tool_schemas

    if not getattr(tokenizer, "chat_template", None):
        return None
    tools, interactions = _user_classes(agent)
    encoder = TurnEncoder(tokenizer, eos_token_ids, tool_schemas(tools), chat_template_kwargs)
    if tools:  # a template that cannot show a tool's answer fails now, not in the middle of a step
        encoder.after_turn([], [{"role": "tool", "content": "0"}])
    return AgentEnv(tools, PARSERS.get(agent.tool_parser), encoder, agent, interactions)

