"""Routing replay (megarl/megatron_runtime/routing_replay.py) against HF transformers'
Qwen3MoeForCausalLM, in 2 gloo processes (TP=1 x EP=2: the expert-parallel group spans the two
data-parallel replicas; the parity also at TP=2 with sequence parallelism, PP=2, and TP=2 x EP=2
in 4 processes), through MegatronModel's own forward (packed micro-batches).

HF plays the engine: its ``mlp.gate`` of each MoE layer gives the expert ids and weights of every
real token of every row (the last response token left at -1, as an engine leaves it). The
Megatron copy's routers are then perturbed, so that its own routing differs from HF's:
- experts_and_weights replay of HF's routing gives HF's log-probs (fp32, 1e-5) although the
  routers differ; the same model without replay does not;
- without replay, the routing agreement of the first MoE layer (whose input is still HF's) equals
  a hand count: HF's gate inputs through the perturbed router weight, top-k sets compared; the
  replay metrics report it, and the mean log-prob gap to HF with replay (~0) and without;
- the reference, another MegatronModel of the same process, keeps its own routing while the
  policy's routers hold replay data, and Megatron's process-global RouterReplay list stays empty.
- the same parity at TP=2 and TP=2 x EP=2 (sequence parallel: each TP rank replays its slice of
  the sequence) and at PP=2 (stage 0 replays MoE layer 0, stage 1 layers 1-2; the log-probs come
  from the last stage), packed and padded micro-batches; in the pass without replay each routed
  token is counted once per layer over all ranks;
- experts replay on one router: the router's gradient is non-zero and equals a hand computation
  (softmax over the replayed logits), also when the router is re-run by a recompute after the
  next micro-batch's ids were installed.
"""

from __future__ import annotations

import pytest
import torch
from actor_cases import batch_of_lengths, gathered, hf_token_logprobs, portable
from spawn import run_distributed
from test_moe_bridge import SHAPE

LOGPROB_TOL = 1e-5
PERTURBED_MIN = 1e-3  # log-probs of the perturbed routers without replay differ at least this much from HF's
GRAD_TOL = 1e-6  # relative to the gradient's norm: float64 router logits, but Megatron's softmax is float32
PROMPTS, RESPONSES = [3, 5, 2, 4], [6, 3, 5, 4]  # rows of several lengths, two per DP replica
NORM_TOPK = {"norm_topk_prob": True, "mlp_only_layers": [1]}  # MoE layers 0, 2, 3


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    from megarl.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("replay") / "m", "qwen3_moe", seed=3, **SHAPE, **NORM_TOPK))


@pytest.fixture(scope="module")
def results(model_path):
    return run_distributed(_worker, 2, model_path)


def _hf_routing(hf, batch) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """HF's routing as an engine reports it: ids [B, P+R, L, k] int16 (-1 on padding and the last
    response token), weights [B, P+R, L, k]; and the first MoE layer's gate inputs [tokens, h]
    of the routed tokens."""
    from megarl.models.qwen3_moe import moe_layers

    layers = [i for i, m in enumerate(moe_layers(hf.config)) if m]
    b, width, k = len(batch), batch.prompt_len + batch.response_len, hf.config.num_experts_per_tok
    ids = torch.full((b, width, len(layers), k), -1, dtype=torch.int16)
    weights = torch.zeros(b, width, len(layers), k)
    seen: dict[int, tuple] = {}
    hooks = [hf.model.layers[i].mlp.gate.register_forward_hook(lambda m, a, out, j=j: seen.__setitem__(j, (a[0], *out)))
             for j, i in enumerate(layers)]  # fmt: skip
    first_inputs = []
    with torch.no_grad():
        for i in range(b):
            pl, rl = int(batch.prompt_lengths[i]), int(batch.response_lengths[i])
            hf(torch.cat([batch.prompt_ids[i, batch.prompt_len - pl :], batch.response_ids[i, :rl]])[None])
            cols = slice(batch.prompt_len - pl, batch.prompt_len + rl - 1)  # no engine forward saw the last token
            for j in range(len(layers)):
                hidden, _, scores, chosen = seen[j]  # [T, h], logits, [T, k], [T, k]
                ids[i, cols, j], weights[i, cols, j] = chosen[:-1].to(torch.int16), scores[:-1]
            first_inputs.append(seen[0][0][:-1])
    for h in hooks:
        h.remove()
    return ids, weights, first_inputs


def _hand_agreement(router_weight: torch.Tensor, inputs: list[torch.Tensor], ids: torch.Tensor, k: int) -> float:
    """Share of routed tokens whose top-k experts under ``router_weight`` equal HF's (layer 0)."""
    x = torch.cat(inputs)  # [n, h]
    own = (x @ router_weight.t()).topk(k, dim=-1).indices.sort(-1).values  # [n, k]
    engine = torch.cat([row[row[:, 0, 0] >= 0, 0] for row in ids]).long().sort(-1).values  # [n, k]
    return (own == engine).all(-1).double().mean().item()


def _perturb_routers(core, seed: int) -> torch.Tensor:
    """Add noise to every router (the same on every rank: routers are replicated); returns the
    first MoE layer's new weight [E, h]."""
    from megatron.core.transformer.moe.router import TopKRouter

    g = torch.Generator().manual_seed(seed)
    routers = [m for m in core.modules() if isinstance(m, TopKRouter)]
    with torch.no_grad():
        for r in routers:
            r.weight += torch.randn(r.weight.shape, generator=g) * 2 * r.weight.std()
    return routers[0].weight.detach().clone()


def _engine_batch(path: str):
    """(HF model, the test batch, the batch with HF's routing and log-probs as an engine's,
    HF's ids [B, P+R, L, k], the first MoE layer's gate inputs, HF's log-probs [B, R])."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    batch = batch_of_lengths(PROMPTS, RESPONSES, torch.Generator().manual_seed(5), hf.config.vocab_size)
    ids, weights, first_inputs = _hf_routing(hf, batch)
    ref_logprobs, _ = hf_token_logprobs(hf, batch, 1.0)
    # The engine's log-probs are HF's: the replay metrics' log-prob gaps are then the trainer's own.
    routed = batch.replace(routed_experts=ids, routing_weights=weights, rollout_logprobs=ref_logprobs)
    return hf, batch, routed, ids, first_inputs, ref_logprobs


def _worker(rank: int, world: int, path: str) -> dict:
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from megarl.config.train_sections import ActorConfig, MoEConfig, ParallelConfig
    from megarl.megatron_runtime.micro_batches import MicroBatching, pack_micro_batch, replica_rows
    from megarl.megatron_runtime.model import MegatronModel, token_logprob_head
    from megarl.megatron_runtime.routing_replay import replay_metrics

    hf, batch, routed, ids, first_inputs, ref_logprobs = _engine_batch(path)
    cfg = ActorConfig(parallel=ParallelConfig(tp=1, ep=2), micro_batch_size=2,
                      moe=MoEConfig(routing_replay="experts_and_weights"))  # fmt: skip
    policy = MegatronModel.build(path, cfg, torch.float32, seed=1)
    reference = MegatronModel.build(path, cfg, torch.float32, seed=1)
    perturbed = _perturb_routers(policy.core, seed=7)

    def rows(model, b):
        return model.forward_tokens(b, token_logprob_head(model, 1.0, False), MicroBatching.of(cfg))

    assert policy.routing is not None
    replayed_rows, own_rows = rows(policy, routed), []
    # As PolicyClient sends it: the batch without routing, and this replica's rows of the routing
    # alone (the forward's split, routing_split.py); the rank's micro-batches find all they need.
    mine = replica_rows(routed, world)[policy.info.dp_rank]
    share = routed.replace(routed_experts=None, routing_weights=None).with_routing_share(routed.routing_share(mine))
    share_equal = torch.equal(gathered(rows(policy, share), routed)["logprobs"], gathered(replayed_rows, routed)["logprobs"])
    metrics = replay_metrics(policy.routing, routed, replayed_rows, lambda: own_rows.append(rows(policy, routed)) or own_rows[0])
    replayed, own = gathered(replayed_rows, routed)["logprobs"], gathered(own_rows[0], routed)["logprobs"]
    agreement = policy.routing.agreement()  # [L, 2] of the pass without replay
    # The policy's routers keep replay data installed while the reference runs (its own routing: HF's).
    policy.routing.install(pack_micro_batch(routed, [0, 1], packed=True))
    reference_own = gathered(rows(reference, batch), batch)["logprobs"]
    policy_hooks_kept = all(h.ids is not None for h in policy.routing.hooks)
    policy.routing.clear()
    diff = lambda lp: (lp - ref_logprobs).abs().max().item()  # noqa: E731
    return portable({
        "replayed": diff(replayed), "own": diff(own), "reference_own": diff(reference_own),
        "agreement": (agreement[:, 0] / agreement[:, 1]).tolist(), "tokens": agreement[:, 1].tolist(),
        "hand_agreement": _hand_agreement(perturbed, first_inputs, ids, hf.config.num_experts_per_tok),
        "global_replay_instances": len(RouterReplay.global_router_replay_instances),
        "policy_hooks_kept": policy_hooks_kept,
        "reference_hooks_distinct": not set(map(id, policy.routing.hooks)) & set(map(id, reference.routing.hooks)),
        "metrics": metrics, "gradient": _router_gradient(policy),
        "share_rows": share.routed_experts.shape[0], "share_equal": share_equal,
    })  # fmt: skip


def _parallel_worker(rank: int, world: int, path: str, parallel: dict) -> dict:
    """experts_and_weights replay under ``parallel`` (TP=2 with sequence parallelism: each TP
    rank routes its slice of the sequence; PP=2: each stage its own MoE layers), packed and
    padded micro-batches: the Batch layer of each of this rank's routers, and per layout
    :func:`_parity`."""
    from megarl.config.train_sections import ActorConfig, MoEConfig, ParallelConfig
    from megarl.megatron_runtime.micro_batches import MicroBatching
    from megarl.megatron_runtime.model import MegatronModel

    _, _, routed, _, _, ref_logprobs = _engine_batch(path)
    cfg = ActorConfig(parallel=ParallelConfig(**parallel), micro_batch_size=2,
                      moe=MoEConfig(routing_replay="experts_and_weights"))  # fmt: skip
    policy = MegatronModel.build(path, cfg, torch.float32, seed=1)
    _perturb_routers(policy.core, seed=7)
    assert policy.routing is not None
    return portable({
        "layers": [h.layer for h in policy.routing.hooks], "sequence_parallel": policy.tcfg.sequence_parallel,
        **{("packed" if packed else "padded"): _parity(policy, routed, ref_logprobs, MicroBatching(2, None, packed))
           for packed in (True, False)},
    })  # fmt: skip


def _parity(policy, routed, ref_logprobs: torch.Tensor, batching) -> dict:
    """Max |log-prob - HF's| with replay and without, the routed tokens each MoE layer counted
    without replay (over all ranks), and the replay metrics."""
    from megarl.megatron_runtime.model import token_logprob_head
    from megarl.megatron_runtime.routing_replay import replay_metrics

    rows = lambda: policy.forward_tokens(routed, token_logprob_head(policy, 1.0, False), batching)  # noqa: E731
    replayed, own = rows(), []
    metrics = replay_metrics(policy.routing, routed, replayed, lambda: own.append(rows()) or own[0])
    diff = lambda r: (gathered(r, routed)["logprobs"] - ref_logprobs).abs().max().item()  # noqa: E731
    return {"replayed": diff(replayed), "own": diff(own[0]), "tokens": policy.routing.agreement()[:, 1].tolist(),
            "metrics": metrics}  # fmt: skip


def _router_gradient(model) -> dict:
    """experts replay on the first router alone (float64): its gradient against a hand
    computation, plain and through a recompute (Megatron's checkpoint) whose backward runs after
    other ids were installed."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.moe.router import TopKRouter

    router = next(m for m in model.core.modules() if isinstance(m, TopKRouter)).double()
    hook = router.router_replay
    hook.with_weights = False  # experts mode
    g = torch.Generator().manual_seed(11)
    n, e, k, h = 5, router.weight.shape[0], router.topk, router.weight.shape[1]
    x = torch.randn(n, 1, h, generator=g, dtype=torch.float64).requires_grad_()  # [S, b, h] (a checkpoint needs an input with grad)
    c = torch.randn(n, e, generator=g, dtype=torch.float64)  # loss = sum(probs * c)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])  # [n, k] not the router's own choice
    ids[2] = -1  # a token the engine did not route: the router's own top-k

    maps = []

    def loss_of(xx):
        probs, routing_map = router(xx)  # [n, E] each
        maps.append(routing_map)
        return (probs * c).sum()

    grads = []
    for recompute in (False, True):
        router.weight.grad = None
        hook.ids, hook.record = ids, True
        if recompute:
            loss = tensor_parallel.checkpoint(loss_of, False, x)
            hook.ids = torch.zeros_like(ids)  # the next micro-batch's ids: the recompute must not use them
        else:
            loss = loss_of(x)
        loss.backward()
        grads.append(router.weight.grad.clone())
        hook.queue.clear()
    hook.ids = None
    hand = _hand_router_grad(router.weight.detach(), x.detach()[:, 0], ids, c)
    own2 = (x.detach()[2, 0] @ router.weight.detach().t()).topk(k).indices
    expected_map = torch.zeros(n, e, dtype=torch.bool).scatter_(1, torch.where(ids >= 0, ids, own2), True)
    return {"norm": grads[0].norm().item(), "err": (grads[0] - hand).abs().max().item(),
            "recompute_err": (grads[1] - hand).abs().max().item(),
            "maps_replayed": all(torch.equal(m, expected_map) for m in maps)}  # fmt: skip


def _hand_router_grad(w: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """d sum(probs * c) / d w [E, h], probs = softmax over the chosen logits (HF's norm_topk_prob):
    for token t with chosen set S, dL/dz_j = p_j (c_j - sum_{i in S} p_i c_i), j in S, and
    dz_j / dw_j = x_t."""
    grad = torch.zeros_like(w)
    k = ids.shape[1]
    for t in range(x.shape[0]):
        chosen = ids[t] if ids[t, 0] >= 0 else (x[t] @ w.t()).topk(k).indices
        p = torch.softmax(x[t] @ w[chosen].t(), -1)  # [k]
        mean_c = (p * c[t, chosen]).sum()
        for j, e in enumerate(chosen.tolist()):
            grad[e] += p[j] * (c[t, e] - mean_c) * x[t]
    return grad


def test_weights_replay_gives_hf_logprobs(results):
    for r in results:
        assert r["replayed"] <= LOGPROB_TOL, r["replayed"]
        assert r["own"] > PERTURBED_MIN, r["own"]  # the perturbation changed the routing
        assert r["reference_own"] <= LOGPROB_TOL, r["reference_own"]


def test_a_rank_sent_its_replicas_routing_alone_replays_the_same(results):
    """Each DP replica receives the routing of half the rows, and its log-probs are those of the
    whole batch's routing (a row of the other replica would raise in the micro-batch)."""
    assert [r["share_rows"] for r in results] == [len(PROMPTS) // 2] * 2
    assert all(r["share_equal"] for r in results)


def test_agreement_and_separation(results):
    routed_tokens = sum(p + q - 1 for p, q in zip(PROMPTS, RESPONSES))
    for r in results:
        assert r["tokens"] == [routed_tokens] * 3  # summed over both DP replicas, every routed token once
        assert abs(r["agreement"][0] - r["hand_agreement"]) < 1e-12, (r["agreement"], r["hand_agreement"])
        assert 0 < r["agreement"][0] < 1
        m = r["metrics"]
        assert [m[f"actor/moe/routing_agreement/layer{i}"] for i in (0, 2, 3)] == r["agreement"]  # decoder layers
        assert abs(m["actor/moe/routing_agreement"] - sum(r["agreement"]) / 3) < 1e-12
        assert m["actor/moe/logprob_diff_replay"] <= LOGPROB_TOL < PERTURBED_MIN / 10 < m["actor/moe/logprob_diff_no_replay"], m
        assert r["global_replay_instances"] == 0 and r["policy_hooks_kept"] and r["reference_hooks_distinct"]


# case -> (parallel, the Batch's MoE layers of each rank's routers, one list per process): PP stage 0
# holds decoder layers 0-1 (MoE layer 0), stage 1 layers 2-3 (MoE layers 1, 2)
PARALLEL = {"tp2_sp": ({"tp": 2}, [[0, 1, 2]] * 2), "pp2": ({"pp": 2}, [[0], [1, 2]]),
            "tp2_ep2": ({"tp": 2, "ep": 2}, [[0, 1, 2]] * 4)}


@pytest.mark.parametrize("case", list(PARALLEL))
def test_weights_replay_under_tp_and_pp(case, model_path):
    parallel, layers = PARALLEL[case]
    results = run_distributed(_parallel_worker, len(layers), model_path, parallel)
    routed_tokens = sum(p + q - 1 for p, q in zip(PROMPTS, RESPONSES))
    for r, want in zip(results, layers):
        assert r["layers"] == want and r["sequence_parallel"] == ("tp" in parallel), r
        for layout in ("packed", "padded"):
            c = r[layout]
            assert c["replayed"] <= LOGPROB_TOL, (layout, c)
            assert c["own"] > PERTURBED_MIN, (layout, c)
            assert c["tokens"] == [routed_tokens] * 3, (layout, c)  # each routed token once: SP slices, PP stages
            assert c["metrics"]["actor/moe/logprob_diff_replay"] <= LOGPROB_TOL, (layout, c)


def test_experts_replay_router_gradient(results):
    for r in results:
        g = r["gradient"]
        assert g["norm"] > 1e-3 and g["maps_replayed"], g
        assert max(g["err"], g["recompute_err"]) <= GRAD_TOL * g["norm"], g
