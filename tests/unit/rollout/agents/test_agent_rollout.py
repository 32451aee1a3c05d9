"""The agent rollout's driver and the tool_agent loop, token by token.

The engine here replays scripted model turns (the model's choices are the test's input), and is
strict where a real engine is: it samples a continuation of exactly the ids it is given, and it
records them, so the tests check that every turn continues the trajectory's ids unchanged.
Everything else is real: the tiny ChatML tokenizer and its template, the parser, the tools
(threads, deadlines), the loop and the Batch.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from agent_doubles import FirstCallHangs, always_call, chat_ids, chat_prompts

from megarl.config.rollout_sections import AgentConfig
from megarl.data.prompt_batch import PromptBatch
from megarl.engines.base import GenerationResult, SamplingParams
from megarl.models.tiny import build_tokenizer
from megarl.rollout.agents.chat import TurnEncoder
from megarl.rollout.agents.driver import AgentRollout, build_env
from megarl.rollout.agents.loops import AgentEnv
from megarl.rollout.agents.tool_calls import parse_hermes
from megarl.rollout.agents.tools import Tool

EXAMPLES = Path(__file__).resolve().parents[4] / "docs" / "examples"
CALC = {"type": "function", "function": {"name": "calc", "description": "arithmetic",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}  # fmt: skip


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()  # byte-level + ChatML template


def _eos(tok) -> int:
    return tok.convert_tokens_to_ids("<|im_end|>")


class ReplayEngine:
    """Answers each trajectory (told apart by its prompt's first ids) with its next scripted turn."""

    def __init__(self, tok, script: dict[str, list[str]]):
        self.tok, self.calls = tok, []
        self.turns = {self._key(p): [self._ids(t) for t in ts] for p, ts in script.items()}
        self.contexts: dict[tuple, list[list[int]]] = {k: [] for k in self.turns}
        self.order: list[tuple[tuple, int]] = []

    def _key(self, prompt_text: str) -> tuple:
        return tuple(self.tok.decode(chat_ids(self.tok, prompt_text)).encode())

    def _ids(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False)) + [_eos(self.tok)]

    def generate(self, prompts, params: SamplingParams) -> list[GenerationResult]:
        assert params.n == 1
        self.calls.append(len(prompts))
        out = []
        for i, ids in enumerate(prompts):
            key = next(k for k in self.turns if self.tok.decode(ids).encode().startswith(bytes(k)))
            self.contexts[key].append(list(ids))
            self.order.append((key, len(self.contexts[key]) - 1))  # (trajectory, its turn) in serving order
            turn = self.turns[key].pop(0)[: params.budget(i)]  # the engine honours each prompt's budget
            reason = "stop" if turn[-1] == _eos(self.tok) else "length"
            out.append(GenerationResult(i, turn, [-0.5] * len(turn), reason))
        return out


def _prompts(tok, texts: list[str], agent: str = "tool_agent", extra: list[dict] | None = None) -> PromptBatch:
    return chat_prompts(tok, texts, extra_info=extra or [{} for _ in texts], agent_name=[agent] * len(texts))


def _env(tok, tools: dict, **limits) -> AgentEnv:
    cfg = AgentConfig(**limits)
    return AgentEnv(tools, parse_hermes, TurnEncoder(tok, [_eos(tok)], [t.tool_schema for t in tools.values()]), cfg)


def _call(name: str, **arguments) -> str:
    import json

    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


class Sleepy(Tool):
    """Answers "ok", after ``config["seconds"]`` when the argument says so."""

    def execute(self, instance_id, parameters, **kwargs):
        if parameters.get("slow"):
            time.sleep(self.config["seconds"])
        return "ok"


def _calc_env(tok, **limits):
    from megarl.rollout.agents.builtin_tools import Calculator

    return _env(tok, {"calc": Calculator({}, CALC)}, **limits)


def test_two_turn_trajectory_ids_mask_and_logprobs_token_by_token(tok):
    turn1, turn2 = _call("calc", expression="2+3"), "It is 5."
    engine = ReplayEngine(tok, {"what is 2+3?": [turn1, turn2]})
    prompts = _prompts(tok, ["what is 2+3?"])
    batch = AgentRollout(AgentConfig(), _calc_env(tok), overlap_tools=False)(engine, prompts, SamplingParams(max_new_tokens=200, seed=1))

    t1, t2 = engine._ids(turn1), engine._ids(turn2)
    # The template closes the model's turn ("<|im_end|>" was sampled: only "\n" is added), shows
    # the tool's answer and opens the next assistant turn; tokenized once.
    context = list(tok.encode("\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False))
    n = int(batch.response_lengths[0])
    assert batch.response_ids[0, :n].tolist() == t1 + context + t2
    assert batch.response_mask[0, :n].tolist() == [1.0] * len(t1) + [0.0] * len(context) + [1.0] * len(t2)
    assert batch.rollout_logprobs[0, :n].tolist() == [-0.5] * len(t1) + [0.0] * len(context) + [-0.5] * len(t2)
    # The second turn continued exactly from the ids so far (nothing re-tokenized).
    first, second = engine.contexts[next(iter(engine.contexts))]
    assert second == first + t1 + context
    assert batch.finish_reason == ["stop"]
    assert batch.extra_info[0]["agent"] == {"turns": 2, "tool_calls": 1, "tool_failures": 0, "turn_scores": [],
                                            "tool_rewards": [0.0]}  # fmt: skip


def test_single_turn_rows_take_the_one_request_path(tok):
    engine = ReplayEngine(tok, {"a": ["x", "y"], "b": ["z", "w"]})
    batch = AgentRollout(AgentConfig(), _calc_env(tok), overlap_tools=False)(
        engine, _prompts(tok, ["a", "b"], agent="single_turn"), SamplingParams(max_new_tokens=10, n=1))
    assert engine.calls == [2] and batch.response_mask.sum().item() == batch.response_lengths.sum().item()
    assert "agent" not in batch.extra_info[0]


@pytest.mark.parametrize(
    ("limits", "turns", "budget", "reason", "counts"),
    [
        ({"max_turns": 2}, [_call("calc", expression="1")] * 3, 400, "max_turns", (2, 1, 0)),
        ({"max_tool_calls": 2}, [_call("calc", expression="1") * 2, _call("calc", expression="1")], 400, "max_tool_calls", (2, 2, 0)),
        ({"max_tool_failures": 2}, [_call("nope"), _call("calc", expression="x")], 400, "tool_error", (2, 2, 2)),
        ({}, [_call("calc", expression="1"), "1"], 90, "length", (1, 1, 0)),  # the tool's answer leaves no room
        ({"max_tokens_per_turn": 3}, ["0123456789"], 400, "length", (1, 0, 0)),
    ],
)
def test_limits_end_a_trajectory_with_their_finish_reason(tok, limits, turns, budget, reason, counts):
    engine = ReplayEngine(tok, {"q": turns})
    batch = AgentRollout(AgentConfig(**limits), _calc_env(tok, **limits), overlap_tools=False)(
        engine, _prompts(tok, ["q"]), SamplingParams(max_new_tokens=budget))
    agent = batch.extra_info[0]["agent"]
    assert batch.finish_reason == [reason] and (agent["turns"], agent["tool_calls"], agent["tool_failures"]) == counts
    n = int(batch.response_lengths[0])
    assert n <= budget and batch.response_mask[0, n - 1] == 1.0  # ends on a generated token (the reward's place)


def test_no_turn_asks_past_its_trajectorys_budget_when_a_round_mixes_budgets(tok):
    """A round batches a trajectory near its end with one that has room left: each turn is asked
    for its own budget (SGLang refuses a request past the model's context length; here the
    engine double checks it)."""
    prompts = _prompts(tok, ["a", "b"])
    context_length = max(len(ids) for ids in prompts.prompt_ids) + 300  # what the plan checks: prompt + max_new_tokens

    class Strict(ReplayEngine):
        def generate(self, contexts, params):
            asked = [len(ids) + params.budget(i) for i, ids in enumerate(contexts)]
            assert max(asked) <= context_length, f"a turn asked for {max(asked)} positions of {context_length}"
            return super().generate(contexts, params)

    long_turn = "x" * 150 + _call("calc", expression="1")
    engine = Strict(tok, {"a": [long_turn, "end"], "b": [_call("calc", expression="2"), "end"]})
    batch = AgentRollout(AgentConfig(), _calc_env(tok), overlap_tools=False)(engine, prompts, SamplingParams(max_new_tokens=300))
    assert engine.calls == [2, 2] and batch.finish_reason == ["stop", "stop"]  # the second round held both


class Silencing(Tool):
    """Points sys.stdout and sys.stderr nowhere (a tool's own `sys.stdout = None`), then answers."""

    def execute(self, instance_id, parameters, **kwargs):
        import sys

        sys.stdout = sys.stderr = None
        return "ok"


def test_a_tool_that_replaces_sys_stdout_has_it_put_back_when_the_rollout_ends(tok, caplog, tmp_path, monkeypatch):
    # Before: the run's later lines (the step, a checkpoint saved, the last line) went nowhere, without a word.
    import sys

    import megarl.user_code
    from megarl.user_code import user_output_to

    monkeypatch.setattr(megarl.user_code, "_WARNED", set())  # (said once per code in a process)

    engine = ReplayEngine(tok, {"q": [_call("calc"), "done"]})
    schema = {"type": "function", "function": {**CALC["function"], "name": "calc"}}
    with user_output_to(tmp_path / "user_code.log"):  # the driver's streams, as a run has them
        before = sys.stdout, sys.stderr
        try:
            AgentRollout(AgentConfig(tools_file="my_tools.yaml"), _env(tok, {"calc": Silencing({}, schema)}), overlap_tools=False)(
                engine, _prompts(tok, ["q"]), SamplingParams(max_new_tokens=400))  # fmt: skip
            assert (sys.stdout, sys.stderr) == before
        finally:
            sys.stdout, sys.stderr = before
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "the tools of rollout.agent.tools_file my_tools.yaml closed or redirected the process's sys.stdout and sys.stderr; "
        "put back: megarl's lines (a checkpoint saved, an error) go there"]


def test_a_failed_call_is_the_models_feedback_and_the_trajectory_goes_on(tok, caplog):
    engine = ReplayEngine(tok, {"q": [_call("calc", expression="1/0"), _call("nope"), "done"]})
    batch = AgentRollout(AgentConfig(), _calc_env(tok), overlap_tools=False)(engine, _prompts(tok, ["q"]), SamplingParams(max_new_tokens=400))
    text = tok.decode(batch.response_ids[0, : int(batch.response_lengths[0])].tolist())
    assert "<|im_start|>tool\nError: calculator: division by zero" in text
    assert "<|im_start|>tool\nError: there is no tool 'nope' (tools: calc)" in text
    assert batch.finish_reason == ["stop"] and batch.extra_info[0]["agent"]["tool_failures"] == 2
    # ... and the user's: one line per tool and rollout
    assert [r.getMessage() for r in caplog.records if r.name == "megarl.rollout.agents.driver"] == [
        "tool calc failed 1 of 1 calls in this rollout; the first: Error: calculator: division by zero in '1 / 0'",
        "tool nope failed 1 of 1 calls in this rollout; the first: Error: there is no tool 'nope' (tools: calc)"]


def test_a_hanging_tool_times_out_and_the_other_trajectories_go_first_with_overlap(tok):
    sleepy = {"sleep": Sleepy({"seconds": 5.0}, {"type": "function", "function": {"name": "sleep"}})}
    script = {f"q{i}": [_call("sleep", slow=i == 0), "again", "end"] for i in range(8)}
    engine = ReplayEngine(tok, script)
    env = _env(tok, sleepy, tool_timeout_s=1.0)
    start = time.monotonic()
    batch = AgentRollout(env.limits, env, overlap_tools=True)(engine, _prompts(tok, list(script)), SamplingParams(max_new_tokens=300))
    assert time.monotonic() - start < 4.0  # the 5 s tool was abandoned at its 1 s deadline
    texts = [tok.decode(batch.response_ids[i, : int(batch.response_lengths[i])].tolist()) for i in range(8)]
    assert "did not answer within 1 s" in texts[0] and all("did not answer" not in t for t in texts[1:])
    assert batch.finish_reason == ["stop"] * 8
    # The first round asked for all 8 turns; the 7 fast trajectories' second turns went before the slow one's.
    slow = engine._key("q0")
    assert engine.calls[0] == 8
    assert engine.order.index((slow, 1)) > max(engine.order.index((k, 1)) for k in engine.contexts if k != slow)


def test_without_overlap_each_round_waits_for_its_tools_until_the_timeout(tok):
    sleepy = {"sleep": Sleepy({"seconds": 5.0}, {"type": "function", "function": {"name": "sleep"}})}
    script = {f"q{i}": [_call("sleep", slow=i == 0), "end"] for i in range(8)}
    engine = ReplayEngine(tok, script)
    env = _env(tok, sleepy, tool_timeout_s=1.0)
    start = time.monotonic()
    AgentRollout(env.limits, env, overlap_tools=False)(engine, _prompts(tok, list(script)), SamplingParams(max_new_tokens=300))
    assert time.monotonic() - start < 4.0  # the step waited for the 1 s deadline, not for the 5 s tool
    assert engine.calls == [8, 8]  # the same rounds whatever the tools' timing: reproducible seeds


def test_a_verl_multi_turn_parquet_runs_with_its_columns(tok, tmp_path, monkeypatch):
    """A row as verl's gsm8k_multiturn_w_tool preprocessing writes it (no agent_name column: the
    config's default loop; tools_kwargs with create_kwargs and interaction_kwargs without a name,
    the file having one interaction), and a row with verl's agent_name column."""
    from megarl.data.datasets import file_label
    from megarl.data.prompts import PromptBuilder
    from megarl.data.stream import encode_records, load_prompt_set

    monkeypatch.syspath_prepend(str(EXAMPLES))
    tools_file, interactions_file = tmp_path / "tools.yaml", tmp_path / "interaction.yaml"
    schema = {"type": "function", "function": {"name": "check_answer", "description": "check",
              "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}}  # fmt: skip
    tools_file.write_text(yaml.safe_dump({"tools": [{"class_name": "agent_extensions.AnswerCheck", "config": {"type": "native"},
                                                     "tool_schema": schema}]}))  # fmt: skip
    interactions_file.write_text(yaml.safe_dump({"interaction": [{"name": "echo", "class_name": "agent_extensions.EchoUser", "config": {}}]}))
    rows = [{"data_source": "openai/gsm8k", "ability": "math",
             "prompt": [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "2+3?"}],
             "reward_model": {"style": "rule", "ground_truth": "5"},
             "extra_info": {"index": 0, "need_tools_kwargs": True,
                            "tools_kwargs": {"check_answer": {"create_kwargs": {"ground_truth": "5"}}},
                            "interaction_kwargs": {"query": "2+3?", "ground_truth": "5"}}}]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist([{**rows[0], "agent_name": "tool_agent"}]), tmp_path / "named.parquet")
    cfg = AgentConfig(tools_file=str(tools_file), interactions_file=str(interactions_file), default_agent="tool_agent")
    env = build_env(cfg, tok, [_eos(tok)])
    builder = PromptBuilder(tok, max_prompt_length=4096, tools=[schema])
    pset = load_prompt_set(str(tmp_path / "train.parquet"), label=file_label("data.train_files[0]", "train.parquet"), builder=builder)
    prompts = encode_records([pset], [(0, 0)], builder, step=0)
    assert prompts.agent_name == [""] and "check_answer" in prompts.prompt_text[0]  # the schema is in the prompt
    named = load_prompt_set(str(tmp_path / "named.parquet"), label="named", builder=builder)
    assert encode_records([named], [(0, 0)], builder, step=0).agent_name == ["tool_agent"]

    class Engine(ReplayEngine):
        def _key(self, prompt_text):
            return tuple(prompts.prompt_text[0].encode())

    engine = Engine(tok, {"": [_call("check_answer", answer="5"), "5", "still 5"]})
    batch = AgentRollout(cfg, env, overlap_tools=False)(engine, prompts, SamplingParams(max_new_tokens=400))
    text = tok.decode(batch.response_ids[0, : int(batch.response_lengths[0])].tolist())
    assert "<|im_start|>tool\ncorrect<|im_end|>" in text  # the tool saw the row's ground truth
    assert "<|im_start|>user\n1<|im_end|>" in text  # the interaction answered once, then ended
    agent = batch.extra_info[0]["agent"]
    assert agent["tool_rewards"] == [1.0] and agent["turn_scores"] == [0.0, 1.0] and agent["turns"] == 3
    assert batch.finish_reason == ["stop"]
    assert env.interactions["echo"].impl.turns == {}  # finalize_interaction ran when the trajectory ended


class Defaults(Tool):
    """Answers the create / execute kwargs it got, and its defaults where it got none."""

    def create(self, instance_id=None, ground_truth=None, tolerance=0.5, **kwargs):
        self.created = f"gt={ground_truth} tol={tolerance}"
        return "id"

    def execute(self, instance_id, parameters, mode="loose", **kwargs):
        return f"{self.created} mode={mode}"


class RecordingUser:
    """An interaction that records the kwargs start_interaction got, then ends the talk."""

    def __init__(self, config):
        self.started = []

    def start_interaction(self, instance_id, level=1, **kwargs):
        self.started.append((level, kwargs))
        return instance_id

    def generate_response(self, instance_id, messages, **kwargs):
        return True, "bye", 0.0, {}


def test_nulls_of_a_parquet_struct_leave_the_tools_and_interactions_own_defaults(tok, tmp_path):
    """Parquet gives each row every key any row of the extra_info column has, null where the row
    has none: the first row's tool and interaction must still get their own defaults, not None."""
    from megarl.rollout.agents.interactions import Interaction

    kw = {"type": "function", "function": {"name": "kw", "description": "d", "parameters": {"type": "object", "properties": {}}}}
    rows = [{"extra_info": {"tools_kwargs": {"kw": {"create_kwargs": {"ground_truth": "72"}}},
                            "interaction_kwargs": {"name": "u", "query": "q"}}},
            {"extra_info": {"tools_kwargs": {"kw": {"create_kwargs": {"ground_truth": "5", "tolerance": 0.01},
                                                    "execute_kwargs": {"mode": "strict"}}},
                            "interaction_kwargs": {"name": "u", "query": "q", "level": 3, "extra": {"a": 1}}}}]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    extra = pq.read_table(tmp_path / "train.parquet").column("extra_info").to_pylist()
    assert extra[0]["tools_kwargs"]["kw"]["create_kwargs"]["tolerance"] is None  # what a reader gets from parquet
    env = _env(tok, {"kw": Defaults({}, kw)})
    env.interactions = {"u": Interaction("u", RecordingUser({}))}
    engine = ReplayEngine(tok, {"a": [_call("kw"), "end"], "b": [_call("kw"), "end"]})
    batch = AgentRollout(AgentConfig(), env, overlap_tools=False)(engine, _prompts(tok, ["a", "b"], extra=extra),
                                                                  SamplingParams(max_new_tokens=300))  # fmt: skip
    texts = [tok.decode(batch.response_ids[r, : int(batch.response_lengths[r])].tolist()) for r in range(2)]
    assert "<|im_start|>tool\ngt=72 tol=0.5 mode=loose<|im_end|>" in texts[0]
    assert "<|im_start|>tool\ngt=5 tol=0.01 mode=strict<|im_end|>" in texts[1]
    assert env.interactions["u"].impl.started == [(1, {"query": "q"}), (3, {"query": "q", "extra": {"a": 1}})]


@pytest.mark.parametrize("method", ["start_interaction", "finalize_interaction"])
def test_an_interaction_that_raises_stops_the_run_with_one_line_naming_it(tok, method):
    from megarl.rollout.agents.errors import AgentError
    from megarl.rollout.agents.interactions import Interaction

    class Broken(RecordingUser):
        def finalize_interaction(self, instance_id):
            pass

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    impl = Broken({})
    setattr(impl, method, boom)
    env = _calc_env(tok)
    env.interactions = {"u": Interaction("u", impl)}
    engine = ReplayEngine(tok, {"q": ["hello", "bye"]})
    with pytest.raises(AgentError, match=rf"interaction 'u' \(Broken.{method} in .*test_agent_rollout.py\) raised RuntimeError: boom; fix it"):
        AgentRollout(AgentConfig(), env, overlap_tools=False)(
            engine, _prompts(tok, ["q"], extra=[{"interaction_kwargs": {"name": "u"}}]), SamplingParams(max_new_tokens=100))


def test_an_unknown_agent_name_is_refused_with_the_known_ones(tok):
    with pytest.raises(ValueError, match=r"agent_name 'searcher' .* not a loop; known: single_turn, tool_agent"):
        AgentRollout(AgentConfig(), _calc_env(tok), overlap_tools=False)(
            ReplayEngine(tok, {}), _prompts(tok, ["q"], agent="searcher"), SamplingParams())


def test_answers_keep_the_turns_call_order_and_the_per_turn_limits(tok):
    bad_json = "<tool_call>\n{not json}\n</tool_call>"
    turn = _call("calc", expression="1+1") + bad_json + _call("nope") + _call("calc", expression="2+2") + _call("calc", expression="3")
    engine = ReplayEngine(tok, {"q": [turn, "end"]})
    env = _calc_env(tok, max_parallel_calls=2, max_tool_failures=9, max_tool_response_length=16)
    batch = AgentRollout(env.limits, env, overlap_tools=False)(engine, _prompts(tok, ["q"]), SamplingParams(max_new_tokens=900))
    text = tok.decode(batch.response_ids[0, : int(batch.response_lengths[0])].tolist())
    answers = [part.split("<|im_end|>")[0] for part in text.split("<|im_start|>tool\n")[1:]]
    cut = "...(truncated)"  # answers are cut at max_tool_response_length (16) characters
    assert answers == ["2", "Error: the tool " + cut, "Error: there is " + cut, "Error: not run: " + cut, "Error: not run: " + cut]
    assert batch.extra_info[0]["agent"]["tool_calls"] == 5 and batch.extra_info[0]["agent"]["tool_failures"] == 4


def test_an_aborted_turn_ends_the_trajectory_on_its_last_generated_token(tok):
    class Aborting(ReplayEngine):
        def generate(self, prompts, params):
            return [dataclasses.replace(r, finish_reason="abort") for r in super().generate(prompts, params)]

    import dataclasses

    engine = Aborting(tok, {"q": [_call("calc", expression="1"), "never"]})
    batch = AgentRollout(AgentConfig(), _calc_env(tok), overlap_tools=False)(engine, _prompts(tok, ["q"]), SamplingParams(max_new_tokens=300))
    assert batch.finish_reason == ["abort"] and batch.extra_info[0]["agent"]["tool_calls"] == 0
    assert batch.response_mask[0, : int(batch.response_lengths[0])].min() == 1.0


def test_a_loop_that_yields_no_calls_again_and_again_does_not_recurse(tok):
    from megarl.rollout.agents.loops import AgentLoop, CallTools, Generate

    class Idle(AgentLoop):
        def run(self):
            for _ in range(5000):
                assert (yield CallTools([])) == []
            result = yield Generate(4)
            return result.finish_reason

    class NotAGenerator(AgentLoop):
        def run(self):
            return "stop"

    engine = ReplayEngine(tok, {"q": ["x"]})
    rollout = AgentRollout(AgentConfig(), _calc_env(tok), overlap_tools=False)
    rollout.loops |= {"idle": Idle, "plain": NotAGenerator}  # as rollout.agent.loops would add them
    batch = rollout(engine, _prompts(tok, ["q"], agent="idle"), SamplingParams(max_new_tokens=10))
    assert batch.finish_reason == ["stop"]
    with pytest.raises(TypeError, match=r"NotAGenerator.run\(\) must be a generator"):
        rollout(ReplayEngine(tok, {"q": ["x"]}), _prompts(tok, ["q"], agent="plain"), SamplingParams(max_new_tokens=10))


class Paying(Tool):
    """verl's (text, reward, metrics) answer: 0.5 per call."""

    def execute(self, instance_id, parameters, **kwargs):
        return "ok", 0.5, {}


def test_a_non_finite_tool_reward_or_turn_score_never_reaches_the_rewards(tok):
    """A tool's NaN reward is its failure (the model is told, the reward is 0); an interaction's
    NaN score stops the run with one line: with turn_rewards either would reach the loss as NaN."""
    from megarl.rollout.agents.errors import AgentError
    from megarl.rollout.agents.interactions import Interaction

    class NanPay(Tool):
        def execute(self, instance_id, parameters, **kwargs):
            return "ok", float("nan"), {}

    env = _env(tok, {"pay": NanPay({}, {"type": "function", "function": {"name": "pay"}})}, turn_rewards=True)
    engine = ReplayEngine(tok, {"q": [_call("pay"), "end"]})
    batch = AgentRollout(env.limits, env, overlap_tools=False)(engine, _prompts(tok, ["q"]), SamplingParams(max_new_tokens=400))
    assert torch.isfinite(batch.turn_rewards).all() and batch.extra_info[0]["agent"]["tool_failures"] == 1
    assert "Error: the tool returned the reward nan, not a finite number" in tok.decode(batch.response_ids[0].tolist())

    class NanUser(RecordingUser):
        def generate_response(self, instance_id, messages, **kwargs):
            return False, "again", float("nan"), {}

    env = _calc_env(tok, turn_rewards=True)
    env.interactions = {"u": Interaction("u", NanUser({}))}
    with pytest.raises(AgentError, match=r"interaction 'u' \(NanUser.generate_response\) returned the score nan; return a finite number"):
        AgentRollout(env.limits, env, overlap_tools=False)(ReplayEngine(tok, {"q": ["hi", "hi"]}),
                                                           _prompts(tok, ["q"], extra=[{"interaction_kwargs": {"name": "u"}}]),
                                                           SamplingParams(max_new_tokens=100))  # fmt: skip


@pytest.mark.parametrize("per_turn", [False, True])
def test_turn_rewards_sit_on_the_last_generated_token_of_the_turn_that_earned_them(tok, per_turn):
    from megarl.algos.advantages import token_rewards_from_scores

    tools = {"pay": Paying({}, {"type": "function", "function": {"name": "pay"}})}
    engine = ReplayEngine(tok, {"q": [_call("pay"), _call("pay"), "end"]})
    env = _env(tok, tools, turn_rewards=per_turn)
    batch = AgentRollout(env.limits, env, overlap_tools=False)(engine, _prompts(tok, ["q"]), SamplingParams(max_new_tokens=400))
    if not per_turn:
        assert batch.turn_rewards is None
        return
    t1 = len(engine._ids(_call("pay")))
    mask = batch.response_mask[0]
    ends = [i for i in range(len(mask) - 1) if mask[i] == 1 and mask[i + 1] == 0]  # the two tool-calling turns' ends
    assert ends[0] == t1 - 1 and len(ends) == 2
    assert batch.turn_rewards[0].nonzero().flatten().tolist() == ends and batch.turn_rewards[0, ends].tolist() == [0.5, 0.5]
    rewards = token_rewards_from_scores(torch.tensor([1.0]), batch.response_lengths, batch.response_mask,
                                        turn_rewards=batch.turn_rewards)  # fmt: skip
    n = int(batch.response_lengths[0])
    assert rewards[0, n - 1] == 1.0 and rewards.sum() == 2.0  # the outcome on the last token, 0.5 per paying turn


def test_at_most_max_concurrent_trajectories_are_in_flight(tok):
    script = {f"q{i}": [_call("calc", expression="1"), "end"] for i in range(5)}
    engine = ReplayEngine(tok, script)
    env = _calc_env(tok, max_concurrent=2)
    batch = AgentRollout(env.limits, env, overlap_tools=False)(engine, _prompts(tok, list(script)), SamplingParams(max_new_tokens=300))
    assert max(engine.calls) == 2 and sum(engine.calls) == 10 and batch.finish_reason == ["stop"] * 5


def test_the_torch_engine_regenerates_a_multi_turn_step_exactly(tmp_path, monkeypatch):
    """Rounds do not depend on timing without overlap, so the same seed gives the same trajectories."""
    from megarl.engines.torch_engine import TorchEngine
    from megarl.models.tiny import build_tiny_model
    from megarl.rollout.agents.builtin_tools import Calculator
    from megarl.rollout.agents.tool_calls import PARSERS

    monkeypatch.syspath_prepend(str(EXAMPLES))
    digit_calls = PARSERS.get("agent_extensions:digit_calls")
    model = build_tiny_model(tmp_path / "m", task_vocab="01", markers=("<tool_call>", "</tool_call>"), seed=0,
                             max_position_embeddings=128)  # fmt: skip
    engine = TorchEngine(model)
    cfg = AgentConfig(default_agent="tool_agent")
    env = AgentEnv({"calc": Calculator({}, CALC)}, digit_calls, TurnEncoder(engine.tokenizer, engine.eos_token_ids), cfg)
    prompts = chat_prompts(engine.tokenizer, ["0110"] * 4)

    def run(seed: int):
        return AgentRollout(cfg, env, overlap_tools=False)(engine, prompts, SamplingParams(max_new_tokens=24, n=4, seed=seed))

    first, again, other = run(3), run(3), run(4)
    assert sum(e["agent"]["tool_calls"] > 0 for e in first.extra_info) >= 2  # multi-turn really happened
    assert torch.equal(first.response_ids, again.response_ids) and torch.equal(first.response_mask, again.response_mask)
    assert torch.equal(first.rollout_logprobs, again.rollout_logprobs)
    assert not torch.equal(first.response_ids[:, :4], other.response_ids[:, :4])


def test_with_the_torch_engine_a_hanging_tool_costs_the_step_its_timeout_only(tmp_path):
    from megarl.engines.torch_engine import TorchEngine
    from megarl.models.tiny import build_tiny_model

    engine = TorchEngine(build_tiny_model(tmp_path / "m", task_vocab="01", max_position_embeddings=256))
    tool = FirstCallHangs({}, {"type": "function", "function": {"name": "wait"}})
    cfg = AgentConfig(default_agent="tool_agent", max_turns=2, tool_timeout_s=1.0, max_tokens_per_turn=4)
    env = AgentEnv({"wait": tool}, always_call("wait"), TurnEncoder(engine.tokenizer, engine.eos_token_ids), cfg)
    prompts = chat_prompts(engine.tokenizer, ["01"] * 8)
    start = time.monotonic()
    batch = AgentRollout(cfg, env, overlap_tools=False)(engine, prompts, SamplingParams(max_new_tokens=40, seed=1))
    wall = time.monotonic() - start
    assert batch.finish_reason == ["max_turns"] * 8 and len(tool.starts) == 8  # one call each, then the turn limit
    assert sum(e["agent"]["tool_failures"] for e in batch.extra_info) == 1  # the hung one timed out
    assert wall < 1.0 + 3.0  # the timeout plus two rounds of generation (well under a second each here)


class VersionedReplayEngine(ReplayEngine):
    """ReplayEngine whose tokens carry a weight version: the number of the generate call."""

    def generate(self, prompts, params: SamplingParams) -> list[GenerationResult]:
        out = super().generate(prompts, params)
        return [dataclasses.replace(r, token_versions=(len(self.calls),) * len(r.response_ids)) for r in out]


def test_a_trajectory_carries_each_tokens_weight_version_and_context_takes_its_turns(tok):
    turn1, turn2 = _call("calc", expression="2+3"), "It is 5."
    rollout = AgentRollout(AgentConfig(), _calc_env(tok), overlap_tools=False)
    engine = VersionedReplayEngine(tok, {"what is 2+3?": [turn1, turn2]})
    batch = rollout(engine, _prompts(tok, ["what is 2+3?"]), SamplingParams(max_new_tokens=200, seed=1))
    n, mask = int(batch.response_lengths[0]), batch.response_mask[0].tolist()
    t1, context = len(engine._ids(turn1)), mask.index(1.0, len(engine._ids(turn1))) - len(engine._ids(turn1))
    assert batch.token_versions[0, :n].tolist() == [1] * (t1 + context) + [2] * (n - t1 - context)
    assert batch.token_versions[0, n:].eq(0).all()
    # an engine without versions (SGLang): none in the batch
    plain = rollout(ReplayEngine(tok, {"what is 2+3?": [turn1, turn2]}), _prompts(tok, ["what is 2+3?"]),
                    SamplingParams(max_new_tokens=200, seed=1))  # fmt: skip
    assert plain.token_versions is None


def test_a_tool_module_slow_to_import_says_so_while_the_run_builds_it(tmp_path, monkeypatch, tok, caplog):
    """The run imports the tool file's modules again after the pre-launch check (which did so in a
    process of its own): a module that takes seconds at import shows progress lines, not silence."""
    from megarl.progress import NOTE_FIRST_S

    (tmp_path / "slow_tools_44.py").write_text(
        "import time\nfrom megarl.rollout.agents.tool_base import Tool\n"
        f"time.sleep({NOTE_FIRST_S + 1.5})  # past the first progress line\n"
        "class Calc(Tool):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    tools_file = tmp_path / "tools.yaml"
    tools_file.write_text(yaml.safe_dump({"tools": [{"class_name": "slow_tools_44.Calc", "tool_schema": CALC}]}))
    with caplog.at_level("INFO", logger="megarl.progress"):
        env = build_env(AgentConfig(tools_file=str(tools_file)), tok, [_eos(tok)])
    assert list(env.tools) == ["calc"]
    what = f"importing and building the classes of rollout.agent.tools_file ({tools_file})"
    lines = [r.getMessage() for r in caplog.records if r.name == "megarl.progress"]
    assert any(line.startswith(f"{what} ... (") for line in lines), lines
    assert lines[-1].startswith(f"{what}: done in "), lines


class StuckAtTheEnd(RecordingUser):
    """An interaction whose finalize_interaction never returns (until released)."""

    def __init__(self, config):
        super().__init__(config)
        self.finalized, self.release = [], threading.Event()

    def finalize_interaction(self, instance_id):
        self.finalized.append(instance_id)
        self.release.wait()


def _stuck_rollout(tok, impl, timeout_s):
    from megarl.rollout.agents.interactions import Interaction

    env = _calc_env(tok)
    env.interactions = {"u": Interaction("u", impl, timeout_s=timeout_s)}
    engine = ReplayEngine(tok, {"a": ["hello"], "b": [_call("calc", expr="1+1"), "bye"]})  # a ends first; b is then mid-way
    extra = [{"interaction_kwargs": {"name": "u"}}] * 2
    return lambda: AgentRollout(AgentConfig(), env, overlap_tools=False)(engine, _prompts(tok, ["a", "b"], extra=extra),
                                                                          SamplingParams(max_new_tokens=100))  # fmt: skip


def test_a_hung_finalize_interaction_is_one_error_at_its_deadline_and_no_noise(tok, capsys):
    """Before: every other loop, closed, ran finalize_interaction again (each up to its deadline),
    and what those raised came out as "Exception ignored in generator ToolAgent.run" tracebacks."""
    import gc

    from megarl.rollout.agents.interactions import InteractionTimeout

    impl = StuckAtTheEnd({})
    try:
        with pytest.raises(InteractionTimeout) as info:
            _stuck_rollout(tok, impl, 0.5)()
        gc.collect()
    finally:
        impl.release.set()
    assert str(info.value).startswith("interaction 'u' (StuckAtTheEnd.finalize_interaction in ") and (
        "did not return within 0.5 s; make it return sooner (it runs as each conversation ends" in str(info.value))
    assert "rollout.agent.interaction_timeout_s" in str(info.value)
    assert len(impl.finalized) == 1  # the conversation still running was closed without it
    assert "Exception ignored" not in capsys.readouterr().err


def test_ctrl_c_while_finalize_interaction_hangs_stops_the_rollout_at_once(tok, capsys):
    """The user's Ctrl-C during the wait ends the rollout as a KeyboardInterrupt, and no
    finalize_interaction runs while the other loops are closed (each would wait its deadline)."""
    import gc
    import os
    import signal as signals

    impl = StuckAtTheEnd({})
    previous = signals.signal(signals.SIGINT, signals.default_int_handler)
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signals.SIGINT))
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            _stuck_rollout(tok, impl, 600)()
        gc.collect()
    finally:
        timer.cancel()
        signals.signal(signals.SIGINT, previous)
        impl.release.set()
    assert len(impl.finalized) == 1
    assert "Exception ignored" not in capsys.readouterr().err


def _stop_requested_after(seconds: float, control, monkeypatch, grace_s: float):
    """``control``'s handlers installed, inside a step (a first signal asks for a stop after it),
    user code given ``grace_s`` after a stop, and a SIGINT to this process in ``seconds``."""
    import os
    import signal as signals

    import megarl.user_code

    monkeypatch.setattr(megarl.user_code, "STOP_GRACE_S", grace_s)
    control.deferred = True
    return threading.Timer(seconds, os.kill, (os.getpid(), signals.SIGINT))


def test_a_first_ctrl_c_while_finalize_interaction_hangs_gives_up_on_it_after_the_grace(tok, capsys, monkeypatch):
    """Before: the first Ctrl-C said "stopping after this step" and the step then waited the
    method's whole interaction_timeout_s, to end in its timeout error (exit 2, nothing saved)."""
    import gc

    from megarl.trainer.watchdog import RunControl
    from megarl.user_code import WaitAbandoned, current_wait

    impl, control = StuckAtTheEnd({}), RunControl()
    with control.handlers():
        timer = _stop_requested_after(0.5, control, monkeypatch, grace_s=1.0)
        try:
            timer.start()
            with pytest.raises(WaitAbandoned) as info:
                _stuck_rollout(tok, impl, 120)()  # (without the grace: InteractionTimeout, 2 minutes later)
            gc.collect()
        finally:
            timer.cancel()
            impl.release.set()
    assert control.stop_requested and control.exit_code == 130 and current_wait() is None
    assert str(info.value).startswith("interaction 'u' (StuckAtTheEnd.finalize_interaction in ")
    assert str(info.value).endswith(" did not return within 1 s of the stop") and " was waited on for " in str(info.value)
    err = capsys.readouterr().err
    assert "megarl: SIGINT (Ctrl-C) received: stopping after this step and saving a checkpoint; waiting at most 1 s more " \
           "for interaction 'u' (StuckAtTheEnd.finalize_interaction in " in err
    assert "Exception ignored" not in err
    assert len(impl.finalized) == 1  # the other conversation, closed, ran no finalize_interaction


def test_after_a_first_ctrl_c_a_tool_that_answers_within_the_grace_lets_the_step_finish(tok, monkeypatch):
    from megarl.trainer.watchdog import RunControl

    sleepy = {"sleep": Sleepy({"seconds": 1.5}, {"type": "function", "function": {"name": "sleep"}})}
    script = {f"q{i}": [_call("sleep", slow=i == 0), "end"] for i in range(2)}
    env = _env(tok, sleepy, tool_timeout_s=120.0)
    control = RunControl()
    with control.handlers():
        timer = _stop_requested_after(0.5, control, monkeypatch, grace_s=60.0)
        try:
            timer.start()
            batch = AgentRollout(env.limits, env, overlap_tools=False)(ReplayEngine(tok, script), _prompts(tok, list(script)),
                                                                       SamplingParams(max_new_tokens=300))  # fmt: skip
        finally:
            timer.cancel()
    assert control.stop_requested  # asked during the tool's call, which answered: the step is whole
    assert batch.finish_reason == ["stop", "stop"]


def test_a_first_ctrl_c_while_a_tool_hangs_gives_up_on_it_after_the_grace(tok, monkeypatch):
    from megarl.trainer.watchdog import RunControl
    from megarl.user_code import WaitAbandoned

    sleepy = {"sleep": Sleepy({"seconds": 60.0}, {"type": "function", "function": {"name": "sleep"}})}
    script = {f"q{i}": [_call("sleep", slow=i == 0), "end"] for i in range(2)}
    env = _env(tok, sleepy, tool_timeout_s=120.0)
    control = RunControl()
    with control.handlers():
        timer = _stop_requested_after(0.5, control, monkeypatch, grace_s=1.0)
        try:
            timer.start()
            with pytest.raises(WaitAbandoned, match="^tool 'sleep' was waited on for .* s and did not return within 1 s of the stop$"):
                AgentRollout(env.limits, env, overlap_tools=False)(ReplayEngine(tok, script), _prompts(tok, list(script)),
                                                                   SamplingParams(max_new_tokens=300))  # fmt: skip
        finally:
            timer.cancel()
