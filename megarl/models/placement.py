"""The dtype/device invariant of a built Megatron model, and its documented exceptions.

Invariant: every parameter, every buffer and every other tensor a module holds as an attribute
of a model built by a megarl bridge (policy, reference, critic) is on the run's device
(:func:`megarl.models.norm.current_device`) and in ``params_dtype``. Weight export relies on
it (each pipeline stage knows what the others send), and so does a model that nothing moves
after the build (the reference has no DDP wrapper).

:data:`DTYPE_EXCEPTIONS` is the one list of tensors that are deliberately in another dtype.
:func:`check_placement` runs once at the end of every build and names every offender.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

# Tensor name suffix -> (its dtype, why). Checked like the others, against this dtype.
DTYPE_EXCEPTIONS: dict[str, tuple[torch.dtype, str]] = {
    "rotary_pos_emb.inv_freq": (
        torch.float32,
        "RoPE angles are computed in float32 (position x inv_freq, then cos/sin) and only the "
        "cos/sin tables are cast to the activation dtype, in Megatron as in HF transformers; a "
        "bf16 inv_freq would shift the angles of long positions by whole radians",
    ),
    # yarn (multi-latent attention): its two frequency sets, blended per call, as inv_freq
    "rotary_pos_emb.inv_freq_extra": (torch.float32, "yarn's unscaled inv_freq: float32 as inv_freq"),
    "rotary_pos_emb.inv_freq_inter": (torch.float32, "yarn's inv_freq / factor: float32 as inv_freq"),
    # Megatron's yarn fills these at build in torch's default dtype for its fused rope kernel only
    # (off in megarl: MLA's unfused rope computes cos/sin per call); the fused path re-caches them
    # in the activation dtype before use
    "rotary_pos_emb.cos_cached": (torch.float32, "yarn's fused-rope cache, unused by the unfused rope"),
    "rotary_pos_emb.sin_cached": (torch.float32, "yarn's fused-rope cache, unused by the unfused rope"),
    # the sigmoid router with a correction bias (DeepSeek-V3): Megatron makes both float32, as HF
    # keeps e_score_correction_bias; a bf16 bias would move expert choices, a bf16 count saturates
    "router.expert_bias": (torch.float32, "the correction bias takes part in top-k in float32, as in HF"),
    "router.local_tokens_per_expert": (torch.float32, "the load count the bias update reads"),
}


def named_tensors(model: torch.nn.Module) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(kind, name, tensor) for every parameter, buffer and plain tensor attribute of ``model``
    (Megatron keeps RoPE's ``inv_freq`` as an attribute, neither a parameter nor a buffer)."""
    for name, param in model.named_parameters():
        yield "parameter", name, param
    for name, buf in model.named_buffers():
        yield "buffer", name, buf
    for module_name, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                yield "tensor attribute", f"{module_name}.{attr}" if module_name else attr, value


def expected_dtype(name: str, params_dtype: torch.dtype) -> torch.dtype:
    for suffix, (dtype, _why) in DTYPE_EXCEPTIONS.items():
        if name == suffix or name.endswith("." + suffix):
            return dtype
    return params_dtype


def placement_errors(model: torch.nn.Module, params_dtype: torch.dtype, device: torch.device) -> list[str]:
    """One line per tensor of ``model`` off ``device`` or not in its expected dtype."""
    errors = []
    for kind, name, tensor in named_tensors(model):
        dtype = expected_dtype(name, params_dtype)
        if tensor.dtype != dtype or tensor.device != device:
            errors.append(
                f"{kind} {name} is {tensor.dtype} on {tensor.device}, expected {dtype} on {device}"
            )
    return errors


def check_placement(model: torch.nn.Module, params_dtype: torch.dtype, device: torch.device) -> None:
    """Raise AssertionError naming every tensor that breaks the invariant (module docstring)."""
    errors = placement_errors(model, params_dtype, device)
    if errors:
        shown = "; ".join(errors[:8]) + (f"; and {len(errors) - 8} more" if len(errors) > 8 else "")
        raise AssertionError(
            f"{type(model).__name__} built with tensors off the run's dtype/device "
            f"(params_dtype={params_dtype}, device={device}): {shown}"
        )
