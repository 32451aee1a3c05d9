"""megarl's RMSNorm: params_dtype and device, Megatron's norm interface, the math of HF's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megarl.models.norm import RMSNorm, current_device


def _config(dtype: torch.dtype = torch.float32, **kw) -> SimpleNamespace:
    base = dict(params_dtype=dtype, normalization="RMSNorm", layernorm_zero_centered_gamma=False, sequence_parallel=False)
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_weight_is_built_in_params_dtype_on_the_current_device(dtype):
    norm = RMSNorm(config=_config(dtype), hidden_size=16, eps=1e-6)  # Megatron's builder call
    assert norm.weight.dtype == dtype and norm.weight.device == current_device()
    assert torch.equal(norm.weight, torch.ones(16, dtype=dtype))
    assert norm.weight.sequence_parallel is False and norm.sequence_parallel is False
    marked = RMSNorm(config=_config(dtype, sequence_parallel=True), hidden_size=16, eps=1e-6)
    assert marked.weight.sequence_parallel is True  # finalize_model_grads all-reduces it under SP


def test_fp32_output_equals_transformers_rmsnorm():
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 32, generator=gen)
    weight = 1 + 0.1 * torch.randn(32, generator=gen)
    ours = RMSNorm(config=_config(), hidden_size=32, eps=1e-6)
    hf = Qwen2RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(weight)
        hf.weight.copy_(weight)
    assert torch.allclose(ours(x), hf(x), atol=1e-6, rtol=0)


def test_bf16_statistics_in_fp32_and_one_rounding():
    """bf16 in, bf16 out; the result is the fp32 computation rounded once (TE/SGLang kernels do
    the same; HF rounds before the weight, one bf16 step apart at most)."""
    gen = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(64, 256, generator=gen)).bfloat16()
    norm = RMSNorm(config=_config(torch.bfloat16), hidden_size=256, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(256, generator=gen))
    y = norm(x)
    xf = x.float()
    ref = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.float()).bfloat16()
    assert y.dtype == torch.bfloat16
    ulp = ref.float().abs() * 2**-7  # one bf16 step
    assert ((y.float() - ref.float()).abs() <= ulp).all()


def test_gradient_reaches_the_weight_and_the_input():
    norm = RMSNorm(config=_config(), hidden_size=8, eps=1e-6)
    x = torch.randn(4, 8, requires_grad=True)
    (norm(x) * torch.arange(8.0)).sum().backward()
    assert norm.weight.grad is not None and norm.weight.grad.abs().sum() > 0
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize(
    ("override", "match"),
    [({"normalization": "LayerNorm"}, "normalization='LayerNorm'"),
     ({"layernorm_zero_centered_gamma": True}, "layernorm_zero_centered_gamma=True")],
)
def test_unsupported_configs_are_refused_by_name(override, match):
    with pytest.raises(ValueError, match=match):
        RMSNorm(config=_config(**override), hidden_size=8, eps=1e-6)


def test_the_layer_spec_uses_it_in_every_norm_slot():
    from megarl.models.bridges import get_bridge

    spec = get_bridge("qwen3").layer_spec()  # q/k norms too
    layer, attention = spec.submodules, spec.submodules.self_attention.submodules
    slots = [layer.input_layernorm, layer.pre_mlp_layernorm, attention.q_layernorm, attention.k_layernorm]
    assert all(slot is RMSNorm for slot in slots), slots
