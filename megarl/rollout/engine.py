"""The rollout engine contract: what the trainer needs from any generator.

Two implementations: the SGLang servers (megarl/rollout_sglang, production on GPUs) and the
torch reference engine (megarl/rollout/torch_engine.py, CPU or GPU, for CI, the demo and
debugging). Both report log-probs the same way: ``log_softmax(logits / temperature)`` of the
sampled token, taken before top-p / top-k filtering (what SGLang reports and what the trainer
recomputes), so the train/inference mismatch metric compares like with like.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to sample; the same fields SGLang's ``sampling_params`` take.

    ``seed`` is the step's base seed: sample ``i`` of a request uses a seed derived from
    (seed, i), so a resumed run regenerates exactly what an uninterrupted one would have.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = the whole vocabulary (SGLang's convention)
    max_new_tokens: int = 128
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6


@dataclass(frozen=True)
class GenerationResult:
    """The output of one sample (one of the ``n`` of a prompt)."""

    prompt_index: int  # which prompt of the request this sample answers
    response_ids: list[int]
    logprobs: list[float]  # one per response token, as in the module docstring
    finish_reason: str  # "stop" (EOS / stop string / stop id) | "length" | "abort"
    weight_version: int = 0


@dataclass(frozen=True)
class EngineHealth:
    alive: bool
    weight_version: int
    detail: str = ""


@dataclass(frozen=True)
class WeightBucket:
    """HF-named tensors sent together; a push is a stream of buckets.

    ``last`` marks the final bucket of a push, after which the engine bumps its weight version
    to ``version``.
    """

    tensors: list[tuple[str, torch.Tensor]]
    version: int
    last: bool = False
    meta: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)


@runtime_checkable
class RolloutEngine(Protocol):
    """One generator (one SGLang server, or one torch model)."""

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[GenerationResult]:
        """Sample ``params.n`` responses per token-id prompt.

        Returns ``len(prompts) * n`` results grouped by prompt: ``[p0s0 .. p0s(n-1), p1s0, ...]``.
        """
        ...

    def load_weights(self, bucket: WeightBucket) -> None:
        """Load one bucket of HF-named tensors (full, unsharded tensors)."""
        ...

    def release_memory(self) -> None:
        """Free weights and KV cache while the trainer uses the device (colocated mode)."""
        ...

    def resume_memory(self) -> None:
        """Take the memory back after :meth:`release_memory`."""
        ...

    def health(self) -> EngineHealth: ...

    @property
    def weight_version(self) -> int: ...


@runtime_checkable
class WeightSync(Protocol):
    """The only way weights move from the trainer to the engines.

    Data path (shared by every transport): gather TP shards -> collect PP stages -> convert
    to HF names and layouts (the model bridge) -> pack buckets of ``bucket_mb`` -> send.
    Implementations differ only in the send: in-process (torch engine), SGLang from tensor
    (CUDA IPC), SGLang from distributed (NCCL broadcast per pipeline stage), disk.
    """

    def connect(self, engines: Iterable[RolloutEngine]) -> None:
        """Attach the engines that receive the weights (rebuilds groups after a restart)."""
        ...

    def push(self, version: int) -> dict[str, float]:
        """Send the current policy weights; returns metrics (seconds, bytes, GB/s)."""
        ...
