"""reward.model.path checked from config.json and the tokenizer's file names (no weights, no
tokenizer loaded), as the launch's preflight, `megarl evaluate` and the reward workers' loader
check it: each wrong directory is one line naming the path, what is wrong and the fix. The
directories hold a config.json, and real tokenizers saved where the check must pass."""

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


def _with_bpe_tokenizer(path: str) -> str:
    """A real byte-level BPE tokenizer (the tokenizers library, in this process) saved into ``path``:
    tokenizer.json and tokenizer_config.json (tokenizer_class PreTrainedTokenizerFast)."""
    from megarl.models.tiny import build_tokenizer

    build_tokenizer().save_pretrained(path)
    return path


BERT_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world", "##s"]


def _bert_dir(tmp_path, tokenizer_config: bool = True) -> str:
    """A BERT reward model's directory as the hub has them: config.json, vocab.txt (WordPiece) and,
    with ``tokenizer_config``, the tokenizer_config.json BertTokenizer saves; no tokenizer.json."""
    from transformers import BertTokenizer

    path = tmp_path / "bert_rm"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForSequenceClassification"],
                                                  "num_labels": 1, "vocab_size": len(BERT_VOCAB)}))  # fmt: skip
    (path / "vocab.txt").write_text("\n".join(BERT_VOCAB) + "\n")
    if tokenizer_config:
        BertTokenizer(vocab_file=str(path / "vocab.txt")).save_pretrained(tmp_path / "saved")
        (path / "tokenizer_config.json").write_bytes((tmp_path / "saved" / "tokenizer_config.json").read_bytes())
    return str(path)


def test_a_sequence_classifier_with_one_label_passes(tmp_path):
    path = _model_dir(tmp_path, architectures=["Qwen2ForSequenceClassification"], num_labels=1)
    assert model_dir_problem(_with_bpe_tokenizer(path)) is None
    # id2label of one entry is one label too; no architectures: nothing says the head is another one
    assert model_dir_problem(_with_bpe_tokenizer(_model_dir(tmp_path, "labels", id2label={"0": "score"}))) is None


@pytest.mark.parametrize("tokenizer_config", [True, False], ids=["tokenizer-class", "model-type"])
def test_a_bert_style_directory_with_vocab_txt_passes(tmp_path, tokenizer_config):
    """No tokenizer.json: the tokenizer class (tokenizer_config.json's, else the model type's) reads vocab.txt."""
    from transformers import AutoTokenizer

    path = _bert_dir(tmp_path, tokenizer_config)
    assert model_dir_problem(path) is None
    assert AutoTokenizer.from_pretrained(path)("hello worlds")["input_ids"] == [2, 5, 6, 7, 3]  # it loads, vocabulary and all


def test_a_generic_tokenizer_class_passes_with_the_model_types_files(tmp_path):
    """tokenizer_config.json naming a class with no vocabulary format of its own (transformers 5
    writes TokenizersBackend): the qwen2 tokenizer's vocab.json + merges.txt load it."""
    from transformers import AutoTokenizer

    path = tmp_path / "rm"
    _with_bpe_tokenizer(_model_dir(tmp_path, architectures=["Qwen2ForSequenceClassification"], num_labels=1))
    bpe = json.loads((path / "tokenizer.json").read_text())["model"]
    (path / "vocab.json").write_text(json.dumps(bpe["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]]  # "a b" or ["a", "b"], by version
    (path / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{m}\n" for m in merges))
    (path / "tokenizer.json").unlink()
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "TokenizersBackend"}))
    assert model_dir_problem(str(path)) is None
    assert AutoTokenizer.from_pretrained(str(path))("ab")["input_ids"]  # it loads


def test_a_directory_without_its_tokenizer_files_is_refused_in_one_line(tmp_path):
    path = _with_bpe_tokenizer(_model_dir(tmp_path, architectures=["Qwen2ForSequenceClassification"], num_labels=1))
    (tmp_path / "rm" / "tokenizer.json").unlink()
    fix = "copy the reward model's tokenizer files into it (its tokenizer's save_pretrained writes them)"
    saved_class = json.loads((tmp_path / "rm" / "tokenizer_config.json").read_text())["tokenizer_class"]  # by version
    problem = model_dir_problem(path)
    # "or tokenizer.model" too where transformers' fast class reads one (transformers 5)
    assert problem.startswith(f"({path}) has no tokenizer files: {saved_class} (tokenizer_config.json) reads tokenizer.json")
    assert problem.endswith(f"; {fix}") and "\n" not in problem
    with pytest.raises(ValueError) as info:  # the workers' loader, before it loads anything
        load_reward_model(path)
    assert str(info.value) == f"reward.model.path: {problem}"
    # no tokenizer_config.json either: the model type's tokenizer class says which files
    (tmp_path / "rm" / "tokenizer_config.json").unlink()
    assert model_dir_problem(path) == (f"({path}) has no tokenizer files: the tokenizer of a qwen2 model reads "
                                       f"tokenizer.json or vocab.json + merges.txt; {fix}")  # fmt: skip
    bert = _bert_dir(tmp_path)
    (tmp_path / "bert_rm" / "vocab.txt").unlink()
    assert model_dir_problem(bert) == f"({bert}) has no tokenizer files: BertTokenizer (tokenizer_config.json) reads tokenizer.json or vocab.txt; {fix}"


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
