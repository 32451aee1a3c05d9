"""The model checkpoint format of `megarl convert hf-to-megatron` and the refusals around it, on
real directories (the conversions themselves run in tests/e2e/test_convert_formats.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megarl.checkpoint.model_checkpoint import (
    RECORD,
    SFT_SOURCE,
    WEIGHTS,
    ModelCheckpointError,
    check_model_checkpoint,
    config_differences,
    is_model_checkpoint,
    write_record,
    write_verified,
)
from megarl.commands.convert import expand_short_form
from megarl.commands.model_outputs import EXPORT_MANIFEST, check_output_target
from megarl.commands.outputs import OutputError, OutputExistsError

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny_grpo.yaml"


def fake_checkpoint(root: Path, hf_dir: Path) -> Path:
    """A model checkpoint's files around an empty weights record: what the checks read."""
    root.mkdir()
    for f in hf_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy2(f, root / f.name)
    (root / WEIGHTS).mkdir()
    (root / WEIGHTS / "metadata.json").write_text("{}")
    config = json.loads((hf_dir / "config.json").read_text())
    write_record(root, source=str(hf_dir), tp=2, pp=1, dtype="float32", hf_config=config, verified_parameters=3)
    return root


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from megarl.commands.demo import prepare_demo

    return prepare_demo(tmp_path_factory.mktemp("demo"))


def test_config_differences_name_each_field():
    recorded = {"hidden_size": 64, "rope_theta": 10000.0, "transformers_version": "4.0", "tie_word_embeddings": True}
    now = {"hidden_size": 64, "rope_theta": 500000.0, "transformers_version": "5.0", "vocab_size": 300}
    assert config_differences(recorded, now) == [
        "rope_theta: recorded 10000.0, now 500000.0",
        "tie_word_embeddings: recorded true, now absent",
        "vocab_size: recorded absent, now 300",
    ]
    assert config_differences(recorded, dict(recorded, transformers_version="9")) == []
    scaled = dict(recorded, rope_scaling={"rope_type": "linear", "factor": 8.0})  # a nested field by its dotted key
    assert config_differences(scaled, dict(scaled, rope_scaling={"rope_type": "linear", "factor": 4.0})) == [
        "rope_scaling.factor: recorded 8.0, now 4.0"
    ]


def test_record_lists_the_files_and_the_checks_refuse_by_name(demo, tmp_path):
    model, _ = demo
    ckpt = fake_checkpoint(tmp_path / "ckpt", model)
    assert is_model_checkpoint(ckpt) and not is_model_checkpoint(model) and not is_model_checkpoint(None)
    record = check_model_checkpoint(ckpt)
    assert "megatron/metadata.json" in record["files"] and "config.json" in record["files"] and RECORD not in record["files"]
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=config["num_hidden_layers"] + 1)))
    with pytest.raises(ModelCheckpointError) as info:
        check_model_checkpoint(ckpt)
    assert f"num_hidden_layers: recorded {config['num_hidden_layers']}, now {config['num_hidden_layers'] + 1}" in str(info.value)
    assert "restore that config.json" in str(info.value)
    (ckpt / "config.json").write_text(json.dumps(config))
    shard = ckpt / WEIGHTS / "__0_1.distcp"  # a shard lost in a copy
    shard.write_bytes(b"weights")
    write_record(ckpt, source=str(model), tp=2, pp=1, dtype="float32", hf_config=config, verified_parameters=3)
    check_model_checkpoint(ckpt)
    shard.write_bytes(b"weig")  # cut short
    with pytest.raises(ModelCheckpointError, match=f"^{ckpt}: megatron/__0_1.distcp \\(listed in {RECORD}\\) has 4 bytes, "
                                                   f"{RECORD} says 7 \\(truncated\\?\\); copy the checkpoint again whole"):  # fmt: skip
        check_model_checkpoint(ckpt)
    shard.unlink()
    with pytest.raises(ModelCheckpointError, match=f"^{ckpt}: megatron/__0_1.distcp \\(listed in {RECORD}\\) is missing; "
                                                   "copy the checkpoint again whole, or convert the HF model again"):  # fmt: skip
        check_model_checkpoint(ckpt)
    # the weights megarl sft trained: no conversion makes them again
    shard.write_bytes(b"weights")
    write_record(ckpt, source=f"{SFT_SOURCE}{model}", tp=2, pp=1, dtype="float32", hf_config=config, verified_parameters=3)
    shard.write_bytes(b"weig")
    with pytest.raises(ModelCheckpointError, match=r"\(truncated\?\); copy it again whole from where `megarl sft` wrote it "
                                                   r"\(no conversion remakes trained weights\)$"):  # fmt: skip
        check_model_checkpoint(ckpt)
    (ckpt / WEIGHTS / "metadata.json").unlink()
    with pytest.raises(ModelCheckpointError, match="holds no Megatron checkpoint"):
        check_model_checkpoint(ckpt)
    (ckpt / RECORD).write_text("{not json")
    with pytest.raises(ModelCheckpointError, match="is unreadable"):
        check_model_checkpoint(ckpt)


def test_launch_refuses_a_checkpoint_whose_config_was_changed(demo, tmp_path):
    """Before Ray: preflight names model.path and every differing field; the untouched copy passes."""
    from megarl.config.loading import load_config
    from megarl.plan.planner import PlanError, make_plan
    from megarl.plan.preflight import preflight

    model, data = demo
    ckpt = fake_checkpoint(tmp_path / "ckpt", model)
    overrides = [f"model.path={ckpt}", f"data.train_files=[{data / 'train.parquet'}]",
                 f"data.val_files=[{data / 'val.parquet'}]", f"trainer.output_dir={tmp_path / 'run'}"]  # fmt: skip
    assert preflight(load_config(TINY, overrides)) == []
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(dict(config, max_position_embeddings=123)))
    with pytest.raises(PlanError) as info:
        make_plan(load_config(TINY, overrides), check_files=True)
    assert f"model.path: {ckpt}: config.json differs from the HF config the weights were converted from" in str(info.value)
    assert f"max_position_embeddings: recorded {config['max_position_embeddings']}, now 123" in str(info.value)


def test_outputs_of_hf_to_megatron_follow_the_overwrite_rule(demo, tmp_path):
    model, _ = demo
    previous = fake_checkpoint(tmp_path / "previous", model)
    check_output_target(previous, True, {}, manifest=RECORD)  # a previous output: replaceable
    with pytest.raises(OutputExistsError, match="--overwrite"):
        check_output_target(previous, False, {}, manifest=RECORD)
    (previous / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match=r"holds files that megarl convert did not write \(notes.txt\)"):
        check_output_target(previous, True, {}, manifest=RECORD)
    exported = tmp_path / "exported"  # the other direction's output is named as such
    exported.mkdir()
    (exported / EXPORT_MANIFEST).write_text(json.dumps({"files": []}))
    with pytest.raises(OutputError, match=r"is a megatron-to-hf output \(megarl_export.json\), and --overwrite here "
                       "replaces only a previous hf-to-megatron output"):
        check_output_target(exported, True, {}, manifest=RECORD)
    with pytest.raises(OutputError, match="is inside the HF model directory"):
        check_output_target(model / "megatron_copy", False, {"the HF model directory": model}, manifest=RECORD)


@pytest.mark.parametrize("argv,expanded", [
    (["convert", "ckpt", "out"], ["convert", "megatron-to-hf", "--ckpt", "ckpt", "--out", "out"]),
    (["--debug", "convert", "ckpt", "out", "--overwrite"],
     ["--debug", "convert", "megatron-to-hf", "--overwrite", "--ckpt", "ckpt", "--out", "out"]),
    (["convert", "--config", "c.yaml", "ckpt", "out"],
     ["convert", "megatron-to-hf", "--config", "c.yaml", "--ckpt", "ckpt", "--out", "out"]),
    (["convert", "ckpt", "--overwrite", "out"], ["convert", "megatron-to-hf", "--overwrite", "--ckpt", "ckpt", "--out", "out"]),
    (["convert", "--overwrite"], ["convert", "--overwrite"]),
    (["convert", "hf-to-megatron", "--hf", "m"], ["convert", "hf-to-megatron", "--hf", "m"]),
    (["convert", "--help"], ["convert", "--help"]),
    (["plan", "convert"], ["plan", "convert"]),
])  # fmt: skip
def test_the_short_form_is_megatron_to_hf(argv, expanded):
    assert expand_short_form(argv) == expanded


def test_cli_refusals_are_one_line_before_ray(demo, tmp_path):
    """Bad layouts and inputs end as one `error:` line naming the flag (exit 2), in seconds."""
    import subprocess
    import sys

    model, _ = demo
    empty = tmp_path / "empty"
    empty.mkdir()
    cut = shutil.copytree(model, tmp_path / "cut")  # a download cut short
    with open(cut / "model.safetensors", "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)
    cli = [sys.executable, "-m", "megarl.cli", "convert"]
    cases = [
        ([*cli, "hf-to-megatron", "--hf", str(model), "--out", str(tmp_path / "o"), "--tp", "3"], "--tp (3) must divide"),
        ([*cli, "hf-to-megatron", "--hf", str(empty), "--out", str(tmp_path / "o")], "has no config.json"),
        ([*cli, "hf-to-megatron", "--hf", str(cut), "--out", str(tmp_path / "o")],
         f"{cut / 'model.safetensors'} is not a readable safetensors file ("),
        ([*cli, "megatron-to-hf", "--out", str(tmp_path / "o")], "megatron-to-hf needs --ckpt"),
        ([*cli, "hf-to-megatron", "--hf", str(model), "--out", str(tmp_path / "o"), "--ep", "2"],
         "--ep (2) splits the experts of a mixture-of-experts model and qwen2 is dense; set it to 1"),
        ([*cli, str(tmp_path), str(tmp_path / "o"), "--tp", "2"], "--tp/--pp/--ep/--etp are for model checkpoints"),
        ([*cli, "--overwrite", str(model), str(tmp_path / "o")], f"error: {model} is a Hugging Face model directory, not a checkpoint"),
    ]
    for argv, expected in cases:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, (argv, done.stderr[-2000:])
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], done.stderr
    assert not (tmp_path / "o").exists()


def test_a_torch_engine_from_a_model_checkpoint_generates_only_after_a_push(demo, tmp_path):
    """Built from the config alone, the engine refuses to generate from its random weights; after
    one complete push of the HF model's tensors it samples what the HF directory's engine samples."""
    from safetensors.torch import load_file

    from megarl.engines.base import SamplingParams, WeightBucket
    from megarl.engines.torch_engine import TorchEngine, WeightLoadError

    model, _ = demo
    engine = TorchEngine(fake_checkpoint(tmp_path / "ckpt", model), dtype="float32")
    params = SamplingParams(temperature=1.0, max_new_tokens=4, seed=7)
    with pytest.raises(WeightLoadError, match="random weights until the first complete weight push"):
        engine.generate([[5, 6, 7]], params)
    engine.load_weights(WeightBucket(list(load_file(str(model / "model.safetensors")).items()), 1, last=True))
    got = engine.generate([[5, 6, 7]], params)
    want = TorchEngine(model, dtype="float32").generate([[5, 6, 7]], params)
    assert [r.response_ids for r in got] == [r.response_ids for r in want]
    for a, b in zip(got, want):  # the same weights; buffers built by another path round differently
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_rank_zero_writes_its_progress_whole_and_throttled(tmp_path, monkeypatch):
    """The count the driver's progress bar follows: rank 0 only, at most every every_s seconds,
    always the last one, and never a half-written file."""
    from megarl.actors.conversion_rank import ProgressFile

    path = tmp_path / "progress"
    monkeypatch.setenv("RANK", "1")
    ProgressFile(str(path))(1, 3)
    assert not path.exists()
    monkeypatch.setenv("RANK", "0")
    progress = ProgressFile(str(path), every_s=3600)
    progress(1, 3)
    assert path.read_text() == "1 3\n"
    progress(2, 3)  # within every_s: skipped
    assert path.read_text() == "1 3\n"
    progress(3, 3)  # the end is always written
    assert path.read_text() == "3 3\n" and not (tmp_path / "progress.tmp").exists()


def test_a_model_source_gone_by_the_write_is_said_not_skipped(tmp_path):
    """An SFT's model.path removed during training: the weights were written without config or
    tokenizer, and nothing said so (sft keeps them as .unverified with this message)."""
    staging, source = tmp_path / "staging", tmp_path / "gone"
    staging.mkdir()
    save = lambda weights: Path(weights).mkdir()  # noqa: E731
    with pytest.raises(FileNotFoundError, match=rf"^{source} has no config.json any more, so the model's config and tokenizer"):
        write_verified(staging, source, {}, save, lambda _: 1)
    assert (staging / "megatron").is_dir()  # what was written stays for the caller to keep


def test_an_sft_output_dir_given_as_the_model_names_the_model_checkpoint_in_it(demo, tmp_path):
    """README's flow passes <sft.output_dir>/model; the folder itself is named as what it is."""
    from megarl.checkpoint.verification import CheckpointError, verify_checkpoint
    from megarl.commands.generate import GenerateError, generate
    from megarl.config.loading import load_config
    from megarl.plan.preflight import preflight

    model, data = demo
    sft = tmp_path / "sft"
    sft.mkdir()
    fake_checkpoint(sft / "model", model)
    hint = f"it is an sft.output_dir: give the model checkpoint in it, {sft / 'model'}"
    with pytest.raises(CheckpointError, match=f"^{sft} is not a checkpoint; {hint}$"):  # megarl convert
        verify_checkpoint(sft)
    with pytest.raises(GenerateError, match=rf"training checkpoint \(step_NNNNNN\); {hint}$"):
        generate(TINY, [f"model.path={sft}"], data / "val.parquet", tmp_path / "gen.parquet")
    findings = preflight(load_config(TINY, [f"model.path={sft}", f"trainer.output_dir={tmp_path / 'run'}",
                                            f"data.train_files=[{data / 'train.parquet'}]", "data.val_files=[]"]))  # fmt: skip
    assert any(f.field == "model.path" and f.message.endswith(f"to launch; {hint}") for f in findings), findings
    (tmp_path / "other").mkdir()
    with pytest.raises(CheckpointError, match="manifest.json is missing"):  # any other folder: as before
        verify_checkpoint(tmp_path / "other")


def test_config_differences_read_configs_as_transformers_does():
    """A config.json re-saved by another transformers version (rope_theta moved into
    rope_parameters, layer_types and defaults written) is the same model; an edit is still named."""
    from transformers import Qwen2Config

    old_style = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 300,
                 "rope_theta": 1000000.0, "rope_scaling": None, "torch_dtype": "bfloat16", "transformers_version": "4.51.0"}  # fmt: skip
    resaved = Qwen2Config.from_dict(dict(old_style)).to_dict()
    assert "rope_theta" not in resaved and "layer_types" in resaved  # the installed version writes it otherwise
    assert config_differences(old_style, resaved) == []
    assert config_differences(old_style, dict(old_style, rope_theta=500000.0)) == [
        "rope_parameters.rope_theta (the file's rope_theta): recorded 1000000.0, now 500000.0"  # what the file says too
    ]
    edited = Qwen2Config.from_dict(dict(old_style, rope_theta=500000.0)).to_dict()  # a file of the installed version
    assert config_differences(old_style, edited) == ["rope_parameters.rope_theta: recorded 1000000.0, now 500000.0"]


def test_config_differences_leave_the_configs_compared_as_they_were():
    """The record's hf_config and the config.json read are the caller's: transformers writes
    rope_theta into the rope_scaling dict it is given, and a second comparison of the same
    dicts then missed an edited rope_theta (the nested one wins)."""
    import copy

    recorded = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "intermediate_size": 128, "vocab_size": 300, "rope_theta": 10000.0,
                "rope_scaling": {"rope_type": "linear", "factor": 2.0}}  # fmt: skip
    before = copy.deepcopy(recorded)
    assert config_differences(recorded, copy.deepcopy(recorded)) == []
    assert recorded == before
    edited = dict(recorded, rope_theta=500000.0)  # (shares the rope_scaling dict, as a shallow copy does)
    assert config_differences(recorded, edited) == ["rope_parameters.rope_theta (the file's rope_theta): recorded 10000.0, "
                                                    "now 500000.0"]  # fmt: skip
