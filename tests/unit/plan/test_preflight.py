"""Preflight: every problem a launch would meet on the disk is refused before Ray starts, as one
line per problem naming the field, the file and the fix (real files in tmp paths)."""

from __future__ import annotations

import io
import math
import os
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.config.loading import load_config
from megarl.data.tasks import TASK_VOCAB
from megarl.plan.issues import Finding
from megarl.plan.planner import PlanError, make_plan
from megarl.plan.preflight import preflight, writable_dir_problem
from megarl.plan.resume_checks import finished_run

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny_grpo.yaml"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from megarl.commands.demo import prepare_demo

    return prepare_demo(tmp_path_factory.mktemp("demo"))


def config(demo, out: Path, *extra: str):
    model, data = demo
    return load_config(TINY, [f"model.path={model}", f"data.train_files=[{data / 'train.parquet'}]",
                              f"data.val_files=[{data / 'val.parquet'}]", f"trainer.output_dir={out}", *extra])


def refusal(cfg) -> str:
    """The refusal's errors (its warnings, said after them, left out)."""
    with pytest.raises(PlanError) as info:
        make_plan(cfg, check_files=True)
    return str(info.value).partition("\nand warns")[0]


def but_repeats(cfg) -> list[Finding]:
    """preflight's findings, but the warning that a file of a few rows repeats prompts within a
    step (data.prompts_per_step 32; tests/unit/plan/test_launch_checks.py tests it)."""
    return [f for f in preflight(cfg) if f.field != "data.prompts_per_step"]


def rows(prompts: list[str], source: str = "reverse_digits") -> list[dict]:
    return [{"data_source": source, "prompt": [{"role": "user", "content": p}], "ability": "t",
             "reward_model": {"ground_truth": p[::-1], "style": "rule"}, "extra_info": {"index": i}}
            for i, p in enumerate(prompts)]


def test_a_good_config_passes(demo, tmp_path):
    assert preflight(config(demo, tmp_path / "run")) == []
    assert not (tmp_path / "run").exists()  # nothing is created


def test_bad_data_files_each_get_one_line(demo, tmp_path):
    (tmp_path / "text.parquet").write_text("not parquet at all\n")
    pq.write_table(pa.Table.from_pylist([{"question": "q", "answer": "a"}]), tmp_path / "columns.parquet")
    pq.write_table(pa.Table.from_pylist(rows(["123"])).slice(0, 0), tmp_path / "empty.parquet")
    bad_row = rows(["123", "456"])
    bad_row[1]["reward_model"] = None
    pq.write_table(pa.Table.from_pylist(bad_row), tmp_path / "row.parquet")
    files = ",".join(str(tmp_path / n) for n in ("text.parquet", "columns.parquet", "empty.parquet", "row.parquet", "gone.parquet"))
    start = time.perf_counter()
    msg = refusal(config(demo, tmp_path / "run", f"data.train_files=[{files}]"))
    assert time.perf_counter() - start < 60  # seconds, not a launch; the real budget is asserted below
    lines = msg.splitlines()[1:]
    assert len(lines) == 5, msg
    assert lines[0].startswith("  - data.train_files[0] (text.parquet): cannot read") and "as parquet" in lines[0]
    assert "data.train_files[1] (columns.parquet): missing column 'data_source'" in lines[1] and "megarl data convert" in lines[1]
    assert "data.train_files[2] (empty.parquet):" in lines[2] and "has no rows" in lines[2]
    assert "data.train_files[3] (row.parquet): row 1, column 'reward_model': expected a struct {ground_truth, style}" in lines[3]
    assert "data.train_files[4] (gone.parquet): file" in lines[4] and "does not exist" in lines[4]


def test_overlong_prompt_with_truncation_error(demo, tmp_path):
    path = tmp_path / "long.parquet"
    pq.write_table(pa.Table.from_pylist(rows(["123", "0123456789" * 4])), path)
    cfg = config(demo, tmp_path / "run", f"data.train_files=[{path}]", "data.filter_overlong_prompts=false")
    msg = refusal(cfg)
    assert "data.train_files[0] (long.parquet): row 1: the prompt has" in msg
    assert "> data.max_prompt_length (16), and data.truncation=error" in msg and "data.truncation=left|right" in msg
    # Filtered (the default), the same file runs without its long half, which is named.
    assert but_repeats(config(demo, tmp_path / "run", f"data.train_files=[{path}]")) == [
        Finding("data.train_files[0] (long.parquet)", "1 of the 2 prompts checked are longer than data.max_prompt_length "
                "(16) and data.filter_overlong_prompts drops them; raise data.max_prompt_length to keep them", "warning")]
    pq.write_table(pa.Table.from_pylist(rows(["12", "123", "0123456789" * 4])), path)
    assert but_repeats(config(demo, tmp_path / "run", f"data.train_files=[{path}]")) == []  # a third dropped: the run's business


def test_a_file_filtering_would_empty_is_refused(demo, tmp_path):
    # The run stopped at start-up, after Ray and the workers had started, with no prompts to draw.
    path = tmp_path / "long.parquet"
    pq.write_table(pa.Table.from_pylist(rows(["0123456789" * 2, "0123456789" * 4])), path)
    msg = refusal(config(demo, tmp_path / "run", f"data.train_files=[{path}]"))
    assert ("  - data.train_files[0] (long.parquet): every one of its 2 prompts is longer than data.max_prompt_length "
            "(16; the shortest has 23 tokens)") in msg and "raise data.max_prompt_length, or cut them" in msg


def test_critic_warmup_against_the_steps_total_epochs_makes(demo, tmp_path):
    path = tmp_path / "forty.parquet"
    pq.write_table(pa.Table.from_pylist(rows([f"{i:03d}" for i in range(40)])), path)
    epochs = [f"data.train_files=[{path}]", "trainer.total_steps=null", "trainer.total_epochs=2"]  # 2 x 40 / 32 rounded up

    def warmup_findings(*extra: str) -> list[str]:
        return [f.message for f in preflight(config(demo, tmp_path / "run", *epochs, *extra)) if f.field == "trainer.critic_warmup_steps"]

    assert warmup_findings("trainer.critic_warmup_steps=4") == [
        "(4) must be below the run's at most 4 steps (trainer.total_epochs 2 x 2 steps per epoch over 40 training prompts), "
        "or the policy never trains; lower it or raise trainer.total_epochs"]  # at most: overlong prompts are dropped at load
    assert "the run's 4 steps" in warmup_findings("trainer.critic_warmup_steps=4", "data.filter_overlong_prompts=false")[0]
    assert warmup_findings("trainer.critic_warmup_steps=3") == []
    assert warmup_findings("trainer.critic_warmup_steps=4", "trainer.total_steps=5") == []  # total_steps wins: the planner's


def test_unscorable_data_source_and_unknown_scorer(demo, tmp_path):
    path = tmp_path / "src.parquet"
    pq.write_table(pa.Table.from_pylist(rows(["123"], source="my_task")), path)
    msg = refusal(config(demo, tmp_path / "run", f"data.train_files=[{path}]", "reward.functions={a: nope}"))
    assert "reward.functions: reward.functions['a'] = 'nope' is not a built-in scorer" in msg
    msg = refusal(config(demo, tmp_path / "run", f"data.train_files=[{path}]"))
    assert "data.train_files[0] (src.parquet): row 0: no reward scorer for data_source 'my_task'" in msg


def test_a_null_ground_truth_for_a_built_in_scorer(demo, tmp_path):
    table = rows(["123", "456", "789"])
    table[1]["reward_model"]["ground_truth"] = table[2]["reward_model"]["ground_truth"] = None  # one line per file
    pq.write_table(pa.Table.from_pylist(table), tmp_path / "t.parquet")
    msg = refusal(config(demo, tmp_path / "run", f"data.train_files=[{tmp_path / 't.parquet'}]"))
    assert ("data.train_files[0] (t.parquet): row 1: reward_model.ground_truth is None; the built-in scorer "
            "'reverse_digits' compares each response with it: give the answer, or score with reward.custom") in msg
    assert "row 2" not in msg
    # code tests may come in extra_info instead: no ground truth needed there
    for row in table:
        row["data_source"] = "code"
    pq.write_table(pa.Table.from_pylist(table), tmp_path / "c.parquet")
    assert but_repeats(config(demo, tmp_path / "run", f"data.train_files=[{tmp_path / 'c.parquet'}]")) == []


def test_a_nan_ground_truth_for_a_built_in_scorer(demo, tmp_path):
    table = rows(["123", "456"])
    table[0]["reward_model"]["ground_truth"], table[1]["reward_model"]["ground_truth"] = 321.0, math.nan  # a float column
    pq.write_table(pa.Table.from_pylist(table), tmp_path / "t.parquet")
    msg = refusal(config(demo, tmp_path / "run", f"data.train_files=[{tmp_path / 't.parquet'}]"))
    assert ("data.train_files[0] (t.parquet): row 1: reward_model.ground_truth is nan; the built-in scorer "
            "'reverse_digits' compares each response with it: give the answer, or score with reward.custom") in msg
    assert "row 0" not in msg  # 321.0 is an answer: only NaN stands for none


@pytest.mark.parametrize("truths", [["$1,234", "18 dollars"], ["$1,234", "3/4"], [["1", "2"]]])
def test_a_ground_truth_no_gsm8k_response_can_match(demo, tmp_path, truths):
    # The gsm8k scorer compares numbers: the last of each would score every response 0, silently.
    table = rows(["123", "456"][: len(truths)], source="openai/gsm8k")
    for row, truth in zip(table, truths, strict=True):
        row["reward_model"]["ground_truth"] = truth
    pq.write_table(pa.Table.from_pylist(table), tmp_path / "g.parquet")
    msg = refusal(config(demo, tmp_path / "run", f"data.train_files=[{tmp_path / 'g.parquet'}]"))
    assert (f"data.train_files[0] (g.parquet): row {len(truths) - 1}: reward_model.ground_truth {truths[-1]!r} is no "
            "number; the built-in scorer 'gsm8k' compares numbers, so every response would score 0") in msg
    assert len(truths) == 1 or "row 0: reward_model" not in msg  # "$1,234" is the number 1234 to the scorer


@pytest.mark.parametrize(
    ("source", "name", "expected"),
    [
        ("def other(s, a, b, c=None):\n    return 0.0\n", "compute_score",
         "'compute_score' is not a function in {path}; functions defined there: other"),
        ("import no_such_module_megarl\n", "compute_score", "ModuleNotFoundError: No module named 'no_such_module_megarl' (line 1)"),
        ("def compute_score(:\n", "compute_score", "SyntaxError"),
        ("x = 1\nraise RuntimeError('broken at import')\n", "compute_score", "RuntimeError: broken at import (line 2)"),
    ],
)
def test_reward_function_that_cannot_load(demo, tmp_path, source, name, expected):
    path = tmp_path / "my_reward.py"
    path.write_text(source)
    msg = refusal(config(demo, tmp_path / "run", f"reward.custom.path={path}", f"reward.custom.name={name}"))
    assert f"reward.custom: loading {name!r} from {path} failed" in msg
    assert expected.format(path=path) in msg


def test_reward_model_that_the_workers_would_refuse(demo, tmp_path):
    """Read from config.json and the tokenizer's file names (no weights: a directory without any
    passes when right)."""
    import json
    import shutil

    path = tmp_path / "rm"
    path.mkdir()
    base = {"model_type": "qwen2", "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1, "vocab_size": 32}
    (path / "config.json").write_text(json.dumps({**base, "architectures": ["Qwen2ForCausalLM"], "num_labels": 1}))
    msg = refusal(config(demo, tmp_path / "run", f"reward.model.path={path}"))
    assert f"reward.model.path: ({path}) holds a Qwen2ForCausalLM (config.json's architectures)" in msg
    assert msg.count("reward.model.path") == 1
    (path / "config.json").write_text(json.dumps({**base, "architectures": ["Qwen2ForSequenceClassification"], "num_labels": 1}))
    msg = refusal(config(demo, tmp_path / "run", f"reward.model.path={path}"))
    assert f"reward.model.path: ({path}) has no tokenizer files: the tokenizer of a qwen2 model reads " in msg
    assert msg.count("reward.model.path") == 1
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the demo model's real tokenizer
        shutil.copy(Path(demo[0]) / name, path / name)
    assert preflight(config(demo, tmp_path / "run", f"reward.model.path={path}")) == []


def test_functions_named_by_import_path_are_imported_before_launch(demo, tmp_path, monkeypatch):
    examples = Path(__file__).resolve().parents[3] / "docs" / "examples"
    monkeypatch.setenv("PYTHONPATH", str(examples))  # the preflight's child imports them, not this process
    good = config(demo, tmp_path / "run", "algorithm.estimator=my_extensions:centered_score",
                  "rollout.generate_function=my_extensions:generate_with_prefix")  # fmt: skip
    assert preflight(good) == []
    msg = refusal(config(demo, tmp_path / "run", "algorithm.policy_loss=my_extensions:nope",
                         "rollout.generate_function=nowhere_megarl.at_all:gen"))  # fmt: skip
    assert "algorithm.policy_loss: policy loss 'my_extensions:nope': module my_extensions has no attribute 'nope'" in msg
    assert "rollout.generate_function: generate function 'nowhere_megarl.at_all:gen': cannot import nowhere_megarl" in msg


def test_output_dir_that_cannot_be_written(demo, tmp_path, read_only_dir):
    with read_only_dir(tmp_path / "ro") as ro:
        problem = writable_dir_problem(ro / "run")
        assert problem is not None and "is not writable" in problem
        msg = refusal(config(demo, ro / "run"))
        assert f"trainer.output_dir: {ro / 'run'} is not writable" in msg and "choose a writable directory" in msg
    (tmp_path / "file").write_text("x")
    assert "exists and is not a directory" in refusal(config(demo, tmp_path / "file"))


def test_rollout_data_dir_that_cannot_be_written_is_refused_before_launch(demo, tmp_path, read_only_dir):
    """trainer.rollout_data_dir gets trainer.output_dir's check: a file, a place under a file, /proc
    or a read-only directory was found only by the first step's write, after Ray started."""
    out = tmp_path / "run"
    (tmp_path / "file").write_text("x")
    cases = {tmp_path / "file": "exists and is not a directory", tmp_path / "file" / "rd": "is not a directory, so",
             Path("/proc/rd"): "is not writable"}  # fmt: skip
    for where, problem in cases.items():
        msg = refusal(config(demo, out, f"trainer.rollout_data_dir={where}"))
        line = next(line for line in msg.splitlines() if "trainer.rollout_data_dir: " in line)
        assert str(where) in line and problem in line and line.endswith("or unset it"), msg
        assert "trainer.output_dir" not in msg
    with read_only_dir(tmp_path / "ro") as ro:
        msg = refusal(config(demo, out, f"trainer.rollout_data_dir={ro / 'rd'}"))
        assert f"trainer.rollout_data_dir: {ro / 'rd'} is not writable" in msg
    make_plan(config(demo, out, f"trainer.rollout_data_dir={tmp_path / 'new' / 'rd'}"), check_files=True)  # to be made


def _checkpoint(out: Path, step: int) -> Path:
    from megarl.checkpoint.manager import CheckpointManager

    with CheckpointManager(out).saving(step) as d:
        (d / "trainer_state.pt").write_bytes(b"state" * 10)
    return out / "checkpoints" / f"step_{step:06d}"


def test_a_critic_path_is_checked_as_model_path_is(demo, tmp_path):
    # A missing critic.path got past the checks, and the critic ranks failed once Ray and the policy had
    # started (transformers took it for a hub repo id); the critic's own config.json was never checked.
    from megarl.models.tiny import build_tiny_model

    out, missing = tmp_path / "run", tmp_path / "no-such-model"
    msg = refusal(config(demo, out, "algorithm.estimator=gae", f"critic.path={missing}"))
    assert (f"  - critic.path: ({missing}) must be a local HF model directory (with config.json) or a model checkpoint "
            "of `megarl convert hf-to-megatron`; unset, the critic starts from model.path") in msg
    assert [f for f in preflight(config(demo, out, f"critic.path={missing}")) if f.field == "critic.path"] == []  # no critic
    # its own model in the critic's layout: TP 2 divides the policy's 2 KV heads, not this one's 1
    mqa = build_tiny_model(tmp_path / "mqa", task_vocab=TASK_VOCAB, hidden_size=64, num_layers=2, num_heads=4,
                           num_kv_heads=1, ffn_hidden_size=128, max_position_embeddings=64)
    msg = refusal(config(demo, out, "algorithm.estimator=gae", f"critic.path={mqa}", "critic.parallel.tp=2"))
    assert f"  - critic.path: ({mqa}) is not a model megarl can train: ValueError: parallel.tp (2) must divide" in msg


def test_a_critic_of_another_tokenizer_is_refused(demo, tmp_path):
    # A critic reads the policy's token ids: one of another tokenizer trained on the wrong tokens,
    # with plausible metrics; one with fewer embeddings than the tokenizer has tokens fails at start-up.
    from safetensors.torch import load_file, save_file

    from megarl.models.tiny import build_tiny_model

    out, shape = tmp_path / "run", dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, ffn_hidden_size=64)
    byte_level = build_tiny_model(tmp_path / "bytes", **shape)  # 256 byte tokens + 3 special ones
    msg = refusal(config(demo, out, "algorithm.estimator=gae", f"critic.path={byte_level}"))
    assert f"  - critic.path: ({byte_level}) has another tokenizer: 10 of the 10 base tokens of model.path's tokenizer" in msg
    assert "(e.g. '0' is 1 in model.path's, 15 in its own); the critic reads the policy's token ids" in msg
    msg = refusal(config(demo, out, f"model.path={byte_level}", "algorithm.estimator=gae", f"critic.path={demo[0]}"))
    assert (f"  - critic.path: ({demo[0]}) has 14 token embeddings (config.json's vocab_size), fewer than the 259 tokens "
            "of model.path's tokenizer") in msg
    same = build_tiny_model(tmp_path / "same", task_vocab=TASK_VOCAB, seed=3, tie_word_embeddings=False, **shape)
    assert [f for f in preflight(config(demo, out, "algorithm.estimator=gae", f"critic.path={same}"))
            if f.field == "critic.path"] == []  # another model, the same tokens  # fmt: skip
    # a critic's lm_head is unused (it has a value head): a directory without one loads, as at run time
    weights = load_file(same / "model.safetensors")
    save_file({k: v for k, v in weights.items() if k != "lm_head.weight"}, same / "model.safetensors")
    assert [f for f in preflight(config(demo, out, "algorithm.estimator=gae", f"critic.path={same}"))
            if f.level == "error"] == []  # fmt: skip


def test_the_policy_tokenizer_is_loaded_once_for_the_critic_and_prompt_checks(demo, tmp_path, monkeypatch):
    # (seconds each for a large tokenizer) the critic's token check and the prompt lengths both read it
    from megarl.data import summary
    from megarl.models.tiny import build_tiny_model

    critic = build_tiny_model(tmp_path / "critic", task_vocab=TASK_VOCAB, seed=3, hidden_size=32, num_layers=1,
                              num_heads=2, num_kv_heads=1, ffn_hidden_size=64)  # fmt: skip
    loaded, load = [], summary.load_tokenizer
    monkeypatch.setattr(summary, "load_tokenizer", lambda path: loaded.append(Path(path)) or load(path))
    findings = preflight(config(demo, tmp_path / "run", "algorithm.estimator=gae", f"critic.path={critic}",
                                "data.filter_overlong_prompts=true"))  # fmt: skip
    assert [f for f in findings if f.level == "error"] == []
    assert sorted(loaded) == sorted([Path(demo[0]), critic])


def test_a_logger_whose_package_is_missing_is_refused_before_launch(demo, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # how Python marks a module unimportable: find_spec gives None
    msg = refusal(config(demo, tmp_path / "out", "trainer.loggers=[console,mlflow]"))
    assert "trainer.loggers: includes mlflow, and mlflow is not installed in this Python" in msg
    assert "drop mlflow from trainer.loggers" in msg


def test_checkpoints_are_never_started_over(demo, tmp_path):
    out = tmp_path / "run"
    ckpt = _checkpoint(out, 2)
    (ckpt / "trainer_state.pt").write_bytes(b"short")
    msg = refusal(config(demo, out))
    assert "  - trainer.resume=auto: " in msg and "none verifies (step_000002: file trainer_state.pt has 5 bytes" in msg
    assert "resume=disable and a new trainer.output_dir" in msg
    assert "  - trainer.resume=disable: starts a new run" in refusal(config(demo, out, "trainer.resume=disable"))
    assert (ckpt / "trainer_state.pt").read_bytes() == b"short"


def _trained_with(out: Path, step: int, cfg, launch_dir: Path, roles: tuple[str, ...] = ()) -> Path:
    """A checkpoint as the trainer saves it: with the config it was trained with and the launch
    directory (and a stand-in directory per trained role: its weights are not read before launch)."""
    from megarl.checkpoint.manager import CheckpointManager
    from megarl.config.loading import config_to_yaml

    with CheckpointManager(out).saving(step, {"launch_dir": str(launch_dir)}) as d:
        (d / "trainer_state.pt").write_bytes(b"state")
        (d / "config.yaml").write_text(config_to_yaml(cfg))
        for role in roles:
            (d / role).mkdir()
            (d / role / "common.pt").write_bytes(b"megatron-core 0.16 writes it")
    return out / "checkpoints" / f"step_{step:06d}"


def test_a_resume_refuses_another_model_and_names_other_changes(demo, tmp_path):
    import shutil

    from megarl.plan.planner import resolved_config

    model, _ = demo
    out = tmp_path / "run"
    trained = config(demo, out, "actor.recompute=auto", f"model.path={model.name}")  # relative to the launch directory, model's parent
    resolved = make_plan(trained).resolved
    assert resolved == {"actor.recompute": "none"}
    trained = resolved_config(trained, resolved)  # what the trainer saves: recompute none, the launch says auto
    _trained_with(out, 2, trained, launch_dir=model.parent)
    moved = shutil.copytree(model, tmp_path / "staged" / "model")  # the same model elsewhere (a staged copy)
    for same in (str(model), str(moved)):
        plan = make_plan(config(demo, out, "actor.recompute=auto", f"model.path={same}", "trainer.total_steps=9"), check_files=True)
        assert [w for w in plan.warnings if w.field in ("model.path", "trainer.resume")] == []
    tuned = shutil.copytree(model, tmp_path / "sft" / "model")  # same names and sizes, other weights
    weights = tuned / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8:] = bytes(8)
    weights.write_bytes(bytes(data))
    msg = refusal(config(demo, out, "actor.recompute=auto", f"model.path={tuned}"))
    assert (f"model.path: ({tuned}) holds other weights than model.path={model.name}, not the model step_000002 was "
            "trained from: its policy would go on from the checkpoint while the reference loads the new one") in msg
    warned = make_plan(config(demo, out, "actor.recompute=auto", "actor.optimizer.lr=0.005", "rollout.n=16"), check_files=True).warnings
    [changed] = [w for w in warned if w.field == "trainer.resume"]
    assert changed.message == ("step_000002 was trained with another config, and the run goes on with this one: "
                               "rollout.n: 8 -> 16; actor.optimizer.lr: 0.001 -> 0.005")
    # the sampler's stream depends on these: refused before launch, not once Ray has started
    msg = refusal(config(demo, out, "actor.recompute=auto", "data.seed=2", "data.shuffle=false"))
    assert ("  - data.seed: cannot resume step_000002: the checkpoint was saved with data.seed = 1, the config now gives 2; "
            "resume with data.seed = 1, or start a fresh run in a new trainer.output_dir") in msg
    assert "  - data.shuffle: cannot resume step_000002: the checkpoint was saved with data.shuffle = True" in msg
    named = preflight(config(demo, out, "actor.recompute=auto", "data.seed=2"))
    assert [f.field for f in named] == ["data.seed"]  # a refused change is not also one "the run goes on with"
    assert "data.seed = 1" in refusal(config(demo, out, "actor.recompute=auto", "data.seed=2", "trainer.val_only=true"))  # it loads the sampler too


def test_a_resume_refuses_a_bad_metrics_line_it_cannot_mend_before_ray_starts(demo, tmp_path):
    """A line of metrics.jsonl that is no JSON record: refused by the plan when the checkpoint
    keeps no copy of the file (a checkpoint of an older megarl); with a copy, the resume mends it
    (the trainer's sink keeps the file aside and takes the copy's records), so the plan passes."""
    out = tmp_path / "run"
    cfg = config(demo, out)
    ckpt = _trained_with(out, 2, cfg, launch_dir=tmp_path)
    metrics = out / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n{"step": 2, "reward/mean": 0.\n{"step": 3}\n')  # (a hand edit gone wrong)
    msg = refusal(cfg)
    assert (f"  - trainer.output_dir: {metrics}:2 is not a JSON record ('{{\"step\": 2, \"reward/mean\": 0.'...), and the "
            "resumed checkpoint keeps no copy of the file to take its place; mend or delete that line") in msg
    assert metrics.read_text().count("\n") == 3  # read, not changed
    assert not [f for f in preflight(config(demo, out, "trainer.loggers=[console]")) if f.field == "trainer.output_dir"]
    import shutil

    shutil.rmtree(ckpt)
    from megarl.checkpoint.manager import CheckpointManager
    from megarl.config.loading import config_to_yaml

    with CheckpointManager(out).saving(2, {"launch_dir": str(tmp_path)}) as d:  # as the trainer saves it: with the copy
        (d / "trainer_state.pt").write_bytes(b"state")
        (d / "config.yaml").write_text(config_to_yaml(cfg))
        (d / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "reward/mean": 0.5}\n')
    assert [f for f in preflight(cfg) if f.field == "trainer.output_dir"] == []


def test_a_resume_refuses_a_model_config_edited_since_training(demo, tmp_path):
    # rope_theta or rope_scaling change no weight shape: the run went on under another model config
    import json
    import shutil

    from megarl.checkpoint.run_record import MODEL_CONFIG, record_model_configs

    model, out = shutil.copytree(demo[0], tmp_path / "model"), tmp_path / "run"
    ckpt = _trained_with(out, 2, config(demo, out, f"model.path={model}"), launch_dir=tmp_path)
    record_model_configs(ckpt, config(demo, out, f"model.path={model}"))  # as the trainer saves it
    assert [f for f in preflight(config(demo, out, f"model.path={model}")) if f.field == "model.path"] == []
    hf = json.loads((model / "config.json").read_text())
    rope = {**hf["rope_parameters"], "rope_theta": 500000.0}  # (transformers 5 keeps rope_theta there)
    (model / "config.json").write_text(json.dumps({**hf, "rope_parameters": rope, "transformers_version": "9"}))
    msg = refusal(config(demo, out, f"model.path={model}"))
    assert (f"  - model.path: ({model}) config.json differs from the one step_000002 was trained with (rope_parameters."
            f"rope_theta: recorded {hf['rope_parameters']['rope_theta']}, now 500000.0); restore it (a copy is "
            f"{ckpt / MODEL_CONFIG}), or start a new run from the new model in a new trainer.output_dir") in msg


def test_a_resume_refuses_a_layout_its_optimizer_state_cannot_load_in(demo, tmp_path):
    # Megatron failed in every rank's load with a KeyError, once the whole cluster had started
    out = tmp_path / "run"
    _trained_with(out, 2, config(demo, out), launch_dir=tmp_path, roles=("policy",))
    msg = refusal(config(demo, out, "actor.parallel.tp=2", "model.dtype=bfloat16", "critic.parallel.tp=2"))
    assert ("  - actor.parallel.tp: step_000002 was trained with actor.parallel.tp=1, and its optimizer state loads only "
            "with the same value (the data-parallel size may change), not 2; resume with actor.parallel.tp=1, or start a "
            "new run from its weights (`megarl convert` it, then model.path) in a new trainer.output_dir") in msg
    assert "  - model.dtype: step_000002 was trained with model.dtype=float32," in msg
    assert "critic.parallel.tp" not in msg  # no critic in the checkpoint: nothing to load
    msg = refusal(config(demo, out, "algorithm.estimator=gae"))  # failed after the start: the checkpoint has no 'critic'
    assert ("  - algorithm.estimator: this launch trains a critic and step_000002 holds none (trained with "
            "algorithm.estimator=grpo): a resume cannot add one; resume with algorithm.estimator=grpo, or start") in msg
    warned = make_plan(config(demo, out, "cluster.gpus_per_node=1"), check_files=True).warnings  # DP 2 -> 1 reshards
    assert [w.message for w in warned if w.field == "trainer.resume"] == [
        "step_000002 was trained with another config, and the run goes on with this one: cluster.gpus_per_node: 2 -> 1"]


def test_the_layout_of_a_critic_this_launch_does_not_train_is_free(demo, tmp_path):
    # a PPO run resumed as GRPO does not load its critic: the critic's layout may change
    out = tmp_path / "run"
    _trained_with(out, 2, config(demo, out, "algorithm.estimator=gae", "critic.parallel.tp=2"), launch_dir=tmp_path,
                  roles=("policy", "critic"))  # fmt: skip
    assert [f for f in preflight(config(demo, out)) if f.level == "error"] == []
    msg = refusal(config(demo, out, "algorithm.estimator=gae"))  # the critic is loaded: its TP must stay 2
    assert "  - critic.parallel.tp: step_000002 was trained with critic.parallel.tp=2," in msg


def test_a_resume_refuses_a_critic_model_of_another_architecture(demo, tmp_path):
    # A PPO run whose critic came from its own critic.path, resumed without it (the critic then
    # starts from model.path) or with another model: Megatron's load failed with a shape mismatch
    # in every critic rank, once Ray and the policy had started.
    import shutil

    from megarl.models.tiny import build_tiny_model

    out = tmp_path / "run"
    small = build_tiny_model(tmp_path / "small", task_vocab=TASK_VOCAB, hidden_size=32, num_layers=1, num_heads=2,
                             num_kv_heads=1, ffn_hidden_size=64, max_position_embeddings=64)
    _trained_with(out, 2, config(demo, out, "algorithm.estimator=gae", f"critic.path={small}"), launch_dir=tmp_path,
                  roles=("policy", "critic"))  # fmt: skip
    msg = refusal(config(demo, out, "algorithm.estimator=gae"))
    assert (f"  - critic.path: this launch's critic model (model.path={demo[0]} (critic.path unset)) differs "
            f"from the one the critic of step_000002 was trained as (critic.path={small}: hidden_size: "
            f"recorded 32, now 64;") in msg
    assert f"whose weights the checkpoint holds; resume with critic.path={small}, or start a new run" in msg
    copy = shutil.copytree(small, tmp_path / "moved")  # another directory, the same model: its weights are not read
    assert [f for f in preflight(config(demo, out, "algorithm.estimator=gae", f"critic.path={copy}"))
            if f.field == "critic.path"] == []  # fmt: skip
    assert [f for f in preflight(config(demo, out)) if f.level == "error"] == []  # GRPO does not load the critic


def test_a_critic_model_edited_in_place_since_training_is_refused_by_the_checkpoints_copy(demo, tmp_path):
    # The checkpoint keeps critic.path's config.json as trained: the same directory, edited since,
    # no longer reads as the model the critic was trained as.
    import json
    import shutil

    from megarl.checkpoint.run_record import CRITIC_MODEL_CONFIG, record_model_configs

    out, critic = tmp_path / "run", shutil.copytree(demo[0], tmp_path / "critic")
    trained = config(demo, out, "algorithm.estimator=gae", f"critic.path={critic}")
    ckpt = _trained_with(out, 2, trained, launch_dir=tmp_path, roles=("policy", "critic"))
    record_model_configs(ckpt, trained)  # as the trainer saves it
    assert (ckpt / CRITIC_MODEL_CONFIG).read_text() == (critic / "config.json").read_text()
    assert [f for f in preflight(trained) if f.field == "critic.path"] == []
    hf = json.loads((critic / "config.json").read_text())
    (critic / "config.json").write_text(json.dumps({**hf, "intermediate_size": 2 * hf["intermediate_size"]}))
    msg = refusal(trained)
    assert (f"  - critic.path: this launch's critic model (critic.path={critic}) differs from the one the critic of "
            f"step_000002 was trained as (critic.path={critic}: intermediate_size: recorded {hf['intermediate_size']}, "
            f"now {2 * hf['intermediate_size']})") in msg


def test_a_fully_reshardable_checkpoint_resumes_in_another_tp_pp(demo, tmp_path):
    import json

    from megarl.parallel.mcore_version import VERSIONS_FILE

    out = tmp_path / "run"
    trained = config(demo, out, "algorithm.estimator=gae", "actor.optimizer.checkpoint_format=fully_reshardable")
    ckpt = _trained_with(out, 2, trained, launch_dir=tmp_path, roles=("policy", "critic"))
    # what the save records: the policy's state per parameter, the critic's (default) per DP buffer
    (ckpt / "policy" / VERSIONS_FILE).write_text(json.dumps({"optimizer_format": "fully_reshardable"}))
    (ckpt / "critic" / VERSIONS_FILE).write_text(json.dumps({"optimizer_format": "dp_reshardable"}))
    msg = refusal(config(demo, out, "algorithm.estimator=gae", "actor.optimizer.checkpoint_format=fully_reshardable",
                         "actor.parallel.tp=2", "actor.parallel.pp=2", "critic.parallel.tp=2", "model.dtype=bfloat16",
                         "cluster.gpus_per_node=4"))
    assert "actor.parallel" not in msg  # the policy's state loads in any TP/PP
    assert "  - model.dtype: step_000002 was trained with model.dtype=float32," in msg  # (fp32 and bf16 state differ)
    assert ("  - critic.parallel.tp: step_000002 was trained with critic.parallel.tp=1, and its optimizer state loads only "
            "with the same value (the data-parallel size may change), not 2; resume with critic.parallel.tp=1, or start a "
            "new run from its weights (`megarl convert` it, then model.path) in a new trainer.output_dir; to change it at a "
            "later resume, resume once with critic.parallel.tp=1 and critic.optimizer.checkpoint_format=fully_reshardable: "
            "the checkpoints it saves may change it") in msg
    plan = make_plan(config(demo, out, "algorithm.estimator=gae", "actor.optimizer.checkpoint_format=fully_reshardable",
                            "actor.parallel.tp=2"), check_files=True)
    assert [w.message for w in plan.warnings if w.field == "trainer.resume"] == [
        "step_000002 was trained with another config, and the run goes on with this one: actor.parallel.tp: 1 -> 2"]
    # the non-distributed optimizer keeps its state per parameter too (tests/distributed/test_dist_checkpoint.py)
    out = tmp_path / "plain"
    _trained_with(out, 2, config(demo, out, "actor.optimizer.distributed=false"), launch_dir=tmp_path, roles=("policy",))
    assert [f for f in preflight(config(demo, out, "actor.optimizer.distributed=false", "actor.parallel.tp=2"))
            if f.level == "error"] == []  # fmt: skip


def test_going_back_to_an_older_checkpoint_is_said_before_launch(demo, tmp_path):
    out = tmp_path / "run"
    older = _checkpoint(out, 2)
    _checkpoint(out, 4)
    warned = make_plan(config(demo, out, f"trainer.resume={older}"), check_files=True).warnings
    [back] = [w for w in warned if w.field == "trainer.resume"]
    assert back.message.startswith("goes back to step 2: the run's newer checkpoints (step_000004; 4.7e-08 GiB) will "
                                   "be kept as <name>.abandoned (not resumed from, not pruned: remove them when no longer needed)")
    assert back.message.endswith("for the latest, use trainer.resume=auto")
    assert (out / "checkpoints" / "step_000004").is_dir()  # planning moves nothing
    for latest in ("auto", str(out / "checkpoints" / "step_000004"), f"{older} trainer.val_only=true"):
        assert [w for w in make_plan(config(demo, out, *f"trainer.resume={latest}".split()), check_files=True).warnings
                if w.field == "trainer.resume"] == []  # (a validation-only run sets nothing aside)


def test_a_finished_run_says_so(demo, tmp_path):
    out = tmp_path / "run"
    _checkpoint(out, 500)
    message = finished_run(config(demo, out))
    assert message is not None and "already finished" in message and "step_000500" in message
    assert "raise trainer.total_steps" in message and "new trainer.output_dir" in message
    assert finished_run(config(demo, out, "trainer.total_steps=600")) is None
    # resumed with a smaller total_steps: the checkpoint is past it, and raising it to 500 would not do
    message = finished_run(config(demo, out, "trainer.total_steps=300"))
    assert message == (f"{out} already finished: its checkpoint step_000500 is step 500, past trainer.total_steps (300); "
                       "nothing to train. To train longer raise trainer.total_steps above 500; to start over give a new "
                       f"trainer.output_dir (or move {out} away)")


def test_a_finished_run_of_total_epochs_says_so(demo, tmp_path):
    """The demo's 800 training prompts, 32 a step: 25 steps an epoch, read from the files' footers."""
    out = tmp_path / "run"
    _checkpoint(out, 50)
    epochs = ("trainer.total_steps=null", "trainer.total_epochs=2")
    message = finished_run(config(demo, out, *epochs))
    assert message == (f"{out} already finished: its checkpoint step_000050 is at the 50 steps of trainer.total_epochs "
                       "(2); nothing to train. To train longer raise trainer.total_epochs; to start over give a new "
                       f"trainer.output_dir (or move {out} away)")
    assert finished_run(config(demo, out, "trainer.total_steps=null", "trainer.total_epochs=3")) is None
    message = finished_run(config(demo, out, "trainer.total_steps=null", "trainer.total_epochs=1"))
    assert message is not None and "is step 50, past the 25 steps of trainer.total_epochs (1)" in message
    assert finished_run(config(demo, out, *epochs, "trainer.resume=disable")) is None


@pytest.mark.slow
def test_a_one_gigabyte_data_file_is_checked_within_five_seconds(tmp_path):
    """Parquet footer plus at most 1,000 rows, whatever the file's size (the issue's budget)."""
    from megarl.data.datasets import check_prompt_file

    path = tmp_path / "big.parquet"
    text = "digits " * 300
    chunk = pa.Table.from_pylist(rows([f"{text}{i}" for i in range(20_000)]))
    with pq.ParquetWriter(path, chunk.schema, compression="none") as writer:
        for _ in range(2**30 // chunk.nbytes + 1):
            writer.write_table(chunk)
    assert path.stat().st_size >= 2**30
    os.posix_fadvise(os.open(path, os.O_RDONLY), 0, 0, os.POSIX_FADV_DONTNEED)  # not from the page cache
    start = time.perf_counter()
    records = check_prompt_file(path, label="data.train_files[0]")
    elapsed = time.perf_counter() - start
    assert 0 < len(records) <= 1000
    assert elapsed < 5.0, f"{elapsed:.1f} s"


def test_a_tokenizer_without_chat_template(demo, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(demo[0], model)
    (model / "chat_template.jinja").unlink()
    msg = refusal(config(demo, tmp_path / "run", f"model.path={model}"))
    assert "data.apply_chat_template: is true but the tokenizer of model.path" in msg and "apply_chat_template=false" in msg


def test_a_model_its_bridge_refuses(demo, tmp_path):
    """config.json whose MLP width differs from the weights': refused before Ray, on one line naming
    model.path and a tensor; a config transformers itself rejects: one line too."""
    import json
    import shutil

    model = shutil.copytree(demo[0], tmp_path / "model")
    hf = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**hf, "intermediate_size": hf["intermediate_size"] + 8}))
    msg = refusal(config(demo, tmp_path / "run", f"model.path={model}"))
    assert f"model.path: ({model}) is not a model megarl can train" in msg
    assert "mlp" in msg and len(msg.splitlines()) == 2  # "the plan is refused:" and one finding

    (model / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": hf["num_hidden_layers"] + 1}))
    msg = refusal(config(demo, tmp_path / "run", f"model.path={model}"))
    assert "layer_types" in msg and len(msg.splitlines()) == 2


def test_a_model_directory_without_a_tokenizer(demo, tmp_path):
    import shutil

    model = shutil.copytree(demo[0], tmp_path / "model")
    (model / "tokenizer.json").unlink()
    msg = refusal(config(demo, tmp_path / "run", f"model.path={model}"))
    assert f"model.path: ({model}) has no tokenizer files: " in msg and "reads tokenizer.json" in msg
    assert "; copy the model's tokenizer files into it" in msg


def test_the_agent_rollouts_user_code_is_loaded_before_launch(demo, tmp_path, monkeypatch):
    examples = Path(__file__).resolve().parents[3] / "docs" / "examples"
    monkeypatch.setenv("PYTHONPATH", str(examples))
    schema = "{type: function, function: {name: check}}"
    (tmp_path / "good.yaml").write_text(f"tools:\n  - class_name: agent_extensions.AnswerCheck\n    tool_schema: {schema}\n")
    (tmp_path / "bad.yaml").write_text(f"tools:\n  - class_name: agent_extensions.Missing\n    tool_schema: {schema}\n")
    (tmp_path / "users.yaml").write_text("interaction:\n  - name: echo\n    class_name: agent_extensions.EchoUser\n")
    good = config(demo, tmp_path / "run", f"rollout.agent.tools_file={tmp_path / 'good.yaml'}",
                  f"rollout.agent.interactions_file={tmp_path / 'users.yaml'}",
                  "rollout.agent.tool_parser=agent_extensions:digit_calls", "rollout.agent.default_agent=tool_agent")  # fmt: skip
    assert preflight(good) == []
    msg = refusal(config(demo, tmp_path / "run", f"rollout.agent.tools_file={tmp_path / 'bad.yaml'}",
                         "rollout.agent.loops={mine: agent_extensions:digit_calls}"))  # fmt: skip
    assert (f"rollout.agent.tools_file: tool file {tmp_path / 'bad.yaml'}, tools[0]: class_name 'agent_extensions.Missing' "
            "cannot be imported") in msg  # fmt: skip
    assert ("rollout.agent.loops.mine: agent loop 'agent_extensions:digit_calls' is not a subclass of "
            "megarl.rollout.agents.loops.AgentLoop") in msg  # fmt: skip


def test_agent_files_that_cannot_be_read_are_refused_with_the_plans_other_problems(demo, tmp_path, monkeypatch):
    """A relative tools_file or interactions_file that does not resolve from the working directory
    is one more problem of the refused plan, named with the others (here a bad output_dir), not
    an error of its own raised by the prompt checks that read the tools' schemas."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "taken").write_text("a file where the output directory should be")
    msg = refusal(config(demo, tmp_path / "taken", "rollout.agent.tools_file=configs/tools/calculator.yaml",
                         "rollout.agent.interactions_file=configs/users.yaml", "data.filter_overlong_prompts=true"))  # fmt: skip
    assert "trainer.output_dir" in msg
    assert ("rollout.agent.tools_file: tool file configs/tools/calculator.yaml: cannot be read (No such file or "
            "directory); check the path (a relative path is relative to the working directory)") in msg
    assert "rollout.agent.interactions_file: interaction file configs/users.yaml: cannot be read" in msg
    assert msg.count("calculator.yaml") == 1  # once, not again by the checks that read its schemas


def test_agent_names_of_every_row_and_interactions_of_the_sampled_rows(demo, tmp_path):
    (tmp_path / "users.yaml").write_text("interaction:\n  - {name: a, class_name: x.A}\n  - {name: b, class_name: x.B}\n")
    data = tmp_path / "agents.parquet"
    records = rows([format(k, "011b") for k in range(1100)])
    for record in records:
        record["agent_name"] = "single_turn_agent"  # verl's name of the single-turn loop
    records[0]["agent_name"] = records[2]["agent_name"] = "tool_agent"
    records[1050]["agent_name"] = "searcher"  # past the rows the data check samples
    records[2]["extra_info"] = {"interaction_kwargs": {"query": "q"}}  # no name, two interactions
    pq.write_table(pa.Table.from_pylist(records), data)
    findings = preflight(config(demo, tmp_path / "run", f"data.train_files=[{data}]", "data.val_files=[]",
                                f"rollout.agent.interactions_file={tmp_path / 'users.yaml'}", "data.max_prompt_length=32"))  # fmt: skip
    messages = {f.message for f in findings if f.field == "data.train_files[0] (agents.parquet)" and f.level == "error"}
    assert messages == {"row 1050: agent_name 'searcher' is not an agent loop; use single_turn, tool_agent (or verl's "
                        "single_turn_agent), or add yours under rollout.agent.loops",
                        "row 2: extra_info.interaction_kwargs has no name and rollout.agent.interactions_file has 2 "
                        "interactions (a, b); add name to interaction_kwargs"}  # fmt: skip


def test_tools_that_no_sampled_row_would_call_are_a_warning(demo, tmp_path):
    (tmp_path / "tools.yaml").write_text("tools:\n  - class_name: calculator\n    tool_schema: {type: function, function: {name: c}}\n")
    found = preflight(config(demo, tmp_path / "run", f"rollout.agent.tools_file={tmp_path / 'tools.yaml'}"))
    # (and the demo model cannot write a tool call: tests/unit/plan/test_token_checks.py)
    (warning,) = [f for f in found if f.field != "rollout.agent.tools_file"]
    assert warning.level == "warning" and warning.field == "rollout.agent.default_agent"
    assert "every row runs single_turn" in warning.message and "set rollout.agent.default_agent=tool_agent" in warning.message


def test_the_driver_imports_no_megatron_and_no_user_code(demo, tmp_path):
    """The bridge check runs in the driver without importing Megatron; the user's reward module
    is imported only by the child process."""
    import subprocess
    import sys

    (tmp_path / "rewards.py").write_text("def score(**kwargs):\n    return 0.0\n")
    code = ("import sys\nfrom megarl.config.loading import load_config\nfrom megarl.plan.preflight import preflight\n"
            f"cfg = load_config({str(TINY)!r}, {list(config_args(demo, tmp_path))!r})\n"
            "assert preflight(cfg) == [], preflight(cfg)\n"
            "print(sorted(m for m in sys.modules if m.startswith('megatron') or 'rewards' in m and 'megarl' not in m))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip() == "[]", out


def config_args(demo, tmp_path: Path) -> list[str]:
    model, data = demo
    return [f"model.path={model}", f"data.train_files=[{data / 'train.parquet'}]", f"data.val_files=[{data / 'val.parquet'}]",
            f"trainer.output_dir={tmp_path / 'run'}", f"reward.custom.path={tmp_path / 'rewards.py'}", "reward.custom.name=score"]


def test_wandb_without_a_key_where_it_cannot_ask_is_refused_before_launch(demo, tmp_path, monkeypatch, real_wandb):
    """A Slurm job (no terminal) with no W&B key met W&B's refusal only after the cluster started;
    W&B's own lookup decides (real SDK), a key in the environment or netrc or offline mode passes."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc, no W&B settings
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / ".netrc"))
    monkeypatch.setattr(sys, "stdin", io.StringIO())  # no terminal
    cfg = config(demo, tmp_path / "out", "trainer.loggers=[console,wandb]")
    msg = refusal(cfg)
    assert "trainer.loggers: includes wandb: W&B has no API key here and no terminal to ask for one" in msg
    assert "set WANDB_MODE=offline" in msg
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert not [f for f in preflight(cfg) if f.field == "trainer.loggers"]
    monkeypatch.delenv("WANDB_MODE")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / ".netrc").write_text(f"machine api.wandb.ai\n  login user\n  password {'a' * 40}\n")
    (tmp_path / "home" / ".netrc").chmod(0o600)
    assert not [f for f in preflight(cfg) if f.field == "trainer.loggers"]


def _lora_checkpoint(out: Path, cfg, launch_dir: Path, model: Path | None = None) -> Path:
    """A LoRA run's checkpoint: its policy holds lora_base.json (with the base's weight files, when
    ``model`` is given, as the policy ranks record them)."""
    import json

    from megarl.models.weight_files import weights_fingerprint

    ckpt = _trained_with(out, 2, cfg, launch_dir=launch_dir, roles=("policy",))
    record = {"path": str(model or "/models/base"), "fingerprint": [1.0, 2.0]}
    if model is not None:
        record["files"] = [list(f) for f in weights_fingerprint(model)]
    (ckpt / "policy" / "lora_base.json").write_text(json.dumps(record))
    return ckpt


def test_a_resume_refuses_lora_changes_before_ray_starts(demo, tmp_path):
    # found after Ray and the model's load (minutes at 72B), or as Megatron's "Global shape mismatch"
    out = tmp_path / "run"
    lora = "actor.lora={rank: 4, alpha: 8, target_modules: [q_proj, v_proj]}"
    _lora_checkpoint(out, config(demo, out, lora), tmp_path)
    assert [f for f in preflight(config(demo, out, lora)) if f.level == "error"] == []
    msg = refusal(config(demo, out))  # the whole model
    assert ("  - actor.lora: (unset) step_000002 holds LoRA adapters (policy/lora_base.json: actor.lora={rank: 4, alpha: 8, "
            "target_modules: ['q_proj', 'v_proj']}), not the whole model's weights, and this launch trains the whole "
            "model; resume with actor.lora as that run set it, or start a new run in a new trainer.output_dir") in msg
    msg = refusal(config(demo, out, lora, "actor.lora.rank=8"))
    assert ("  - actor.lora.rank: step_000002's adapters were trained with actor.lora.rank=4 (A [rank, in], B [out, rank]) "
            "and load only at that rank, not 8; resume with actor.lora.rank=4, or start a new run") in msg
    assert "actor.lora.alpha" not in msg  # (the rank's refusal covers the scale)
    msg = refusal(config(demo, out, lora, "actor.lora.target_modules=all-linear"))
    assert ("  - actor.lora.target_modules: step_000002 holds adapters of q_proj, v_proj (actor.lora.target_modules="
            "['q_proj', 'v_proj']), and this launch's are q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj") in msg
    msg = refusal(config(demo, out, lora, "actor.lora.alpha=16"))
    assert ("  - actor.lora.alpha: step_000002's adapters were trained at actor.lora.alpha=8 (scale alpha / rank = 2); at "
            "16 the same adapters would add 2x their update to every adapted layer and the policy's output would jump at "
            "the resume; resume with actor.lora.alpha=8, or start a new run") in msg
    # a listing of the same modules, and a training-only setting, are not refused
    findings = preflight(config(demo, out, "actor.lora={rank: 4, alpha: 8, target_modules: [v_proj, q_proj], dropout: 0.1}"))
    assert [f for f in findings if f.level == "error"] == []


def test_a_resume_of_a_whole_model_checkpoint_with_lora_is_refused(demo, tmp_path):
    # the launch said "the run goes on with this one: actor.lora: None -> {...}" and failed 30 s later
    out = tmp_path / "run"
    _trained_with(out, 2, config(demo, out), launch_dir=tmp_path, roles=("policy",))
    findings = preflight(config(demo, out, "actor.lora.rank=8"))
    assert [(f.field, f.level) for f in findings] == [("actor.lora", "error")]
    assert findings[0].message.startswith("step_000002 holds the whole model's weights (no policy/lora_base.json), not "
                                          "LoRA adapters, and this launch sets actor.lora; resume without actor.lora")
    assert preflight(config(demo, out)) == []


def test_a_lora_resume_refuses_replaced_base_weights_at_the_same_path(demo, tmp_path):
    # only a changed path string was refused before Ray; replaced weights met the fingerprint after the load
    import shutil

    model, out = shutil.copytree(demo[0], tmp_path / "model"), tmp_path / "run"
    lora = "actor.lora={rank: 4}"
    _lora_checkpoint(out, config(demo, out, lora, f"model.path={model}"), tmp_path, model=model)
    assert [f for f in preflight(config(demo, out, lora, f"model.path={model}")) if f.level == "error"] == []
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8:] = bytes(8)  # the same names and sizes, other weights (a fine-tuned model copied over the base)
    weights.write_bytes(bytes(data))
    msg = refusal(config(demo, out, lora, f"model.path={model}"))
    assert (f"  - model.path: ({model}) holds other weights than the base step_000002's adapters were trained on ({model}; "
            "weight files that differ: model.safetensors): the adapters would go on from another base; restore that "
            "base at model.path, or start a new run in a new trainer.output_dir") in msg


def test_an_moe_resume_changes_ep_where_the_optimizer_state_is_keyed_per_parameter(demo, tmp_path):
    import json

    from megarl.models.tiny import build_tiny_model
    from megarl.parallel.mcore_version import VERSIONS_FILE

    _, data = demo
    moe = build_tiny_model(tmp_path / "moe", "qwen3_moe", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                           ffn_hidden_size=32, num_experts=4, experts_per_token=2, moe_ffn_hidden_size=16)  # fmt: skip
    demo = (moe, data)
    fmt = "actor.optimizer.checkpoint_format=fully_reshardable"
    for unprefixed, refused in ((True, False), (False, True)):  # False: a save by a megarl that did not record it
        out = tmp_path / f"run_{unprefixed}"
        ckpt = _trained_with(out, 2, config(demo, out, fmt, "actor.parallel.ep=2"), launch_dir=tmp_path, roles=("policy",))
        record = {"optimizer_format": "fully_reshardable", "optimizer_state_unprefixed": unprefixed}
        (ckpt / "policy" / VERSIONS_FILE).write_text(json.dumps(record))
        errors = [f for f in preflight(config(demo, out, fmt, "actor.parallel.ep=1"))
                  if f.level == "error" and f.field.startswith("actor.")]  # (the demo's prompts suit another tokenizer)
        assert [f.field for f in errors] == (["actor.parallel.ep"] if refused else []), errors
    assert ("step_000002 was trained with actor.parallel.ep=2, and its optimizer state loads only with the same value "
            "(the data-parallel size may change), not 1; resume with actor.parallel.ep=2, or start a new run from its "
            "weights (`megarl convert` it, then model.path) in a new trainer.output_dir; to change it at a later resume, "
            "resume once with actor.parallel.ep=2 and actor.optimizer.checkpoint_format=fully_reshardable") in errors[0].message
    # the non-distributed optimizer: no resume of this run may change ep, only a new run with the distributed one
    out, plain = tmp_path / "run_plain", "actor.optimizer.distributed=false"
    _trained_with(out, 2, config(demo, out, plain, "actor.parallel.ep=2"), launch_dir=tmp_path, roles=("policy",))
    errors = [f for f in preflight(config(demo, out, plain, "actor.parallel.ep=1")) if f.level == "error" and f.field.startswith("actor.")]
    assert [f.field for f in errors] == ["actor.parallel.ep"], errors
    assert errors[0].message.endswith(
        "in a new trainer.output_dir; the non-distributed optimizer's checkpoints never change it, and "
        "actor.optimizer.distributed is kept at a resume too: start that new run with actor.optimizer.distributed=true "
        "and actor.optimizer.checkpoint_format=fully_reshardable, whose checkpoints may change it")
