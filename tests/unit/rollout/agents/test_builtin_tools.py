"""The built-in tools: calculator (values and refusals), python (sandboxed runs), retrieval (BM25),
and a verl-format tool file naming a built-in."""

import json
import time

import pytest

from megarl.rollout.agents.builtin_tools import Calculator, PythonTool, Retrieval
from megarl.rollout.agents.tools import BUILTIN_TOOLS, load_tools, start_tool_call


def schema(name: str, argument: str) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"the {name} tool",
            "parameters": {
                "type": "object",
                "properties": {argument: {"type": "string"}},
                "required": [argument],
            },
        },
    }


def calc(expression: str) -> str:
    return Calculator({}, schema("calc", "expression")).execute("id", {"expression": expression})


def test_the_builtin_names_are_registered():
    assert BUILTIN_TOOLS["calculator"] is Calculator
    assert BUILTIN_TOOLS["python"] is PythonTool
    assert BUILTIN_TOOLS["retrieval"] is Retrieval


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("2+3*4", "14"),
        ("(1+2)**3", "27"),
        ("7/2", "3.5"),
        ("6/3", "2"),  # an integral float is written as an int
        ("-5//2", "-3"),  # floor, not truncation
        ("-5 % 3", "1"),
        ("123", "123"),
        (" 2 ** -1 ", "0.5"),
        ("1.5*4", "6"),
        ("9**64", str(9**64)),  # exact big int, under 1e100
    ],
)
def test_calculator_values(expression, expected):
    assert calc(expression) == expected


def test_calculator_accepts_a_number_for_the_expression():
    assert Calculator({}, schema("calc", "expression")).execute("id", {"expression": 12}) == "12"


@pytest.mark.parametrize(
    "expression, reason",
    [
        ("x + 1", "names are not allowed: 'x'"),
        ("__import__('os')", "function calls are not allowed"),
        ("(1).real", "attribute access is not allowed"),
        ("'abc'", "only numbers are allowed"),
        ("1 < 2", "comparisons are not allowed"),
        ("2^3", "write ** for a power"),
        ("2**100000", "exponent 100000 is too large"),
        ("10**10**10", "exponent 10000000000 is too large"),
        ("99999999999**60", "too large (over 1e100)"),  # exponent is small, the result is not
        ("9**64 * 9**64", "too large (over 1e100)"),
        ("1" * 201, "201 characters, at most 200"),
        ("1/0", "division by zero"),
        ("5 // (2-2)", "division by zero"),
        ("(-8) ** 0.5", "not a real number"),
        ("2 +", "not an arithmetic expression"),
    ],
)
def test_calculator_refusals_say_why(expression, reason):
    with pytest.raises(ValueError, match="^calculator: ") as info:
        calc(expression)
    assert reason in str(info.value)


def test_calculator_missing_argument():
    tool = Calculator({}, schema("calc", "expression"))
    with pytest.raises(ValueError, match="calculator: needs the argument 'expression'"):
        tool.execute("id", {"expr": "1+1"})


def test_a_refusal_through_start_tool_call_is_an_error_outcome():
    tool = Calculator({}, schema("calc", "expression"))
    outcome = start_tool_call(tool, {"expression": "__import__('os').system('true')"}, {}).result(timeout=10)
    assert outcome.error == "error"
    assert outcome.text.startswith("Error: calculator: function calls are not allowed")
    good = start_tool_call(tool, {"expression": "2+3*4"}, {}).result(timeout=10)
    assert (good.text, good.error) == ("14", None)


def python_tool(**config) -> PythonTool:
    return PythonTool(config, schema("run_python", "code"))


def test_python_prints_and_strips_a_fence():
    tool = python_tool()
    assert tool.execute("id", {"code": "print(6*7)"}) == "42\n"
    fenced = "Here:\n```python\nprint('a' + 'b')\n```\n"
    assert tool.execute("id", {"code": fenced}) == "ab\n"


def test_python_error_shows_the_output_and_the_exception():
    text = python_tool().execute("id", {"code": "print('before')\n{}['missing']\n"})
    assert text.startswith("before\n")
    assert "KeyError: 'missing'" in text


def test_python_timeout_is_reported_and_bounded():
    start = time.monotonic()
    text = python_tool(time_limit_s=1).execute("id", {"code": "while True:\n    pass\n"})
    assert time.monotonic() - start < 10
    assert "timed out after 1 s" in text


def test_python_config_is_checked():
    with pytest.raises(ValueError, match="unknown config keys \\['timeout'\\]"):
        python_tool(timeout=3)
    with pytest.raises(ValueError, match="must be positive"):
        python_tool(time_limit_s=0)


PASSAGES = [
    "Paris is the capital of France.",
    "Berlin is the capital of Germany.",
    "The platypus is a mammal that lays eggs.",
    "Rome is the capital of Italy.",
]


def retrieval(corpus, top_k=None) -> Retrieval:
    config = {"corpus": str(corpus)} | ({} if top_k is None else {"top_k": top_k})
    return Retrieval(config, schema("search", "query"))


def test_retrieval_txt_ranks_the_only_match_first(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(PASSAGES[:2]) + "\n\n" + "\n".join(PASSAGES[2:]) + "\n")  # a blank line
    text = retrieval(corpus).execute("id", {"query": "Which animal lays eggs?"})
    assert text.splitlines()[0] == "1. The platypus is a mammal that lays eggs."
    assert len(text.splitlines()) == 1  # the other passages share no word with the query


def test_retrieval_top_k_and_a_small_corpus(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(PASSAGES))
    lines = retrieval(corpus, top_k=2).execute("id", {"query": "capital of Germany"}).splitlines()
    assert lines[0] == "1. Berlin is the capital of Germany."
    assert len(lines) == 2 and lines[1].startswith("2. ") and "capital" in lines[1]
    # top_k larger than the corpus: what exists, no error
    lines = retrieval(corpus, top_k=10).execute("id", {"query": "capital"}).splitlines()
    assert [line[:3] for line in lines] == ["1. ", "2. ", "3. "]


def test_retrieval_jsonl_with_titles(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    rows = [{"title": "Platypus", "text": "A mammal that lays eggs."}, {"text": "Paris is in France."}]
    corpus.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tool = retrieval(corpus)
    assert tool.execute("id", {"query": "platypus"}) == "1. Platypus: A mammal that lays eggs."
    assert tool.execute("id", {"query": "paris"}) == "1. Paris is in France."


def test_retrieval_unknown_words_give_no_results(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(PASSAGES))
    tool = retrieval(corpus)
    assert tool.execute("id", {"query": "zyzzyva quokka"}).startswith("No results")
    assert tool.execute("id", {"query": "the of"}).startswith("No results")  # stopwords only
    assert tool.execute("id", {"query": ""}).startswith("No results")


def test_retrieval_bad_corpus_names_the_path(tmp_path):
    missing = tmp_path / "nowhere.txt"
    with pytest.raises(ValueError, match="nowhere.txt cannot be read") as info:
        retrieval(missing)
    assert str(missing) in str(info.value)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="empty.jsonl has no passages"):
        retrieval(empty)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "ok"}\n{"title": "no text"}\n')
    with pytest.raises(ValueError, match="broken.jsonl, line 2: needs a string field 'text'"):
        retrieval(broken)
    with pytest.raises(ValueError, match="needs 'corpus'"):
        Retrieval({}, schema("search", "query"))


def test_load_tools_verl_format_with_a_builtin(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(
        "tools:\n"
        "  - class_name: calculator\n"
        "    config:\n"
        "      type: native\n"
        "    tool_schema:\n"
        "      type: function\n"
        "      function:\n"
        "        name: calc\n"
        "        description: Evaluate an arithmetic expression.\n"
        "        parameters:\n"
        "          type: object\n"
        "          properties:\n"
        "            expression:\n"
        "              type: string\n"
        "              description: for example 2+3*4\n"
        "          required: [expression]\n"
    )
    tools = load_tools(path)
    assert list(tools) == ["calc"]
    assert isinstance(tools["calc"], Calculator)
    outcome = start_tool_call(tools["calc"], {"expression": "(1+2)**3"}, {}).result(timeout=10)
    assert (outcome.text, outcome.error) == ("27", None)


def test_a_tool_file_that_is_not_valid_yaml_is_one_line_naming_it(tmp_path):
    from megarl.rollout.agents.errors import AgentError

    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n  - class_name: calculator\n    config: {type: native\n")
    with pytest.raises(AgentError) as err:
        load_tools(path)
    # PyYAML's own text spans 6 lines and names the file "<unicode string>"
    assert str(err.value).startswith(f"{path}:4:1: ") and "\n" not in str(err.value)
    assert "<unicode string>" not in str(err.value)
    path.write_bytes(b"tools:\n  - class_name: calcul\xe9tor\n")
    with pytest.raises(AgentError, match=f"^tool file {path} is not a YAML text file \\(byte 0xe9 at offset 29 is not UTF-8\\); save it as UTF-8 text$"):
        load_tools(path)


def test_a_verl_tool_class_points_at_the_built_ins(tmp_path):
    """A verl tool file as it is names verl's classes: the fix is megarl's built-in or a port, not
    installing verl."""
    from megarl.rollout.agents.errors import AgentError

    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n    config: {type: native}\n"
                    "    tool_schema: {type: function, function: {name: calc_gsm8k_reward, parameters: {type: object}}}\n")
    with pytest.raises(AgentError, match=r"class_name 'verl.tools.gsm8k_tool.Gsm8kTool' cannot be imported \(.*\); verl's "
                                         r"classes do not run in megarl: use a built-in name \(.*calculator.*\), or port the "
                                         r"class to megarl's base class"):  # fmt: skip
        load_tools(path)
