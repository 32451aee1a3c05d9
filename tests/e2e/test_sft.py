"""HF model -> `megarl sft` -> RL -> `megarl generate` -> `megarl evaluate` on the demo task, on CPU:
SFT on the correct reversals must lift the held-out greedy reward from ~0.05 to >= 0.5 before
any RL step, and its model checkpoint must serve RL, generate (through the export) and refuse
to be overwritten."""

from __future__ import annotations

import pytest
from run_helpers import ROOT, read_jsonl, train

from megarl.commands.demo import prepare_demo
from megarl.commands.evaluate import evaluate
from megarl.commands.generate import generate
from megarl.commands.sft import SFTError, run_sft
from megarl.config.loading import load_config

CONFIG = ROOT / "configs" / "tiny_grpo.yaml"


def test_sft_then_rl_generate_and_evaluate(tmp_path):
    model, data = prepare_demo(tmp_path / "demo")
    sft = [f"model.path={model}", f"sft.train_files=[{data / 'train.parquet'}]", f"sft.val_files=[{data / 'val.parquet'}]",
           f"sft.output_dir={tmp_path / 'sft'}", "sft.total_steps=100", "sft.eval_freq=50", "trainer.loggers=[jsonl]"]  # fmt: skip
    checkpoint = run_sft(load_config(CONFIG, sft))
    records = read_jsonl(tmp_path / "sft" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 101))
    assert records[-1]["sft/loss"] < 0.25 * records[0]["sft/loss"]  # the loss falls
    assert [r["step"] for r in records if r.get("sft/val_loss") is not None] == [50, 100]
    assert records[-1]["sft/val_loss"] < records[49]["sft/val_loss"]
    assert records[0]["sft/tokens"] == 64 * 4  # 3 digits + EOS per row, 64 rows a step

    with pytest.raises(SFTError, match="exists"):  # a second run never replaces the model
        run_sft(load_config(CONFIG, sft))

    # RL starts from the checkpoint (policy and reference): the held-out greedy reward before step 1
    _, _, rl = train(tmp_path / "demo", tmp_path / "rl", 1, f"model.path={checkpoint}", "trainer.eval_before_train=true")
    assert rl[0]["step"] == 0 and rl[0]["val/reward/mean"] >= 0.5

    greedy = [f"model.path={checkpoint}", "rollout.n=1", "rollout.sampling.temperature=0"]
    out = generate(CONFIG, greedy, data / "val.parquet", tmp_path / "gen.parquet")  # exports the checkpoint to HF first
    summary = evaluate(out, CONFIG, greedy)["per_data_source"]["all"]
    assert summary["pass@1"] >= 0.5
