"""`megarl generate` and `megarl evaluate` on the demo's tiny model, end to end on CPU: the
output file, a crash and its resume (equal to an uninterrupted run), a model checkpoint as the
model, and the evaluation's numbers against the reward function called directly."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from megarl.commands.demo import prepare_demo
from megarl.commands.evaluate import evaluate
from megarl.commands.generate import GenerateError, generate
from megarl.commands.outputs import OutputExistsError
from megarl.evaluation import pass_at_k
from megarl.rewards.reverse_digits import compute_score

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny_grpo.yaml"
CRASHING = """
    import os
    from pathlib import Path

    from megarl.rollout.single_turn import generate_batch

    def generate(engines, prompts, params):
        # The default generation, but the process dies (as if killed) on call CRASH_AT_CALL.
        calls = Path(os.environ["CALLS_FILE"])
        count = int(calls.read_text()) + 1 if calls.exists() else 1
        calls.write_text(str(count))
        if count == int(os.environ.get("CRASH_AT_CALL", "0")):
            os._exit(9)
        return generate_batch(engines, prompts, params)
"""

# The default generation, held at its first call until RELEASE_FILE appears (STARTED_FILE says it is there).
HELD = """
    import os
    import time
    from pathlib import Path

    from megarl.rollout.single_turn import generate_batch

    def generate(engines, prompts, params):
        Path(os.environ["STARTED_FILE"]).touch()
        deadline = time.monotonic() + 240
        while not Path(os.environ["RELEASE_FILE"]).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        return generate_batch(engines, prompts, params)
"""

# A generation that fails before its first part is written (as an engine that cannot start).
FAILING = """
def generate(engines, prompts, params):
    raise RuntimeError("the engine failed at start-up")
"""

# The default generation, printing a lot on the way.
CHATTY = """
from megarl.rollout.single_turn import generate_batch

def generate(engines, prompts, params):
    print("generating", len(prompts), "prompts " + "x" * 200_000)
    return generate_batch(engines, prompts, params)
"""


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return prepare_demo(tmp_path_factory.mktemp("demo"))


def _overrides(model: Path, *extra: str) -> list[str]:
    return [f"model.path={model}", "rollout.sampling.max_new_tokens=4", *extra]


def _cli(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megarl.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def test_generate_writes_every_row_and_evaluate_scores_it(demo, tmp_path):
    model, data = demo
    out = generate(CONFIG, _overrides(model, "rollout.n=4"), data / "val.parquet", tmp_path / "gen.parquet", batch_size=64)
    source, generated = pq.read_table(data / "val.parquet"), pq.read_table(out)
    assert generated.column_names == [*source.column_names, "prompt_text", "responses", "response_lengths", "finish_reasons",
                                      "turns", "tool_calls"]  # fmt: skip
    assert {t for row in generated.column("turns").to_pylist() for t in row} == {1}  # single-turn rows
    assert generated.select(source.column_names).equals(source)  # the input rows, in order, untouched
    rows = generated.to_pylist()
    assert all(len(r["responses"]) == len(r["response_lengths"]) == len(r["finish_reasons"]) == 4 for r in rows)
    assert all(1 <= n <= 4 for r in rows for n in r["response_lengths"])
    assert {reason for r in rows for reason in r["finish_reasons"]} <= {"stop", "length"}
    assert not (tmp_path / "gen.parquet.partial").exists()

    summary = evaluate(out, CONFIG, _overrides(model), ks=[1, 4])["per_data_source"]["reverse_digits"]
    scores = [[compute_score("reverse_digits", text, r["reward_model"]["ground_truth"]) for text in r["responses"]]
              for r in rows]  # fmt: skip
    assert summary["reward/mean"] == pytest.approx(sum(map(sum, scores)) / (4 * len(rows)))
    expected = sum(pass_at_k(4, sum(s >= 1.0 for s in row), 4) for row in scores) / len(rows)
    assert summary["pass@4"] == pytest.approx(expected)
    lengths = [n for r in rows for n in r["response_lengths"]]
    assert summary["response_length/mean"] == pytest.approx(sum(lengths) / len(lengths))


def test_a_crashed_generation_resumes_to_the_uninterrupted_result(demo, tmp_path):
    model, data = demo
    (tmp_path / "crashing.py").write_text(textwrap.dedent(CRASHING))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "CALLS_FILE": str(tmp_path / "calls"), "OMP_NUM_THREADS": "1"}
    args = ["generate", str(CONFIG), *_overrides(model, "rollout.generate_function=crashing:generate"),
            "--data", str(data / "val.parquet"), "--out", "gen.parquet", "--n", "2", "--batch-size", "50"]  # fmt: skip
    crashed = _cli(args, {**env, "CRASH_AT_CALL": "3"}, tmp_path)
    partial = tmp_path / "gen.parquet.partial"
    # The generate function's os._exit(9) ends the driver without a word: the supervisor's one line.
    assert crashed.returncode == 2, crashed.stderr
    [line] = [line for line in crashed.stderr.splitlines() if line.startswith("error:")]
    assert line == crashed.stderr.splitlines()[-1] and "exited with code 9 without reporting an error: user code" in line
    assert "Ray" not in line  # an HF model: generate starts no Ray
    assert line.endswith(f"its output is above; the parts finished so far are kept in {partial}: the same command goes on from them")
    assert sorted(p.name for p in partial.glob("part-*")) == ["part-000000.parquet", "part-000001.parquet"]
    assert not (tmp_path / "gen.parquet").exists()

    changed = _cli([*args, "--temperature", "0.5"], env, tmp_path)  # other settings: refused, nothing removed
    assert changed.returncode == 2 and "sampling.temperature was 1.0, now 0.5" in changed.stderr and partial.is_dir()

    (partial / "notes.txt").write_text("mine")  # not generate's: it stays
    resumed = _cli(args, env, tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "continuing the generation" in resumed.stderr and (tmp_path / "calls").read_text() == str(3 + 2)
    assert [p.name for p in partial.iterdir()] == ["notes.txt"]
    whole = generate(CONFIG, _overrides(model, "rollout.n=2"), data / "val.parquet", tmp_path / "whole.parquet", batch_size=50)
    assert pq.read_table(tmp_path / "gen.parquet").equals(pq.read_table(whole))  # seeded per part: the same samples


def test_a_second_generate_into_the_same_out_is_refused_naming_the_first(demo, tmp_path):
    """Two processes: the second starts while the first generates (its partial folder half
    written) and is refused in one line naming the first's pid; the first finishes untouched."""
    model, data = demo
    (tmp_path / "held.py").write_text(textwrap.dedent(HELD))
    started, release = tmp_path / "started", tmp_path / "release"
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "STARTED_FILE": str(started),
           "RELEASE_FILE": str(release), "OMP_NUM_THREADS": "1"}  # fmt: skip
    args = ["generate", str(CONFIG), *_overrides(model, "rollout.generate_function=held:generate"),
            "--data", str(data / "val.parquet"), "--out", "gen.parquet", "--n", "1", "--batch-size", "100"]  # fmt: skip
    first = subprocess.Popen([sys.executable, "-m", "megarl.cli", *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not started.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert started.exists(), first.communicate()[1]
        # the command's own process holds OUT for its driver from before the driver started: a second
        # command is refused by that hold in its first second, not after the driver's imports
        st = (tmp_path / ".gen.parquet.megarl.lock").stat()
        key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        owners = [line.split()[4] for line in Path("/proc/locks").read_text().splitlines() if line.split()[5] == key]
        assert owners == [str(first.pid)]
        second = _cli(args, env, tmp_path)
        assert second.returncode == 2, second.stderr
        assert re.fullmatch(rf"error: --out {tmp_path / 'gen.parquet'} is in use by pid {first.pid} on \S+ \(since [^)]*\); wait for that "
                            r"command to end or stop it .*, or give another --out\n", second.stderr.splitlines(keepends=True)[-1])
        assert "continuing the generation" not in second.stderr
    finally:
        release.touch()
        _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert pq.read_metadata(tmp_path / "gen.parquet").num_rows == 200
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".gen")) == []  # the lock file went with it


def test_generate_from_a_model_checkpoint_equals_its_hf_source(demo, tmp_path):
    from megarl.commands.conversion import convert_hf_to_megatron

    model, data = demo
    ckpt = convert_hf_to_megatron(model, tmp_path / "ckpt")
    greedy = _overrides(model, "rollout.n=1", "rollout.sampling.temperature=0")
    from_hf = generate(CONFIG, greedy, data / "val.parquet", tmp_path / "hf.parquet")
    from_ckpt = generate(CONFIG, greedy, data / "val.parquet", tmp_path / "ckpt.parquet", model=str(ckpt))
    assert pq.read_table(from_ckpt).equals(pq.read_table(from_hf))
    assert not (tmp_path / "ckpt.parquet.partial").exists()  # the staged export went with it


def test_output_and_partial_are_never_overwritten_silently(demo, tmp_path):
    model, data = demo
    out = tmp_path / "gen.parquet"
    out.write_text("the user's file")
    with pytest.raises(OutputExistsError, match="exists; pass --overwrite"):
        generate(CONFIG, _overrides(model), data / "val.parquet", out)
    assert out.read_text() == "the user's file"
    stray = tmp_path / "other.parquet.partial"
    stray.mkdir()
    (stray / "notes.txt").write_text("mine")
    with pytest.raises(GenerateError, match="was not made by megarl generate"):
        generate(CONFIG, _overrides(model), data / "val.parquet", tmp_path / "other.parquet")
    assert (stray / "notes.txt").read_text() == "mine"
    with pytest.raises(GenerateError, match="is the input file"):
        generate(CONFIG, _overrides(model), data / "val.parquet", data / "val.parquet", overwrite=True)
    # refused before anything is written: a wrong model, a prompt over data.max_prompt_length
    with pytest.raises(GenerateError, match="is not an HF model directory"):
        generate(CONFIG, _overrides(model), data / "val.parquet", tmp_path / "a.parquet", model=str(tmp_path / "nope"))
    with pytest.raises(GenerateError, match="200 prompts of --data are longer than data.max_prompt_length \\(3 tokens\\), the first row 0"):
        generate(CONFIG, _overrides(model, "data.max_prompt_length=3"), data / "val.parquet", tmp_path / "a.parquet")
    assert not (tmp_path / "a.parquet.partial").exists()


def test_evaluate_cli_writes_the_summary_and_scored_rows(demo, tmp_path):
    model, data = demo
    out = generate(CONFIG, _overrides(model, "rollout.n=2"), data / "val.parquet", tmp_path / "gen.parquet")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = _cli(["evaluate", "--data", str(out), "reward.functions={reverse_digits: reverse_digits}", "--k", "1,2",
                 "--scored", str(tmp_path / "scored.parquet")], env, tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "gen.eval.json").read_text())
    assert set(summary["per_data_source"]) == {"all", "reverse_digits"}
    assert "pass@2" in done.stdout.splitlines()[0] and done.stdout.splitlines()[1].startswith("all")
    scored = pq.read_table(tmp_path / "scored.parquet").column("scores").to_pylist()
    mean = sum(map(sum, scored)) / sum(map(len, scored))
    assert summary["per_data_source"]["all"]["reward/mean"] == pytest.approx(mean)
    too_many = _cli(["evaluate", "--data", str(out), "--k", "4"], env, tmp_path)
    assert too_many.returncode == 2 and "k 4 is not in 1..2" in too_many.stderr
    onto_data = _cli(["evaluate", "--data", str(out), "--out", str(out)], env, tmp_path)
    assert onto_data.returncode == 2 and "is the --data file" in onto_data.stderr and pq.read_table(out).num_rows == 200
    again = _cli(["evaluate", "--data", str(out), "--scored", str(tmp_path / "scored.parquet")], env, tmp_path)
    assert again.returncode == 2 and "--scored" in again.stderr and "exists; pass --overwrite" in again.stderr
    same = _cli(["evaluate", "--data", str(out), "--out", "s.json", "--scored", "s.json"], env, tmp_path)
    assert same.returncode == 2 and "also the --out summary" in same.stderr
    (tmp_path / "bad_reward.py").write_text("def score(:\n")
    bad = _cli(["evaluate", "--data", str(out), f"reward.custom.path={tmp_path / 'bad_reward.py'}", "reward.custom.name=score",
                "--out", "b.json"], env, tmp_path)  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "SyntaxError" in bad.stderr and "Traceback" not in bad.stderr


def test_generate_runs_agent_loops_and_writes_their_counts(tmp_path, monkeypatch):
    import yaml

    from megarl.data.datasets import write_prompt_file
    from megarl.models.tiny import build_tiny_model

    monkeypatch.syspath_prepend(str(ROOT / "docs" / "examples"))  # the digit-call parser
    model = build_tiny_model(tmp_path / "model", task_vocab="01", markers=("<tool_call>", "</tool_call>"),
                             max_position_embeddings=128)  # fmt: skip
    rows = [{"data_source": "reverse_digits", "prompt": [{"role": "user", "content": format(k, "04b")}],
             "agent_name": "tool_agent", "reward_model": {"ground_truth": format(k, "04b")[::-1], "style": "rule"}}
            for k in range(8)]  # fmt: skip
    data = write_prompt_file(rows, tmp_path / "agents.parquet")
    schema = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}
    (tmp_path / "tools.yaml").write_text(yaml.safe_dump({"tools": [{"class_name": "calculator", "tool_schema": schema}]}))
    overrides = [f"model.path={model}", "model.arch=null", "rollout.n=4", "rollout.sampling.max_new_tokens=24",
                 "data.max_prompt_length=16", f"rollout.agent.tools_file={tmp_path / 'tools.yaml'}",
                 "rollout.agent.tool_parser=agent_extensions:digit_calls"]  # fmt: skip
    out = pq.read_table(generate(CONFIG, overrides, data, tmp_path / "gen.parquet")).to_pylist()
    calls = [c for r in out for c in r["tool_calls"]]
    turns = [t for r in out for t in r["turns"]]
    assert len(calls) == len(turns) == 32 and any(c > 0 for c in calls)  # the loops really called the tool
    assert all(t >= 1 for t in turns) and any(t > 1 for t in turns)
    assert all(c >= 1 for t, c in zip(turns, calls, strict=True) if t > 1)  # only a tool answer starts another turn


def test_a_run_that_failed_before_its_first_part_leaves_nothing_in_the_way(demo, tmp_path, monkeypatch):
    model, data = demo
    (tmp_path / "failing.py").write_text(FAILING)
    monkeypatch.syspath_prepend(str(tmp_path))
    broken = tmp_path / "broken"  # the model at another path: another model to the job record
    shutil.copytree(model, broken)
    failing = _overrides(model, "rollout.generate_function=failing:generate")
    out, partial = tmp_path / "y.parquet", tmp_path / "y.parquet.partial"
    with pytest.raises(RuntimeError, match="the engine failed at start-up"):
        generate(CONFIG, failing, data / "val.parquet", out, model=str(broken))
    assert [p.name for p in partial.iterdir()] == ["generate.json"]  # the failed run wrote no part
    (partial / "notes.txt").write_text("mine")
    # the corrected command (another model) is not refused: there was nothing to continue
    generate(CONFIG, _overrides(model, "rollout.n=2"), data / "val.parquet", out)
    whole = generate(CONFIG, _overrides(model, "rollout.n=2"), data / "val.parquet", tmp_path / "whole.parquet")
    assert pq.read_table(out).equals(pq.read_table(whole))
    assert [p.name for p in partial.iterdir()] == ["notes.txt"]  # the user's file stays

    # a staged HF export of another model is work too: still refused, and left in place
    stale = tmp_path / "z.parquet.partial"
    with pytest.raises(RuntimeError, match="the engine failed at start-up"):
        generate(CONFIG, failing, data / "val.parquet", tmp_path / "z.parquet", model=str(broken))
    (stale / "model").mkdir()
    with pytest.raises(GenerateError, match=re.escape(f'model was "{broken}", now "{model.absolute()}"')):
        generate(CONFIG, _overrides(model), data / "val.parquet", tmp_path / "z.parquet")
    assert (stale / "model").is_dir()


def test_generate_refuses_more_new_tokens_than_the_model_has_positions(demo, tmp_path):
    model, data = demo
    with pytest.raises(GenerateError, match=r"\(16 \+ 1000 = 1016\) exceeds the model's max_position_embeddings \(64\); "
                                            r"lower --max-new-tokens to at most 48"):  # fmt: skip
        generate(CONFIG, _overrides(model, "rollout.sampling.max_new_tokens=1000"), data / "val.parquet", tmp_path / "a.parquet")
    assert not (tmp_path / "a.parquet.partial").exists()  # refused before anything was written
    # greedy is fine offline (RL's temperature rule is not generate's); 16 + 48 fills the 64 positions
    greedy = _overrides(model, "rollout.sampling.max_new_tokens=48", "rollout.sampling.temperature=0", "rollout.n=1")
    out = generate(CONFIG, greedy, data / "val.parquet", tmp_path / "b.parquet")
    assert pq.read_metadata(out).num_rows == 200


def test_generating_from_a_scored_file_replaces_its_generated_columns(demo, tmp_path):
    model, data = demo
    first = generate(CONFIG, _overrides(model, "rollout.n=4"), data / "val.parquet", tmp_path / "gen.parquet")
    scored = tmp_path / "scored.parquet"
    evaluate(first, CONFIG, _overrides(model), scored=scored)
    again = pq.read_table(generate(CONFIG, _overrides(model, "rollout.n=2"), scored, tmp_path / "again.parquet"))
    # no 4-entry 'scores' of the earlier responses beside the 2 new ones: the file is one generation
    assert again.column_names == pq.read_table(first).column_names
    assert {len(r) for r in again.column("responses").to_pylist()} == {2}
    assert again.select(pq.read_table(data / "val.parquet").column_names).equals(pq.read_table(data / "val.parquet"))


def test_what_a_generate_function_prints_goes_beside_out_not_to_the_terminal(demo, tmp_path, monkeypatch, capsys):
    model, data = demo
    (tmp_path / "chatty.py").write_text(CHATTY)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = generate(CONFIG, _overrides(model, "rollout.generate_function=chatty:generate"), data / "val.parquet",
                   tmp_path / "gen.parquet", batch_size=64)  # fmt: skip
    terminal = capsys.readouterr()
    assert "x" * 100 not in terminal.out + terminal.err and pq.read_table(out).num_rows > 0
    log = (tmp_path / "gen.parquet.user_code.log").read_text().splitlines()
    assert log and all(line.startswith("generating ") and line.endswith("x" * 200_000) for line in log)
