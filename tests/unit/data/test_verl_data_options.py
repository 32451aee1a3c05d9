"""verl's data options: data.reward_fn_key, data.apply_chat_template_kwargs, data.custom_cls, and
the reward_model fields besides ground_truth reaching the scorer (extra_info["reward_model"])."""

from __future__ import annotations

import copy
import re
import textwrap

import pytest
from pydantic import ValidationError

from megarl.config.sections import CustomDatasetConfig, DataConfig, RewardConfig
from megarl.data.datasets import DataError, read_prompt_file, write_prompt_file
from megarl.data.prompts import PromptBuilder
from megarl.data.stream import build_train_stream, load_val_prompts
from megarl.plan.import_check_child import ChildChecks


def test_reward_fn_key_names_the_column_read_as_the_data_source(tmp_path):
    rows = [{"task": "gsm8k", "prompt": "1+1?", "reward_model": {"ground_truth": "2", "style": "rule"}}]
    path = write_prompt_file(rows, tmp_path / "t.parquet")
    (record,) = read_prompt_file(path, source_key="task")
    assert record.data_source == "gsm8k"
    with pytest.raises(DataError, match=r"missing column 'data_source'"):
        read_prompt_file(path)  # the default column
    with pytest.raises(DataError, match=r"missing column 'kind' \(data.reward_fn_key is 'kind'\)"):
        read_prompt_file(path, source_key="kind")
    assert DataConfig().reward_fn_key == "data_source"


def test_reward_model_fields_besides_ground_truth_reach_the_scorer(tmp_path):
    rows = [{"data_source": "s", "prompt": "q", "reward_model": {"ground_truth": "2", "style": "rule", "min_len": 3},
             "extra_info": {"index": 0}},
            {"data_source": "s", "prompt": "q", "reward_model": {"ground_truth": "2", "style": "rule"}}]  # fmt: skip
    first, second = read_prompt_file(write_prompt_file(rows, tmp_path / "t.parquet"))
    assert first.extra_info == {"index": 0, "reward_model": {"style": "rule", "min_len": 3}}
    assert second.extra_info == {}  # parquet's null min_len is no field of that row: nothing beyond style


THINKING = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
            "{% if strict is defined and strict %}{{ raise_exception('strict is not supported') }}{% endif %}"
            "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}<assistant>")  # fmt: skip


@pytest.fixture
def thinking_tokenizer(byte_tokenizer):
    tok = copy.deepcopy(byte_tokenizer)
    tok.chat_template = THINKING
    return tok


def test_apply_chat_template_kwargs_reach_every_prompt(thinking_tokenizer, prompt_file):
    plain = PromptBuilder(thinking_tokenizer, max_prompt_length=100)
    assert plain.render("hi") == "<user>hi<assistant>"
    cfg = DataConfig(train_files=[str(prompt_file("t.parquet", ["hi", "yo"]))], val_files=[str(prompt_file("v.parquet", ["hey"]))],
                     apply_chat_template_kwargs={"enable_thinking": False}, max_prompt_length=100, prompts_per_step=2)
    batch = build_train_stream(cfg, thinking_tokenizer).next_batch()
    assert sorted(batch.prompt_text) == ["<user>hi<no-think><assistant>", "<user>yo<no-think><assistant>"]
    val = load_val_prompts(cfg, thinking_tokenizer)
    assert val is not None and val.prompt_text == ["<user>hey<no-think><assistant>"]


def test_an_argument_the_template_rejects_is_one_line_naming_the_key(thinking_tokenizer):
    builder = PromptBuilder(thinking_tokenizer, max_prompt_length=100, chat_template_kwargs={"strict": True})
    with pytest.raises(DataError) as info:
        builder.render("hi", "data.train_files[0] (t.parquet): row 0")
    message = str(info.value)
    assert "data.apply_chat_template_kwargs {'strict': True}" in message and "strict is not supported" in message
    assert "\n" not in message


def test_apply_chat_template_kwargs_config_errors():
    with pytest.raises(ValidationError, match="'tokenize' is an argument megarl sets itself"):
        DataConfig(apply_chat_template_kwargs={"tokenize": True})
    with pytest.raises(ValidationError, match="set data.apply_chat_template=true, or drop data.apply_chat_template_kwargs"):
        DataConfig(apply_chat_template=False, apply_chat_template_kwargs={"enable_thinking": False})


DATASET = textwrap.dedent(
    """
    import json

    class JsonlPrompts:  # verl's signature; rows in the verl schema, the prompt as verl's raw_prompt
        def __init__(self, data_files, tokenizer, config, processor=None):
            self.rows = [json.loads(line) for f in data_files for line in open(f)]
            self.limit = config.max_prompt_length, config.get("prompt_key")
        def __len__(self):
            return len(self.rows)
        def __getitem__(self, i):
            r = self.rows[i]
            return {"data_source": "gsm8k", "raw_prompt": [{"role": "user", "content": r["q"]}],
                    "reward_model": {"ground_truth": r["a"]}, "extra_info": {"i": i}, "input_ids": [1, 2]}

    class NoRows:
        def __init__(self, data_files, tokenizer, config): pass
        def __len__(self): return 0

    class OtherArguments:
        def __init__(self, path): pass
        def __len__(self): return 0
        def __getitem__(self, i): return {}

    class BadRow(JsonlPrompts):
        def __getitem__(self, i):
            return {"data_source": "gsm8k", "prompt": "q"}

    class Exits(JsonlPrompts):
        def __getitem__(self, i):
            import sys
            sys.exit(5)

    class Interrupts(JsonlPrompts):
        def __len__(self): raise KeyboardInterrupt

    class Boom(BaseException): pass

    class OwnBaseException(JsonlPrompts):
        def __getitem__(self, i): raise Boom("custom")

    class FailsToBuild(JsonlPrompts):
        def __init__(self, data_files, tokenizer, config):
            raise ValueError("column 'question' not found")

    class FailsToRead(JsonlPrompts):
        def __getitem__(self, i):
            return self.rows[i]["question"]
    """
)


@pytest.fixture
def dataset_file(tmp_path):
    path = tmp_path / "my_dataset.py"
    path.write_text(DATASET)
    (tmp_path / "train.jsonl").write_text('{"q": "1+1?", "a": "2"}\n{"q": "2+2?", "a": "4"}\n')
    return path


def _custom(dataset_file, name, **kw):
    return DataConfig(train_files=[str(dataset_file.with_name("train.jsonl"))], custom_cls=CustomDatasetConfig(path=str(dataset_file), name=name),
                      prompts_per_step=2, max_prompt_length=200, **kw)  # fmt: skip


def test_custom_cls_gives_the_training_prompts(dataset_file, byte_tokenizer):
    stream = build_train_stream(_custom(dataset_file, "JsonlPrompts"), byte_tokenizer)
    batch = stream.next_batch()
    assert sorted(batch.ground_truth) == ["2", "4"] and batch.data_source == ["gsm8k", "gsm8k"]
    assert all("<|im_start|>user\n" in t for t in batch.prompt_text) and {e["i"] for e in batch.extra_info} == {0, 1}


@pytest.mark.parametrize("name, error", [
    ("Missing", r"data.custom_cls.name: 'Missing' is not defined in .*my_dataset.py; classes there: BadRow, Boom, Exits, FailsToBuild, FailsToRead, Interrupts, JsonlPrompts"),
    ("NoRows", r"data.custom_cls: NoRows \(.*\) has no __getitem__"),
    ("OtherArguments", r"data.custom_cls: OtherArguments \(.*\) cannot be built as OtherArguments\(data_files=..., "),
    ("BadRow", r"data.custom_cls \(BadRow on data.train_files\): row 0 has no key 'reward_model'"),
    ("Exits", r"data.custom_cls \(Exits on data.train_files\) \(.*my_dataset.py\) called sys.exit\(5\) while it was built "
              r"or its rows read; a dataset class must raise an exception"),  # not the function's exit code
    ("Interrupts", r"data.custom_cls \(Interrupts on data.train_files\) \(.*my_dataset.py\) raised KeyboardInterrupt while "
                   r"it was built"),  # not the user's Ctrl-C
    ("OwnBaseException", r"data.custom_cls \(OwnBaseException on data.train_files\) \(.*my_dataset.py\) raised Boom \(a "
                         r"BaseException, which only ends a process\): custom while it was built or its rows read; a dataset class"),
])  # fmt: skip
def test_a_class_that_does_not_fit_is_one_line(dataset_file, byte_tokenizer, name, error):
    with pytest.raises(DataError, match=error) as info:
        build_train_stream(_custom(dataset_file, name), byte_tokenizer)
    assert "\n" not in str(info.value)


def _class_finding(cfg: DataConfig, tokenizer_dir) -> object:
    """The pre-launch check child's one finding on ``cfg``'s data.custom_cls (built and read on
    its train files with the tokenizer at ``tokenizer_dir``)."""
    build = {"files": [f.path for f in cfg.train_files], "field": "data.train_files", "model": str(tokenizer_dir),
             "config": cfg.model_dump(mode="json")}  # fmt: skip
    child = ChildChecks(None, [], cfg.custom_cls, RewardConfig().functions, build)
    try:
        (finding,) = child.results("data.custom_cls")
    finally:
        child.stop()
    return finding


def test_custom_cls_is_checked_before_launch(dataset_file, tmp_path):
    missing = CustomDatasetConfig(path=str(tmp_path / "nope.py"), name="X")
    checks = {"fits": CustomDatasetConfig(path=str(dataset_file), name="JsonlPrompts"), "missing file": missing,
              "no class": CustomDatasetConfig(path=str(dataset_file), name="OtherArguments")}
    found = {}
    for what, spec in checks.items():
        child = ChildChecks(None, [], spec, RewardConfig().functions)
        try:
            found[what] = [(f.field, f.message) for f in child.results("data.custom_cls")]
        finally:
            child.stop()
    assert found["fits"] == []
    assert found["missing file"][0][0] == "data.custom_cls.path" and "is not a file" in found["missing file"][0][1]
    assert found["no class"][0][0] == "data.custom_cls" and "verl's arguments" in found["no class"][0][1]


@pytest.mark.parametrize("hook", ["__init__", "__len__", "__getitem__(1)"])
def test_a_class_that_ends_the_check_s_process_is_named_by_the_hook_it_was_in(dataset_file, byte_tokenizer_dir, tmp_path, hook):
    """os._exit(0) in one of the class's hooks ends the check's process without a word: the finding
    names the hook that was running (its __getitem__(1), not its __init__), from the child's steps."""
    body = {"__init__": "    def __init__(self, *a, **kw):\n        os._exit(0)\n",
            "__len__": "    def __len__(self):\n        os._exit(0)\n",
            "__getitem__(1)": "    def __getitem__(self, i):\n        if i == 1:\n            os._exit(0)\n        return super().__getitem__(i)\n"}
    ending = tmp_path / "ending_dataset.py"
    ending.write_text(dataset_file.read_text() + "\nimport os\n\nclass Ends(JsonlPrompts):\n" + body[hook])
    cfg = _custom(dataset_file, "Ends").model_copy(update={"custom_cls": CustomDatasetConfig(path=str(ending), name="Ends")})
    finding = _class_finding(cfg, byte_tokenizer_dir)
    assert finding.field == "data.custom_cls" and "ended (exit code 0)" in finding.message, finding.message
    assert finding.message.endswith(f"before it answered: os._exit in its {hook}"), finding.message
    assert [h for h in ("__init__", "__len__", "__getitem__(0)", "__getitem__(1)") if f"its {h}" in finding.message] == [hook]


def test_a_class_that_ends_the_driver_past_the_checked_rows_is_named_by_its_method(dataset_file, byte_tokenizer_dir, tmp_path, capsys):
    """os._exit in __getitem__ of a row the pre-launch check did not read ends the driver itself:
    the supervisor's line names the class's method (the driver told it), not only the class."""
    import sys

    from megarl.driver_supervisor import supervise

    ending = tmp_path / "ending_dataset.py"
    ending.write_text(dataset_file.read_text() + "\nimport os\n\nclass Ends(JsonlPrompts):\n    def __getitem__(self, i):\n"
                      "        if i == 1:\n            os._exit(0)\n        return super().__getitem__(i)\n")  # fmt: skip
    cfg = _custom(dataset_file, "Ends").model_copy(update={"custom_cls": CustomDatasetConfig(path=str(ending), name="Ends")})
    driver = ("import sys\nfrom megarl import driver_supervisor as s\ns.take_report_pipe()\nfrom transformers import AutoTokenizer\n"
              "from megarl.config.sections import DataConfig\nfrom megarl.data.stream import build_train_stream\n"
              "build_train_stream(DataConfig.model_validate_json(sys.argv[1]), AutoTokenizer.from_pretrained(sys.argv[2]))\n")
    code = supervise([sys.executable, "-c", driver, cfg.model_dump_json(), str(byte_tokenizer_dir)], ray=False,
                     user_code="data.custom_cls Ends")  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "exited with code 0 without reporting an error" in err, err
    assert "user code in the driver (data.custom_cls Ends.__getitem__ (reading its 2 rows)) calling os._exit" in err, err


@pytest.mark.parametrize("name, error", [
    ("FailsToBuild", r"^FailsToBuild \(.*my_dataset.py\) on data.train_files: building it or reading its first rows failed: "
                     r"ValueError: column 'question' not found$"),
    ("FailsToRead", r"^FailsToRead \(.*\) on data.train_files: building it or reading its first rows failed: KeyError: 'question'$"),
    ("BadRow", r"^BadRow \(.*\) on data.train_files: row 0 has no key 'reward_model'"),
    ("Exits", r"^Exits \(.*my_dataset.py\) called sys.exit\(5\) in its __getitem__\(0\) while it was built or its first rows read; a dataset class "
              r"must raise an exception"),
    ("Interrupts", r"^Interrupts \(.*\) raised KeyboardInterrupt in its __len__ while it was built"),
])  # fmt: skip
def test_custom_cls_is_built_and_read_before_launch(dataset_file, byte_tokenizer_dir, name, error):
    """Errors of the class's own building and reading code, found in the check's child (before Ray
    starts) with the run's words, where only its import was checked."""
    cfg = _custom(dataset_file, name)
    finding = _class_finding(cfg, byte_tokenizer_dir)
    assert finding.field == "data.custom_cls"
    assert re.search(error, finding.message), finding.message


def test_a_build_past_the_deadline_is_a_warning_not_a_refusal(dataset_file, byte_tokenizer_dir, tmp_path, monkeypatch):
    """A class that tokenizes every row in __init__ can outlast the check on real data: the run is
    not refused for it (the import succeeded); a class that raises still is (the test above)."""
    from megarl.plan import import_check_child

    slow = tmp_path / "slow_dataset.py"
    slow.write_text(dataset_file.read_text() + "\nimport time\n\nclass Slow(JsonlPrompts):\n"
                    "    def __init__(self, *a, **kw):\n        time.sleep(30)\n        super().__init__(*a, **kw)\n")
    # launch's bound, shortened for the test; past the child's own start (loading transformers for
    # the tokenizer takes 4-5 s on some machines, counted as the import before the class's __init__)
    monkeypatch.setattr(import_check_child, "CHILD_TIMEOUT_S", 12.0)
    cfg = DataConfig(train_files=[str(dataset_file.with_name("train.jsonl"))], custom_cls=CustomDatasetConfig(path=str(slow), name="Slow"),
                     prompts_per_step=2, max_prompt_length=200)  # fmt: skip
    build = {"files": [f.path for f in cfg.train_files], "field": "data.train_files", "model": str(byte_tokenizer_dir),
             "config": cfg.model_dump(mode="json")}  # fmt: skip
    child = ChildChecks(None, [("rollout.generate_function", "nowhere_megarl.at_all:gen")], cfg.custom_cls,
                        RewardConfig().functions, build)  # fmt: skip
    try:
        (finding,) = child.results("data.custom_cls")
        others = child.results("rollout.generate_function")
    finally:
        child.stop()
    assert (finding.field, finding.level) == ("data.custom_cls", "warning")
    assert finding.message == "Slow: building it took over 12 s, not checked before launch; the run builds it"
    assert "nowhere_megarl" in others[0].message  # the checks after it in the child still answered, not timed out


def test_a_slow_first_row_is_named_as_that_in_the_warning(dataset_file, byte_tokenizer_dir, tmp_path, monkeypatch):
    from megarl.plan import import_check_child

    slow = tmp_path / "slow_rows.py"
    slow.write_text(dataset_file.read_text() + "\nimport time\n\nclass SlowRow(JsonlPrompts):\n"
                    "    def __getitem__(self, i):\n        time.sleep(300)\n        return super().__getitem__(i)\n")
    monkeypatch.setattr(import_check_child, "CHILD_TIMEOUT_S", 15.0)  # (the tokenizer's load comes first: seconds on a busy machine)
    cfg = _custom(dataset_file, "SlowRow").model_copy(update={"custom_cls": CustomDatasetConfig(path=str(slow), name="SlowRow")})
    finding = _class_finding(cfg, byte_tokenizer_dir)
    assert (finding.level, finding.message) == ("warning", "SlowRow: reading its first rows (its __getitem__(0)) took over 15 s, "
                                                "not checked before launch; the run builds it")
