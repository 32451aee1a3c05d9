"""reward.model.path checked from config.json alone (no weights), as the launch's preflight,
`megarl evaluate` and the reward workers' loader check it: each wrong directory is one line
naming the path, what is wrong and the fix. The directories hold a config.json only."""

from __future__ import annotations

import json

import pytest

from megarl.cli import EXIT_USER, main
from megarl.rewards.reward_model import FIX, load_reward_model, model_dir_problem

QWEN2 = {"model_type": "qwen2", "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
         "num_hidden_layers": 1, "intermediate_size": 16, "vocab_size": 32}  # fmt: skip


def _model_dir(tmp_path, name: str = "rm", **config) -> str:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**QWEN2, **config}))
    return str(path)


def test_a_sequence_classifier_with_one_label_passes(tmp_path):
    assert model_dir_problem(_model_dir(tmp_path, architectures=["Qwen2ForSequenceClassification"], num_labels=1)) is None
    # id2label of one entry is one label too; no architectures: nothing says the head is another one
    assert model_dir_problem(_model_dir(tmp_path, "labels", id2label={"0": "score"})) is None


def _wrong_dir(tmp_path, setup: str) -> str:
    if setup == "missing":
        return str(tmp_path / "nowhere")
    if setup == "empty":
        (tmp_path / "empty").mkdir()
        return str(tmp_path / "empty")
    if setup == "bad-json":
        path = _model_dir(tmp_path)
        (tmp_path / "rm" / "config.json").write_text("{not json")
        return path
    return _model_dir(tmp_path, **WRONG_CONFIGS[setup])


WRONG_CONFIGS = {
    "unknown-type": {"model_type": "no_such_model"},
    "no-classifier": {"model_type": "vit"},
    "causal-lm": {"architectures": ["Qwen2ForCausalLM"], "num_labels": 1},  # would load with a random score head
    "two-labels": {"architectures": ["Qwen2ForSequenceClassification"]},  # no num_labels: transformers' default 2
}


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        ("missing", "is not a directory"),
        ("empty", "has no config.json"),
        ("bad-json", "has a config.json transformers {version} cannot read: It looks like the config file at "),
        ("unknown-type", "has a config.json transformers {version} cannot read: The checkpoint you are trying to load "
                         "has model type `no_such_model` but Transformers does not recognize this architecture"),
        ("no-classifier", "is a vit model, and transformers {version} has no sequence-classification class for it"),
        ("causal-lm", "holds a Qwen2ForCausalLM (config.json's architectures), not a Qwen2ForSequenceClassification: "
                      "a reward model needs the trained score head of a sequence classifier"),
        ("two-labels", "has num_labels=2; a reward model has 1 (one score per sample)"),
    ],
)
def test_a_wrong_directory_is_one_line_with_the_fix(tmp_path, setup, expected):
    import transformers

    path = _wrong_dir(tmp_path, setup)
    problem = model_dir_problem(path)
    assert problem is not None and problem.startswith(f"({path}) {expected.format(version=transformers.__version__)}")
    assert problem.endswith(f"; {FIX}") and "\n" not in problem
    # the workers' loader refuses the same directory with the same words, before reading anything else
    with pytest.raises(ValueError) as info:
        load_reward_model(path)
    assert str(info.value) == f"reward.model.path: {problem}"


def test_evaluate_refuses_a_wrong_reward_model_in_one_line(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "gen.parquet"
    pq.write_table(pa.table({"prompt": ["2+2?"], "data_source": ["mine"], "reward_model": [{"ground_truth": "4"}],
                             "responses": [["4", "5"]]}), data)  # fmt: skip
    path = _model_dir(tmp_path, architectures=["Qwen2ForCausalLM"], num_labels=1)
    out = tmp_path / "summary.json"
    assert main(["evaluate", "--data", str(data), f"reward.model.path={path}", "--out", str(out)]) == EXIT_USER
    err = capsys.readouterr().err
    assert err.startswith(f"error: reward.model.path: ({path}) holds a Qwen2ForCausalLM") and err.count("\n") == 1
    assert not out.exists()
