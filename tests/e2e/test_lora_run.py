"""A LoRA GRPO run of the demo through Ray (docs/lora.md): adapters train, the base model is the
reference, merged pushes reach the torch engine exactly, checkpoints hold the adapters only and
resume exactly, and a resume on another base model is refused (by the plan; the policy ranks check
the base's fingerprint recorded with the adapters too: tests/unit/megatron_runtime)."""

from __future__ import annotations

import shutil

import pytest
from megatron.core.dist_checkpointing import load_tensors_metadata
from run_helpers import train
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.slow
LORA = ("actor.lora.rank=4", "actor.lora.alpha=8", "trainer.save_freq=3", "trainer.eval_freq=0")


def _comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(("time/", "weight_sync/seconds", "weight_sync/gbps"))}


def test_lora_run_trains_adapters_resumes_exactly_and_refuses_another_base(ray_local, tmp_path_factory):
    root, out = tmp_path_factory.mktemp("lora-demo"), tmp_path_factory.mktemp("lora-run")
    cfg, _, records = train(root, out, 6, *LORA)
    assert cfg.reference_enabled and not cfg.reference_model  # the KL's reference is the base model
    trained = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in trained] == list(range(1, 7))
    assert trained[0]["actor/kl"] == 0.0  # B starts at zero: the first policy is the base model
    assert all(r["actor/kl"] > 0 for r in trained[1:])  # then the adapters move it away from its reference
    assert max(r["weight_sync/logprob_diff"] for r in trained) < 1e-4  # merged weights reach the engine exactly
    step3 = out / "checkpoints" / "step_000003"
    assert (step3 / "policy" / "lora_base.json").is_file()
    saved = load_tensors_metadata(str(step3 / "policy"))  # the adapters and their optimizer state, no base weight
    assert saved and all(k.startswith(("lora.model.layers.", "optimizer.")) for k in saved), sorted(saved)

    # From a copy of step 3's checkpoint, steps 4-6 again: the same updates, the same metrics.
    again = tmp_path_factory.mktemp("lora-resume")
    shutil.copytree(step3, again / "checkpoints" / "step_000003")
    _, _, resumed = train(root, again, 6, *LORA, "trainer.resume=auto")
    # (metrics.jsonl's records up to step 3 come back from the checkpoint's copy of it)
    assert {r["step"]: _comparable(r) for r in resumed} == {r["step"]: _comparable(r) for r in records}

    # The same checkpoint on a base model one weight apart: refused by the plan, before Ray starts.
    other = tmp_path_factory.mktemp("other-base") / "model"
    shutil.copytree(root / "model", other)
    weights = next(other.glob("*.safetensors"))
    tensors = load_file(weights)
    name = next(n for n in tensors if n.endswith("q_proj.weight"))
    tensors[name] = tensors[name] * 1.01
    save_file(tensors, weights, metadata={"format": "pt"})
    third = tmp_path_factory.mktemp("lora-other")
    shutil.copytree(step3, third / "checkpoints" / "step_000003")
    with pytest.raises(Exception, match="holds other weights than model.path"):
        train(root, third, 6, *LORA, "trainer.resume=auto", f"model.path={other}")
