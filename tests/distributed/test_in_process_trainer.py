"""The whole RL step without Ray: every role in one process through the in-process worker
group (what a one-GPU box runs under torchrun), on the demo's tiny model and task; any import of
Ray on that path fails the test, as it would there.

One spawned process (a world of one) runs several configurations one after another, each
built by the real ``build_trainer(..., in_process=True)`` and trained for two steps. The tests
check which phase implementations the build picked (skipped old log-probs when strictly
on-policy, the critic for GAE, the greedy baseline for ReMax, dynamic sampling for DAPO, the
policy waiting out the critic's warm-up) and what the steps logged.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from spawn import run_distributed

ROOT = Path(__file__).resolve().parents[2]
PHASES = ("old_logprobs", "reference", "critic", "collector", "baseline", "generate")

CASES = {
    "grpo": (),
    "ppo": ("algorithm.estimator=gae", "algorithm.lam=0.95", "actor.ppo_epochs=2", "algorithm.kl.use_in_reward=true",
            "critic.mini_batch_size=32", "critic.micro_batch_size=16", "critic.optimizer.lr=1e-3",
            "actor.recompute=auto", "critic.recompute=auto"),  # the plan resolves them; the run builds with that
    "warmup": ("algorithm.estimator=gae", "algorithm.kl.use_in_loss=false", "critic.mini_batch_size=32",
               "critic.micro_batch_size=16", "trainer.critic_warmup_steps=1"),
    "remax": ("algorithm.estimator=remax",),
    # The engines' log-probs as the old ones, over two epochs: no old-log-prob forward.
    "engine_old": ("algorithm.old_logprobs=engine", "actor.ppo_epochs=2", "algorithm.kl.use_in_reward=true"),
    "dapo": ("algorithm.dynamic_sampling.enabled=true", "algorithm.dynamic_sampling.max_rounds=2"),
    "adaptive_kl": ("algorithm.kl.use_in_reward=true", "algorithm.kl.controller=adaptive", "algorithm.kl.coef=0.05"),
    # The documented extension examples (docs/examples/my_extensions.py), named by import path.
    # verl's features: shuffled mini-batches over two epochs, no EOS, sampled validation, the rollout dump.
    "verl": ("actor.shuffle=true", "actor.ppo_epochs=2", "actor.mini_batch_size=16", "rollout.sampling.ignore_eos=true",
             "rollout.val.greedy=false", "rollout.val.temperature=1.0", "rollout.val.n=2",
             "trainer.rollout_data_dir={out}/rollouts"),
    # reward.combine: the rule, a tiny classifier reward model and the demo's model as an LLM judge
    # (in this process: its outputs are digits, which the number parser reads).
    "combine": ("reward.combine={reverse_digits: {reverse_digits: 1.0, model: 0.1, judge: 0.01}}",
                "reward.model.path={rm}", "reward.judge.model={demo}/model", "reward.judge.prompt_template={judge_template}",
                "reward.judge.parser=number", "reward.judge.max_new_tokens=3"),
    "extensions": ("algorithm.estimator=my_extensions:centered_score", "algorithm.policy_loss=my_extensions:unclipped_ratio",
                   "rollout.generate_function=my_extensions:generate_with_prefix"),
}  # fmt: skip


def _overrides(root: Path, out: Path, extra: tuple[str, ...]) -> list[str]:
    from megarl.commands.demo import prepare_demo

    model, data = prepare_demo(root)
    return [
        f"model.path={model}", f"data.train_files=[{data / 'train.parquet'}]", f"data.val_files=[{data / 'val.parquet'}]",
        f"trainer.output_dir={out}", "trainer.total_steps=2", "trainer.eval_before_train=false", "trainer.eval_freq=2",
        "trainer.save_freq=0", "trainer.loggers=[jsonl]", "cluster.gpus_per_node=1", "data.prompts_per_step=8",
        "rollout.n=4", "actor.mini_batch_size=32", "actor.micro_batch_size=16", "reward.workers=1",
        "rollout.weight_sync.check_logprobs_every=1", *extra,
    ]  # fmt: skip


def _run_cases(rank: int, world: int, root: str) -> dict:
    import os
    import sys

    import yaml

    # No Ray: a one-GPU box runs this under torchrun with Ray not installed. None in sys.modules
    # makes every `import ray` of the run fail, as there.
    assert "ray" not in sys.modules, "something imported Ray before the in-process run"
    sys.modules["ray"] = None  # type: ignore[assignment]
    from megarl.config.loading import load_config
    from megarl.plan.planner import make_plan
    from megarl.trainer.build import build_trainer, shutdown

    # Where the extension examples live, as a user puts their own code: on PYTHONPATH, which the
    # preflight's child process (and Ray's workers) inherit; sys.path for this process.
    examples = str(ROOT / "docs" / "examples")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (examples, os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, examples)
    results = {}
    places = _reward_roles(Path(root))
    for name, extra in CASES.items():
        out = Path(root) / name
        for key, value in {**places, "out": str(out)}.items():
            extra = tuple(e.replace("{" + key + "}", value) for e in extra)
        cfg = load_config(ROOT / "configs" / "tiny_grpo.yaml", _overrides(Path(root) / "demo", out, extra))
        trainer = build_trainer(cfg, make_plan(cfg, check_files=True, in_process=True), in_process=True)
        try:
            trainer.fit()
            phases = {p: _name(getattr(trainer.parts.rollouts if p == "collector" else trainer.parts, p)) for p in PHASES}
        finally:
            shutdown(trainer)
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        saved = yaml.safe_load((out / "config.yaml").read_text())
        dumped = {f.name: [json.loads(line) for line in f.read_text().splitlines()] for f in (out / "rollouts").glob("*")}
        results[name] = {"phases": phases, "records": records, "recompute": [saved[s]["recompute"] for s in ("actor", "critic")],
                         "rollouts": dumped}  # fmt: skip
    return results


def _reward_roles(root: Path) -> dict[str, str]:
    """The combine case's reward model (a tiny random classifier with the demo's tokenizer) and judge template."""
    from megarl.commands.demo import prepare_demo
    from megarl.models.tiny import build_tiny_reward_model

    model, _ = prepare_demo(root / "demo")
    build_tiny_reward_model(root / "rm", model, max_position_embeddings=64)
    (root / "judge.txt").write_text("{prompt}{response}")
    return {"rm": str(root / "rm"), "demo": str(root / "demo"), "judge_template": str(root / "judge.txt")}


def _name(part: object) -> str:
    """A phase object's class, or a function's qualified name (the generate function)."""
    return f"{part.__module__}.{part.__name__}" if callable(part) and hasattr(part, "__name__") else type(part).__name__


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    # Not a daemon: the trainer starts its reward worker pool.
    return run_distributed(_run_cases, 1, str(tmp_path_factory.mktemp("in_process")), timeout_s=900, daemon=False)[0]


def test_grpo_skips_the_old_logprob_forward_and_keeps_engine_and_trainer_equal(runs):
    grpo = runs["grpo"]
    # KL in the loss only: the update computes the reference's log-probs on its micro-batches.
    assert grpo["phases"] == {"old_logprobs": "Skip", "reference": "Skip", "critic": "Skip",
                              "collector": "PlainCollector", "baseline": "NoBaseline",
                              "generate": "AgentRollout"}  # fmt: skip
    assert [r["step"] for r in grpo["records"]] == [1, 2]
    for record in grpo["records"]:
        assert record["weight_sync/logprob_diff"] <= 1e-5  # fp32: the push is exact
        assert 0.0 <= record["reward/mean"] <= 1.0 and math.isfinite(record["actor/kl"])
        assert record["rollout/logprob_mismatch"] <= 1e-5
    assert "val/reward/mean" in grpo["records"][-1]


def test_ppo_runs_the_critic_and_the_old_logprob_forward(runs):
    ppo = runs["ppo"]
    assert ppo["recompute"] == ["none", "none"]  # auto, as the CPU plan resolved it
    assert ppo["phases"]["old_logprobs"] == "OldLogprobs" and ppo["phases"]["critic"] == "CriticPhase"
    for record in ppo["records"]:
        assert math.isfinite(record["critic/loss"]) and "reward/kl" in record
        assert record["actor/optimizer_steps"] == 2  # two epochs over one mini-batch


def test_engine_old_logprobs_train_two_epochs_without_the_old_logprob_forward(runs):
    run = runs["engine_old"]
    assert run["phases"]["old_logprobs"] == "EngineOldLogprobs"
    for record in run["records"]:
        assert record["actor/optimizer_steps"] == 2 and math.isfinite(record["actor/loss"]) and "reward/kl" in record
        assert record["time/old_logprobs_s"] < 0.01  # no forward: the engine's tensor is taken as it is
        assert record["rollout/logprob_mismatch"] > 0  # current vs engine: the second epoch has moved


def test_critic_warmup_skips_the_policy_update(runs):
    first, second = runs["warmup"]["records"]
    assert "actor/loss" not in first and "critic/loss" in first
    assert "actor/loss" in second
    assert second["actor/kl"] is None  # no reference: null in the log, not a made-up number


def test_remax_scores_a_greedy_baseline(runs):
    assert runs["remax"]["phases"]["baseline"] == "GreedyBaseline"
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in runs["remax"]["records"])


def test_dapo_collects_over_at_most_max_rounds(runs):
    assert runs["dapo"]["phases"]["collector"] == "DynamicSamplingCollector"
    assert all(1 <= r["dynamic_sampling/rounds"] <= 2 for r in runs["dapo"]["records"])


def test_adaptive_kl_moves_its_coefficient(runs):
    first, second = runs["adaptive_kl"]["records"]
    assert first["reward/kl_coef"] > 0 and second["reward/kl_coef"] != first["reward/kl_coef"]


def test_verls_features_train_and_dump_each_steps_rollouts(runs):
    verl = runs["verl"]
    assert [r["step"] for r in verl["records"]] == [1, 2]
    for record in verl["records"]:
        assert record["actor/optimizer_steps"] == 4  # two epochs of two shuffled mini-batches
        assert record["response/truncated_frac"] == 1.0  # ignore_eos: every response runs to max_new_tokens
    assert "val/reward/mean" in verl["records"][-1]
    assert sorted(verl["rollouts"]) == ["1.jsonl", "2.jsonl"]
    rows = verl["rollouts"]["2.jsonl"]
    assert len(rows) == 32 and {r["step"] for r in rows} == {2}  # 8 prompts x 4 samples
    assert {"input", "output", "gts", "score", "data_source", "advantage"} <= set(rows[0])


def test_combined_rewards_log_each_component(runs):
    """reward.combine: the rule, the reward model and the judge each logged as reward/<component>; the
    judge's failures counted (its garbage outputs included), never silent."""
    records = runs["combine"]["records"]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        for key in ("reward/reverse_digits", "reward/model", "reward/judge", "reward/judge_errors", "reward/judge_timeouts"):
            assert math.isfinite(record[key]), key
        assert 0.0 <= record["reward/reverse_digits"] <= 1.0 and record["reward/judge_timeouts"] == 0
        assert math.isfinite(record["reward/mean"]) and math.isfinite(record["actor/loss"])
    for key in ("val/reward/reverse_digits", "val/reward/model", "val/reward/judge", "val/reverse_digits/reward/judge"):
        assert math.isfinite(records[-1][key]), key  # validation reports the components as evaluate does


def test_user_functions_named_by_import_path_train(runs):
    assert runs["extensions"]["phases"]["generate"] == "my_extensions.generate_with_prefix"
    records = runs["extensions"]["records"]
    assert [r["step"] for r in records] == [1, 2]
    assert all(math.isfinite(r["actor/loss"]) and r["actor/clip_frac"] == 0 for r in records)  # unclipped


def _sft_in_process(rank: int, world: int, root: str) -> dict:
    import sys

    assert "ray" not in sys.modules, "something imported Ray before the in-process run"
    sys.modules["ray"] = None  # type: ignore[assignment]  # as on a box without Ray
    from megarl.commands.demo import prepare_demo
    from megarl.commands.sft import run_sft
    from megarl.config.loading import load_config

    model, data = prepare_demo(Path(root) / "demo")
    out = Path(root) / "sft"
    overrides = [f"model.path={model}", f"sft.train_files=[{data / 'train.parquet'}]", "sft.val_files=[]", f"sft.output_dir={out}",
                 "sft.total_steps=20", "trainer.loggers=[jsonl]", "cluster.gpus_per_node=1",
                 "rollout.engine=sglang"]  # fmt: skip  # SFT generates nothing: any engine is fine
    target = run_sft(load_config(ROOT / "configs" / "tiny_grpo.yaml", overrides), in_process=True)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"target": str(target), "files": sorted(p.name for p in target.iterdir()), "records": records}


def test_sft_runs_in_process_without_ray(tmp_path):
    # `megarl sft --in-process`: the policy worker in this process (a one-GPU box without Ray).
    result = run_distributed(_sft_in_process, 1, str(tmp_path), timeout_s=600, daemon=False)[0]
    records = result["records"]
    assert [r["step"] for r in records] == list(range(1, 21))
    assert records[-1]["sft/loss"] < 0.7 * records[0]["sft/loss"]  # it trains
    assert Path(result["target"]) == tmp_path / "sft" / "model" and "config.json" in result["files"]


def _shuffled_resume(rank: int, world: int, root: str) -> dict:
    """Steps 3-4 of a run with actor.shuffle, uninterrupted and resumed from its step-2 checkpoint."""
    import sys

    sys.modules["ray"] = None  # type: ignore[assignment]  # as on a box without Ray
    from megarl.config.loading import load_config
    from megarl.plan.planner import make_plan
    from megarl.trainer.build import build_trainer, shutdown

    def run(out: Path, steps: int) -> None:
        extra = ("actor.shuffle=true", "actor.ppo_epochs=2", "actor.mini_batch_size=16", f"trainer.total_steps={steps}",
                 "trainer.save_freq=2", "trainer.eval_freq=0")  # fmt: skip
        cfg = load_config(ROOT / "configs" / "tiny_grpo.yaml", _overrides(Path(root) / "demo", out, extra))
        trainer = build_trainer(cfg, make_plan(cfg, check_files=True, in_process=True), in_process=True)
        try:
            trainer.fit()
        finally:
            shutdown(trainer)

    run(Path(root) / "whole", 4)
    run(Path(root) / "resumed", 2)
    run(Path(root) / "resumed", 4)  # trainer.resume=auto: from step 2
    return {name: [json.loads(line) for line in (Path(root) / name / "metrics.jsonl").read_text().splitlines()]
            for name in ("whole", "resumed")}  # fmt: skip


def test_a_resumed_shuffled_run_logs_what_the_uninterrupted_one_does(tmp_path):
    runs = run_distributed(_shuffled_resume, 1, str(tmp_path), timeout_s=600, daemon=False)[0]
    timing = ("time/", "weight_sync/seconds", "weight_sync/gbps")  # wall-clock, different by nature
    whole, resumed = ([{k: v for k, v in r.items() if not k.startswith(timing)} for r in runs[n]] for n in ("whole", "resumed"))
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert resumed[2:] == whole[2:]


def _stop_while_the_step_is_logged(rank: int, world: int, root: str) -> dict:
    """A real SIGINT delivered while step 1's metrics are written (after the step decided whether
    it saves): the stop still saves the step, as its line promised."""
    import os
    import signal

    from megarl.cli import report
    from megarl.config.loading import load_config
    from megarl.plan.planner import make_plan
    from megarl.trainer.build import build_trainer, shutdown

    out = Path(root) / "run"
    cfg = load_config(ROOT / "configs" / "tiny_grpo.yaml", _overrides(Path(root) / "demo", out, ("trainer.total_steps=5",)))
    trainer = build_trainer(cfg, make_plan(cfg, check_files=True, in_process=True), in_process=True)
    import megarl.trainer.loop as loop

    logged = loop._log_reward_failures  # what the loop runs right after writing a step's metrics

    def then_interrupt(step: int, metrics: dict) -> None:
        logged(step, metrics)
        if step == 1:
            os.kill(os.getpid(), signal.SIGINT)  # handled at once in this (the main) thread: the step's end is after it

    loop._log_reward_failures = then_interrupt  # (this process is the test's own)
    try:
        trainer.fit()
    except Exception as exc:  # noqa: BLE001 - what ends the run is the result
        return {"message": str(exc), "exit": report(exc), "saved": sorted(p.name for p in (out / "checkpoints").glob("step_*"))}
    finally:
        shutdown(trainer)
    return {"message": None}


def test_a_ctrl_c_while_the_step_is_logged_still_saves_it(tmp_path):
    """Before: a signal between the step's save decision and its end stopped it unsaved, blaming
    trainer.checkpoint_on_signal=false (its default is true)."""
    ended = run_distributed(_stop_while_the_step_is_logged, 1, str(tmp_path), timeout_s=600, daemon=False)[0]
    assert ended["exit"] == 130 and ended["saved"] == ["step_000001"], ended
    assert "after step 1" in ended["message"] and "checkpoint_on_signal" not in ended["message"], ended["message"]
