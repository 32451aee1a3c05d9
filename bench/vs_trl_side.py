"""TRL's side of bench/vs_trl.py: GRPOTrainer on the demo's job, run by the TRL venv's Python.

    <trl venv>/bin/python bench/vs_trl_side.py --job job.json --out run/

``job.json`` (written by vs_trl.py) names the demo model (an HF folder both sides load), the
training prompts in megarl's sampler order for this seed (so step k sees the same prompts as
megarl's step k: TRL's shuffle is off), the held-out prompts, the reward file and the settings.
Writes ``metrics.jsonl``: one line per optimizer step with its phase times (the trainer's own
methods timed: generation, reward, reference log-probs; the update is the rest of the step), and
``eval.jsonl``: the held-out greedy reward at step 0 and every ``eval_every`` steps (its time is
not part of a step's). Imports nothing of megarl but its reward file, loaded by path.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer


def load_reward(path: str):
    spec = importlib.util.spec_from_file_location("bench_reward", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.compute_score


def response_text(tokenizer, ids: list[int]) -> str:
    """What megarl scores: the decoded response, special tokens kept, a final EOS dropped."""
    ids = list(ids)
    while ids and ids[-1] == tokenizer.pad_token_id and tokenizer.pad_token_id != tokenizer.eos_token_id:
        ids.pop()
    if ids and ids[-1] == tokenizer.eos_token_id:
        ids.pop()
    return tokenizer.decode(ids, skip_special_tokens=False)


class Phases:
    """Seconds spent in the wrapped methods since the last reset."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, obj, name: str, phase) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[phase(args) if callable(phase) else phase] += time.perf_counter() - start

        setattr(obj, name, timed)


class StepLog(TrainerCallback):
    """Per optimizer step: its wall time and phases; the held-out reward every ``eval_every``."""

    def __init__(self, out: Path, phases: Phases, evaluate, eval_every: int) -> None:
        self.out, self.phases, self.evaluate, self.eval_every = out, phases, evaluate, eval_every
        self.start = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self._eval(0, kwargs["model"])

    def on_step_begin(self, args, state, control, **kwargs):
        self.phases.seconds.clear()
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        step_s = time.perf_counter() - self.start
        record = {"step": state.global_step, "time/step_s": step_s} | {f"time/{k}_s": v for k, v in self.phases.seconds.items()}
        record["time/update_s"] = step_s - self.phases.seconds.get("generate_and_score", 0.0)
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        if state.global_step % self.eval_every == 0:
            self._eval(state.global_step, kwargs["model"])

    def _eval(self, step: int, model) -> None:
        start = time.perf_counter()
        reward = self.evaluate(model)
        with open(self.out / "eval.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "val/reward/mean": reward, "eval_s": time.perf_counter() - start}) + "\n")


def held_out(tokenizer, rows: list[dict], score, max_new_tokens: int):
    """Greedy responses to the held-out prompts, scored as megarl's validation scores them."""
    texts = [tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]

    @torch.no_grad()
    def evaluate(model) -> float:
        was_training = model.training
        model.eval()
        tokenizer.padding_side = "left"
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
        model.train(was_training)
        scores = []
        for row, ids in zip(rows, out[:, enc["input_ids"].shape[1]:].tolist(), strict=True):
            if tokenizer.eos_token_id in ids:
                ids = ids[: ids.index(tokenizer.eos_token_id) + 1]
            scores.append(score(row["data_source"], response_text(tokenizer, ids), row["ground_truth"]))
        return sum(scores) / len(scores)

    return evaluate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    job = json.loads(Path(args.job).read_text())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(job["threads"])
    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    score = load_reward(job["reward_file"])

    def reward(completion_ids, ground_truth, data_source, **kwargs) -> list[float]:  # kwargs: prompts, completions, ...
        return [score(src, response_text(tokenizer, ids), truth) for src, ids, truth in zip(data_source, completion_ids, ground_truth, strict=True)]

    s = job["settings"]
    config = GRPOConfig(
        output_dir=str(out / "trainer"), seed=job["seed"], data_seed=job["seed"], use_cpu=True, bf16=False, fp16=False,
        max_steps=job["steps"], learning_rate=s["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=s["weight_decay"],
        adam_beta1=s["betas"][0], adam_beta2=s["betas"][1], adam_epsilon=s["eps"], max_grad_norm=s["clip_grad"],
        per_device_train_batch_size=s["micro_batch"], gradient_accumulation_steps=s["prompts_per_step"] * s["n"] // s["micro_batch"],
        num_generations=s["n"], max_completion_length=s["max_new_tokens"], temperature=s["temperature"], top_p=1.0, top_k=0,
        beta=s["kl_coef"], epsilon=s["clip"], num_iterations=1, loss_type="dapo", scale_rewards="group",
        shuffle_dataset=False, report_to="none", save_strategy="no", logging_steps=10**9, disable_tqdm=True,
        dataloader_num_workers=0,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
    train = Dataset.from_list(job["train_rows"])
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=train, processing_class=tokenizer)
    phases = Phases()
    phases.wrap(trainer, "_generate", "generate")
    phases.wrap(trainer, "_calculate_rewards", "reward")
    phases.wrap(trainer, "_generate_and_score_completions", "generate_and_score")
    phases.wrap(trainer, "_get_per_token_logps_and_entropies",
                lambda a: "ref_logprobs" if a and a[0] is trainer.ref_model else "logprobs")
    evaluate = held_out(tokenizer, job["val_rows"], score, s["max_new_tokens"])
    trainer.add_callback(StepLog(out, phases, evaluate, job["eval_every"]))
    trainer.train()


if __name__ == "__main__":
    main()
