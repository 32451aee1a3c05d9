"""Mixture-of-experts routing as the engines report it, for routing replay (actor.moe.routing_replay).

Per sample, ``routed_experts [P+R, L, k]``: the experts token t of prompt + response went
to in MoE layer l (the model's MoE layers in order, dense layers left out), packed as
megarl/data/routing_ids.py says (uint8 up to 255 experts), "not routed" in the row of the last
response token, which no forward pass of the engine saw; ``routing_weights`` the router's
weights of those experts, in the dtype the router computed them in (exact: the engine's dtype). Here: which runs ask for it (:func:`routing_replay`), which
layers an HF config routes (:class:`RoutingLayout`), and how the torch engine records it from
the HF model's routers (:class:`RouterRecorder`). SGLang's answer is parsed in
megarl/rollout_sglang/client.py. Deliberately left out: shared experts (always on, nothing to
replay) and routers that do not return ``(logits, weights, ids)`` as transformers' Qwen3-MoE does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megarl.config.architectures import resolve_arch
from megarl.data.routing_ids import pack_expert_ids, unrouted_id


def routing_replay(cfg: Any) -> str:
    """The run's routing replay: ``actor.moe.routing_replay`` for a mixture-of-experts model,
    "none" for a dense one (which has no routing to report)."""
    mode = str(cfg.actor.moe.routing_replay)
    if mode == "none":
        return mode
    return mode if resolve_arch(cfg.model.path, cfg.model.arch).num_experts else "none"


@dataclass(frozen=True)
class RoutingLayout:
    """Which of a model's layers route (``moe_layers``, 0-based, in order), ``top_k``, and how
    many routed experts there are (which sets the ids' dtype)."""

    num_layers: int
    moe_layers: tuple[int, ...]
    top_k: int
    num_experts: int

    @staticmethod
    def of_model(model_path: str | Path) -> RoutingLayout:
        """The layout of the HF model at ``model_path`` (its config.json)."""
        from transformers import AutoConfig

        from megarl.models import deepseek_v3, qwen3_moe

        hf = AutoConfig.from_pretrained(str(model_path))
        moe_layers = deepseek_v3.moe_layers if hf.model_type == "deepseek_v3" else qwen3_moe.moe_layers
        top_k = getattr(hf, "num_experts_per_tok", None)
        if not top_k:
            raise ValueError(f"model {model_path} ({hf.model_type}) has no num_experts_per_tok: it is not a "
                             "mixture-of-experts model; set actor.moe.routing_replay: none")  # fmt: skip
        layers = tuple(i for i, moe in enumerate(moe_layers(hf)) if moe)
        experts = getattr(hf, "num_experts", None) or getattr(hf, "n_routed_experts", None) or hf.num_local_experts
        return RoutingLayout(int(hf.num_hidden_layers), layers, int(top_k), int(experts))


def router_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The routers of an HF MoE model's layers in layer order: the ``mlp.gate`` modules that pick
    ``top_k`` experts (a dense layer's MLP has no gate; a shared expert's gate is not one)."""
    return [m for name, m in model.named_modules() if name.endswith("mlp.gate") and hasattr(m, "top_k")]


class RouterRecorder:
    """Records, per sample, what the routers of an HF model chose in the torch engine's decode loop.

    Used as a context manager around the loop: hooks on the routers keep each forward's
    choice, and the loop says whose tokens that forward held (:meth:`prefill`, :meth:`decode`).
    """

    def __init__(self, model: torch.nn.Module, rows: int) -> None:
        self.routers = router_modules(model)
        if not self.routers:
            raise ValueError(f"SamplingParams.return_routing asks for expert routing, and {type(model).__name__} "
                             "has no mixture-of-experts router (mlp.gate); set actor.moe.routing_replay: none")  # fmt: skip
        self._seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # per router of the last forward
        self._rows: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(rows)]
        self._handles: list[Any] = []

    def __enter__(self) -> RouterRecorder:
        self._handles = [r.register_forward_hook(self._hook) for r in self.routers]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        _, weights, ids = output  # [B*S, E] logits, [B*S, k] weights, [B*S, k] ids (B-major)
        self._seen.append((ids, weights))

    def _take(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last forward's routing: ids [B, S, L, k] packed, weights [B, S, L, k] as the routers
        computed them (the engine's dtype: kept, not widened, as it is exact and half of float32)."""
        seen, self._seen = self._seen, []
        assert len(seen) == len(self.routers), (len(seen), len(self.routers))
        ids = torch.stack([i.reshape(batch, -1, i.shape[-1]) for i, _ in seen], dim=2)
        weights = torch.stack([w.reshape(batch, -1, w.shape[-1]) for _, w in seen], dim=2)
        experts = int(self.routers[0].weight.shape[0])  # type: ignore[index]
        return pack_expert_ids(ids.to("cpu"), experts), weights.to("cpu")

    def prefill(self, lengths: list[int], rows: list[int]) -> None:
        """After a prefill forward of left-padded sequences: batch row b is sample ``rows[b]``, its
        last ``lengths[b]`` columns real. A prefill (first, or again under new weights: a partial
        rollout's push) routes the sample's whole context, so it replaces what was recorded."""
        ids, weights = self._take(len(lengths))  # [B, S, L, k]
        width = ids.shape[1]
        for b, (r, n) in enumerate(zip(rows, lengths, strict=True)):
            self._rows[r] = [(ids[b, width - n :], weights[b, width - n :])]

    def decode(self, rows: list[int | None]) -> None:
        """After a one-token forward: cache row j held a token of sample ``rows[j]``, or (None)
        one of a finished sample that is still in the cache (its last token: not recorded)."""
        ids, weights = self._take(len(rows))  # [B, 1, L, k]
        for j, r in enumerate(rows):
            if r is not None:
                self._rows[r].append((ids[j], weights[j]))

    def result(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ``row``'s routing, ids [P+R, L, k] packed and weights [P+R, L, k], with the
        "not routed" / 0 row of its last response token appended."""
        ids = torch.cat([i for i, _ in self._rows[row]])  # [P+R-1, L, k]
        weights = torch.cat([w for _, w in self._rows[row]])
        return torch.cat([ids, ids.new_full((1, *ids.shape[1:]), unrouted_id(ids.dtype))]), torch.cat([weights, weights.new_zeros((1, *weights.shape[1:]))])


class NoRecorder:
    """What the decode loop records when routing was not asked for: nothing, at no cost."""

    def __enter__(self) -> NoRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def prefill(self, lengths: list[int], rows: list[int]) -> None:
        return None

    def decode(self, rows: list[int | None]) -> None:
        return None

    def result(self, row: int) -> tuple[None, None]:
        return None, None
