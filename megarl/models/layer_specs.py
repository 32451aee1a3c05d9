"""Which modules a decoder layer is built from: Megatron's local ones or transformer-engine's.

``model.layer_spec`` chooses: ``local`` (the default: Megatron's plain-torch modules, megarl's
RMSNorm and SDPA attention; runs anywhere), ``te`` (transformer-engine: the norms fused into the
following linear layers, TE's fused attention, THD included; CUDA only), or ``auto`` (TE where
it can run: on CUDA with transformer-engine importable; local elsewhere). ``te`` is not the
default until its GPU test (tests/gpu/test_te_spec.py) has run.

The two specs hold the same weights under two names for the two norms that TE fuses into the
next linear layer (:data:`TE_NAMES`); the bridges map both to the same HF tensors. A
dist-checkpoint written with one spec has not been tested with the other (TE's layers keep
extra state of their own).
"""

from __future__ import annotations

import importlib.util
from typing import Literal

LayerSpec = Literal["te", "local"]

# TE layer parameter suffix -> the local spec's suffix of the same weight.
TE_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


def te_importable() -> bool:
    """Whether transformer-engine's PyTorch modules are installed (without importing them)."""
    try:
        return importlib.util.find_spec("transformer_engine.pytorch") is not None
    except ModuleNotFoundError:  # no transformer_engine package at all
        return False


def resolve_layer_spec(setting: str, device: str) -> LayerSpec:
    """``model.layer_spec`` made concrete for a model built on ``device`` ("cuda" or "cpu")."""
    if setting == "local":
        return "local"
    if setting not in ("auto", "te"):
        raise ValueError(f"model.layer_spec ({setting!r}) must be auto, te or local")
    if device != "cuda":
        if setting == "te":
            raise ValueError(f"model.layer_spec (te) needs CUDA, and this model is built on {device}; "
                             "use auto or local")  # fmt: skip
        return "local"
    if not te_importable():
        if setting == "te":
            raise ValueError("model.layer_spec (te) needs transformer-engine, which is not installed here; "
                             "pip install 'transformer-engine[pytorch]', or use auto or local")  # fmt: skip
        return "local"
    return "te"


def local_suffix(suffix: str) -> str:
    """A layer parameter's suffix under the local spec (TE's fused-norm names translated)."""
    return TE_NAMES.get(suffix, suffix)
