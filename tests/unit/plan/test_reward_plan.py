"""reward.combine and reward.judge before launch: unknown components refused by the plan, a data
source no row has, a judge template with an unknown placeholder and a judge directory without a
model refused by the preflight's checks; the judge and reward-model roles sized from config.json."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.config.loading import load_config
from megarl.data.datasets import PromptRecord
from megarl.plan.planner import PlanError, make_plan
from megarl.plan.reward_checks import combine_findings, reward_roles

ROOT = Path(__file__).resolve().parents[3]


def _cfg(*overrides: str):
    return load_config(ROOT / "configs" / "tiny_grpo.yaml", list(overrides))


def test_the_plan_refuses_a_component_that_names_nothing():
    with pytest.raises(PlanError, match=r"reward.combine\['reverse_digits'\] names the component 'gsm9k'.*use one of"):
        make_plan(_cfg("reward.combine={reverse_digits: {gsm9k: 1.0}}"))


def test_preflight_checks_the_judge_and_the_combined_sources(tmp_path):
    from megarl.models.tiny import build_tiny_model

    judge = build_tiny_model(tmp_path / "judge", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, ffn_hidden_size=64)
    (tmp_path / "template.txt").write_text("Q {prompt} A {response} ref {answer}")
    rows = [("data.train_files[0] (t.parquet)", [PromptRecord("reverse_digits", "123", "321", 0)])]
    cfg = _cfg("reward.combine={reverse_digits: {reverse_digits: 1.0, judge: 1.0}, gsm8k: {judge: 1.0}}",
               f"reward.judge.model={tmp_path}", f"reward.judge.prompt_template={tmp_path / 'template.txt'}")  # fmt: skip
    found = {(f.field, f.message) for f in combine_findings(cfg, rows)}
    assert ("reward.combine", "['gsm8k'] is a data_source no row of the data files has (they have reverse_digits); fix the key") in found
    assert any(field == "reward.judge.model" and "has no config.json" in msg for field, msg in found)
    assert any(field == "reward.judge.prompt_template" and "unknown placeholder {answer}" in msg for field, msg in found)
    (tmp_path / "template.txt").write_text("Q {prompt} A {response} ref {ground_truth}")
    good = _cfg("reward.combine={reverse_digits: {judge: 1.0}}", f"reward.judge.model={judge}",
                f"reward.judge.prompt_template={tmp_path / 'template.txt'}")  # fmt: skip
    assert combine_findings(good, rows) == []
    (role,) = reward_roles(good, good.samples_per_step)
    assert role["role"] == "LLM judge" and 0 < role["memory_gib"] < 0.1


def test_an_sglang_judge_is_planned_on_cpu_and_refused_on_cuda_in_one_line(tmp_path):
    judge = ["reward.combine={reverse_digits: {judge: 1.0}}", f"reward.judge.model={tmp_path}",
             "reward.judge.prompt_template=judge {prompt} {response}", "reward.judge.engine=sglang"]  # fmt: skip
    make_plan(_cfg(*judge))  # cluster.device cpu: its server runs beside the controller
    (role,) = reward_roles(_cfg(*judge), 8)
    assert role["where"].startswith("SGLang server of its own")
    with pytest.raises(PlanError, match=r"reward.judge.engine: \(sglang\) runs its server on CPU only for now \(cluster.device "
                       r"is cuda\): GPUs of its own are not placed yet; use reward.judge.engine=torch"):  # fmt: skip
        make_plan(_cfg(*judge, "cluster.device=cuda"))
