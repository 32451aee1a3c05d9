"""Routing replay: the trainer's MoE routers route each token as the rollout engine did.

The engine reports, per token and MoE layer, the ``k`` experts it chose (and, the torch engine,
their weights): ``Batch.routed_experts`` / ``routing_weights`` ``[B, P+R, L, k]``, aligned with
``Batch.sequences()``, -1 where the engine routed none (padding, the last response token, maybe
tool tokens). For each micro-batch, :class:`RoutingReplay` lays them out exactly as the
micro-batch's tokens (packed ``[1, T]`` or padded ``[b, S]``, Megatron's ``[S, b]`` order,
this TP rank's slice of the sequence under sequence parallelism, this pipeline stage's MoE
layers) and hands each router of ITS model its layer's part. Modes (``actor.moe.routing_replay``):

- ``experts``: the engine's expert ids; the weights are the trainer's own router's, gathered at
  those ids and renormalised as the normal path does (Megatron's ``REPLAY_FORWARD``: with
  ``moe_router_pre_softmax=False``, i.e. HF's ``norm_topk_prob``, a softmax over the chosen
  logits). The router keeps its gradient from the policy loss.
- ``experts_and_weights``: the engine's ids and weights, constants: the router gets no gradient
  from the policy loss through replayed tokens (only from the auxiliary losses, if any).

Tokens the engine did not route (-1) keep the trainer's own top-k, in both modes.

How it hooks in: Megatron's ``TopKRouter`` hands top-k selection to ``self.router_replay``
(``get_replay_topk``) when set. Megatron's own ``RouterReplay`` registers every instance in one
process-global list, and the reference model lives in the policy's processes: so megarl leaves
``moe_enable_routing_replay`` off and sets its own per-router object, reachable only from the
model that owns it. Full recompute re-runs each router in the backward: every training forward
queues its ids, and a re-run inside the backward takes them back in order (first in, first out,
as the 1F1B schedule runs the backwards), like Megatron's ``REPLAY_BACKWARD``.

Also here: :meth:`RoutingReplay.observe`, a pass without replay that counts, per layer, the
real tokens whose trainer top-k set equals the engine's (the routing-agreement metric).

DeepSeek-V3's router (sigmoid scores, an expert bias, group-limited top-k, a scaling factor)
replays too: the engine's ids win over the bias and the group limit; in ``experts`` mode the
weights are the trainer's sigmoid scores at those ids (the bias picks experts, it does not weigh
them), normalised and scaled, as Megatron computes them; an unrouted token gets the router's
own group-limited choice of score + bias. In ``experts_and_weights`` mode Megatron ignores the
values top-k returns on a router with the bias (it gathers its sigmoid scores afresh at the
chosen ids): there a forward hook on the router puts the engine's weights in its output instead
(:meth:`_RouterHook.weigh`). Left out: sinkhorn, fused (TE) routing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from megarl.data.batch import Batch, TokenRows
from megarl.data.routing_ids import unpack_expert_ids
from megarl.megatron_runtime.micro_batches import MicroBatch

MODES = ("none", "experts", "experts_and_weights")


def moe_layer_indices(tcfg: Any) -> list[int]:
    """0-based decoder layers that are MoE layers, in order (the ``L`` axis of the Batch's routing)."""
    freq = tcfg.moe_layer_freq
    flags = [bool(f) for f in freq] if isinstance(freq, list) else [i % freq == 0 for i in range(tcfg.num_layers)]
    return [i for i, moe in enumerate(flags) if moe]


class _RouterHook:
    """One router's replay (duck-typed as Megatron's ``RouterReplay``: ``get_replay_topk``)."""

    def __init__(self, layer: int, with_weights: bool, log_weights: bool, scale: float, regather: bool = False) -> None:
        self.layer = layer  # index into the Batch's L axis
        self.with_weights = with_weights
        # Megatron weighs the chosen experts afresh after the top-k (a router with an expert bias):
        # the engine's weights go in through :meth:`weigh`, a forward hook on the router, instead.
        self.regather = regather
        self.pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (ids, weights, routed) for weigh
        self.log_weights = log_weights  # the router softmaxes what top-k returns: hand it log(w)
        self.scale = scale  # Megatron multiplies the probabilities by its scaling factor afterwards
        self.ids: torch.Tensor | None = None  # [N, k] long, -1 = the trainer routes this token itself
        self.weights: torch.Tensor | None = None  # [N, k] float32
        self.queue: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # training forwards, for recompute
        self.record = False  # a training forward: queue what it replays
        self.observe = False  # no replay: count agreement with the engine instead
        self.agree = torch.zeros(2, dtype=torch.float64)  # (tokens whose top-k set matched, tokens compared)

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups=None, group_topk=None, default_compute_topk=None):
        """``(values [N, k], ids [N, k])`` for ``scores [N, E]`` (logits or probabilities, as the
        router's score function passes them), as Megatron's top-k returns them."""
        assert default_compute_topk is not None
        values, own = default_compute_topk(scores, topk, num_groups, group_topk)  # [N, k] each
        if self.ids is None:
            return values, own
        ids, weights = self._targets()
        if ids.shape[0] != scores.shape[0]:
            raise RuntimeError(f"routing replay of layer {self.layer}: {ids.shape[0]} tokens laid out, the router "
                               f"sees {scores.shape[0]}")  # fmt: skip
        routed = (ids >= 0).all(-1, keepdim=True)  # [N, 1] the engine routed this token
        if self.observe:
            self._count(own, ids, routed[:, 0])
            return values, own
        ids = torch.where(routed, ids.to(scores.device), own)  # [N, k]
        replayed = scores.gather(1, ids)  # the trainer's own scores at the engine's experts: differentiable
        if weights is not None and self.regather:
            self.pending = (ids, weights.to(scores.device), routed)
        elif weights is not None:
            w = weights.to(device=scores.device, dtype=torch.float32) / self.scale
            w = w.clamp(min=1e-30).log() if self.log_weights else w
            replayed = torch.where(routed, w.to(scores.dtype), replayed)  # constants where replayed
        return replayed, ids

    def weigh(self, module: Any, args: Any, output: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward hook of a ``regather`` router: its ``(probs [N, E], routing_map [N, E])`` with the
        engine's weights (normalised and scaled, as the router's own) at the replayed tokens' experts."""
        pending, self.pending = self.pending, None
        if pending is None:
            return output
        probs, routing_map = output
        ids, weights, routed = pending
        engine = torch.zeros_like(probs).scatter(1, ids, weights.to(probs.dtype))  # [N, E]
        return torch.where(routed & routing_map, engine, probs), routing_map  # constants where replayed

    def _targets(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The current forward's ids (a recompute inside the backward takes the oldest queued)."""
        if torch._C._current_graph_task_id() != -1:  # re-run by a checkpoint's backward
            if not self.queue:
                raise RuntimeError(f"routing replay of layer {self.layer}: a recompute with no queued forward")
            return self.queue.pop(0)
        assert self.ids is not None
        target = (self.ids, self.weights if self.with_weights else None)
        if self.record and not self.observe:
            self.queue.append(target)
        return target

    def _count(self, own: torch.Tensor, ids: torch.Tensor, routed: torch.Tensor) -> None:
        same = (own.sort(-1).values == ids.to(own.device).sort(-1).values).all(-1) & routed  # [N]
        self.agree = self.agree.to(own.device)  # stays on the device: no host sync per layer
        self.agree += torch.stack([same.sum(), routed.sum()]).to(self.agree)


class RoutingReplay:
    """The replay hooks of one model's routers (see the module docstring)."""

    def __init__(self, hooks: list[_RouterHook], mode: str, sequence_parallel: bool, tp_rank: int, tp_size: int,
                 layers: Sequence[int] = (), recompute: bool = False) -> None:  # fmt: skip
        self.hooks = hooks
        self.recompute = recompute  # full activation recomputation re-runs the routers in the backward
        self.layers = list(layers)  # the model's MoE layers (decoder indices, all stages): the Batch's L axis
        self.num_layers = len(self.layers)
        self.mode = mode
        self.sequence_parallel = sequence_parallel
        self.tp_rank, self.tp_size = tp_rank, tp_size

    @classmethod
    def attach(cls, core: Any, tcfg: Any, mode: str, tp_rank: int = 0, tp_size: int = 1) -> RoutingReplay | None:
        """Hook the ``TopKRouter``s of ``core`` (a GPTModel, this stage's layers); None for a dense
        model or ``mode == "none"``."""
        from megatron.core.transformer.moe.router import TopKRouter

        if mode not in MODES:
            raise ValueError(f"actor.moe.routing_replay must be one of {MODES}, got {mode!r}")
        routers = [m for m in core.modules() if isinstance(m, TopKRouter)]
        if mode == "none" or not routers:
            return None
        order = moe_layer_indices(tcfg)
        log_weights = tcfg.moe_router_score_function == "softmax" and not tcfg.moe_router_pre_softmax
        scale = float(tcfg.moe_router_topk_scaling_factor or 1.0)
        regather = mode == "experts_and_weights" and bool(getattr(tcfg, "moe_router_enable_expert_bias", False))
        hooks = []
        for router in routers:
            hook = _RouterHook(order.index(router.layer_number - 1), mode == "experts_and_weights", log_weights, scale,
                               regather)  # fmt: skip
            router.router_replay = hook  # this router's only: nothing process-global
            if regather:
                router.register_forward_hook(hook.weigh)
            hooks.append(hook)
        recompute = getattr(tcfg, "recompute_granularity", None) == "full"
        return cls(hooks, mode, bool(tcfg.sequence_parallel), tp_rank, tp_size, order, recompute)

    # ---- per micro-batch ----------------------------------------------------------------------
    def install(self, mb: MicroBatch) -> None:
        """Hand each router its layer's routing of ``mb`` (nothing when the batch carries none:
        every router then routes by itself)."""
        laid = self.layout(mb)
        for hook in self.hooks:
            if laid is None:
                hook.ids = hook.weights = None
                continue
            ids, weights = laid
            hook.ids = ids[:, hook.layer]  # [N, k]
            hook.weights = None if weights is None else weights[:, hook.layer]

    def layout(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """``(ids [N, L, k] long, weights [N, L, k] | None)`` in the order this rank's routers see
        the tokens (``N = S x b``, sequence-major; this TP rank's sequence slice under sequence
        parallelism); None when the batch carries no routing."""
        ids, weights = mb.batch.dense_routing()  # a rank's share: its replica's rows, which its micro-batches hold
        if ids is None:
            return None
        fields = [unpack_expert_ids(ids)]
        if self.mode == "experts_and_weights":
            if weights is None:
                raise ValueError("actor.moe.routing_replay=experts_and_weights needs the engine's routing weights; "
                                 "this batch carries expert ids only (SGLang): use routing_replay=experts")  # fmt: skip
            fields.append(weights.float())
        laid = [self._lay_out(mb, f, fill) for f, fill in zip(fields, (-1, 0.0))]
        return laid[0], laid[1] if len(laid) > 1 else None

    def _lay_out(self, mb: MicroBatch, field: torch.Tensor, fill: float) -> torch.Tensor:
        """``field [b, P+R, L, k]`` placed like ``mb.tokens`` and flattened as the router sees it."""
        b, p = len(mb.rows), mb.batch.prompt_len
        plen, rlen = mb.batch.prompt_lengths.tolist(), mb.batch.response_lengths.tolist()
        lines, width = mb.tokens.shape  # packed [1, T] / padded [b, S]
        out = field.new_full((lines, width, *field.shape[2:]), fill)  # [lines, S, L, k]
        for i in range(b):
            real = field[i, p - int(plen[i]) : p + int(rlen[i])]  # this row's real tokens, as pack_micro_batch lays them
            line, start = (0, mb.layout.starts[i]) if mb.layout is not None else (i, 0)
            out[line, start : start + len(real)] = real
        out = out.transpose(0, 1)  # [S, lines, L, k]: Megatron's sequence-first order
        if self.sequence_parallel:  # this TP rank routes its own slice of the sequence
            chunk = width // self.tp_size
            out = out[self.tp_rank * chunk : (self.tp_rank + 1) * chunk]
        return out.flatten(0, 1).to(mb.tokens.device)  # [N, L, k]

    def clear(self) -> None:
        for hook in self.hooks:
            hook.ids = hook.weights = hook.pending = None
            hook.queue.clear()

    @contextmanager
    def run(self, *, training: bool) -> Iterator[None]:
        """Around one schedule run: training forwards queue their ids for the recompute of full
        activation recomputation (only then: a queue nothing pops would keep every micro-batch's
        routing until the run ends); nothing stays installed afterwards."""
        for hook in self.hooks:
            hook.record = training and self.recompute
        try:
            yield
        finally:
            self.clear()

    @contextmanager
    def observe(self) -> Iterator[None]:
        """Replay off: the routers route by themselves and count agreement with the engine."""
        for hook in self.hooks:
            hook.observe = True
            hook.agree.zero_()
        try:
            yield
        finally:
            for hook in self.hooks:
                hook.observe = False

    def agreement(self, device: torch.device | str = "cpu", group: Any = None) -> torch.Tensor:
        """``[L, 2]`` (tokens whose top-k set matched, tokens compared) per MoE layer,
        summed over ``group`` (each token of each layer is routed on exactly one rank of the
        model's processes: its TP slice, DP replica and pipeline stage), from the last
        :meth:`observe`. Collective when ``group`` has several ranks."""
        counts = torch.zeros(self.num_layers, 2, dtype=torch.float64, device=device)
        for hook in self.hooks:
            counts[hook.layer] += hook.agree.to(device)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
        return counts


def replay_metrics(
    replay: RoutingReplay,
    batch: Batch,
    replayed: TokenRows | None,
    forward: Callable[[], TokenRows | None],
    device: torch.device | str = "cpu",
    group: Any = None,
    role: str = "actor",
) -> dict[str, float]:
    """What replay changes, from one extra forward without it (``forward``, run under
    :meth:`RoutingReplay.observe`; collective over ``group``, the model's processes):

    - ``<role>/moe/routing_agreement/layer{i}`` and their mean over layers ``<role>/moe/routing_agreement``:
      share of the tokens the engine routed whose trainer top-k set (without replay) equals
      the engine's;
    - ``<role>/moe/logprob_diff_replay`` / ``<role>/moe/logprob_diff_no_replay``: mean |trainer - rollout|
      log-prob over the loss tokens (``response_mask``), with ``replayed`` (this rank's rows of
      the forward with replay) and without.

    ``batch`` carries ``rollout_logprobs [B, R]``; the rows of each forward sit on the output
    ranks (one per DP replica, distinct rows), so one SUM over ``group`` makes the totals."""
    assert batch.rollout_logprobs is not None
    with replay.observe():
        own = forward()
    sums = torch.zeros(4, dtype=torch.float64)  # replay |diff| sum, its count, no-replay sum, its count
    for k, rows in enumerate((replayed, own)):
        if rows is not None:
            mask = batch.response_mask[rows.rows].double()  # [n, R]
            gap = (rows.values["logprobs"].double() - batch.rollout_logprobs[rows.rows].double()).abs()
            sums[2 * k : 2 * k + 2] = torch.stack([(gap * mask).sum(), mask.sum()])
    sums = sums.to(device)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(sums, group=group)
    counts = replay.agreement(device, group).cpu()  # [L, 2]
    sums = sums.cpu()
    per_layer = (counts[:, 0] / counts[:, 1]).tolist()  # NaN for a layer no routed token reached
    # named by decoder layer (HF's 0-based index), as the load-balance metrics
    metrics = {f"{role}/moe/routing_agreement/layer{layer}": a for layer, a in zip(replay.layers, per_layer, strict=True)}
    metrics[f"{role}/moe/routing_agreement"] = sum(per_layer) / len(per_layer) if per_layer else float("nan")
    metrics[f"{role}/moe/logprob_diff_replay"] = float(sums[0] / sums[1])
    metrics[f"{role}/moe/logprob_diff_no_replay"] = float(sums[2] / sums[3])
    return metrics
