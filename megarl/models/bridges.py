"""Which bridge an HF model has (by ``model_type``), and whether that bridge takes a given model
directory: the lookup over the built-in bridges (megarl/models/dense.py registers llama, qwen2
and qwen3, megarl/models/qwen3_moe.py qwen3_moe, megarl/models/deepseek_v3.py deepseek_v3) and any registered with
:func:`megarl.models.bridge.register_bridge`."""

from __future__ import annotations

from typing import Any

import megarl.models.deepseek_v3  # noqa: F401  (registers deepseek_v3)
import megarl.models.dense  # noqa: F401  (registers llama, qwen2, qwen3)
import megarl.models.qwen3_moe  # noqa: F401  (registers qwen3_moe)
from megarl.models.bridge import BRIDGES, ModelBridge


def get_bridge(model_type_or_hf_config: str | Any) -> ModelBridge:
    """The bridge of an HF ``model_type`` (a string or an HF config object)."""
    model_type = model_type_or_hf_config
    if not isinstance(model_type, str):
        model_type = getattr(model_type_or_hf_config, "model_type", None)
    if model_type not in BRIDGES:
        raise ValueError(
            f"HF model_type {model_type!r} has no megarl bridge; supported: "
            f"{', '.join(sorted(BRIDGES))}"
        )
    return BRIDGES[model_type]()


class ModelRefused(ValueError):
    """An HF model megarl's bridge does not take; ``part`` says which part: "config" (its
    config.json, or a parallel layout for it) or "weights" (its safetensors' tensors)."""

    def __init__(self, part: str, exc: BaseException):
        self.part = part
        # one line, whatever transformers or safetensors wrote
        super().__init__(f"{type(exc).__name__}: {' '.join(str(exc).split())}")


def check_hf_model(path: str, layouts: tuple[Any, ...] = (), *, value_head: bool = False, weights: bool = True) -> None:
    """Raise :class:`ModelRefused` unless the bridge of the HF model at ``path`` takes its
    config.json (values, and each ParallelConfig in ``layouts``) and, with ``weights``, its
    safetensors hold exactly the tensors that config implies (headers only: transformers would
    fill a missing tensor with random values, megarl's load refuses it at start-up).
    ``value_head``: a critic's checkpoint, whose lm_head is unused."""
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(path)
        bridge = get_bridge(hf)
        bridge.check_hf_config(hf)
        for layout in layouts:
            bridge.check_parallel(hf, layout)
    except Exception as exc:  # noqa: BLE001 - any refusal (ValueError, OSError, ...) is the config's
        raise ModelRefused("config", exc) from exc
    if weights:
        try:
            bridge.check_hf_checkpoint(hf, str(path), value_head=value_head)
        except Exception as exc:  # noqa: BLE001 - a cut file, a missing tensor (ValueError), ...
            raise ModelRefused("weights", exc) from exc
