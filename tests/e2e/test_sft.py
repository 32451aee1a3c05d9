"""HF model -> `megarl sft` -> RL -> `megarl generate` -> `megarl evaluate` on the demo task, on CPU:
SFT on the correct reversals must lift the held-out greedy reward from ~0.05 to >= 0.5 before
any RL step, and its model checkpoint must serve RL, generate (through the export) and refuse
to be overwritten."""

from __future__ import annotations

import logging

import pytest
from run_helpers import ROOT, read_jsonl, train

from megarl.commands.conversion import export_model_checkpoint
from megarl.commands.demo import prepare_demo
from megarl.commands.evaluate import evaluate
from megarl.commands.generate import generate
from megarl.commands.sft import SFTError, run_sft
from megarl.config.loading import load_config

CONFIG = ROOT / "configs" / "tiny_grpo.yaml"


def _hf_nll(model_dir, val_file) -> float:
    """Mean NLL of the trained tokens of ``val_file`` under the HF model (an independent forward)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.data.prompts import PromptBuilder
    from megarl.data.sft import read_sft_file
    from megarl.engines.base import eos_token_ids

    tok = AutoTokenizer.from_pretrained(model_dir)
    examples = read_sft_file(val_file, label="val", builder=PromptBuilder(tok, max_prompt_length=64),
                             eos_id=eos_token_ids(model_dir, tok)[0], response_key="reward_model.ground_truth")  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    total, count = 0.0, 0
    with torch.no_grad():
        for e in examples:
            ids = torch.tensor([e.prompt_ids + e.response_ids])  # [1, T]
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)  # [T-1, V]
            targets = ids[0, 1:]
            token_logp = logp[torch.arange(len(targets)), targets][len(e.prompt_ids) - 1 :]  # the response tokens
            mask = torch.tensor(e.loss_mask, dtype=torch.float32)
            total -= float((token_logp * mask).sum())
            count += int(mask.sum())
    return total / count


def test_sft_then_rl_generate_and_evaluate(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO)  # as the CLI sets it: the driver's log holds its INFO lines
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
    assert "INFO megarl.commands.sft: sft: 800 training rows" in (tmp_path / "sft" / "logs" / "driver.log").read_text()

    with pytest.raises(SFTError, match="exists"):  # a second run never replaces the model
        run_sft(load_config(CONFIG, sft))

    # `megarl convert` exports it; transformers' NLL of the held-out answers equals sft/val_loss
    hf = export_model_checkpoint(checkpoint, tmp_path / "hf")
    assert records[-1]["sft/val_loss"] == pytest.approx(_hf_nll(hf, data / "val.parquet"), rel=1e-4)

    # RL starts from the checkpoint (policy and reference): the held-out greedy reward before step 1
    _, _, rl = train(tmp_path / "demo", tmp_path / "rl", 1, f"model.path={checkpoint}", "trainer.eval_before_train=true")
    assert rl[0]["step"] == 0 and rl[0]["val/reward/mean"] >= 0.5
    into_rl = [a for a in sft if not a.startswith("sft.output_dir=")] + [f"sft.output_dir={tmp_path / 'rl'}"]
    before = (tmp_path / "rl" / "metrics.jsonl").read_text()
    with pytest.raises(SFTError, match=r"holds an RL run \(step_000001 in its checkpoints/\); give megarl sft a folder"):
        run_sft(load_config(CONFIG, into_rl))
    assert (tmp_path / "rl" / "metrics.jsonl").read_text() == before and not (tmp_path / "rl" / "model").exists()

    greedy = [f"model.path={checkpoint}", "rollout.n=1", "rollout.sampling.temperature=0"]
    out = generate(CONFIG, greedy, data / "val.parquet", tmp_path / "gen.parquet")  # exports the checkpoint to HF first
    summary = evaluate(out, CONFIG, greedy)["per_data_source"]["all"]
    assert summary["pass@1"] >= 0.5

    # Generate from the RL run's step checkpoint, somewhere the config's relative model.path
    # (outputs/demo/model) is not: the run's own model gives the tokenizer, as convert finds it.
    import pyarrow.parquet as pq

    monkeypatch.chdir(tmp_path)
    pq.write_table(pq.read_table(data / "val.parquet").slice(0, 16), tmp_path / "val16.parquet")
    step = tmp_path / "rl" / "checkpoints" / "step_000001"
    from_rl = generate(CONFIG, greedy[1:], tmp_path / "val16.parquet", tmp_path / "rl-gen.parquet", model=str(step))
    # The step's own model answers: its greedy answers are the ones the RL run logged for its
    # step-1 validation (the first held-out rows), whatever one RL step did to the SFT model.
    logged = [(r["ground_truth"], r["response"]) for r in read_jsonl(tmp_path / "rl" / "samples" / "step_000001.jsonl")]
    answers = [(r["reward_model"]["ground_truth"], r["responses"][0]) for r in pq.read_table(from_rl).to_pylist()]
    assert len(logged) == 4 and answers[: len(logged)] == logged
    assert evaluate(from_rl, CONFIG, greedy[1:])["per_data_source"]["all"]["responses"] == 16


def test_a_step_of_more_rows_than_the_training_file_has_is_refused(tmp_path):
    import pyarrow.parquet as pq

    model, data = prepare_demo(tmp_path / "demo")
    for rows, fix in ((1, "give at least 2 training rows"), (5, "set sft.batch_size to at most 4")):
        pq.write_table(pq.read_table(data / "train.parquet").slice(0, rows), tmp_path / "few.parquet")
        cfg = load_config(CONFIG, [f"model.path={model}", f"sft.train_files=[{tmp_path / 'few.parquet'}]", "sft.val_files=[]",
                                   f"sft.output_dir={tmp_path / 'sft'}"])  # fmt: skip
        with pytest.raises(SFTError, match=rf"^sft\.batch_size \(64\) is more than the {rows} training row\(s\): a step "
                           rf"would hold rows twice; {fix}"):
            run_sft(cfg)
        assert not (tmp_path / "sft").exists()  # refused before anything is written


def test_sft_at_tp2_dp2_with_an_odd_held_out_set(tmp_path):
    # TP=2 x DP=2 (4 processes); 33 held-out rows: the last chunk is padded to the DP size with
    # masked copies, which must not change the loss transformers computes on the 33 rows.
    import pyarrow.parquet as pq

    from megarl.checkpoint.model_checkpoint import read_record

    model, data = prepare_demo(tmp_path / "demo")
    pq.write_table(pq.read_table(data / "val.parquet").slice(0, 33), tmp_path / "val33.parquet")
    sft = [f"model.path={model}", f"sft.train_files=[{data / 'train.parquet'}]", f"sft.val_files=[{tmp_path / 'val33.parquet'}]",
           f"sft.output_dir={tmp_path / 'sft'}", "sft.total_steps=3", "actor.parallel.tp=2", "cluster.gpus_per_node=4",
           "trainer.loggers=[jsonl]"]  # fmt: skip
    checkpoint = run_sft(load_config(CONFIG, sft))
    assert read_record(checkpoint)["tp"] == 2
    last = read_jsonl(tmp_path / "sft" / "metrics.jsonl")[-1]
    hf = export_model_checkpoint(checkpoint, tmp_path / "hf", tp=1, pp=1)
    assert last["sft/val_loss"] == pytest.approx(_hf_nll(hf, tmp_path / "val33.parquet"), rel=1e-4)


def _sft_process(tmp_path, name: str, *extra: str):
    import subprocess
    import sys

    model, data = prepare_demo(tmp_path / "demo")
    out = tmp_path / name
    args = [sys.executable, "-m", "megarl.cli", "sft", str(CONFIG), f"model.path={model}",
            f"sft.train_files=[{data / 'train.parquet'}]", "sft.val_files=[]", f"sft.output_dir={out}", "trainer.loggers=[jsonl]",
            *extra]  # fmt: skip
    log = (tmp_path / f"{name}.log").open("w")
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), out, tmp_path / f"{name}.log"


def _wait_for(condition, proc, log, what: str, seconds: float = 300) -> None:
    import time

    deadline = time.monotonic() + seconds
    while not condition():
        assert proc.poll() is None, f"ended before {what}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {seconds} s"
        time.sleep(0.05)


def test_sigterm_while_starting_and_after_a_step(tmp_path):
    """SIGTERM (what Slurm sends) to the driver: while the workers start, exit 143 with nothing
    written; after a step, the step ends, the weights so far are written and verified, exit 143."""
    import signal

    from megarl.checkpoint.model_checkpoint import read_record

    proc, out, log = _sft_process(tmp_path, "starting", "sft.total_steps=1000")
    _wait_for(lambda: "training rows" in log.read_text(), proc, log, "the start")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143, log.read_text()[-3000:]
    assert "stopped by SIGTERM while starting; nothing was trained or written" in log.read_text()
    assert not (out / "model").exists()

    proc, out, log = _sft_process(tmp_path, "stepping", "sft.total_steps=1000")
    metrics = out / "metrics.jsonl"
    _wait_for(lambda: metrics.is_file() and metrics.read_text().count("\n") >= 1, proc, log, "a step")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=300) == 143, log.read_text()[-3000:]
    text = log.read_text()
    assert "stopped by SIGTERM after step" in text and "of 1000" in text, text[-3000:]
    assert read_record(out / "model")["verified_parameters"] > 0


def test_sft_with_lora_writes_the_merged_model_and_a_peft_adapter(tmp_path):
    # actor.lora.rank=8: only the adapters train; <output_dir>/model is the merged model as a
    # plain model checkpoint (no adapter keys: RL loads it as any model) and lora_adapter/ the
    # adapters, which peft loads onto model.path. In process (one rank), 3 steps.
    import json
    import os
    import subprocess
    import sys

    import torch
    from peft import PeftModel
    from run_helpers import hf_tensors, lora_merged_reference
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForCausalLM

    model, data = prepare_demo(tmp_path / "demo")
    out = tmp_path / "sft"
    env, said = {**os.environ, "OMP_NUM_THREADS": "1"}, []
    for args in (["sft", str(CONFIG), f"model.path={model}", f"sft.train_files=[{data / 'train.parquet'}]", "sft.val_files=[]",
                  f"sft.output_dir={out}", "sft.total_steps=3", "actor.lora.rank=8", "actor.optimizer.lr=0.01",
                  "cluster.gpus_per_node=1", "trainer.loggers=[jsonl]", "--in-process"],
                 ["convert", str(out / "model"), str(tmp_path / "hf"), "--in-process"]):  # fmt: skip
        done = subprocess.run([sys.executable, "-m", "megarl.cli", *args], capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        said.append(done.stdout)
    assert f"wrote {out / 'lora_adapter'}: the LoRA adapters as an HF PEFT adapter of {model}" in said[0]
    keys = FileSystemReader(str(out / "model" / "megatron")).read_metadata().state_dict_metadata
    assert keys and not [k for k in keys if "lora" in k]
    config = json.loads((out / "lora_adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (8, 16, str(model.absolute()))

    expected, merged = lora_merged_reference(model, out / "lora_adapter"), hf_tensors(tmp_path / "hf")
    assert merged.keys() == expected.keys()
    for name, tensor in expected.items():  # adapted weights merged bit for bit, every other the base's (frozen)
        assert torch.equal(merged[name], tensor), name
    assert sum(not torch.equal(t, merged[n]) for n, t in hf_tensors(model).items()) == 2 * 7  # the adapters trained

    ids = torch.tensor([[1, 5, 7, 9, 3, 2, 4]])
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), out / "lora_adapter")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(peft_model(ids).logits, hf(ids).logits, atol=1e-5, rtol=0)
