"""SGLang's routed experts: the request flag, the launch flag, and parsing SGLang 0.5.23's encoding
(base64 of int32 [tokens - 1, num_hidden_layers, k], state_capturer/routed_experts.py)."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from megarl.data.routing_ids import unpack_expert_ids
from megarl.engines.base import SamplingParams
from megarl.engines.routing import RoutingLayout
from megarl.rollout_sglang.client import (
    SGLangHTTPError,
    build_generate_payload,
    parse_generate_reply,
)
from megarl.rollout_sglang.server import ServerSpec, build_launch_command

LAYOUT = RoutingLayout(num_layers=3, moe_layers=(0, 2), top_k=2, num_experts=32)


def _item(routed: np.ndarray | None, response: list[int]) -> dict:
    meta = {"output_token_logprobs": [[-0.5, t, None] for t in response], "finish_reason": {"type": "length"}}
    if routed is not None:
        meta["routed_experts"] = base64.b64encode(routed.astype(np.int32).tobytes()).decode()
    return {"output_ids": response, "meta_info": meta}


def test_request_and_launch_ask_for_routing_only_when_told():
    asked = build_generate_payload([1, 2], SamplingParams(return_routing=True), 0)
    assert asked["return_routed_experts"] is True
    assert "return_routed_experts" not in build_generate_payload([1, 2], SamplingParams(), 0)
    spec = ServerSpec(model_path="m", device="cpu", memory_saver=False, return_routed_experts=True)
    assert "--enable-return-routed-experts" in build_launch_command(spec, 1234)
    assert "--enable-return-routed-experts" not in build_launch_command(ServerSpec(model_path="m"), 1234)


def test_routed_experts_parse_into_moe_layer_rows():
    prompt, response = 3, [7, 8]
    routed = np.arange((prompt + 2 - 1) * 3 * 2).reshape(4, 3, 2)  # [tokens - 1, all layers, k]
    (result,) = parse_generate_reply([_item(routed, response)], 0, 1, (prompt, LAYOUT))
    assert result.routed_experts is not None and result.routed_experts.dtype == torch.uint8  # 32 experts: a byte
    assert result.routed_experts.shape == (5, 2, 2)
    ids = unpack_expert_ids(result.routed_experts)
    assert torch.equal(ids[:4], torch.from_numpy(routed[:, [0, 2]]).long())  # layer 1 dense
    assert (ids[4] == -1).all() and result.routing_weights is None


def test_missing_or_misshapen_routing_is_a_clear_error():
    with pytest.raises(SGLangHTTPError, match="--enable-return-routed-experts"):
        parse_generate_reply([_item(None, [7])], 0, 1, (2, LAYOUT))
    with pytest.raises(SGLangHTTPError, match="expected 2 tokens x 3 layers x top-2"):
        parse_generate_reply([_item(np.zeros((5, 3, 2)), [7])], 0, 1, (2, LAYOUT))
    (plain,) = parse_generate_reply([_item(None, [7])], 0, 1)
    assert plain.routed_experts is None
