"""RMSNorm for megarl's Megatron layer spec, built in ``params_dtype`` on the run's device.

Megatron's local spec uses ``WrappedTorchNorm``, which returns a plain ``torch.nn.RMSNorm``
with neither a dtype nor a device: its weight is float32 on the CPU whatever the model's
``params_dtype`` and device. In a bf16 run that breaks the dtype-per-tensor agreement of weight
export between pipeline stages, and on a GPU it leaves the weights of a model that no DDP moves
(the reference) on the CPU. :class:`RMSNorm` takes its place in the spec (every layer's input
and pre-MLP norms, the q/k norms, the final norm), built like Megatron's other modules:

- weight ``[hidden]`` in ``config.params_dtype`` on the current device, initialised to ones;
- ``sequence_parallel`` set on the module and the weight from the config, the mark Megatron's
  ``finalize_model_grads`` reads to all-reduce a replicated weight's gradient over TP under
  sequence parallelism (each TP rank's norm then sees only its slice of the sequence);
- the math is ``torch.nn.functional.rms_norm``: the statistics in float32 for bf16/fp16 inputs,
  the weight applied before the one cast back (as TE's and SGLang's fused RMSNorm kernels do).

Left out: LayerNorm, zero-centred gamma, apex/TE fused kernels: the config is checked and
anything else is refused by name.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def current_device() -> torch.device:
    """The device a model of this process lives on: the current CUDA device, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class RMSNorm(torch.nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension (see module docstring).

    The constructor answers Megatron's norm builder call
    ``norm(config=..., hidden_size=..., eps=...)`` (megatron-core 0.16 to 0.19).
    """

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **unused: Any) -> None:
        super().__init__()
        if getattr(config, "normalization", "RMSNorm") != "RMSNorm":
            raise ValueError(
                f"megarl's RMSNorm got TransformerConfig normalization={config.normalization!r}; "
                f"only 'RMSNorm' is supported"
            )
        if getattr(config, "layernorm_zero_centered_gamma", False):
            raise ValueError(
                "TransformerConfig layernorm_zero_centered_gamma=True is not supported by megarl's "
                "RMSNorm; set it to False"
            )
        self.config = config
        self.hidden_size = int(hidden_size)
        self.eps = float(eps)
        self.weight = torch.nn.Parameter(
            torch.ones(self.hidden_size, dtype=config.params_dtype, device=current_device())
        )
        self.sequence_parallel = bool(getattr(config, "sequence_parallel", False))
        self.weight.sequence_parallel = self.sequence_parallel  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, dtype={self.weight.dtype}"
