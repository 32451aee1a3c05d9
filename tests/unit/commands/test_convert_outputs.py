"""`megarl convert` never destroys what the user owns: the output checks, the swap and the run's
paths, on real directories (the export itself runs in tests/e2e/test_failures_run.py and tests/e2e/test_convert_formats.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from megarl.checkpoint.manager import CheckpointManager
from megarl.checkpoint.run_record import other_dtype_note, run_config
from megarl.commands.model_outputs import (
    EXPORT_MANIFEST,
    _normalize_modes,
    _swap_in,
    check_output_target,
)
from megarl.commands.outputs import OutputError, OutputExistsError


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def run(tmp_path):
    """A launch directory holding a model and a run with one checkpoint (relative paths, as the demo)."""
    launch = tmp_path / "project"
    (launch / "models" / "tiny").mkdir(parents=True)
    (launch / "models" / "tiny" / "config.json").write_text("{}")
    cfg = {"model": {"path": "models/tiny", "arch": "tiny-demo", "dtype": "float32"}, "trainer": {"output_dir": "outputs/run"}}
    manager = CheckpointManager(launch / "outputs" / "run")
    with manager.saving(4, {"launch_dir": str(launch)}) as d:
        (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    return launch, manager.resolve_resume("auto")


def protected(launch: Path, ckpt) -> dict[str, Path]:
    return {"the run's checkpoints directory": ckpt.path.parent, "the model directory": launch / "models" / "tiny"}


def test_current_directory_and_its_parents_are_refused(run, monkeypatch):
    launch, ckpt = run
    work = launch / "work"
    work.mkdir()
    (work / "precious.txt").write_text("mine")
    monkeypatch.chdir(work)
    for out in (Path("."), work, launch):
        with pytest.raises(OutputError, match="current directory"):
            check_output_target(out.absolute(), True, protected(launch, ckpt))
    assert (work / "precious.txt").read_text() == "mine"


@pytest.mark.parametrize(
    ("where", "relation"),
    [("outputs/run/checkpoints/hf", "is inside the run's checkpoints"), ("outputs", "contains the run's checkpoints"),
     ("models/tiny", "is the model directory"), ("models/tiny/hf", "is inside the model directory")],
)
def test_the_checkpoint_tree_and_the_model_are_refused(run, where, relation):
    launch, ckpt = run
    with pytest.raises(OutputError, match=relation):
        check_output_target(launch / where, True, protected(launch, ckpt))


def test_an_existing_directory_is_replaced_only_when_it_is_a_previous_output(run):
    launch, ckpt = run
    out = launch / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="exists and is not empty.*--overwrite"):
        check_output_target(out, False, protected(launch, ckpt))
    with pytest.raises(OutputError, match=f"has no {EXPORT_MANIFEST} \\(it holds notes.txt\\)"):
        check_output_target(out, True, protected(launch, ckpt))
    (out / "model.safetensors").write_bytes(b"w")
    (out / EXPORT_MANIFEST).write_text(json.dumps({"files": ["model.safetensors"]}))
    with pytest.raises(OutputError, match=r"holds files that megarl convert did not write \(notes.txt\)"):
        check_output_target(out, True, protected(launch, ckpt))
    assert (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    check_output_target(out, True, protected(launch, ckpt))  # a previous output, alone: replaceable
    check_output_target(launch / "new" / "hf", False, protected(launch, ckpt))  # a new place: fine


def test_weights_sft_trained_are_never_overwritten(run):
    """A `megarl sft` model has the record of an hf-to-megatron output; its weights are trained,
    not converted, so --overwrite must not take it for a conversion's output."""
    from megarl.checkpoint.model_checkpoint import RECORD, SFT_SOURCE

    launch, ckpt = run
    out = launch / "sft" / "model"
    out.mkdir(parents=True)
    (out / "weights").write_bytes(b"trained")
    (out / RECORD).write_text(json.dumps({"files": ["weights"], "source": f"{SFT_SOURCE}models/tiny"}))
    with pytest.raises(OutputError, match=r"holds the weights `megarl sft` trained .*; choose another directory"):
        check_output_target(out, True, protected(launch, ckpt), manifest=RECORD)
    (out / RECORD).write_text(json.dumps({"files": ["weights"], "source": "models/tiny"}))  # a conversion's: replaceable
    check_output_target(out, True, protected(launch, ckpt), manifest=RECORD)


def test_another_dtype_in_config_is_mentioned(run):
    _, ckpt = run  # trained in float32
    assert other_dtype_note(ckpt, "float32") is None
    assert other_dtype_note(ckpt, "bfloat16") == ("note: --config has model.dtype=bfloat16, step_000004 was trained in "
                                                  "float32: its weights are rounded to bfloat16; set model.dtype=float32 "
                                                  "in --config to export them as trained")


def test_swap_replaces_a_previous_output_and_normalizes_modes(tmp_path):
    target, written = tmp_path / "hf", tmp_path / ".hf.staging" / "v0"
    target.mkdir()
    (target / "old.safetensors").write_bytes(b"old")
    written.mkdir(parents=True)
    shard = written / "model-00000.safetensors"
    shard.write_bytes(b"new")
    shard.chmod(0o600)
    _normalize_modes(written)
    _swap_in(written, target)
    assert tree(target) == {"model-00000.safetensors": b"new"}
    umask = os.umask(0)
    os.umask(umask)
    assert (target / "model-00000.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask
    assert not list(tmp_path.glob(".hf.megarl-old-*"))


def test_relative_paths_resolve_against_the_launch_directory(run, tmp_path, monkeypatch):
    launch, ckpt = run
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert run_config(ckpt).model.path == str((launch / "models" / "tiny").resolve())
    # Without the recorded launch directory (older checkpoints), it is derived from output_dir.
    ckpt.manifest["metadata"].pop("launch_dir")
    assert run_config(ckpt).model.path == str((launch / "models" / "tiny").resolve())
    from megarl.config.loading import ConfigError

    (launch / "models" / "tiny" / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"model.path \(models/tiny\) of .*config.yaml is relative, and no models/tiny/config.json"):
        run_config(ckpt)
    # an absolute model.path moved away since the run: named before Ray starts
    gone = tmp_path / "gone"
    (tmp_path / "run.yaml").write_text((ckpt.path / "config.yaml").read_text().replace("models/tiny", str(gone)))
    with pytest.raises(ConfigError, match=f"^model.path \\({gone}\\) of {tmp_path / 'run.yaml'} has no config.json "
                                          r"\(moved or deleted since the run\?\); pass --config"):  # fmt: skip
        run_config(ckpt, tmp_path / "run.yaml")


def test_a_model_config_changed_since_training_is_refused_before_anything_starts(run, tmp_path):
    # An edited rope_theta changes no weight shape: the export would load fine and write the new
    # config.json beside weights trained with the old one.
    from megarl.checkpoint.run_record import MODEL_CONFIG, model_config_change, record_model_configs
    from megarl.commands.conversion import convert_checkpoint
    from megarl.commands.generate import GenerateError, _run_model
    from megarl.config.sections import MegaRLConfig

    launch, older = run
    model = launch / "models" / "tiny"
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "rope_theta": 10000.0, "transformers_version": "4"}))
    manager = CheckpointManager(launch / "outputs" / "run")
    with manager.saving(5, {"launch_dir": str(launch)}) as d:
        (d / "config.yaml").write_text((older.path / "config.yaml").read_text())
        record_model_configs(d, MegaRLConfig(model={"path": str(model)}))
    ckpt = manager.resolve_resume("auto")
    assert (ckpt.step, (ckpt.path / MODEL_CONFIG).read_text()) == (5, (model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "rope_theta": 10000.0, "transformers_version": "5"}))
    assert model_config_change(ckpt, str(model)) is None  # bookkeeping keys are no change
    assert model_config_change(older, str(model)) is None  # a checkpoint without the copy: nothing to compare
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "rope_theta": 1000000.0}))
    out = tmp_path / "hf"
    with pytest.raises(OutputError, match=f"^model.path {model.resolve()}: config.json differs from the one step_000005 was "
                                          r"trained with \(rope_parameters.rope_theta \(the file's rope_theta\): recorded 10000.0, now 1000000.0\); "
                                          r"restore it"):  # fmt: skip
        convert_checkpoint(ckpt.path, out)
    assert not out.exists()
    # generate --model exports it the same way
    with pytest.raises(GenerateError, match=r"config.json differs from the one step_000005 was trained with \(rope_parameters.rope_theta"):
        _run_model(ckpt.path, convert_checkpoint, None)  # (before generate opens its partial folder)


def test_a_read_only_place_is_refused_before_anything_starts(run, tmp_path, read_only_dir):
    launch, ckpt = run
    with read_only_dir(tmp_path / "ro") as ro:
        with pytest.raises(OutputError, match=r"cannot write .*ro/hf: .*is not writable .*choose a writable place"):
            check_output_target(ro / "hf", False, protected(launch, ckpt))


def test_another_runs_checkpoints_folder_is_refused(run, tmp_path):
    launch, ckpt = run
    with CheckpointManager(tmp_path / "other").saving(1) as d:
        (d / "state").write_text("s")
    with pytest.raises(OutputError, match=r"hf is inside the checkpoints folder of a run \(.*other/checkpoints\)"):
        check_output_target(tmp_path / "other" / "checkpoints" / "hf", True, protected(launch, ckpt))


def test_a_symbolic_link_out_is_refused_before_any_work(run, tmp_path, capsys):
    launch, ckpt = run
    export = tmp_path / "export"
    export.mkdir()
    (export / "model.safetensors").write_bytes(b"w")
    (export / EXPORT_MANIFEST).write_text(json.dumps({"files": ["model.safetensors"]}))
    link = tmp_path / "linkA"
    link.symlink_to(export)
    # The swap renames OUT: the user's link would be moved aside, and its target left as it was.
    with pytest.raises(OutputError, match=f"linkA is a symbolic link to {export}; give {export} itself, or another path"):
        check_output_target(link, True, protected(launch, ckpt))
    from megarl.cli import EXIT_USER, main

    # hf-to-megatron: refused before the HF directory is read (this one has no config.json).
    assert main(["convert", "hf-to-megatron", "--hf", str(tmp_path / "nohf"), "--out", str(link), "--overwrite"]) == EXIT_USER
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "linkA is a symbolic link to" in err
    assert link.is_symlink() and tree(export) == tree(link)


def test_a_killed_converts_staging_is_removed_by_the_next_one_on_this_machine(tmp_path):
    import subprocess
    import sys

    from megarl.commands.model_outputs import _staging_prefix, staged_output

    target = tmp_path / "hf"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f"{_staging_prefix(target)}{int(gone.stdout)}"
    live = tmp_path / f"{_staging_prefix(target)}{os.getppid()}"  # a running process: a convert under way
    foreign = tmp_path / ".hf.megarl-staging-othernode-4026531836-12"  # maybe live, on another node
    other_out = tmp_path / f"{_staging_prefix(tmp_path / 'hf2')}{int(gone.stdout)}"  # another OUT's
    for d in (dead, live, foreign, other_out):
        (d / "v0").mkdir(parents=True)
        (d / "v0" / "model.safetensors").write_bytes(b"w")
    said = []
    with staged_output(target, said.append) as staging:
        assert staging.is_dir()
    assert not dead.exists() and live.is_dir() and foreign.is_dir() and other_out.is_dir()
    note = next(line for line in said if line.startswith("note:"))
    assert note.startswith(f"note: {foreign} is left as it is") and "no convert or sft writes hf" in note
    assert f"removed {dead}: the staging directory of an interrupted convert or sft (pid {gone.stdout.strip()}, no longer running)" in said
    assert len(said) == 2 and not staging.exists()


def test_a_previous_output_kept_by_a_killed_swap_is_named_not_removed(tmp_path):
    """A kill between _swap_in's two renames leaves the user's previous output as .OUT.megarl-old-PID
    (and no OUT): the next convert to OUT names it, with the way back, and leaves it as it is."""
    from megarl.commands.model_outputs import staged_output

    target = tmp_path / "hf"
    kept = tmp_path / ".hf.megarl-old-4242"
    (kept / "model.safetensors").parent.mkdir()
    (kept / "model.safetensors").write_bytes(b"previous")
    other_out = tmp_path / ".hf2.megarl-old-4242"  # another OUT's: not this convert's business
    other_out.mkdir()
    said = []
    with staged_output(target, said.append):
        pass
    assert said == [f"warning: {kept} is the previous output of an interrupted convert or sft, kept; delete it when you no "
                    "longer need it (or rename it back to hf)"]  # fmt: skip
    assert tree(kept) == {"model.safetensors": b"previous"} and other_out.is_dir()
    target.mkdir()  # OUT is there (the kill came after the new output was in): no way back to offer
    said.clear()
    with staged_output(target, said.append):
        pass
    assert said == [f"warning: {kept} is the previous output of an interrupted convert or sft, kept; delete it when you no "
                    "longer need it"]  # fmt: skip
    assert tree(kept) == {"model.safetensors": b"previous"}


def test_an_in_process_conversion_of_several_ranks_is_refused_before_anything_is_written(tmp_path):
    from megarl.commands.conversion import convert_hf_to_megatron
    from megarl.models.tiny import build_tiny_model

    hf = build_tiny_model(tmp_path / "tiny", "qwen2", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=128)
    with pytest.raises(OutputError, match=r"^--in-process converts with one rank, in this process; --tp 2 --pp 1 has 2 "
                                          r"ranks: use --tp 1 --pp 1, or run without --in-process$"):  # fmt: skip
        convert_hf_to_megatron(hf, tmp_path / "ckpt", tp=2, in_process=True)
    assert not (tmp_path / "ckpt").exists()
