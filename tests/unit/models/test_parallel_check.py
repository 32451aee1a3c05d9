"""The bridge's layout check (`megarl convert --tp/--pp`, model builds): a refused tp names
only values that split both the query and the key/value heads."""

from __future__ import annotations

import pytest
from transformers import Qwen2Config

from megarl.config.train_sections import ParallelConfig
from megarl.models.bridges import get_bridge


@pytest.mark.parametrize("tp", [3, 4])
def test_a_refused_tp_suggests_only_layouts_that_pass(tp):
    hf = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=128)
    bridge = get_bridge(hf)
    with pytest.raises(ValueError, match=r"parallel.tp \(\d\) must divide num_\w+ \(\d\); try 1, 2$") as info:
        bridge.check_parallel(hf, ParallelConfig(tp=tp))
    for suggested in (1, 2):  # every suggestion really passes
        bridge.check_parallel(hf, ParallelConfig(tp=suggested))
    assert str(tp) not in str(info.value).split("try ")[1]
