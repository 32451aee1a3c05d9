"""A model directory's parameter count and weight bytes for the plan's reward rows (the reward
model's and the judge's), from the planner's own shapes: :func:`resolve_arch` on its config.json,
so experts, grouped-query attention, biases and norms count as they do for the policy.

A causal LM (the judge) counts :attr:`ArchSpec.num_params`: the embedding, the decoder, the final
norm and the LM head (unless tied). A sequence classifier (the reward model, e.g.
Qwen2ForSequenceClassification) has no LM head: its own score head [num_labels x hidden] instead,
so an untied model counts its embedding once, plus the score head.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megarl.config.architectures import ArchError, ArchSpec, resolve_arch
from megarl.plan.gpu_memory import DTYPE_BYTES


@dataclass(frozen=True)
class ModelSize:
    """The shapes of a model directory and the dtype its weights were saved in (what the loaders keep)."""

    arch: ArchSpec
    dtype: str
    num_labels: int  # a sequence classifier's score-head outputs (config.json num_labels; 1 when unset)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES.get(self.dtype, 4)

    @property
    def causal_lm_params(self) -> int:
        return self.arch.num_params

    @property
    def classifier_params(self) -> int:
        """Without the LM head (an untied model's second vocab x hidden matrix), with the score head."""
        lm_head = 0 if self.arch.tie_embeddings else self.arch.embedding_params
        return self.arch.num_params - lm_head + self.num_labels * self.arch.hidden_size


def model_size(path: str) -> ModelSize | None:
    """``path``'s shapes and dtype from its config.json; None when it has none or it is unreadable
    (the preflight names that)."""
    try:
        arch = resolve_arch(path, None)
        config = json.loads((Path(path) / "config.json").read_text())
    except (ArchError, OSError, ValueError):
        return None
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    return ModelSize(arch, dtype, int(config.get("num_labels") or 1))
