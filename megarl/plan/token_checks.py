"""What the policy's tokenizer must be able to write for the data to train at all, checked before
launch (megarl/plan/preflight.py calls it once model.path's tokenizer loads):

- the tool calls the agent loop's parser reads (rollout.agent.tool_parser ``hermes``:
  ``<tool_call>{json}</tool_call>``, or the tool-use demo's compact parser: ``<tool_call>12+34</tool_call>``),
  when rollout.agent.tools_file offers tools;
- per data file, the answer its first row's built-in scorer reads (``#### 42`` for gsm8k,
  ``\\boxed{42}`` for math, the whole trajectory of call and answer for tool_sum, ...:
  megarl/rewards/registry.py, model_answer), made from the row's ground truth and extra_info (a
  data source of reward.combine is left to its components' checks).

Each is encoded and decoded by the tokenizer, as a response the model samples is: a text that
does not come back as it must (the parser finds no call, the scorer scores less) is text the
model can never write, and the run would train at reward 0 with no word. A data set for another
model (tool-use or gsm8k data on the digits-only demo model) is the case this catches. Left out:
a parser of the user's (its format is not known here) and reward functions of the user's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megarl.config.sections import MegaRLConfig
from megarl.plan.issues import Finding

ROWS_TRIED = 20  # rows of a file tried for one whose right answer its scorer takes (a few suffice)


def round_trip(tokenizer: Any, text: str) -> str:
    """``text`` as the model would write it: its token ids, decoded as responses are, special
    tokens kept (a trajectory's turn markers are what the tool_sum scorer reads). Unknown
    characters are dropped, so the finding shows what is left of the text rather than ``<unk>``s."""
    unknown = getattr(tokenizer, "unk_token_id", None)
    ids = [i for i in tokenizer.encode(text, add_special_tokens=False) if unknown is None or i != unknown]
    return tokenizer.decode(ids, skip_special_tokens=False)


def offered_tools(cfg: MegaRLConfig) -> list[dict[str, Any]]:
    """The tool schemas the prompts show; none when rollout.agent.tools_file cannot be read (the
    preflight names that file once, with the plan's other problems, rather than stop here)."""
    from megarl.rollout.agents.tools import ToolFileError, prompt_tools

    try:
        return prompt_tools(cfg)
    except ToolFileError:
        return []


def check_tool_calls(cfg: MegaRLConfig, tokenizer: Callable[[], Any], findings: list[Finding]) -> None:
    """A call of the first offered tool, in the parser's format, survives the round trip."""
    from megarl.rollout.agents.sample_calls import sample_call

    tools = offered_tools(cfg)
    name = next((t.get("function", {}).get("name") for t in tools if isinstance(t, dict)), None)
    call = sample_call(cfg.rollout.agent.tool_parser, name) if name else None
    if call is None:
        return
    text, parse = call
    written = round_trip(tokenizer(), text)
    if [c.name for c in parse(written).calls] != [name]:
        findings.append(Finding("rollout.agent.tools_file", f"offers tools, and a call in the format rollout.agent.tool_parser "
                                f"({cfg.rollout.agent.tool_parser}) reads, {text!r}, comes back from model.path's tokenizer "
                                f"as {written!r}: the model cannot write a tool call; {_model_fix(cfg)}"))  # fmt: skip


def _model_fix(cfg: MegaRLConfig) -> str:
    """The fix for a tokenizer that cannot write the parser's calls: the tool-use demo's model for
    its compact format (a digits-only demo model is the likely mistake), else a real chat model."""
    from megarl.rollout.agents.compact_calls import COMPACT_PARSER

    if cfg.rollout.agent.tool_parser == COMPACT_PARSER:
        return ("use the tool-use demo's model, which has the call markers in its vocabulary (model.path of "
                "configs/tiny_tool_agent.yaml, built by `megarl demo --config configs/tiny_tool_agent.yaml`)")
    return "use a model whose tokenizer can (e.g. Qwen2.5 or Qwen3), or data without tools (megarl data gsm8k without --tools)"


def check_answers(cfg: MegaRLConfig, files: list[tuple[str, list[Any]]], tokenizer: Callable[[], Any],
                  findings: list[Finding]) -> None:  # fmt: skip
    """Per file (label, PromptRecords): the right answer to its first row scorable by a built-in
    scorer, in that scorer's format, scores as much after the round trip as before it."""
    import megarl.rewards.registry as registry

    r = cfg.reward
    if r.custom is not None or r.model is not None:
        return
    for label, records in files:
        for record in records[:ROWS_TRIED]:
            if record.data_source in r.combine:  # scored by its components (megarl/plan/reward_checks.py)
                continue
            try:
                name = registry.resolve(record.data_source, r.functions)
            except ValueError:
                continue  # the scorer check's finding
            answer = registry.model_answer(name, record.ground_truth, record.extra_info)
            if answer is None:
                continue
            full = _score(registry, name, record, answer)
            if full <= 0:  # an answer the scorer does not take as right (an odd ground truth): no verdict
                continue
            written = round_trip(tokenizer(), answer)
            got = _score(registry, name, record, written)
            if got < full:
                findings.append(Finding(label, f"row {record.row}: a right answer in the format the {name!r} scorer reads, "
                                        f"{answer!r}, comes back from model.path's tokenizer as {written!r} and scores "
                                        f"{got:g}, not {full:g}: the model cannot write it and every response would score "
                                        "at most that; use a model whose tokenizer can write it, data for this model, "
                                        "or score with reward.custom"))  # fmt: skip
            break  # one row a file: every row of a file shares its format


def _score(registry: Any, name: str, record: Any, response: str) -> float:
    value = registry.score(name, record.data_source, response, record.ground_truth, record.extra_info)
    return float(value["score"] if isinstance(value, dict) else value)
