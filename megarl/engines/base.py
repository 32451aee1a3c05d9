"""The rollout engine contract: what the trainer needs from any generator.

Two implementations: the SGLang servers (megarl/rollout_sglang, production on GPUs) and the
torch reference engine (megarl/engines/torch_engine.py, CPU or GPU, for CI, the demo and
debugging). Both report log-probs the same way: ``log_softmax(logits / temperature)`` of the
sampled token, taken before top-p / top-k filtering (what SGLang reports and what the trainer
recomputes), so the train/inference mismatch metric compares like with like.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

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
    # Generate past EOS and stop_token_ids to the token budget (SGLang's and vLLM's ignore_eos:
    # stop strings still end a response); for throughput runs and length studies.
    ignore_eos: bool = False
    seed: int | None = None
    # One cap per prompt of the request (each <= max_new_tokens), or None: max_new_tokens for
    # all. The agent driver batches turns of different budgets in one request; asking each
    # for the largest would overrun the context length of a trajectory near its end.
    prompt_max_new_tokens: tuple[int, ...] | None = None
    # Ask for each token's mixture-of-experts routing (GenerationResult.routed_experts); the
    # rollout sets it when actor.moe.routing_replay is on for an MoE model (megarl/engines/routing.py).
    return_routing: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6

    def for_prompts(self, start: int, stop: int) -> SamplingParams:
        """These params for the prompts [start, stop) of the request (a shard of it)."""
        if self.prompt_max_new_tokens is None:
            return self
        return replace(self, prompt_max_new_tokens=self.prompt_max_new_tokens[start:stop])

    def check_budgets(self, prompts: int) -> None:
        """ValueError unless prompt_max_new_tokens has one cap in [1, max_new_tokens] per prompt."""
        caps = self.prompt_max_new_tokens
        if caps is not None and (len(caps) != prompts or not all(1 <= c <= self.max_new_tokens for c in caps)):
            raise ValueError(f"SamplingParams.prompt_max_new_tokens {caps} needs one value in [1, max_new_tokens="
                             f"{self.max_new_tokens}] per prompt ({prompts} prompts)")  # fmt: skip

    def budget(self, prompt: int) -> int:
        """max_new_tokens of prompt ``prompt`` of the request."""
        caps = self.prompt_max_new_tokens
        return self.max_new_tokens if caps is None else caps[prompt]


@dataclass(frozen=True)
class GenerationResult:
    """The output of one sample (one of the ``n`` of a prompt)."""

    prompt_index: int  # which prompt of the request this sample answers
    response_ids: list[int]
    logprobs: list[float]  # one per response token, as in the module docstring
    finish_reason: str  # "stop" (EOS / stop string / stop id) | "length" | "abort"
    weight_version: int = 0
    # With SamplingParams.return_routing, for an MoE model: the experts each token of
    # prompt + response went to in each MoE layer (L: the MoE layers in order, k: experts per
    # token), -1 in the row of the last response token (no forward pass of the engine saw it);
    # rows follow the tokens as the Batch's [B, P+R] rows do, without their padding.
    routed_experts: torch.Tensor | None = field(default=None, compare=False)  # [P+R, L, k] uint8 / int16 (megarl/data/routing_ids.py)
    # The router's weights of those experts (0 where routed_experts says "not routed"); None from engines that
    # report ids alone (SGLang).
    routing_weights: torch.Tensor | None = field(default=None, compare=False)  # [P+R, L, k] in the engine's dtype
    # The engine's weight version that sampled each response token (a partial rollout continues
    # under newer weights after a push, docs/async.md); None from engines that do not say (SGLang).
    token_versions: tuple[int, ...] | None = None  # [R]


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
    index: int = 1  # its place in the push, from 1 (for progress reports)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)


class Engines(Protocol):
    """What the controller generates with: one or more engines behind one call (torch engines
    in the policy ranks, SGLang servers), results grouped by prompt, in prompt order."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[GenerationResult]: ...


@runtime_checkable
class RolloutEngine(Protocol):
    """One generator (one SGLang server, or one torch model). Releasing and resuming its memory
    is engine-specific and the memory hand-over's business (megarl/memory/handover.py)."""

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

    def health(self) -> EngineHealth: ...

    @property
    def weight_version(self) -> int: ...


def eos_token_ids(model_path: str | Path, tokenizer: Any = None) -> tuple[int, ...]:
    """The token ids that end a response for the HF model at ``model_path``: those of its
    generation_config.json, its config.json and its tokenizer, in that order, once each
    (the engines stop on them; scoring drops a final one). ``tokenizer``: an already loaded one."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    try:
        generation = GenerationConfig.from_pretrained(str(model_path)).eos_token_id
    except OSError:  # no generation_config.json
        generation = None
    tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(str(model_path))
    ids = [*_id_list(generation), *_id_list(AutoConfig.from_pretrained(str(model_path)).eos_token_id),
           *_id_list(tokenizer.eos_token_id)]  # fmt: skip
    return tuple(dict.fromkeys(ids))


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
