"""`megarl sft`'s refusals of its output, which come before any worker starts (the training
itself runs in tests/e2e/test_sft.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.commands.demo import prepare_demo
from megarl.commands.sft import SFTError, run_sft
from megarl.config.loading import load_config

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "tiny_grpo.yaml"


def test_an_output_dir_whose_model_folder_is_model_path_is_named_so(tmp_path):
    """<sft.output_dir>/model is where SFT writes: when that is the model it starts from, the
    refusal must not say to move it away (an earlier SFT's output) but to pick another folder."""
    model, _ = prepare_demo(tmp_path / "demo")  # model.path is demo/model
    before = sorted(p.name for p in model.iterdir())
    cfg = load_config(CONFIG, [f"model.path={model}", f"sft.output_dir={model.parent}", "cluster.gpus_per_node=1"])
    with pytest.raises(SFTError, match=rf"^{model} is model.path, the model SFT starts from, .*give another "
                                       rf"sft.output_dir than {model.parent}$"):  # fmt: skip
        run_sft(cfg, in_process=True)
    assert sorted(p.name for p in model.iterdir()) == before


def test_an_output_dir_that_is_a_file_is_named_so(tmp_path):
    model, _ = prepare_demo(tmp_path / "demo")
    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    cfg = load_config(CONFIG, [f"model.path={model}", f"sft.output_dir={afile}", "cluster.gpus_per_node=1"])
    with pytest.raises(SFTError, match=rf"^sft.output_dir \({afile}\) is a file; give a folder \(megarl sft writes model/ "
                                       r"and logs/ in it\)$"):  # fmt: skip
        run_sft(cfg, in_process=True)
    assert afile.read_text() == "mine"
