"""A tool-using GRPO run end to end on CPU: the real trainer (in-process worker group, Megatron
policy, torch engine, weight pushes, reward pool) with the tool_agent loop on a tiny model.

The model's task vocabulary is "01" plus the tool-call markers as single tokens, and the calls
use the digit syntax of docs/examples/agent_extensions.py (``<tool_call>DIGITS</tool_call>`` ->
the calculator), so a random policy already calls the tool in a good share of its turns.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from spawn import run_distributed

ROOT = Path(__file__).resolve().parents[2]
TOOLS = {"tools": [{"class_name": "calculator", "config": {"type": "native"},
                    "tool_schema": {"type": "function", "function": {"name": "calc", "description": "evaluate",
                                    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}}]}  # fmt: skip


def _write_inputs(root: Path) -> list[str]:
    import yaml

    from megarl.data.datasets import write_prompt_file
    from megarl.models.tiny import build_tiny_model

    model = build_tiny_model(root / "model", task_vocab="01", markers=("<tool_call>", "</tool_call>"), seed=0,
                             hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=128,
                             max_position_embeddings=128)  # fmt: skip
    strings = [format(k, "04b") for k in range(16)]
    rows = [{"data_source": "reverse_digits", "prompt": [{"role": "user", "content": s}], "agent_name": "tool_agent",
             "reward_model": {"ground_truth": s[::-1], "style": "rule"}, "extra_info": {"index": i}}
            for i, s in enumerate(strings)]  # fmt: skip
    data = write_prompt_file(rows, root / "train.parquet")
    (root / "tools.yaml").write_text(yaml.safe_dump(TOOLS))
    return [
        f"model.path={model}", "model.arch=null", f"data.train_files=[{data}]", "data.val_files=[]", "data.max_prompt_length=16",
        f"trainer.output_dir={root / 'run'}", "trainer.total_steps=2", "trainer.eval_before_train=false", "trainer.eval_freq=0",
        "trainer.save_freq=0", "trainer.loggers=[jsonl]", "cluster.gpus_per_node=1", "data.prompts_per_step=8",
        "rollout.n=4", "actor.mini_batch_size=32", "actor.micro_batch_size=16", "reward.workers=1",
        "rollout.weight_sync.check_logprobs_every=1", "rollout.sampling.max_new_tokens=24", f"rollout.agent.tools_file={root / 'tools.yaml'}",
        "rollout.agent.tool_parser=agent_extensions:digit_calls", "rollout.agent.max_turns=4",
    ]  # fmt: skip


def _run(rank: int, world: int, root: str) -> dict:
    import os
    import sys

    from run_helpers import fit_in_process_keeping_batches

    from megarl.config.loading import load_config

    examples = str(ROOT / "docs" / "examples")  # the parser's module, on the path as a user's would be
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (examples, os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, examples)
    batches = fit_in_process_keeping_batches(load_config(ROOT / "configs" / "tiny_grpo.yaml", _write_inputs(Path(root))))
    records = [json.loads(line) for line in (Path(root) / "run" / "metrics.jsonl").read_text().splitlines()]
    first = batches[0]
    return {"records": records, "finish": first.finish_reason, "agent": [e["agent"] for e in first.extra_info],
            "mask": first.response_mask.tolist(), "lengths": first.response_lengths.tolist(),
            "ids": first.response_ids.tolist()}  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    return run_distributed(_run, 1, str(tmp_path_factory.mktemp("agent")), timeout_s=600, daemon=False)[0]


def test_tool_calls_happen_and_are_counted(run):
    first = run["records"][0]
    assert [r["step"] for r in run["records"]] == [1, 2]
    assert first["agent/with_tool_call_frac"] >= 0.2  # calls parsed and executed in the first step
    ran = [a for a in run["agent"] if a["tool_calls"] > a["tool_failures"]]
    assert len(ran) / len(run["agent"]) == pytest.approx(first["agent/with_tool_call_frac"])
    assert first["agent/turns_mean"] > 1.0 and math.isfinite(first["actor/loss"])


def test_the_trainer_scores_exactly_the_ids_the_engine_sampled(run):
    # fp32: the trainer's log-probs of the generated tokens, in their multi-turn context (tool
    # answers included), equal the engine's; a shifted or re-tokenized id would not.
    for record in run["records"]:
        assert record["rollout/logprob_mismatch"] <= 1e-5
        assert record["weight_sync/logprob_diff"] <= 1e-5


def test_masks_cover_exactly_the_generated_tokens(run):
    for mask, n, agent in zip(run["mask"], run["lengths"], run["agent"]):
        generated = sum(mask[:n])
        assert all(m == 0 for m in mask[n:]) and mask[n - 1] == 1  # the reward's token is a generated one
        if agent["turns"] > 1:
            assert 0 < generated < n  # tool answers are context: no loss on them
        else:
            assert generated == n


HANGING_USER = '''
import threading

class HangingUser:
    """A simulated user whose answer never comes."""
    def __init__(self, config):
        self.never = threading.Event()
    def start_interaction(self, instance_id, **kwargs):
        return instance_id
    def generate_response(self, instance_id, messages, **kwargs):
        print("let me think about", len(messages), "messages")
        self.never.wait()
'''


def _stop_once_it_hangs(log: Path) -> None:
    """A Ctrl-C to this process as soon as the user's code printed its first line (it hangs then)."""
    import os
    import signal
    import threading
    import time

    def watch() -> None:
        while not (log.exists() and "let me think about" in log.read_text()):
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=watch, daemon=True).start()


def _run_hanging_interaction(rank: int, world: int, root: str, stop: bool = False) -> dict:
    """``stop``: a Ctrl-C once the interaction hangs, whose timeout is 10 minutes then (the stop's grace 1 s)."""
    import os
    import sys

    import yaml

    from megarl.cli import report
    from megarl.config.loading import load_config
    from megarl.data.datasets import write_prompt_file
    from megarl.plan.planner import make_plan
    from megarl.trainer.build import build_trainer, shutdown
    from megarl.user_code import user_output_to

    folders = [str(ROOT / "docs" / "examples"), root]  # the parser's module and the user's interaction, as a user's would be
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (*folders, os.environ.get("PYTHONPATH")) if p)
    sys.path[:0] = folders
    (Path(root) / "hanging_user.py").write_text(HANGING_USER)
    (Path(root) / "interactions.yaml").write_text(yaml.safe_dump({"interaction": [{"name": "hang", "class_name": "hanging_user.HangingUser"}]}))
    overrides = _write_inputs(Path(root))
    rows = [{"data_source": "reverse_digits", "prompt": [{"role": "user", "content": format(k, "04b")}], "agent_name": "tool_agent",
             "reward_model": {"ground_truth": "0", "style": "rule"}, "extra_info": {"index": k, "interaction_kwargs": {"name": "hang"}}}
            for k in range(16)]  # fmt: skip
    data = write_prompt_file(rows, Path(root) / "talk.parquet")
    cfg = load_config(ROOT / "configs" / "tiny_grpo.yaml", [*overrides, f"data.train_files=[{data}]", "trainer.total_steps=1",
                      f"rollout.agent.interactions_file={Path(root) / 'interactions.yaml'}",
                      f"rollout.agent.interaction_timeout_s={600 if stop else 2}"])  # fmt: skip
    log = Path(root) / "run" / "logs" / "user_code.log"
    trainer = build_trainer(cfg, make_plan(cfg, check_files=True, in_process=True), in_process=True)
    if stop:
        import megarl.user_code

        megarl.user_code.STOP_GRACE_S = 1.0  # (this process is the test's own)
        _stop_once_it_hangs(log)
    try:
        with user_output_to(log):
            trainer.fit()
    except Exception as exc:  # noqa: BLE001 - what ends the run is the result
        return {"type": type(exc).__name__, "message": str(exc), "exit": report(exc), "log": log.read_text()}
    finally:
        shutdown(trainer)
    return {"type": None}


def test_an_interaction_that_never_answers_ends_the_run_at_its_deadline_naming_it(tmp_path):
    """Below Ray: the trainer's own rollout, a hanging simulated user on the tiny tool model."""
    ended = run_distributed(_run_hanging_interaction, 1, str(tmp_path), timeout_s=600, daemon=False)[0]
    assert ended["type"] == "InteractionTimeout" and ended["exit"] == 2
    assert ended["message"].startswith("interaction 'hang' (HangingUser.generate_response in ")
    assert "hanging_user.py) did not return within 2 s; " in ended["message"]
    assert "rollout.agent.interaction_timeout_s" in ended["message"] and "it printed: 'let me think about" in ended["message"]
    assert ended["log"].startswith("let me think about")


def test_a_first_ctrl_c_while_an_interaction_hangs_stops_the_run_after_the_grace_naming_it(tmp_path):
    """Before: the first Ctrl-C said "stopping after this step", the step waited the interaction's
    whole timeout and the run ended in its error (exit 2) instead of the stop (exit 130)."""
    ended = run_distributed(_run_hanging_interaction, 1, str(tmp_path), True, timeout_s=600, daemon=False)[0]
    assert ended["type"] == "RunStopped" and ended["exit"] == 130
    first, resume = ended["message"].split("\n")
    assert first.startswith("stopped by SIGINT (Ctrl-C) during step 1 (abandoned: interaction 'hang' "
                            "(HangingUser.generate_response in ")
    assert first.endswith(" did not return within 1 s of the stop); no checkpoint yet (it starts again at step 0)")
    assert resume.startswith("resume with: ")
