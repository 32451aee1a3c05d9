"""`megarl convert` refuses a mismatch between a checkpoint and the config's actor.lora before
anything starts (megarl/commands/conversion.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.commands.conversion import _lora_base
from megarl.commands.outputs import OutputError
from megarl.config.loading import load_config

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny_grpo.yaml"


def test_a_whole_model_checkpoint_with_a_lora_config_is_refused_before_ray(tmp_path):
    (tmp_path / "policy").mkdir()
    cfg = load_config(TINY, ["actor.lora.rank=4"])
    with pytest.raises(OutputError, match="holds a whole model, not LoRA adapters .* drop actor.lora from --config"):
        _lora_base(tmp_path, cfg, None)
    assert _lora_base(tmp_path, load_config(TINY), None) is None  # a whole model, no adapter
