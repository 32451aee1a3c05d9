"""The dtype/device invariant check: it names every offender, and knows its one exception."""

from __future__ import annotations

import pytest
import torch

from megarl.models.placement import (
    DTYPE_EXCEPTIONS,
    check_placement,
    named_tensors,
    placement_errors,
)

CPU = torch.device("cpu")


class _Rotary(torch.nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.inv_freq = torch.ones(4, dtype=dtype)  # a plain attribute, as in Megatron


class _Toy(torch.nn.Module):
    def __init__(self, norm_dtype: torch.dtype, rope_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4, dtype=torch.bfloat16)
        self.norm = torch.nn.RMSNorm(4, dtype=norm_dtype)
        self.register_buffer("counter", torch.zeros(2, dtype=torch.bfloat16))
        self.rotary_pos_emb = _Rotary(rope_dtype)


def test_a_consistent_model_passes():
    model = _Toy(torch.bfloat16)
    assert placement_errors(model, torch.bfloat16, CPU) == []
    check_placement(model, torch.bfloat16, CPU)
    kinds = {(kind, name) for kind, name, _ in named_tensors(model)}
    assert ("buffer", "counter") in kinds and ("tensor attribute", "rotary_pos_emb.inv_freq") in kinds


def test_an_fp32_norm_in_a_bf16_model_is_named_with_dtypes_and_devices():
    with pytest.raises(AssertionError) as err:
        check_placement(_Toy(torch.float32), torch.bfloat16, CPU)
    message = str(err.value)
    assert "parameter norm.weight is torch.float32 on cpu, expected torch.bfloat16 on cpu" in message
    assert "linear" not in message  # only offenders are listed


def test_the_exception_is_checked_against_its_own_dtype():
    assert DTYPE_EXCEPTIONS["rotary_pos_emb.inv_freq"][0] == torch.float32
    errors = placement_errors(_Toy(torch.bfloat16, rope_dtype=torch.bfloat16), torch.bfloat16, CPU)
    assert errors == [
        "tensor attribute rotary_pos_emb.inv_freq is torch.bfloat16 on cpu, expected torch.float32 on cpu"
    ]


def test_a_tensor_on_another_device_is_named():
    errors = placement_errors(_Toy(torch.bfloat16), torch.bfloat16, torch.device("meta"))
    assert len(errors) == 5 and all("expected" in e and "on meta" in e for e in errors)
