"""Load balance of a Qwen3-MoE policy update against HF transformers, in one gloo process.

A tiny Qwen3MoeForCausalLM (2 MoE layers, 4 experts, top-2, fp32) is updated by megarl's
PolicyWorker with zero advantages (the policy loss is 0) and actor.moe aux_loss_coef / z_loss_coef
on, over 2 micro-batches. The reference is the HF model on the same tokens, each micro-batch's
router logits (output_router_logits) turned into Megatron's per-layer losses by hand:
- Switch loss A_l = E / (k T^2) sum_i count_li * prob_sum_li (Megatron's aux_loss), equal to HF's
  load_balancing_loss_func on that layer alone / k; z_l = mean over tokens of logsumexp(logits)^2;
- the router's gradient == d(sum_mb count_mb / N * sum_l (c_aux A_l + c_z z_l)) (each micro-batch
  weighs its share of the loss count N), by autograd through HF;
- the reported expert-load max / mean per layer == a count of HF's top-2 choices; the reported
  aux_loss / z_loss == the mean of A_l / z_l over micro-batches and layers.
"""

from __future__ import annotations

import pytest
import torch
from spawn import run_distributed

SHAPE = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=96, num_experts=4,
             experts_per_token=2, moe_ffn_hidden_size=32)  # fmt: skip
AUX, Z = 0.5, 0.05
TOL = 1e-4  # relative to the largest gradient entry; fp32, two implementations of the same model


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    from megarl.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("moe") / "m", "qwen3_moe", seed=3, **SHAPE))


def _update(rank: int, world: int, path: str, recompute: str):
    from actor_cases import make_batch, pg_loss

    from megarl.actors.policy import PolicyWorker
    from megarl.config.train_sections import ActorConfig

    cfg = ActorConfig(micro_batch_size=3, optimizer={"lr": 1e-9, "clip_grad": 0.0}, recompute=recompute,
                      moe={"aux_loss_coef": AUX, "z_loss_coef": Z})  # fmt: skip
    worker = PolicyWorker(path, cfg, "float32", seed=1)
    import dataclasses

    batch = make_batch(0, rows=6)
    batch = dataclasses.replace(batch, advantages=torch.zeros_like(batch.advantages))  # policy loss 0: only the MoE losses act
    seen = []

    def loss_fn(mb, outputs):
        if outputs.logprobs.requires_grad:  # not the loss count's probe (algos.losses.loss_count)
            seen.append(mb)
        return pg_loss(mb, outputs)

    metrics = worker.update(batch, loss_fn)
    routers = {i: layer.mlp.router.weight for i, layer in enumerate(worker.model.core.decoder.layers)}
    grads = {i: w.main_grad.clone() for i, w in routers.items()}
    worker.close()
    return metrics, grads, seen


def _rows(mb) -> list[torch.Tensor]:
    """Each sample's real tokens (prompt without its left padding, then the response)."""
    out = []
    for i in range(len(mb)):
        prompt = mb.prompt_ids[i][mb.prompt_mask[i].bool()]
        out.append(torch.cat([prompt, mb.response_ids[i, : int(mb.response_lengths[i])]]))
    return out


def _hand_losses(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's Switch loss and z-loss of one layer's router logits [T, E], and its expert counts [E]."""
    t, e = logits.shape
    probs = logits.softmax(-1)  # [T, E]
    counts = torch.zeros(e).scatter_add_(0, probs.topk(k, -1).indices.flatten(), torch.ones(t * k))  # [E]
    aux = e / (k * t * t) * (counts * probs.sum(0)).sum()
    z = torch.logsumexp(logits, -1).square().mean()
    return aux, z, counts


@pytest.mark.parametrize("recompute", ["none", "full"])  # full: each micro-batch's first forward runs without gradients
def test_aux_and_z_losses_reach_the_router_with_their_coefficients_and_the_load_is_counted(moe_dir, recompute):
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    metrics, grads, seen = run_distributed(_update, 1, moe_dir, recompute)[0]
    hf = AutoModelForCausalLM.from_pretrained(moe_dir, torch_dtype=torch.float32)
    k, e = hf.config.num_experts_per_tok, hf.config.num_experts
    total = sum(float(mb.response_mask.sum()) for mb in seen)  # N: the token-mean loss count
    objective, aux_sum, z_sum, load = torch.zeros(()), 0.0, 0.0, torch.zeros(2, e)
    for mb in seen:
        per_row = [hf(input_ids=r[None], output_router_logits=True).router_logits for r in _rows(mb)]
        for layer in range(2):
            logits = torch.cat([rl[layer] for rl in per_row])  # [T_mb, E]
            aux, z, counts = _hand_losses(logits, k)
            hf_aux = load_balancing_loss_func((logits,), e, k)  # HF's definition: f_i sums to k
            torch.testing.assert_close(hf_aux, k * aux, rtol=1e-5, atol=1e-7)
            objective = objective + float(mb.response_mask.sum()) / total * (AUX * aux + Z * z)
            aux_sum, z_sum, load[layer] = aux_sum + aux.item(), z_sum + z.item(), load[layer] + counts
    objective.backward()
    for layer in range(2):
        ref = hf.model.layers[layer].mlp.gate.weight.grad
        err = (grads[layer] - ref).abs().max() / ref.abs().max()
        assert err < TOL, (layer, float(err))
        ratio = float(load[layer].max() / load[layer].mean())
        assert metrics[f"actor/moe/expert_load_max_over_mean/layer{layer}"] == pytest.approx(ratio, rel=1e-6)
    ratios = [metrics[f"actor/moe/expert_load_max_over_mean/layer{i}"] for i in range(2)]
    assert metrics["actor/moe/expert_load_max_over_mean"] == pytest.approx(sum(ratios) / 2)
    assert metrics["actor/moe/aux_loss"] == pytest.approx(aux_sum / (2 * len(seen)), rel=1e-4)
    assert metrics["actor/moe/z_loss"] == pytest.approx(z_sum / (2 * len(seen)), rel=1e-4)


def _staged_update(rank: int, world: int, path: str, pp: int):
    """One update with the auxiliary losses and a non-zero policy loss over 3 micro-batches (1F1B
    at pp 2 runs stage 0's last two backwards in a row): each parameter's gradient by its global
    name (decoder layers by their global number), and the MoE metrics."""
    from actor_cases import make_batch, pg_loss

    from megarl.actors.policy import PolicyWorker
    from megarl.config.train_sections import ActorConfig

    cfg = ActorConfig(micro_batch_size=2, parallel={"pp": pp}, optimizer={"lr": 1e-9, "clip_grad": 0.0},
                      moe={"aux_loss_coef": AUX, "z_loss_coef": Z})  # fmt: skip
    worker = PolicyWorker(path, cfg, "float32", seed=1)
    metrics = worker.update(make_batch(0, rows=6), pg_loss)
    core = worker.model.core
    grads = {}
    for name, p in core.named_parameters():
        if not name.startswith("decoder.layers."):
            grads[name] = p.main_grad.clone()
    for layer in core.decoder.layers:
        for name, p in layer.named_parameters():
            grads[f"layer{layer.layer_number}.{name}"] = p.main_grad.clone()
    worker.close()
    return {k: v for k, v in metrics.items() if k.startswith("actor/moe/")}, grads


def test_aux_losses_weigh_the_same_on_every_pipeline_stage(moe_dir):
    """PP=2 (one MoE layer per stage) against one rank on the same batch: every gradient (the
    policy loss's and the auxiliary losses') and the reported MoE metrics agree."""
    single_metrics, single = run_distributed(_staged_update, 1, moe_dir, 1)[0]
    staged = run_distributed(_staged_update, 2, moe_dir, 2)
    assert single_metrics["actor/moe/aux_loss"] > 0 and single_metrics["actor/moe/z_loss"] > 0
    covered = set()
    for metrics, grads in staged:
        assert metrics == pytest.approx(single_metrics, rel=1e-5), (metrics, single_metrics)
        for name, grad in grads.items():
            covered.add(name)
            err = (grad - single[name]).abs().max() / single[name].abs().max().clamp(min=1e-12)
            assert err < TOL, (name, float(err))
    assert covered == set(single)
    assert {n for n in single if n.startswith("layer1.")} and {n for n in single if n.startswith("layer2.")}


def _hf_grads(rank: int, world: int, path: str, parallel: dict):
    """One update (the auxiliary losses on) in ``parallel``: its MoE metrics, and its gradients after
    Megatron's reductions, under HF names, whole (read through the bridge's export: TP, ETP and EP gathered).
    Every row has an even length: sequence parallelism at TP 2 then adds no padding segment to a
    packed micro-batch, whose tokens the router would route and the auxiliary losses count."""
    from actor_cases import batch_of_lengths, pg_loss

    from megarl.actors.policy import PolicyWorker
    from megarl.config.train_sections import ActorConfig

    cfg = ActorConfig(micro_batch_size=2, parallel=parallel, optimizer={"lr": 1e-9, "clip_grad": 0.0},
                      moe={"aux_loss_coef": AUX, "z_loss_coef": Z})  # fmt: skip
    worker = PolicyWorker(path, cfg, "float32", seed=1)
    metrics = worker.update(batch_of_lengths([4, 3, 5, 2, 6, 3], [6, 5, 7, 4, 8, 9], torch.Generator().manual_seed(0)), pg_loss)
    core = worker.model.core
    saved = [(p, p.data) for p in core.parameters()]
    for p, _ in saved:
        p.data = p.main_grad.view_as(p.data)
    grads = {n: t.clone() for n, t in worker.export_weights(gather_bytes=1 << 20)}
    for p, data in saved:
        p.data = data
    worker.close()
    return {k: v for k, v in metrics.items() if k.startswith("actor/moe/")}, grads


# etp 2: each expert's slices on the TP ranks; ep 2: two whole experts on each.
@pytest.mark.parametrize("experts", [{"etp": 2}, {"ep": 2}], ids=["etp2", "ep2"])
def test_expert_tensor_parallel_training_reduces_gradients_as_one_rank(moe_dir, experts):
    """TP=2 (sequence parallel) with the experts split against one rank: every gradient after DDP's
    and finalize's reductions, experts and router included, the auxiliary losses' shares under
    sequence parallelism too (megatron-core 0.19 multiplies them by the TP group's size, 0.16 does
    not: moe_balance.premultiplied_ranks), and the reported MoE metrics."""
    single_metrics, single = run_distributed(_hf_grads, 1, moe_dir, {})[0]
    assert single_metrics["actor/moe/aux_loss"] > 0 and single_metrics["actor/moe/z_loss"] > 0
    for metrics, grads in run_distributed(_hf_grads, 2, moe_dir, {"tp": 2} | experts):
        assert metrics == pytest.approx(single_metrics, rel=1e-5), (metrics, single_metrics)
        assert set(grads) == set(single) and any(".experts.3." in n for n in grads)
        for name, ref in single.items():
            err = (grads[name] - ref).abs().max() / ref.abs().max().clamp(min=1e-12)
            assert err < TOL, (name, float(err))
