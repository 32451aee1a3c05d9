"""Per-expert LoRA adapters on a Qwen3-MoE model (megarl/models/lora.py) in parallel layouts against one rank.

A tiny Qwen3-MoE (2 layers: layer 0 with 4 experts, top-2; layer 1 dense through
``mlp_only_layers``) gets the same random adapters (B non-zero) on every linear: attention,
every expert's gate/up/down (global expert index) and the dense layer's MLP, set through
``load_peft`` from full tensors. Layouts: EP=2 (2 processes: the expert-parallel group spans the
two data-parallel replicas, each EP rank holds 2 experts), TP=2 x EP=2 with sequence parallelism
(4 processes), PP=2 (the MoE layer on the first stage), and EP=2 with the distributed optimizer.
In each, the log-probs, the adapters' gradients of one backward (Megatron's ``main_grad``: the
experts' reduced over the expert-data-parallel group, gathered over EP; not under the distributed
optimizer, whose buffer each rank holds reduced only in its own slice), the adapters after one
optimizer step and the merged export must equal the single rank's; the merged export bit for bit.
The router decides in both (routing_replay none): the same hidden states give the same top-k.
An adapter-only checkpoint written at EP=2 after one update loads back exactly at EP=2 (adapters
and optimizer state). With the non-distributed optimizer its adapters alone load at EP=1
(Megatron's optimizer is a chain of a dense and an expert optimizer at EP > 1 and one optimizer
at EP=1, and that state is keyed by chain member; the planner refuses such a resume). The
distributed optimizer's fully_reshardable state is keyed per parameter alone: a resume at EP=1
loads it, and its next step equals EP=2's second step.
"""

from __future__ import annotations

import actor_cases as ac
import pytest
import torch
from spawn import run_distributed

from megarl.config.train_sections import ActorConfig, LoRAConfig, OptimizerConfig, ParallelConfig

TEMPERATURE = 0.7
LORA = LoRAConfig(rank=4, alpha=8.0)  # all-linear: attention, experts, the dense MLP
SHAPE = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=96, num_experts=4,
             experts_per_token=2, moe_ffn_hidden_size=32, mlp_only_layers=[1])  # fmt: skip
LOGPROB_TOL = 1e-5  # fp32, absolute
GRAD_ATOL, GRAD_RTOL = 1e-6, 1e-4


def _cfg(ep: int = 1, tp: int = 1, pp: int = 1, distributed: bool = False) -> ActorConfig:
    # fully_reshardable: the distributed optimizer's state per parameter, which loads at another EP
    fmt = "fully_reshardable" if distributed else "dp_reshardable"
    opt = OptimizerConfig(lr=1e-3, distributed=distributed, checkpoint_format=fmt)
    return ActorConfig(parallel=ParallelConfig(tp=tp, pp=pp, ep=ep), optimizer=opt, lora=LORA)


# layout -> (processes, its config, whether it saves a checkpoint); tp2_ep2 runs with sequence
# parallelism (on by default at tp > 1): 4 processes, dp 2, the EP group spans the two replicas
LAYOUTS = {
    "ep2": (2, _cfg(ep=2), True),
    "tp2_ep2_sp": (4, _cfg(ep=2, tp=2), False),
    "pp2": (2, _cfg(pp=2), False),
    "ep2_distributed_optimizer": (2, _cfg(ep=2, distributed=True), True),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from megarl.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("lora_moe") / "m", "qwen3_moe", seed=2, **SHAPE))


def _shapes() -> dict[str, tuple[int, int]]:
    """HF module (under model.layers.{i}.) -> (out, in) of everything LoRA adapts."""
    h, f, fe = SHAPE["hidden_size"], SHAPE["ffn_hidden_size"], SHAPE["moe_ffn_hidden_size"]
    out = {f"{i}.self_attn.{m}": s for i in range(2)
           for m, s in {"q_proj": (h, h), "k_proj": (h // 2, h), "v_proj": (h // 2, h), "o_proj": (h, h)}.items()}  # fmt: skip
    out |= {"1.mlp.gate_proj": (f, h), "1.mlp.up_proj": (f, h), "1.mlp.down_proj": (h, f)}
    for e in range(SHAPE["num_experts"]):
        out |= {f"0.mlp.experts.{e}.gate_proj": (fe, h), f"0.mlp.experts.{e}.up_proj": (fe, h), f"0.mlp.experts.{e}.down_proj": (h, fe)}
    return out


@pytest.fixture(scope="module")
def adapters() -> dict[str, torch.Tensor]:
    """Full PEFT-named adapters: A small uniform, B random (non-zero)."""
    from megarl.models.lora import PEFT_PREFIX

    out, g = {}, torch.Generator().manual_seed(7)
    for module, (rows, cols) in _shapes().items():
        name = f"{PEFT_PREFIX}model.layers.{module}"
        out[f"{name}.lora_A.weight"] = (torch.rand(4, cols, generator=g) - 0.5) / cols**0.5
        out[f"{name}.lora_B.weight"] = torch.randn(rows, 4, generator=g) * 0.1
    return out


def _run(rank: int, world: int, path: str, cfg: ActorConfig, adapters: dict, save_dir: str | None) -> dict:
    """Log-probs (with and without adapters), merged export, adapter gradients, and the adapters
    after one update (``trained``); with ``save_dir`` a checkpoint and its load here."""
    batch = ac.make_batch(0)
    policy, lora, out = ac.lora_policy(path, cfg, adapters, batch, TEMPERATURE)
    out["expert_allreduce"] = sorted({getattr(t, "allreduce", True) for _, _, t, _ in lora.items(experts=True)})
    out["no_experts"] = sorted(lora.peft_tensors(experts=False))
    policy.update(batch, ac.pg_loss)
    out["trained"] = lora.peft_tensors()
    if save_dir is not None:
        policy.save(save_dir)
        out["resumed"] = _loaded(path, cfg, save_dir)
        if cfg.optimizer.distributed:
            policy.update(batch, ac.pg_loss)  # the second step: Adam's moments and step count at work
            out["second"] = lora.peft_tensors()
    policy.close()
    return ac.portable(out)


def _load_only(rank: int, world: int, path: str, load_dir: str, distributed: bool) -> dict:
    """At EP=1 in one rank, from ``load_dir``: the non-distributed optimizer's state does not load
    across EP=1 and EP>1, so the adapters alone; the distributed optimizer's fully_reshardable
    state does, so a resume and its next step."""
    if not distributed:
        return ac.portable({"loaded": _adapters_loaded(path, _cfg(), load_dir)})
    from megarl.actors.policy import PolicyWorker
    from megarl.models.lora import lora_of

    policy = PolicyWorker(path, _cfg(distributed=True), "float32", seed=1)
    policy.load(load_dir)
    lora = lora_of(policy.model.core)
    out = {"loaded": lora.peft_tensors()}
    policy.update(ac.make_batch(0), ac.pg_loss)
    out["second"] = lora.peft_tensors()
    policy.close()
    return ac.portable(out)


def _loaded(path: str, cfg: ActorConfig, checkpoint: str) -> dict[str, torch.Tensor]:
    """The adapters of a fresh policy under ``cfg`` that loaded ``checkpoint``."""
    from megarl.actors.policy import PolicyWorker
    from megarl.models.lora import lora_of

    again = PolicyWorker(path, cfg, "float32", seed=1)
    again.load(checkpoint)
    loaded = lora_of(again.model.core).peft_tensors()
    again.close()
    return loaded


def _adapters_loaded(path: str, cfg: ActorConfig, checkpoint: str) -> dict[str, torch.Tensor]:
    """The adapters of a fresh policy under ``cfg`` that read the checkpoint's adapters alone
    (the optimizer state is Megatron's chain of a dense and an expert optimizer at EP > 1, one
    optimizer at EP=1: it does not load across that change)."""
    from megatron.core import dist_checkpointing

    from megarl.actors.policy import PolicyWorker
    from megarl.megatron_runtime.training import LORA_KEY
    from megarl.models.lora import lora_of

    again = PolicyWorker(path, cfg, "float32", seed=1)
    lora = lora_of(again.model.core)
    lora.load_sharded(dist_checkpointing.load({"model": lora.sharded_state_dict(LORA_KEY)}, checkpoint)["model"], LORA_KEY)
    loaded = lora.peft_tensors()
    again.close()
    return loaded


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(got[name], t), name


@pytest.fixture(scope="module")
def single(model_dir, adapters) -> dict:
    return ac.tensors(run_distributed(_run, 1, model_dir, _cfg(), adapters, None)[0])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_equal_one_rank(model_dir, adapters, single, layout, tmp_path):
    world, cfg, saves = LAYOUTS[layout]
    ckpt = str(tmp_path / "ckpt") if saves else None
    # daemon=False: the dist-checkpoint writer starts processes of its own
    results = [ac.tensors(r) for r in run_distributed(_run, world, model_dir, cfg, adapters, ckpt, daemon=False)]
    assert single["grads"].keys() == {k for k in adapters}  # every adapter, experts by global index
    assert all(k.count(".mlp.experts.") == 0 for k in single["no_experts"]) and single["no_experts"]
    assert (single["logprobs"] - single["base"]).abs().max() > 1e-2  # the adapters change the model
    for out in results:
        if not cfg.optimizer.distributed:  # its gradient buffer is reduce-scattered: each rank's own slice summed
            _assert_close_adapters(out["grads"], single["grads"], nonzero=True)
        _assert_close_adapters(out["trained"], single["trained"])  # one optimizer step
        _assert_equal(out["trained"], results[0]["trained"])  # every rank gathered every adapter
        assert out["optimized_ok"]
        assert out["expert_allreduce"] in ([], [cfg.parallel.ep == 1])  # Megatron's expert gradient path under EP
        if out["logprobs"] is None:  # a PP stage without the last layer: no rows, its own merged weights
            continue
        torch.testing.assert_close(out["logprobs"], single["logprobs"], atol=LOGPROB_TOL, rtol=0)
        torch.testing.assert_close(out["base"], single["base"], atol=LOGPROB_TOL, rtol=0)
        assert out["merged"].keys() == single["merged"].keys()
        for name, weight in single["merged"].items():
            assert torch.equal(out["merged"][name], weight), name
    assert any(out["expert_allreduce"] for out in results)  # a PP stage without experts holds none
    if saves:
        for out in results:
            _assert_equal(out["resumed"], results[0]["trained"])  # saved at EP=2, loaded at EP=2
        at_ep1 = ac.tensors(run_distributed(_load_only, 1, model_dir, ckpt, cfg.optimizer.distributed)[0])
        _assert_equal(at_ep1["loaded"], results[0]["trained"])  # and at EP=1
        if cfg.optimizer.distributed:  # the optimizer state too: the next step equals EP=2's
            _assert_close_adapters(at_ep1["second"], results[0]["second"])
            assert any(not torch.equal(at_ep1["second"][k], t) for k, t in at_ep1["loaded"].items())


def _assert_close_adapters(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], nonzero: bool = False) -> None:
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert not nonzero or t.abs().max() > 0, name
        torch.testing.assert_close(got[name], t, atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=lambda m, n=name: f"{n}: {m}")


def _deepseek_adapters(rank: int, world: int, path: str) -> dict:
    """Attach adapters to the DeepSeek-V3 demo model in one rank: their parameter count for the
    modules MLA has; the error for q_proj (MLA has no linear_qkv)."""
    from test_moe_bridge import _build

    from megarl.models.lora import attach_lora
    from megarl.parallel.groups import init_parallel

    init_parallel(tp=1, pp=1, seed=0)
    out: dict = {}
    for key, modules in (("mla", ["o_proj", "gate_proj", "up_proj", "down_proj"]), ("q", ["q_proj", "o_proj"])):
        _, _, model = _build(path, 1, 1)
        try:
            lora = attach_lora(model, LoRAConfig(rank=4, target_modules=modules), seed=0)
            out[key] = (sum(p.numel() for p in lora.parameters()), sorted({k.split("_", 1)[1] for k in lora.linears}))
        except ValueError as e:
            out[key] = str(e)
    return out


def test_deepseek_v3_adapters_are_what_the_planner_counts(tmp_path):
    """On multi-latent attention LoRA adapts o_proj, the dense MLP and each routed expert (the
    shared expert not), as many parameters as the planner counts (tests/unit/plan/test_lora_plan.py
    by hand); q_proj is refused by name."""
    from megarl.commands.demo import DEMO_DSV3_MODEL
    from megarl.config.architectures import builtin_arch
    from megarl.models.tiny import build_tiny_model
    from megarl.plan.gpu_memory import lora_params

    path = str(build_tiny_model(tmp_path / "dsv3", **DEMO_DSV3_MODEL))
    out = run_distributed(_deepseek_adapters, 1, path)[0]
    count, linears = out["mla"]
    assert count == lora_params(builtin_arch("tiny-dsv3-demo"), 4, ("o_proj", "gate_proj", "up_proj", "down_proj"))
    assert not any("shared" in k for k in linears) and "mlp_linear_fc1" in linears, linears
    assert out["q"].startswith("actor.lora.target_modules: layer 0 has no self_attention.linear_qkv for q_proj"), out["q"]
