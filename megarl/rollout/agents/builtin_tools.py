"""The built-in tools: ``calculator``, ``python`` and ``retrieval`` (the ``class_name`` of a tool file).

A tool file always supplies the schema the model sees; the parameters each tool reads are in its
class docstring. Example entry::

    tools:
      - class_name: calculator
        config: {type: native}
        tool_schema:
          type: function
          function:
            name: calc
            description: Evaluate an arithmetic expression.
            parameters: {type: object, properties: {expression: {type: string}}, required: [expression]}

Bad input from the model raises ``ValueError`` with a message written for the model to read:
``start_tool_call`` turns it into an ``Error: ...`` answer, the rollout goes on.
"""

from __future__ import annotations

import ast
import json
import math
import operator
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megarl.rewards.code_sandbox import bwrap_available, extract_program, run_program
from megarl.rollout.agents.tool_base import Tool, register_tool
from megarl.signal_kinds import signal_name

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64  # |exponent| of ** at most this
MAX_RESULT = 10**100  # no value (the result or a step of it) may be larger in magnitude
STDERR_LINES = 20  # lines of a failed program's stderr shown to the model
OUTPUT_CHARS = 4096  # the python tool's answer: stdout cut so that the error stays visible

_ALLOWED = "use numbers, + - * / // % ** and parentheses"
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_OTHER_OPERATORS: dict[type, str] = {  # looked up by the type of any node's op (None too)
    ast.BitXor: "^ (write ** for a power)",
    ast.BitAnd: "&",
    ast.BitOr: "|",
    ast.LShift: "<<",
    ast.RShift: ">>",
    ast.MatMult: "@",
    ast.Invert: "~",
    ast.Not: "not",
}
_REFUSED = {  # node type -> what the model wrote, in words
    ast.Name: "names are not allowed",
    ast.Call: "function calls are not allowed",
    ast.Attribute: "attribute access is not allowed",
    ast.Subscript: "indexing is not allowed",
    ast.Compare: "comparisons are not allowed",
    ast.BoolOp: "and/or are not allowed",
    ast.Lambda: "lambdas are not allowed",
    ast.Tuple: "commas are not allowed (write 1234, not 1,234; one expression per call)",
}


def _argument(parameters: Any, tool: str, name: str) -> str:
    value = parameters.get(name) if isinstance(parameters, dict) else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)  # {"expression": 123} from a model that skipped the quotes
    if not isinstance(value, str):
        raise ValueError(f"{tool}: needs the argument {name!r} (a string), got {parameters!r}"[:300])
    return value


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; ``ValueError`` (the reason, for the model) otherwise."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"calculator: the expression has {len(expression)} characters, "
                         f"at most {MAX_EXPRESSION_CHARS} are allowed")  # fmt: skip
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"calculator: {expression!r} is not an arithmetic expression ({exc.msg}); {_ALLOWED}") from exc
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise ValueError(f"calculator: only numbers are allowed, not {node.value!r}; {_ALLOWED}")
        return _checked(node.value, ast.unparse(node))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError as exc:
            raise ValueError(f"calculator: division by zero in {ast.unparse(node)!r}") from exc
        except OverflowError as exc:
            raise ValueError(f"calculator: {ast.unparse(node)!r} is too large (over 1e100)") from exc
        return _checked(result, ast.unparse(node))
    raise ValueError(_refusal(node))


def _refusal(node: ast.AST) -> str:
    text = ast.unparse(node)
    text = text if len(text) <= 60 else text[:57] + "..."
    op = getattr(node, "op", None)
    if type(op) in _OTHER_OPERATORS:
        return f"calculator: the operator {_OTHER_OPERATORS[type(op)]} is not allowed: {text!r}; {_ALLOWED}"
    what = _REFUSED.get(type(node), f"{type(node).__name__} is not allowed")
    return f"calculator: {what}: {text!r}; {_ALLOWED}"


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuse a power before computing it when the exponent or the result would be too large."""
    if abs(exponent) > MAX_EXPONENT:
        raise ValueError(f"calculator: the exponent {exponent} is too large (at most {MAX_EXPONENT} in magnitude)")
    if base != 0 and exponent * math.log10(abs(base)) > math.log10(MAX_RESULT) + 1e-9:
        raise ValueError(f"calculator: {base}**{exponent} is too large (over 1e100)")


def _checked(value: Any, text: str) -> int | float:
    if isinstance(value, complex):
        raise ValueError(f"calculator: {text!r} is not a real number")
    limit = float(MAX_RESULT) if isinstance(value, float) else MAX_RESULT  # 1e100 is a bit over 10**100
    if (isinstance(value, float) and not math.isfinite(value)) or abs(value) > limit:
        raise ValueError(f"calculator: {text!r} is too large (over 1e100)")
    return value


def format_number(value: int | float) -> str:
    """An int as is; a float that is a small whole number as an int (6/3 -> 2); else the shortest repr."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return str(value) if isinstance(value, int) else repr(value)


@register_tool("calculator")
class Calculator(Tool):
    """Safe arithmetic: ``{"expression": str}`` -> the value as text (``"2+3*4"`` -> ``"14"``).

    Numbers (int, float), unary + -, binary + - * / // % ** and parentheses only; no names,
    calls, attributes, strings or comparisons. At most 200 characters, exponents at most 64 in
    magnitude, values at most 1e100. No config.
    """

    def execute(self, instance_id: str, parameters: dict[str, Any], **_execute_kwargs: Any) -> str:
        return format_number(evaluate(_argument(parameters, "calculator", "expression")))


@register_tool("python")
class PythonTool(Tool):
    """Runs ``{"code": str}`` (a ```python fence around it is stripped) in the code rewards' sandbox.

    The program gets no stdin, the standard library only, a scratch working directory, and
    with bubblewrap no network (megarl/rewards/code_sandbox.py). The answer is what it printed;
    when it fails, also the last 20 lines of its stderr; on timeout, a line saying so.

    Config: ``time_limit_s`` (5.0, wall clock), ``memory_limit_mb`` (512), ``use_bwrap``
    (unset: bubblewrap when it works here; true: required, refused at load without it).
    """

    def __init__(self, config: dict[str, Any], tool_schema: dict[str, Any]):
        super().__init__(config, tool_schema)
        unknown = set(self.config) - {"time_limit_s", "memory_limit_mb", "use_bwrap"}
        if unknown:
            raise ValueError(f"python tool: unknown config keys {sorted(unknown)}; "
                             "known: time_limit_s, memory_limit_mb, use_bwrap")  # fmt: skip
        self.time_limit_s = float(self.config.get("time_limit_s", 5.0))
        self.memory_limit_mb = int(self.config.get("memory_limit_mb", 512))
        if self.time_limit_s <= 0 or self.memory_limit_mb <= 0:
            raise ValueError(f"python tool: time_limit_s ({self.time_limit_s}) and memory_limit_mb "
                             f"({self.memory_limit_mb}) must be positive")  # fmt: skip
        self.use_bwrap = self.config.get("use_bwrap")
        if self.use_bwrap and not bwrap_available():
            raise ValueError("python tool: use_bwrap is true but bubblewrap (bwrap) is not installed or "
                             "cannot create namespaces here; install it or drop use_bwrap")  # fmt: skip

    def execute(self, instance_id: str, parameters: dict[str, Any], **_execute_kwargs: Any) -> str:
        code = _argument(parameters, "python", "code")
        if "```" in code:
            code = extract_program(code) or code
        result = run_program(code, time_limit_s=self.time_limit_s, memory_limit_mb=self.memory_limit_mb,
                             use_bwrap=self.use_bwrap)  # fmt: skip
        if not result.timed_out and result.returncode == 0:
            return result.stdout or "(no output: print() what you want to see)"
        lines = result.stderr.rstrip("\n").splitlines()[-STDERR_LINES:]
        problem = "\n".join(lines)[-2000:]
        if result.timed_out:
            problem += f"\nError: the program timed out after {self.time_limit_s:g} s and was killed"
        elif result.returncode is not None and result.returncode > 0:
            problem += f"\nError: the program exited with code {result.returncode}"
        elif result.returncode is not None and result.returncode < 0:
            problem += f"\nError: the program was killed by signal {signal_name(-result.returncode)} (a CPU, memory or output limit)"
        problem = problem.strip("\n") + "\n"
        stdout = result.stdout
        room = max(OUTPUT_CHARS - len(problem) - 100, 0)  # keep the error visible after the cut
        if len(stdout) > room:
            stdout = stdout[:room] + "...(output truncated)\n"
        elif stdout and not stdout.endswith("\n"):
            stdout += "\n"
        return stdout + problem


@register_tool("retrieval")
class Retrieval(Tool):
    """BM25 search (``bm25s``) over a local corpus: ``{"query": str}`` -> the best passages, numbered.

    Config: ``corpus``, the path of a ``.jsonl`` file (one ``{"text": ..., "title": ...}`` per line,
    title optional) or a ``.txt`` file (one passage per non-empty line); ``top_k`` (3). The index is
    built once, when the tool is loaded. English stopwords are dropped, no stemming; passages that
    share no word with the query are not returned.
    """

    def __init__(self, config: dict[str, Any], tool_schema: dict[str, Any]):
        super().__init__(config, tool_schema)
        try:
            import bm25s
        except ImportError as exc:
            raise ImportError("the retrieval tool needs the bm25s package: pip install bm25s") from exc
        unknown = set(self.config) - {"corpus", "top_k"}
        if unknown:
            raise ValueError(f"retrieval tool: unknown config keys {sorted(unknown)}; known: corpus, top_k")
        if not self.config.get("corpus"):
            raise ValueError("retrieval tool: config needs 'corpus', the path of a .jsonl file "
                             '(one {"text": ...} per line) or a .txt file (one passage per line)')  # fmt: skip
        self.top_k = int(self.config.get("top_k", 3))
        if self.top_k < 1:
            raise ValueError(f"retrieval tool: top_k must be at least 1, got {self.top_k}")
        self.passages, texts = _read_corpus(Path(str(self.config["corpus"])).expanduser())
        self._tokenize = bm25s.tokenize
        self._index = bm25s.BM25()
        self._index.index(bm25s.tokenize(texts, stopwords="en", show_progress=False), show_progress=False)

    def execute(self, instance_id: str, parameters: dict[str, Any], **_execute_kwargs: Any) -> str:
        query = _argument(parameters, "retrieval", "query")
        tokens = self._tokenize(query, stopwords="en", return_ids=False, show_progress=False)[0]
        known = [token for token in tokens if token and token in self._index.vocab_dict]
        if not known:
            return f"No results for {query!r} (none of its words occur in the corpus)."
        scores = self._index.get_scores(known)
        order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
        best = [i for i in order[: self.top_k] if scores[i] > 0]
        if not best:
            return f"No results for {query!r}."
        return "\n".join(f"{rank}. {self.passages[i]}" for rank, i in enumerate(best, 1))


def _read_corpus(path: Path) -> tuple[list[str], list[str]]:
    """The passages as shown to the model, and the texts indexed (title and text)."""
    fix = 'a .jsonl file (one {"text": ..., "title": ...} per line) or a .txt file (one passage per line)'
    if path.suffix not in (".jsonl", ".txt"):
        raise ValueError(f"retrieval tool: corpus {path} must be {fix}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"retrieval tool: corpus {path} cannot be read ({exc.strerror}); "
                         f"set config.corpus to {fix}") from exc  # fmt: skip
    passages: list[str] = []
    texts: list[str] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if path.suffix == ".txt":
            passages.append(line.strip())
            texts.append(line)
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"retrieval tool: corpus {path}, line {number}: not JSON ({exc.msg})") from exc
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise ValueError(f"retrieval tool: corpus {path}, line {number}: needs a string field 'text'")
        title = row.get("title")
        title = title.strip() if isinstance(title, str) else ""
        text = row["text"].strip()
        passages.append(f"{title}: {text}" if title else text)
        texts.append(f"{title}\n{text}")
    if not passages:
        raise ValueError(f"retrieval tool: corpus {path} has no passages; it must be {fix}")
    return passages, texts
