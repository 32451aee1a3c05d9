"""`megarl convert` of a LoRA training checkpoint (adapters only, plus policy/lora_base.json).

One GRPO step of the demo with actor.lora (rank 4, alpha 8, all-linear; a large learning rate,
so B is far from zero) run with --in-process, then `megarl convert STEP OUT --in-process`:

- OUT/lora_adapter, loaded by the real ``peft`` onto the HF base (PeftModel.from_pretrained),
  holds exactly the trained adapters under peft's names and gives the log-probs megarl's policy
  gives when it resumes from the checkpoint (fp32, atol 2e-5, as tests/distributed/test_lora.py);
- OUT, the merged model, equals base + alpha/r * B A computed here by the same elementwise
  fp32 formula, bit for bit (torch.equal), every other tensor the base's;
- a LoRA checkpoint whose base model is gone, or whose base is a megarl model checkpoint (no
  PEFT base), is refused in one line before anything is written.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import actor_cases as ac
import pytest
import torch
from run_helpers import TINY, hf_tensors, lora_merged_reference, small_overrides
from spawn import run_distributed

from megarl.commands.outputs import OutputError

TEMPERATURE = 1.0
VOCAB = 14  # token ids of the batches: the demo model's vocabulary
LORA = ("actor.lora.rank=4", "actor.lora.alpha=8", "actor.optimizer.lr=0.05")


def _cli(*args) -> str:
    done = subprocess.run([sys.executable, "-m", "megarl.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(the base model, the step checkpoint, the convert output, what convert printed)."""
    root = tmp_path_factory.mktemp("lora_convert")
    run = small_overrides(root / "demo", root / "run", 1, "cluster.gpus_per_node=1", "trainer.save_freq=1", *LORA)
    _cli("launch", TINY, "--in-process", *run)
    step = root / "run" / "checkpoints" / "step_000001"
    said = _cli("convert", step, root / "hf", "--in-process")
    return root / "demo" / "model", step, root / "hf", said


def _resumed(rank: int, world: int, model: str, step: str) -> dict:
    """megarl's policy resumed from the checkpoint (the run's actor config): log-probs, adapters."""
    from megarl.actors.policy import PolicyWorker
    from megarl.checkpoint.run_record import run_config
    from megarl.checkpoint.verification import verify_checkpoint
    from megarl.models.lora import lora_of

    cfg = run_config(verify_checkpoint(step))
    policy = PolicyWorker(model, cfg.actor, "float32", seed=cfg.trainer.seed)
    policy.load(os.path.join(step, "policy"))
    lora = lora_of(policy.model.core)
    batch = ac.make_batch(0, vocab=VOCAB)
    out = {"logprobs": ac.gathered(policy.compute_logprobs(batch, TEMPERATURE), batch)["logprobs"],
           "adapters": lora.peft_tensors()}  # fmt: skip
    with lora.disabled():
        out["base"] = ac.gathered(policy.compute_logprobs(batch, TEMPERATURE), batch)["logprobs"]
    policy.close()
    return out


def test_peft_loads_the_adapter_and_equals_megarls_policy(converted):
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict

    model, step, out, said = converted
    assert "lora_adapter" in said and "LoRA adapters merged" in said
    adapter = out / "lora_adapter"
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"], config["task_type"]) == (4, 8, "LORA", "CAUSAL_LM")
    assert config["base_model_name_or_path"] == str(model.resolve())
    assert sorted(config["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])

    (megarl,) = run_distributed(_resumed, 1, str(model), str(step))
    peft_model = PeftModel.from_pretrained(ac.hf_model(config["base_model_name_or_path"]), str(adapter))
    loaded = get_peft_model_state_dict(peft_model)  # what peft holds: every file tensor, nothing else
    assert loaded.keys() == hf_tensors(adapter).keys() == megarl["adapters"].keys()
    for name, tensor in megarl["adapters"].items():
        assert torch.equal(loaded[name], tensor), name
    with torch.no_grad():
        logprobs, _ = ac.hf_token_logprobs(peft_model, ac.make_batch(0, vocab=VOCAB), TEMPERATURE)
    torch.testing.assert_close(megarl["logprobs"], logprobs, atol=2e-5, rtol=0)
    assert (megarl["logprobs"] - megarl["base"]).abs().max() > 1e-2  # the trained adapters change the model


def test_merged_model_is_base_plus_scaled_adapters_bit_for_bit(converted):
    model, _, out, _ = converted
    expected, written = lora_merged_reference(model, out / "lora_adapter"), hf_tensors(out)
    assert written.keys() == expected.keys()
    for name, tensor in expected.items():
        assert written[name].dtype == tensor.dtype and torch.equal(written[name], tensor), name
    changed = [n for n, t in hf_tensors(model).items() if not torch.equal(t, written[n])]
    assert len(changed) == 2 * 7  # every adapted linear of both layers, nothing else
    assert json.loads((out / "megarl_export.json").read_text())["verified_parameters"] > 0


def test_a_missing_or_model_checkpoint_base_is_refused(converted, tmp_path):
    from megarl.checkpoint.model_checkpoint import RECORD
    from megarl.commands.conversion import convert_checkpoint

    model, step, _, _ = converted
    moved = model.with_name("moved")
    model.rename(moved)
    try:
        with pytest.raises(OutputError, match=rf"^{step} holds LoRA adapters only, and their base model {model} "
                           r"\(policy/lora_base.json\) is not there: put the base model back there"):  # fmt: skip
            convert_checkpoint(step, tmp_path / "a", in_process=True)
    finally:
        moved.rename(model)
    fake = tmp_path / "base_ckpt"  # a megarl model checkpoint as the base: PEFT cannot name it
    shutil.copytree(model, fake)
    (fake / RECORD).write_text("{}")
    config = tmp_path / "config.yaml"
    config.write_text((step / "config.yaml").read_text().replace(str(model), str(fake)))
    with pytest.raises(OutputError, match=r"is a megarl model checkpoint, which a PEFT adapter cannot name as its base: "
                       r"pass --no-adapter"):  # fmt: skip
        convert_checkpoint(step, tmp_path / "b", config, in_process=True, adapter=None)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
