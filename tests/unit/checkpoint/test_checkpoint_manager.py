"""CheckpointManager: atomic save, verification, resume selection, retention."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from megarl.checkpoint.manager import CheckpointManager, plan_resume
from megarl.checkpoint.verification import (
    MANIFEST,
    CheckpointError,
    step_dir_name,
    verify_checkpoint,
)


def _save(manager: CheckpointManager, step: int, payload: bytes = b"weights") -> Path:
    with manager.saving(step) as d:
        (d / "policy").mkdir()
        (d / "policy" / "shard_0.distcp").write_bytes(payload * 10)
        (d / "policy" / "metadata.json").write_text(json.dumps({"step": step}))
        (d / "trainer_state.pt").write_bytes(b"state%d" % step)
    return manager.root / step_dir_name(step)


def _names(manager: CheckpointManager) -> list[str]:
    return sorted(p.name for p in manager.root.iterdir())


def test_save_writes_manifest_and_resume_finds_it(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=3)
    path = _save(manager, 12)
    assert path.name == "step_000012" and _names(manager) == ["step_000012"]
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["step"] == 12 and manifest["components"] == ["policy", "trainer_state.pt"]
    files = {f["path"]: f for f in manifest["files"]}
    assert set(files) == {"policy/shard_0.distcp", "policy/metadata.json", "trainer_state.pt"}
    assert files["policy/shard_0.distcp"]["size"] == 70 and len(files["trainer_state.pt"]["sha256"]) == 64
    ckpt = manager.resolve_resume("auto")
    assert ckpt is not None and ckpt.step == 12 and ckpt.path == path
    assert ckpt.component("policy") == path / "policy"
    with pytest.raises(CheckpointError, match="no component 'critic'.*policy"):
        ckpt.component("critic")
    assert manager.resolve_resume(str(path)).step == 12
    assert CheckpointManager(tmp_path / "fresh").resolve_resume("disable") is None


def test_metadata_goes_into_the_manifest(tmp_path):
    manager = CheckpointManager(tmp_path)
    with manager.saving(2, metadata={"run": "abc", "config": {"seed": 1}}) as d:
        (d / "trainer_state.pt").write_bytes(b"s")
    assert manager.resolve_resume("auto").manifest["metadata"] == {"run": "abc", "config": {"seed": 1}}


def test_big_files_are_checked_by_size_only(tmp_path):
    manager = CheckpointManager(tmp_path, checksum_max_bytes=10)
    path = _save(manager, 1)
    files = {f["path"]: f for f in json.loads((path / MANIFEST).read_text())["files"]}
    assert "sha256" not in files["policy/shard_0.distcp"] and "sha256" in files["trainer_state.pt"]


def test_exception_inside_saving_leaves_previous_checkpoint(tmp_path):
    manager = CheckpointManager(tmp_path)
    good = _save(manager, 1)
    with pytest.raises(RuntimeError, match="worker died"):
        with manager.saving(2) as d:
            (d / "policy").mkdir()
            (d / "policy" / "half.distcp").write_bytes(b"x" * 100)
            raise RuntimeError("worker died")
    assert _names(manager) == ["step_000001"]  # no step_000002, no temp dir
    verify_checkpoint(good)
    assert manager.resolve_resume("auto").step == 1


def test_empty_save_is_refused(tmp_path):
    manager = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointError, match="nothing was written"):
        with manager.saving(3):
            pass
    assert _names(manager) == []


def test_stale_temp_dirs_are_removed_at_start(tmp_path, caplog):
    manager = CheckpointManager(tmp_path)
    _save(manager, 1)
    stale = manager.root / ".tmp_step_000002_99999"
    (stale / "policy").mkdir(parents=True)
    (stale / "policy" / "x.distcp").write_bytes(b"partial")
    with caplog.at_level(logging.WARNING):
        manager = CheckpointManager(tmp_path)
    assert _names(manager) == ["step_000001"]
    assert ".tmp_step_000002_99999" in caplog.text


def test_interrupted_replacement_is_recovered(tmp_path):
    manager = CheckpointManager(tmp_path)
    path = _save(manager, 4)
    # A crash after moving the old step aside and before moving the new one in.
    path.rename(manager.root / ".trash_step_000004_4242")
    manager = CheckpointManager(tmp_path)
    assert _names(manager) == ["step_000004"] and manager.resolve_resume("auto").step == 4


def test_resaving_a_step_replaces_it(tmp_path):
    manager = CheckpointManager(tmp_path)
    _save(manager, 5, b"old")
    path = _save(manager, 5, b"new")
    assert (path / "policy" / "shard_0.distcp").read_bytes() == b"new" * 10
    assert _names(manager) == ["step_000005"]
    verify_checkpoint(path)


def test_auto_skips_torn_checkpoints_with_warnings(tmp_path, caplog):
    manager = CheckpointManager(tmp_path)
    _save(manager, 1)
    truncated = _save(manager, 2)
    with open(truncated / "policy" / "shard_0.distcp", "r+b") as f:
        f.truncate(5)
    corrupted = _save(manager, 3)
    (corrupted / "trainer_state.pt").write_bytes(b"STATE3")  # same size, other bytes
    no_manifest = _save(manager, 4)
    (no_manifest / MANIFEST).unlink()
    with caplog.at_level(logging.WARNING):
        ckpt = manager.resolve_resume("auto")
    assert ckpt is not None and ckpt.step == 1
    text = caplog.text
    assert "step_000004" in text and "manifest.json is missing" in text
    assert "step_000003" in text and "sha256" in text
    assert "step_000002" in text and "has 5 bytes, the manifest says 70" in text


def test_manifest_of_another_step_is_invalid(tmp_path):
    manager = CheckpointManager(tmp_path)
    path = _save(manager, 6)
    moved = path.rename(manager.root / "step_000007")
    with pytest.raises(CheckpointError, match="says step 6 but the directory is step_000007"):
        verify_checkpoint(moved)
    (path.parent / "step_000008").mkdir()
    ((path.parent / "step_000008") / MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable"):
        verify_checkpoint(path.parent / "step_000008")


def test_a_checkpoint_of_a_newer_format_is_refused_naming_the_megarl_that_wrote_it(tmp_path):
    # A later megarl may lay components or files out otherwise: read as this format, they would
    # fail somewhere in the ranks, or load wrongly.
    import megarl

    manager = CheckpointManager(tmp_path)
    path = _save(manager, 2)
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["manifest_version"] == 1
    (path / MANIFEST).write_text(json.dumps({**manifest, "manifest_version": 2, "megarl_version": "9.0.0"}))
    with pytest.raises(CheckpointError, match=f"^{path} was written by megarl 9.0.0 in checkpoint format 2, which this "
                                              f"megarl \\({megarl.__version__}\\) cannot read \\(it reads format 1\\); "
                                              "use megarl 9.0.0 or newer$"):  # fmt: skip
        verify_checkpoint(path)
    # resume=auto does not go back past it to an older checkpoint (its steps trained again, here)
    older = _save(manager, 1)
    with pytest.raises(CheckpointError, match=r"^trainer.resume=auto: .*step_000002 was written by megarl 9.0.0 .*; this "
                                              "run's latest checkpoint is of it$"):  # fmt: skip
        plan_resume(tmp_path, "auto")
    assert verify_checkpoint(older).step == 1
    del manifest["manifest_version"]  # a manifest without it is read as format 1
    (path / MANIFEST).write_text(json.dumps(manifest))
    assert verify_checkpoint(path).step == 2


def test_a_run_folder_given_for_a_checkpoint_names_its_latest_valid_step(tmp_path):
    manager = CheckpointManager(tmp_path)
    _save(manager, 2)
    torn = _save(manager, 4)
    (torn / MANIFEST).unlink()  # the newest: skipped, as resume=auto skips it
    latest = manager.root / "step_000002"
    with pytest.raises(CheckpointError, match=f"^{tmp_path} is a run's output_dir, not a checkpoint; give one of its "
                                              f"step directories, e.g. the latest valid one: {latest}$"):  # fmt: skip
        verify_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=f"^{manager.root} is the checkpoints folder of a run, not a checkpoint; "
                                              f".*latest valid one: {latest}$"):  # fmt: skip
        verify_checkpoint(manager.root)
    # a part of a complete checkpoint (`megarl convert step_000002/policy OUT`): not a torn save
    with pytest.raises(CheckpointError, match=f"^{latest / 'policy'} is the policy part of the checkpoint {latest}, "
                                              f"not a checkpoint; give {latest}$"):  # fmt: skip
        verify_checkpoint(latest / "policy")
    (latest / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="none of its 2 step directories in .* verifies; repair one"):
        verify_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=f"^manifest.json is missing in {latest} \\(the save did not finish\\)$"):
        verify_checkpoint(latest)  # a step directory itself: its save was torn
    with pytest.raises(CheckpointError, match=f"^{tmp_path / 'nope'} does not exist; give a checkpoint directory"):
        verify_checkpoint(tmp_path / "nope")
    (tmp_path / "file").touch()
    with pytest.raises(CheckpointError, match=f"^{tmp_path / 'file'} is not a directory"):
        verify_checkpoint(tmp_path / "file")


def test_explicit_invalid_resume_path_errors(tmp_path):
    manager = CheckpointManager(tmp_path)
    torn = _save(manager, 3)
    (torn / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=r"trainer.resume=.*step_000003.*manifest.json is missing.*resume=auto"):
        manager.resolve_resume(str(torn))
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        manager.resolve_resume(str(tmp_path / "nope"))


def test_retention_keeps_newest_valid(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3, 4):
        _save(manager, step)
    assert _names(manager) == ["step_000003", "step_000004"]
    # A torn newer directory never counts as "newest": the newest valid one stays.
    manager = CheckpointManager(tmp_path, keep_last=1)
    torn = manager.root / "step_000009"
    torn.mkdir()
    (torn / "junk").write_bytes(b"x")
    _save(manager, 5)
    assert _names(manager) == ["step_000005", "step_000009"]  # invalid dirs are left for a person
    assert manager.resolve_resume("auto").step == 5


def test_retention_removes_only_the_checkpoints_own_files(tmp_path, caplog):
    manager = CheckpointManager(tmp_path, keep_last=1)
    first = _save(manager, 1)
    (first / "samples.parquet").write_bytes(b"a user's evaluation")  # put there by hand after the save
    (first / "policy" / "notes.txt").write_text("mine")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "keep.bin").write_bytes(b"not the checkpoint's")
    (first / "policy" / "link").symlink_to(outside, target_is_directory=True)
    with caplog.at_level(logging.WARNING):
        _save(manager, 2)
    kept = manager.root / "step_000001.pruned"
    assert _names(manager) == ["step_000001.pruned", "step_000002"]
    assert _tree(kept) == {"policy/notes.txt": b"mine", "samples.parquet": b"a user's evaluation"}
    assert (outside / "keep.bin").read_bytes() == b"not the checkpoint's"  # a link is removed, never followed
    assert ("step_000001 is removed, but it also held files the checkpoint does not list or that could not be removed "
            "(policy/notes.txt, samples.parquet)") in caplog.text
    # A removal cut short (some listed files gone, the manifest still there) finishes at the next start.
    third = _save(manager, 3)
    (third / "mine.txt").write_text("x")
    (third / "trainer_state.pt").unlink()
    third.rename(manager.root / ".trash_step_000003_77")
    CheckpointManager(tmp_path)
    assert _tree(manager.root / "step_000003.pruned") == {"mine.txt": b"x"}


def test_keep_last_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match=r"trainer.keep_last \(0\)"):
        CheckpointManager(tmp_path, keep_last=0)


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_auto_refuses_when_no_checkpoint_verifies_and_changes_nothing(tmp_path):
    manager = CheckpointManager(tmp_path)
    for step in (2, 4):
        path = _save(manager, step)
        state = path / "trainer_state.pt"
        state.write_bytes(state.read_bytes()[:3])  # truncated
    before = _tree(tmp_path)
    with pytest.raises(CheckpointError) as info:
        CheckpointManager(tmp_path).resolve_resume("auto")
    msg = str(info.value)
    assert "none verifies" in msg and "step_000002: file trainer_state.pt has 3 bytes" in msg and "step_000004" in msg
    assert "Repair or restore" in msg and "trainer.resume=disable and a new trainer.output_dir" in msg
    assert _tree(tmp_path) == before  # the evidence is untouched


def test_a_new_run_never_writes_over_another_runs_checkpoints(tmp_path):
    manager = CheckpointManager(tmp_path / "old")
    old = _save(manager, 3)
    with pytest.raises(CheckpointError, match=r"resume=disable starts a new run.*holds the checkpoints of another run \(step_000003\)"):
        plan_resume(tmp_path / "old", "disable")
    other = CheckpointManager(tmp_path / "other")
    _save(other, 1)
    with pytest.raises(CheckpointError, match="starts from another run's checkpoint.*new trainer.output_dir"):
        plan_resume(tmp_path / "other", str(old))
    # From another run's checkpoint into an empty output_dir, or from its own: fine.
    assert plan_resume(tmp_path / "new", str(old)).step == 3
    assert plan_resume(tmp_path / "old", str(old)).step == 3
    assert not (tmp_path / "new").exists()  # planning reads only


def test_going_back_to_an_older_checkpoint_keeps_the_newer_ones_aside(tmp_path, caplog):
    manager = CheckpointManager(tmp_path, keep_last=5)
    for step in (2, 4, 6):
        _save(manager, step)
    torn = _save(manager, 8)
    (torn / MANIFEST).unlink()  # a broken newer one is set aside too, not replaced by the re-run's save
    evidence = {name: _tree(manager.root / name) for name in ("step_000004", "step_000006", "step_000008")}
    older = manager.resolve_resume(str(manager.root / "step_000002"))  # found; nothing moves until it has loaded
    assert older.step == 2 and _names(manager)[-1] == "step_000008"
    with caplog.at_level(logging.WARNING):
        manager.set_aside_newer(older)
    assert _names(manager) == ["step_000002", "step_000004.abandoned", "step_000006.abandoned", "step_000008.abandoned"]
    assert {name: _tree(manager.root / f"{name}.abandoned") for name in evidence} == evidence
    assert "resuming from step_000002 (step 2), an older checkpoint of this run; the newer 3 are kept" in caplog.text
    _save(manager, 4, b"rerun")  # the new history's step 4 and a later resume=auto: the new branch only
    assert manager.resolve_resume("auto").path.name == "step_000004"
    assert _tree(manager.root / "step_000004.abandoned") == evidence["step_000004"]
    assert manager.set_aside_newer(manager.resolve_resume(str(manager.root / "step_000004"))) == []  # the latest
    manager.set_aside_newer(older)  # going back twice: the second branch's step 4 is kept under a free name
    assert (manager.root / "step_000004.abandoned-1").is_dir() and (manager.root / "step_000004.abandoned").is_dir()


def test_going_back_to_a_step_set_aside_earlier_sets_aside_the_one_in_its_place(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=5)
    for step in (2, 4):
        _save(manager, step, b"A")
    manager.set_aside_newer(manager.resolve_resume(str(manager.root / "step_000002")))
    _save(manager, 4, b"B")  # the second history's step 4, beside the first's step_000004.abandoned
    first = manager.resolve_resume(str(manager.root / "step_000004.abandoned"))
    assert first.step == 4
    manager.set_aside_newer(first)
    assert (manager.root / "step_000004.abandoned-1" / "policy" / "shard_0.distcp").read_bytes() == b"B" * 10
    assert manager.resolve_resume("auto").step == 2  # never B's step 4 mixed into A's history


def test_removing_a_checkpoint_never_raises(tmp_path, caplog):
    """A removal the OS refuses in part (here: a listed entry that is a folder, as a hand-edited
    manifest can say) keeps what is left and warns; a plain file named like a leftover is left
    alone. Retention runs after a save committed, recovery at every start: neither may end a run."""
    manager = CheckpointManager(tmp_path, keep_last=1)
    first = _save(manager, 1)
    manifest = json.loads((first / MANIFEST).read_text())
    (first / "odd").mkdir()
    (first / "odd" / "x").write_text("y")
    manifest["files"].append({"path": "odd", "size": 0})
    (first / MANIFEST).write_text(json.dumps(manifest))
    first.rename(manager.root / ".trash_step_000001_77")  # a removal cut short by a crash
    (manager.root / ".trash_not_a_folder").write_text("a file with a reserved name")
    with caplog.at_level(logging.WARNING):
        CheckpointManager(tmp_path)
    assert _tree(manager.root / "step_000001.pruned") == {"odd/x": b"y"}
    assert "could not remove" in caplog.text and "odd" in caplog.text
    assert (manager.root / ".trash_not_a_folder").read_text() == "a file with a reserved name"


def test_save_keeps_an_unverified_step_dir_aside(tmp_path, caplog):
    manager = CheckpointManager(tmp_path)
    _save(manager, 1)
    damaged = _save(manager, 2)
    (damaged / MANIFEST).unlink()
    evidence = _tree(damaged)
    with caplog.at_level(logging.WARNING):
        path = _save(manager, 2, b"new")
    verify_checkpoint(path)
    kept = manager.root / "step_000002.unverified"
    assert _tree(kept) == evidence and "kept as step_000002.unverified" in caplog.text
    (path / MANIFEST).unlink()
    _save(manager, 2, b"newer")
    assert (manager.root / "step_000002.unverified-1").is_dir()  # never overwritten either


def test_the_free_space_message_states_what_a_save_needs_in_one_unit():
    """Once said "a checkpoint takes about 0.0011 GiB and 0.0038 GiB are free": the margin that
    made 0.0038 too little was hidden. Now the need is stated with it, every number in one unit."""
    from megarl.checkpoint.manager import space_for_a_save, space_shortfall

    mib = 2**20
    assert space_shortfall(int(1.1 * mib), int(3.9 * mib)) == (
        "a checkpoint takes about 1.1 MiB and a save needs 65.2 MiB free (it, 5% more and 64 MiB kept for the run's "
        "logs and metrics), but 3.9 MiB are free")  # fmt: skip
    assert space_shortfall(int(1.1 * mib), space_for_a_save(int(1.1 * mib))) is None  # exactly enough
    assert "takes about 20 GiB and a save needs 21.1 GiB free" in space_shortfall(20 * 2**30, 2**30)


def test_save_refuses_without_disk_space_and_writes_nothing(tmp_path):
    import shutil

    manager = CheckpointManager(tmp_path)
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(CheckpointError, match=r"not enough disk space to save step 7 in \S+: a checkpoint takes about .* GiB and "
                       r"a save needs .* GiB free \(it, 5% more and 64 MiB kept for the run's logs and metrics\), but .* GiB "
                       r"are free; free some space"):  # fmt: skip
        with manager.saving(7, expected_bytes=10 * free) as d:
            (d / "x").write_bytes(b"never")
    assert _names(manager) == []
    # what megarl set aside (and never deletes) is named with its size: the first thing to remove
    (manager.root / "step_000003.abandoned" / "policy").mkdir(parents=True)
    (manager.root / "step_000003.abandoned" / "policy" / "w").write_bytes(b"x" * 2**20)
    (manager.root / "step_000002.unverified-1").mkdir()
    with pytest.raises(CheckpointError, match=r"keeps fewer checkpoints; step_000002\.unverified-1, step_000003\.abandoned "
                       r"\(1 MiB\) are kept aside, never deleted by megarl: remove them if not needed\) or point"):
        manager.check_free_space(7, expected_bytes=10 * free)
