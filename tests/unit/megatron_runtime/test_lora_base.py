"""A LoRA checkpoint names the base model its adapters were trained on (lora_base.json); a load
checks it against the run's (megarl/megatron_runtime/training.py ``check_lora_base``)."""

from __future__ import annotations

import json

import pytest

from megarl.checkpoint.run_record import LORA_BASE_FILE
from megarl.megatron_runtime.training import check_lora_base

BASE = {"path": "/models/base", "fingerprint": [12.5, 4096.25]}


def _checkpoint(tmp_path, identity=None):
    if identity is not None:
        (tmp_path / LORA_BASE_FILE).write_text(json.dumps(identity))
    return tmp_path


def test_without_adapters_on_either_side_there_is_nothing_to_check(tmp_path):
    check_lora_base(tmp_path, None)


def test_the_same_base_loads_up_to_fp64_rounding(tmp_path):
    check_lora_base(_checkpoint(tmp_path, BASE), BASE)
    rounded = {"path": "/elsewhere/base", "fingerprint": [12.5 * (1 + 1e-13), 4096.25 * (1 - 1e-13)]}  # another layout's sums
    check_lora_base(tmp_path, rounded)


def test_another_base_is_refused_naming_both(tmp_path):
    other = {"path": "/models/other", "fingerprint": [12.5, 4096.25 * 1.0001]}
    with pytest.raises(ValueError, match=r"trained on the base model /models/base .* model.path /models/other differs"):
        check_lora_base(_checkpoint(tmp_path, BASE), other)


def test_full_and_lora_checkpoints_do_not_mix(tmp_path):
    lora, full = tmp_path / "lora", tmp_path / "full"
    lora.mkdir()
    full.mkdir()
    with pytest.raises(ValueError, match="holds LoRA adapters .* this run trains the whole model"):
        check_lora_base(_checkpoint(lora, BASE), None)
    with pytest.raises(ValueError, match="holds a whole model, not LoRA adapters"):
        check_lora_base(_checkpoint(full), BASE)

