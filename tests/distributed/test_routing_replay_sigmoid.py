"""Routing replay on DeepSeek-V3's router: sigmoid scores, a correction bias that picks the experts
but does not weigh them, group-limited top-k and a routed scaling factor. One Megatron TopKRouter
built directly (8 experts in 4 groups, 2 groups per token, top-2, scale 2.5), in one process.

- experts: the engine's ids win over the bias and the group limit; the weights are the trainer's
  sigmoid scores at those ids, normalised, times the scale (the bias left out), with gradient;
  a token the engine did not route gets the group-limited top-k of score + bias, by hand; the
  router's gradient equals autograd's through that hand formula.
- experts_and_weights: the engine's weights come out exactly, on a router without the bias (through
  the values top-k returns) and on one with it (Megatron gathers its weights afresh there: megarl's
  forward hook puts them in); a token the engine did not route keeps the router's own weights, and
  only it gives the router a gradient.
"""

from __future__ import annotations

import pytest
import torch
from spawn import run_distributed

E, K, GROUPS, GROUP_TOPK, SCALE, H, N = 8, 2, 4, 2, 2.5, 16, 6


def _router(bias: bool):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.router import TopKRouter

    tcfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, num_moe_experts=E, moe_router_topk=K,
                             moe_router_score_function="sigmoid", moe_router_enable_expert_bias=bias,
                             moe_router_num_groups=GROUPS, moe_router_group_topk=GROUP_TOPK,
                             moe_router_topk_scaling_factor=SCALE, moe_router_load_balancing_type="none",
                             moe_aux_loss_coeff=0.0, add_bias_linear=False)  # fmt: skip
    router = TopKRouter(config=tcfg, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    router.set_layer_number(1)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=torch.Generator().manual_seed(2)))
        if bias:  # large enough to change the choice of some tokens
            router.expert_bias.copy_(torch.linspace(-1.0, 1.0, E))
    return router, tcfg


def _own_choice(scores: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's selection of one token [E] -> [K] ids: the GROUP_TOPK groups with the highest
    sum of their top-(K / GROUP_TOPK) scores, then the top K experts inside them."""
    groups = scores.view(GROUPS, -1).topk(K // GROUP_TOPK, -1).values.sum(-1)  # [GROUPS]
    keep = torch.zeros(GROUPS, dtype=torch.bool)
    keep[groups.topk(GROUP_TOPK).indices] = True
    masked = scores.masked_fill(~keep.repeat_interleave(E // GROUPS), -torch.inf)
    return masked.topk(K).indices


def _replay(rank: int, world: int) -> dict:
    from megarl.config.train_sections import ParallelConfig
    from megarl.megatron_runtime.model import ensure_parallel
    from megarl.megatron_runtime.routing_replay import RoutingReplay

    ensure_parallel(ParallelConfig(), seed=1)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N, 1, H, generator=g)  # [S, b, h]
    router, tcfg = _router(bias=True)
    replay = RoutingReplay.attach(router, tcfg, "experts")
    assert replay is not None
    ids = torch.tensor([[0, 1], [6, 7], [0, 7], [2, 5], [3, 4], [-1, -1]])  # [N, K]: token 2 spans 2 groups
    replay.hooks[0].ids = ids
    probs, routing_map = router(x)  # [N, E] each
    w = router.weight.detach().clone().requires_grad_()
    sig = torch.sigmoid(x[:, 0] @ w.t())  # [N, E]
    chosen = ids.clone()
    chosen[-1] = _own_choice(sig[-1].detach() + router.expert_bias)  # the engine did not route token 5
    picked = sig.gather(1, chosen)  # [N, K] the bias picks, the sigmoid weighs
    expected = torch.zeros(N, E).scatter(1, chosen, SCALE * picked / picked.sum(-1, keepdim=True))
    # a token's weights sum to SCALE (a constant): weigh each expert's by its index instead
    (probs * torch.arange(E)).sum().backward()
    (expected * torch.arange(E)).sum().backward()
    out = {"map": torch.equal(routing_map, expected > 0), "probs_err": (probs - expected).abs().max().item(),
           "grad_norm": router.weight.grad.norm().item(), "grad_err": (router.weight.grad - w.grad).abs().max().item(),
           "own_changed_by_bias": not torch.equal(_own_choice(sig[-1]).sort().values, chosen[-1].sort().values)}  # fmt: skip
    plain, tcfg = _router(bias=False)
    replay = RoutingReplay.attach(plain, tcfg, "experts_and_weights")
    assert replay is not None
    weights = torch.rand(N, K, generator=g) + 0.1
    weights = SCALE * weights / weights.sum(-1, keepdim=True)  # as the engine reports them: normalised, scaled
    replay.hooks[0].ids, replay.hooks[0].weights = ids[:-1], weights[:-1]
    probs, routing_map = plain(x[:-1])
    out["weights_err"] = (probs.gather(1, ids[:-1]) - weights[:-1]).abs().max().item()
    out["weights_map"] = torch.equal(routing_map, torch.zeros(N - 1, E, dtype=torch.bool).scatter(1, ids[:-1], True))
    return out


def test_replay_on_a_sigmoid_router_with_bias_groups_and_scale():
    r = run_distributed(_replay, 1)[0]
    assert r["map"] and r["probs_err"] <= 1e-6, r  # ids replayed across the group limit; weights without the bias
    assert r["own_changed_by_bias"], r  # the unrouted token's own choice really depends on the bias
    assert r["grad_norm"] > 1e-3 and r["grad_err"] <= 1e-5 * r["grad_norm"], r  # experts mode: the router learns
    assert r["weights_map"] and r["weights_err"] <= 1e-6, r


def _weights_with_bias(rank: int, world: int) -> dict:
    from megarl.config.train_sections import ParallelConfig
    from megarl.megatron_runtime.model import ensure_parallel
    from megarl.megatron_runtime.routing_replay import RoutingReplay

    ensure_parallel(ParallelConfig(), seed=1)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N, 1, H, generator=g)  # [S, b, h]
    router, tcfg = _router(bias=True)
    replay = RoutingReplay.attach(router, tcfg, "experts_and_weights")
    assert replay is not None
    ids = torch.tensor([[0, 1], [6, 7], [0, 7], [2, 5], [3, 4], [-1, -1]])  # [N, K]: token 5 not routed
    weights = torch.rand(N, K, generator=g) + 0.1
    weights = SCALE * weights / weights.sum(-1, keepdim=True)  # as the engine reports them: normalised, scaled
    replay.hooks[0].ids, replay.hooks[0].weights = ids, weights
    probs, routing_map = router(x)  # [N, E] each
    w = router.weight.detach().clone().requires_grad_()
    sig = torch.sigmoid(x[-1, 0] @ w.t())  # [E] the unrouted token's scores
    own = _own_choice(sig.detach() + router.expert_bias)
    picked = sig[own]
    expected = torch.zeros(N, E).scatter(1, ids.clamp(min=0), weights)  # constants where replayed
    expected[-1] = torch.zeros(E).scatter(0, own, SCALE * picked / picked.sum())
    (probs * torch.arange(E)).sum().backward()
    (expected * torch.arange(E)).sum().backward()
    return {"map": torch.equal(routing_map, expected > 0), "probs_err": (probs - expected).abs().max().item(),
            "grad_norm": router.weight.grad.norm().item(), "grad_err": (router.weight.grad - w.grad).abs().max().item(),
            "rows_with_grad": (router.weight.grad.abs().sum(-1) > 0).sum().item(), "pending": replay.hooks[0].pending}  # fmt: skip


def test_weights_replay_on_a_router_with_bias():
    r = run_distributed(_weights_with_bias, 1)[0]
    assert r["map"] and r["probs_err"] <= 1e-6, r  # the engine's weights, not the router's sigmoid scores
    assert r["grad_norm"] > 1e-3 and r["grad_err"] <= 1e-5 * r["grad_norm"], r  # from the unrouted token alone
    assert r["rows_with_grad"] == K, r  # the unrouted token's two experts: replayed tokens give no gradient
    assert r["pending"] is None, r  # the hook used what the top-k left it


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])
