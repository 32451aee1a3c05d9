"""LoRA adapters on Megatron's parallel linears (megarl/models/lora.py) against one rank and HF PEFT.

The same random adapters (B non-zero, so they change the model) are loaded at TP=1, TP=2 (with
and without sequence parallelism) and PP=2: the log-probs, the adapters' gradients of one
backward, and the merged weights an export yields must equal the single rank's; the single
rank's log-probs must equal HF transformers + the real ``peft`` package with those adapters,
and with the adapters switched off, the base model's. Base weights get no gradient and no
optimizer state. An adapter-only checkpoint saved at TP=2 loads back exactly.
"""

from __future__ import annotations

import actor_cases as ac
import pytest
import torch
from spawn import run_distributed

from megarl.config.train_sections import ActorConfig, LoRAConfig, OptimizerConfig, ParallelConfig

TEMPERATURE = 0.7
LORA = LoRAConfig(rank=4, alpha=8.0)  # all-linear


def _cfg(tp: int = 1, pp: int = 1, sp: bool | None = None) -> ActorConfig:
    opt = OptimizerConfig(lr=1e-3, distributed=False)
    return ActorConfig(parallel=ParallelConfig(tp=tp, pp=pp, sequence_parallel=sp), optimizer=opt, lora=LORA)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megarl.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("lora") / "m", **ac.TINY))


@pytest.fixture(scope="module")
def adapters(model_dir):
    """Full PEFT-named adapters of the tiny model: A as peft draws it, B random (non-zero)."""
    from megarl.models.lora import PEFT_PREFIX

    out, g = {}, torch.Generator().manual_seed(7)
    sizes = {"q_proj": (64, 64), "k_proj": (32, 64), "v_proj": (32, 64), "o_proj": (64, 64),
             "gate_proj": (128, 64), "up_proj": (128, 64), "down_proj": (64, 128)}  # fmt: skip
    for layer in range(ac.TINY["num_layers"]):
        for module, (rows, cols) in sizes.items():
            parent = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            name = f"{PEFT_PREFIX}model.layers.{layer}.{parent}.{module}"
            out[f"{name}.lora_A.weight"] = (torch.rand(4, cols, generator=g) - 0.5) / cols**0.5
            out[f"{name}.lora_B.weight"] = torch.randn(rows, 4, generator=g) * 0.1
    return out


def _lora_run(rank: int, world: int, path: str, cfgs: list[ActorConfig], adapters: dict, save_dir: str | None) -> list[dict]:
    from megarl.actors.policy import PolicyWorker
    from megarl.models.lora import lora_of

    batch, results = ac.make_batch(0), []
    for cfg in cfgs:
        policy, lora, out = ac.lora_policy(path, cfg, adapters, batch, TEMPERATURE)
        out["frozen_ok"] = not [n for n, p in policy.model.core.named_parameters() if p.requires_grad and "lora" not in n]
        if save_dir is not None:
            policy.update(batch, ac.pg_loss)
            trained = lora.peft_tensors()
            policy.save(save_dir)
            again = PolicyWorker(path, cfg, "float32", seed=1)
            again.load(save_dir)
            out["resumed_equal"] = all(torch.equal(trained[k], v) for k, v in lora_of(again.model.core).peft_tensors().items())
            again.close()
            save_dir = None
        policy.close()
        results.append(out)
    return results


def _output(results: list, world: int) -> list[dict]:
    """The run's dicts from the rank that holds the last stage's rows (rank world-1 holds them under PP)."""
    return next(r for r in reversed(results) if r[0]["logprobs"] is not None)


@pytest.fixture(scope="module")
def single(model_dir, adapters):
    return _output(run_distributed(_lora_run, 1, model_dir, [_cfg()], adapters, None), 1)[0]


def test_one_rank_equals_hf_with_peft(model_dir, adapters, single):
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    base = ac.hf_model(model_dir)
    with torch.no_grad():
        base_logprobs, _ = ac.hf_token_logprobs(base, ac.make_batch(0), TEMPERATURE)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    result = set_peft_model_state_dict(peft_model, adapters)
    assert not result.unexpected_keys
    with torch.no_grad():
        lora_logprobs, _ = ac.hf_token_logprobs(peft_model, ac.make_batch(0), TEMPERATURE)
    torch.testing.assert_close(single["logprobs"], lora_logprobs, atol=2e-5, rtol=0)
    torch.testing.assert_close(single["base"], base_logprobs, atol=2e-5, rtol=0)
    assert (single["logprobs"] - single["base"]).abs().max() > 1e-2  # the adapters change the model
    assert single["frozen_ok"] and single["optimized_ok"]


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_layouts_equal_one_rank(model_dir, adapters, single, layout, tmp_path):
    cfgs = [_cfg(tp=2), _cfg(tp=2, sp=False)] if layout == "tp2" else [_cfg(pp=2)]
    save = str(tmp_path / "ckpt") if layout == "tp2" else None
    # daemon=False: the dist-checkpoint writer starts processes of its own
    for out in _output(run_distributed(_lora_run, 2, model_dir, cfgs, adapters, save, daemon=False), 2):
        torch.testing.assert_close(out["logprobs"], single["logprobs"], atol=1e-5, rtol=0)
        torch.testing.assert_close(out["base"], single["base"], atol=1e-5, rtol=0)
        assert out["grads"].keys() == single["grads"].keys()
        for name, grad in single["grads"].items():
            torch.testing.assert_close(out["grads"][name], grad, atol=1e-6, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
        assert out["merged"].keys() == single["merged"].keys()
        for name, weight in single["merged"].items():  # one formula, elementwise: the same bits at any layout
            assert torch.equal(out["merged"][name], weight), name
        assert out["frozen_ok"] and out["optimized_ok"]
        if "resumed_equal" in out:
            assert out["resumed_equal"]
