"""Every check a launch makes before Ray, reported together: the planner's, the files' and the
machine's in one refusal (none waits for another to be fixed), and the plan-time warnings of
settings that are valid but do not do what their user meant."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.config.loading import load_config
from megarl.plan.machine_checks import local_gpus_problem
from megarl.plan.planner import PlanError, make_plan
from megarl.plan.trainer_checks import SAVE_OVERHEAD_S
from megarl.trainer.launch import launch_plan

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
TINY = CONFIGS / "tiny_grpo.yaml"
GRPO72 = CONFIGS / "qwen72b_grpo.yaml"


def tiny(demo, out: Path, *extra: str):
    model, data = demo
    return load_config(TINY, [f"model.path={model}", f"data.train_files=[{data / 'train.parquet'}]",
                              f"data.val_files=[{data / 'val.parquet'}]", f"trainer.output_dir={out}", *extra])  # fmt: skip


def refused_fields(cfg, **kwargs) -> dict[str, str]:
    with pytest.raises(PlanError) as info:
        make_plan(cfg, check_files=True, **kwargs)
    return {i.field: i.message for i in info.value.issues}


def warnings_of(cfg) -> dict[str, str]:
    return {str(w.field): w.message for w in make_plan(cfg, check_files=True).warnings}


def test_a_bridge_refusal_memory_and_missing_files_are_named_together(demo, tmp_path):
    """The bridge check used to wait for every other file to pass, the memory plan for the files."""
    model = shutil.copytree(demo[0], tmp_path / "model")
    hf = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**hf, "intermediate_size": hf["intermediate_size"] + 8}))
    fields = refused_fields(tiny(demo, tmp_path / "run", f"model.path={model}", f"data.val_files=[{tmp_path / 'gone.parquet'}]"))
    assert "is not a model megarl can train" in fields["model.path"] and "does not exist" in fields["data.val_files[0] (gone.parquet)"]

    cfg = load_config(GRPO72, ["cluster.nnodes=1", "actor.parallel.pp=1", "trainer.loggers=[console]",
                               "rollout.server_python=/bin/true", f"trainer.output_dir={tmp_path / 'big'}"])  # fmt: skip
    fields = refused_fields(cfg)
    assert "training needs an estimated" in fields["actor"] and "over cluster.gpu_memory_gib" in fields["actor"]
    assert "does not exist" in fields["data.train_files[0] (dapo-math-17k.parquet)"] and "model.path" in fields


def test_the_machine_problems_come_with_the_plans(demo, tmp_path, monkeypatch, refused_port):
    """`megarl launch` of a multi-node config on one machine named that alone; fixed, the rest came."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # (Ray lets it win over the address given)
    cfg = tiny(demo, tmp_path / "run", "cluster.nnodes=2", f"data.val_files=[{tmp_path / 'gone.parquet'}]")
    with pytest.raises(PlanError) as info:
        launch_plan(cfg, None)
    fields = [i.field for i in info.value.issues]
    assert fields == ["cluster.nnodes", "data.val_files[0] (gone.parquet)"], info.value
    port = refused_port  # a cluster address nothing listens at
    with pytest.raises(PlanError) as info:
        launch_plan(tiny(demo, tmp_path / "run"), f"127.0.0.1:{port}")
    (issue,) = info.value.issues
    assert issue.field == "cluster.ray_address" and f"127.0.0.1:{port} does not answer" in issue.message
    assert "ray start --head" in issue.message
    assert launch_plan(tiny(demo, tmp_path / "run"), None, in_process=False).roles["policy"].dp == 2  # this machine, CPU: fine


def test_an_embedded_cuda_run_needs_this_machines_gpus():
    import torch

    found = torch.cuda.device_count()
    assert local_gpus_problem(found) is None
    problem = local_gpus_problem(found + 1)
    assert problem is not None and f"it has {found} " in problem and f"cluster.gpus_per_node is {found + 1}" in problem
    assert "cluster.device=cpu" in problem and "--address" in problem


def test_more_prompts_a_step_than_training_rows_is_a_warning(demo, tmp_path):
    rows = [{"data_source": "reverse_digits", "prompt": [{"role": "user", "content": p}], "ability": "t",
             "reward_model": {"ground_truth": p[::-1], "style": "rule"}, "extra_info": {"index": i}}
            for i, p in enumerate(["123", "456", "789"])]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "three.parquet")
    found = warnings_of(tiny(demo, tmp_path / "run", f"data.train_files=[{tmp_path / 'three.parquet'}]", "data.prompts_per_step=4",
                             "actor.mini_batch_size=32", "actor.micro_batch_size=16"))  # fmt: skip
    assert "(4) is more than the 3 training rows" in found["data.prompts_per_step"] and "at most 3" in found["data.prompts_per_step"]
    assert "data.prompts_per_step" not in warnings_of(tiny(demo, tmp_path / "run"))


def test_a_refused_plan_says_its_warnings_with_its_errors(demo, tmp_path):
    # Before: the warnings appeared only once the refusal's errors were fixed, one round later.
    cfg = tiny(demo, tmp_path / "run", "data.val_files=[]", "actor.mini_batch_size=7")
    with pytest.raises(PlanError) as info:
        launch_plan(cfg, None, in_process=True)
    refused, _, warned = str(info.value).partition("\nand warns (not a refusal):\n")
    assert "actor.mini_batch_size" in refused and "trainer.eval_freq" not in refused
    assert warned.startswith("  - trainer.eval_freq: ") and "no validation runs" in warned
    assert [w.field for w in info.value.warnings] == ["trainer.eval_freq"]


def test_validation_asked_for_without_validation_files(demo, tmp_path):
    cfg = tiny(demo, tmp_path / "run", "data.val_files=[]")  # the demo config: eval_freq 20, eval_before_train
    message = warnings_of(cfg)["trainer.eval_freq"]
    assert "trainer.eval_freq=20 and trainer.eval_before_train=true ask for validation" in message and "no validation runs" in message
    assert "trainer.val_only" in refused_fields(tiny(demo, tmp_path / "run", "data.val_files=[]", "trainer.val_only=true"))
    assert "trainer.eval_freq" not in warnings_of(tiny(demo, tmp_path / "run", "data.val_files=[]", "trainer.eval_freq=0",
                                                       "trainer.eval_before_train=false"))  # fmt: skip


def test_a_watchdog_shorter_than_a_save(demo, tmp_path):
    """0.5 s passed the plan and then stopped the run in its final save."""
    message = warnings_of(tiny(demo, tmp_path / "run", "trainer.hang_timeout_s=0.5"))["trainer.hang_timeout_s"]
    assert message.startswith("(0.5 s) is shorter than a checkpoint save is expected to take") and "set it to 0" in message
    assert "trainer.hang_timeout_s" not in warnings_of(tiny(demo, tmp_path / "run", f"trainer.hang_timeout_s={SAVE_OVERHEAD_S + 1}"))
    # 72B on 32 GPUs: about 1 TB of checkpoint, 31 GB a GPU at 20 GB/s: a second and a half of writing alone
    with pytest.raises(PlanError, match=r"trainer.hang_timeout_s: \(1 s\) .* every save would stop the run"):
        make_plan(load_config(GRPO72, ["trainer.hang_timeout_s=1"]))
