"""DeepSeek-V3's aux-loss-free balancing in megarl's policy update, on 2 data-parallel gloo ranks.

The tiny Qwen3-MoE (2 MoE layers, 4 experts, top-2) is built by megarl's PolicyWorker with its
Megatron config switched to a DeepSeek-style router (sigmoid scores, an expert bias moved at
rate RATE, 2 expert groups of which 1 is picked per token): until the DeepSeek-V3 bridge exists,
no shipped bridge builds that router. Each rank counts, in a hook of its own, the experts its
training forwards routed to; the test sums them over the ranks and computes the new bias by
hand: bias + RATE x sign(mean load - load_e), per layer, once per optimizer step.
"""

from __future__ import annotations

import dataclasses
import multiprocessing

import pytest
import torch
from spawn import run_distributed

SHAPE = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=96, num_experts=4,
             experts_per_token=2, moe_ffn_hidden_size=32)  # fmt: skip
RATE = 0.01


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    from megarl.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("moe") / "m", "qwen3_moe", seed=3, **SHAPE))


def _deepseek_router(bridge_cls) -> None:
    """The bridge's Megatron config with DeepSeek-V3's router (in this process only)."""
    plain = bridge_cls.transformer_config

    def transformer_config(self, *args, **kwargs):
        tcfg = plain(self, *args, **kwargs)
        return dataclasses.replace(tcfg, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                                   moe_router_bias_update_rate=RATE, moe_router_num_groups=2, moe_router_group_topk=1,
                                   moe_router_topk_scaling_factor=2.5)  # fmt: skip

    bridge_cls.transformer_config = transformer_config


def _biases(worker) -> torch.Tensor:
    return torch.stack([layer.mlp.router.expert_bias.clone() for layer in worker.model.core.decoder.layers])  # [L, E]


def _train_and_resume(rank: int, world: int, path: str, ckpt: str):
    import torch.distributed as dist
    from actor_cases import make_batch, pg_loss

    from megarl.actors.policy import PolicyWorker
    from megarl.config.train_sections import ActorConfig
    from megarl.models.qwen3_moe import Qwen3MoeBridge

    # Megatron's checkpoint writer starts a multiprocessing Manager, which the spawn helper's
    # daemonic ranks may not (torchrun / Ray ranks are not daemonic): adapts the harness only.
    multiprocessing.current_process()._config["daemon"] = False
    _deepseek_router(Qwen3MoeBridge)
    cfg = ActorConfig(micro_batch_size=1, optimizer={"lr": 1e-3, "clip_grad": 0.0})
    worker = PolicyWorker(path, cfg, "float32", seed=1)
    routers = [layer.mlp.router for layer in worker.model.core.decoder.layers]
    counted = torch.zeros(2, 2, 4)  # [step, layer, expert] the training forwards' routing, this rank
    step = [0]

    def count(router, inputs, output):
        if torch.is_grad_enabled():  # the training forwards (the log-prob pass runs without gradients)
            counted[step[0], router.layer_number - 1] += output[1].sum(0)

    for router in routers:
        router.register_forward_hook(count)
    before = _biases(worker)
    batch = make_batch(10, rows=8)  # the step's batch, as every rank is handed it
    worker.compute_logprobs(batch)  # the old-log-prob forward: no counts, no move
    after_logprobs = _biases(worker), torch.stack([r.local_tokens_per_expert.clone() for r in routers])
    # two optimizer steps of 4 rows: 2 per rank, 2 micro-batches of 1 row each
    original = worker.trainer._step
    biases_after = []

    def stepped(*args, **kwargs):
        out = original(*args, **kwargs)
        biases_after.append(_biases(worker))
        step[0] += 1
        return out

    worker.trainer._step = stepped
    metrics = worker.update(batch, pg_loss, mini_batch_size=4)
    grads = [r.expert_bias.grad for r in routers] + [r.expert_bias.requires_grad for r in routers]
    in_optimizer = any(p is r.expert_bias for g in worker.trainer.optimizer.param_groups for p in g["params"] for r in routers)
    dist.all_reduce(counted)  # the test's own sum over the DP ranks
    worker.save(ckpt)
    saved = _biases(worker)
    for r in routers:
        r.expert_bias.fill_(7.0)
    worker.load(ckpt)
    return dict(before=before, after_logprobs=after_logprobs, counted=counted, biases=biases_after, metrics=metrics,
                grads=grads, in_optimizer=in_optimizer, saved=saved, loaded=_biases(worker))  # fmt: skip


def test_the_bias_moves_by_the_reduced_load_once_per_step_outside_the_optimizer_and_resumes(moe_dir, tmp_path):
    results = run_distributed(_train_and_resume, 2, moe_dir, str(tmp_path / "ckpt"))
    r0, r1 = results
    assert torch.equal(r0["before"], torch.zeros(2, 4))
    bias, tokens = r0["after_logprobs"]
    assert torch.equal(bias, r0["before"]) and torch.equal(tokens, torch.zeros(2, 4))  # forward-only: untouched
    assert torch.equal(r0["counted"], r1["counted"])
    expected = r0["before"].double()
    assert len(r0["biases"]) == 2
    for step in range(2):
        load = r0["counted"][step].double()  # [L, E] both ranks' tokens of this optimizer step
        assert load.sum() > 0
        expected = expected + RATE * torch.sign(load.mean(-1, keepdim=True) - load)  # by hand
        assert torch.allclose(r0["biases"][step].double(), expected, rtol=0, atol=1e-7), step
        assert torch.equal(r0["biases"][step], r1["biases"][step])  # identical on both DP ranks
    assert expected.abs().max() > 0  # the load was not even: the bias moved
    final = r0["biases"][-1]
    for layer in range(2):
        assert r0["metrics"][f"actor/moe/expert_bias_abs_max/layer{layer}"] == pytest.approx(float(final[layer].abs().max()))
    assert r0["metrics"]["actor/moe/expert_bias_abs_max"] == pytest.approx(float(final.abs().max()))
    assert r0["grads"] == [None, None, False, False] and not r0["in_optimizer"]  # no gradient, not Adam's
    assert torch.equal(r0["saved"], final) and torch.equal(r0["loaded"], final)  # the resume restores it exactly
