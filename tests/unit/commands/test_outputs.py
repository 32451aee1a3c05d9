"""The one rule every command's file output follows: nothing the user has is written over
unless they pass --overwrite, and a folder is never taken for a file."""

import pytest

from megarl.commands.outputs import (
    OutputError,
    OutputExistsError,
    check_folder,
    check_new_file,
    make_folder,
)


def test_an_existing_file_is_replaced_only_with_overwrite(tmp_path):
    out = tmp_path / "out.parquet"
    check_new_file(out, overwrite=False)  # nothing there: fine
    out.write_text("the user's")
    with pytest.raises(OutputExistsError, match=rf"^--out {out} exists; pass --overwrite to replace it, or give another path$"):
        check_new_file(out, overwrite=False)
    check_new_file(out, overwrite=True)
    assert out.read_text() == "the user's"  # a check writes nothing


def test_a_folder_is_refused_even_with_overwrite(tmp_path):
    with pytest.raises(OutputError, match=rf"^{tmp_path} is a directory; give another OUT_DIR$"):
        check_new_file(tmp_path, overwrite=True, flag="", fix="give another OUT_DIR")


def test_a_missing_folder_is_named_where_the_command_creates_none(tmp_path):
    out = tmp_path / "nodir" / "job.sbatch"
    with pytest.raises(OutputError, match=rf"^--out {out}: the folder {out.parent} does not exist; create it, or give another path$"):
        check_new_file(out, overwrite=False, in_existing_folder=True)
    check_new_file(out, overwrite=False)  # a command that creates its folders


def test_make_folder_makes_the_missing_folders_and_names_what_is_in_the_way(tmp_path):
    make_folder(tmp_path / "a" / "b" / "out.json")
    assert (tmp_path / "a" / "b").is_dir()
    make_folder(tmp_path / "a" / "b" / "out.json")  # there already: fine
    (tmp_path / "notes").write_text("the user's")
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    for blocking in (tmp_path / "notes", tmp_path / "gone"):
        out = blocking / "sub" / "out.json"
        for check in (make_folder, check_folder):
            with pytest.raises(OutputError, match=rf"^--scored {out}: {blocking} is not a folder; give another path$"):
                check(out, flag="--scored")
    assert (tmp_path / "notes").read_text() == "the user's" and not (tmp_path / "nowhere").exists()


def test_check_folder_makes_nothing(tmp_path):
    check_folder(tmp_path / "a" / "b" / "out.json")
    assert not (tmp_path / "a").exists()  # a refusal after it leaves no empty folder behind


def test_an_output_inside_a_runs_checkpoints_folder_is_refused(tmp_path):
    """Retention deletes whole step directories: a file in one would go with it."""
    from megarl.checkpoint.manager import CheckpointManager
    from megarl.commands.outputs import check_outside_checkpoints

    manager = CheckpointManager(tmp_path / "run")
    with manager.saving(2) as d:
        (d / "state").write_text("s")
    folder = (tmp_path / "run" / "checkpoints").resolve()
    for out in (folder / "step_000002" / "gen.parquet", folder / "gen.parquet", folder / "new" / "e.json"):
        with pytest.raises(OutputError, match=rf"^--out {out} is inside the checkpoints folder of a run \({folder}\), "
                                              "whose step directories retention removes \\(megarl manages that folder\\); give a path outside it$"):
            check_outside_checkpoints(out)
    check_outside_checkpoints(tmp_path / "run" / "gen.parquet")  # beside the checkpoints: the user's
    mine = tmp_path / "mine" / "checkpoints"  # a folder of that name holding no step directory
    mine.mkdir(parents=True)
    check_outside_checkpoints(mine / "gen.parquet")
    # a run's folder the caller knows (a config's) is refused before its first save too
    with pytest.raises(OutputError, match=r"^--scored .* is inside the checkpoints folder of a run"):
        check_outside_checkpoints(mine / "gen.parquet", flag="--scored", runs=[mine])
