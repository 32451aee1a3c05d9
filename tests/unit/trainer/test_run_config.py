"""output_dir/config.yaml: each launch writes the config as run; a config.yaml there that megarl
did not write (the user's own) is kept, renamed; an empty output_dir is refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megarl.config.loading import ConfigError, load_config
from megarl.trainer.build import RUN_CONFIG_HEADER, write_run_config

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny_grpo.yaml"


def test_a_users_config_yaml_in_output_dir_is_kept_and_megarls_own_is_rewritten(tmp_path, caplog):
    mine = "# my notes\nactor: {}\n"
    (tmp_path / "config.yaml").write_text(mine)
    cfg = load_config(TINY, [f"trainer.output_dir={tmp_path}"])
    written = write_run_config(cfg)
    kept = list(tmp_path.glob("config.*.yaml"))
    assert len(kept) == 1 and kept[0].read_text() == mine
    assert "has no megarl header (a file of yours, or the run config of an older megarl); kept as config." in caplog.text
    assert written.read_text().startswith(RUN_CONFIG_HEADER)
    assert load_config(written).model_dump() == cfg.model_dump()  # what ran, loadable as a config
    write_run_config(load_config(TINY, [f"trainer.output_dir={tmp_path}", "trainer.total_steps=7"]))  # a later launch
    assert list(tmp_path.glob("config.*.yaml")) == kept  # megarl's own file is simply rewritten
    assert load_config(written).trainer.total_steps == 7
    # a later megarl may reword the header: a file with megarl's mark is still its own
    written.write_text(written.read_text().replace(RUN_CONFIG_HEADER, "# megarl: another wording\n"))
    write_run_config(cfg)
    assert list(tmp_path.glob("config.*.yaml")) == kept and kept[0].read_text() == mine
    # a second file of the user's in the same second is kept beside the first, not over it
    (tmp_path / "config.yaml").write_text("# other notes\n")
    os.utime(tmp_path / "config.yaml", (kept[0].stat().st_mtime,) * 2)
    write_run_config(cfg)
    assert sorted(p.read_text() for p in tmp_path.glob("config.*.yaml")) == ["# my notes\nactor: {}\n", "# other notes\n"]


@pytest.mark.parametrize("section", ["trainer", "sft"])
def test_an_empty_output_dir_is_refused(section):
    with pytest.raises(ConfigError, match=rf"{section}.output_dir"):
        load_config(TINY, [f"{section}.output_dir="])
