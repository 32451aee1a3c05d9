"""The critic's output layer: hidden state -> one scalar value per token.

It takes the place of ``GPTModel.output_layer`` and answers the same call
(``layer(hidden, weight=None, runtime_gather_output=None) -> (out, bias)``), so the rest of
GPTModel (pipeline stages, checkpointing) is unchanged. The weight ``[1, hidden]`` is replicated
on every TP rank (a vocabulary of 1 cannot be split); its input is the full hidden state on every
TP rank, so every rank computes the same values and gets the same gradient, as for a norm weight.

Initialised from a fixed generator, identically on every rank, with a small std so the first
values are near 0. Under sequence parallelism the model's position hook gathers the sequence
before the head (megarl/megatron_runtime/model.py), so the head still sees full hidden
states and its weight is not marked ``sequence_parallel``.
"""

from __future__ import annotations

import torch

from megarl.parallel.mcore_version import require_megatron_core

require_megatron_core()  # a one-line error instead of a deep ImportError (e.g. no triton)
from megatron.core.transformer.module import MegatronModule  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megarl.models.layouts import VALUE_HEAD_HF_NAME  # noqa: E402,F401 - the head's HF name, beside its class


class ValueHead(MegatronModule):
    is_value_head = True  # what the bridges check (without importing this module)

    def __init__(self, config: TransformerConfig, init_seed: int = 0) -> None:
        super().__init__(config=config)
        gen = torch.Generator().manual_seed(init_seed)
        weight = torch.randn(1, config.hidden_size, generator=gen) / (config.hidden_size + 1)
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        self.weight = torch.nn.Parameter(weight.to(device=device, dtype=config.params_dtype))
        self.sequence_parallel = False

    def forward(
        self,
        hidden: torch.Tensor,  # [s, b, h]
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[torch.Tensor, None]:  # ([s, b, 1], None)
        return torch.matmul(hidden, self.weight.t()), None
