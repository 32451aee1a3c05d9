"""The CLI's contract: documented exit codes, one `error:` line per user error (the override that
caused it named), tracebacks only with --debug or for bugs, quiet broken pipes, and `--help` /
`plan` without torch or Ray."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megarl.cli import EXIT_USER, build_parser, main

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "configs" / "tiny_grpo.yaml"


def megarl(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megarl.cli", *args], capture_output=True, text=True, timeout=120, **kw)


def test_help_lists_the_exit_codes():
    out = megarl("--help").stdout
    assert "exit codes:" in out and "2    user error" in out and "130  stopped by Ctrl-C" in out


def test_help_and_plan_import_neither_torch_nor_ray(tmp_path):
    code = ("import sys; from megarl.cli import main; assert main(['plan', *sys.argv[1:]]) == 0; "
            "assert not {'torch', 'ray'} & set(sys.modules), sorted({'torch', 'ray'} & set(sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code, str(TINY)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # an SGLang judge's memory is sized from its server's token pool, without the server's module
    judge = tmp_path / "judge"
    judge.mkdir()
    (judge / "config.json").write_text('{"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 32, '
                                       '"num_hidden_layers": 1, "intermediate_size": 64, "num_attention_heads": 2, '
                                       '"num_key_value_heads": 1, "vocab_size": 100, "max_position_embeddings": 64}')  # fmt: skip
    overrides = ["reward.combine={reverse_digits: {reverse_digits: 1.0, judge: 1.0}}", f"reward.judge.model={judge}",
                 "reward.judge.prompt_template=judge {prompt} {response}", "reward.judge.engine=sglang"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code, str(TINY), *overrides], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "LLM judge SGLang server of its own" in " ".join(proc.stdout.split())
    # on cuda its servers' devices and GPU memory, from the planner's SGLang memory model
    cuda = [*overrides, "cluster.device=cuda", "cluster.gpus_per_node=2", "reward.judge.gpus=1"]
    proc = subprocess.run([sys.executable, "-c", code, str(TINY), *cuda], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "LLM judge: 1 x sglang server tp1 of its own" in proc.stdout and "judge memory/GPU" in proc.stdout


def test_a_command_that_needs_ray_where_it_is_missing_says_so_in_one_line(tmp_path):
    from megarl.models.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=128)
    code = "import sys; sys.modules['ray'] = None; from megarl.cli import main; sys.exit(main(sys.argv[1:]))"  # as if not installed
    args = ["convert", "hf-to-megatron", "--hf", str(model), "--out", str(tmp_path / "ckpt")]
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == EXIT_USER, proc.stderr
    assert proc.stderr.splitlines()[-1] == (f"error: Ray is not installed for {sys.executable}: pip install 'ray[default]' "
                                            "(a megarl dependency), or, for a layout of one process, add --in-process "
                                            "(megarl launch, sft, convert and generate then run without Ray)")  # fmt: skip
    assert "Traceback" not in proc.stderr and not (tmp_path / "ckpt").exists()


def test_a_missing_submodule_of_an_installed_ray_is_not_called_ray_missing():
    # A Ray that is installed but lacks a module megarl imports (another Ray version): a bug,
    # shown whole (exit 1), not "Ray is not installed" with advice that does not apply.
    import importlib.util

    from megarl.cli import user_error_line

    if importlib.util.find_spec("ray") is None:
        pytest.skip("Ray is not installed here")
    exc = ModuleNotFoundError("No module named 'ray.util.scheduling_strategies'", name="ray.util.scheduling_strategies")
    assert user_error_line(exc) is None


def test_an_override_type_error_names_the_override(capsys):
    assert main(["plan", str(TINY), "rollout.n=many"]) == EXIT_USER
    err = capsys.readouterr().err
    assert err.startswith("error: override rollout.n=many: invalid configuration")
    assert str(TINY) not in err  # the YAML file is not blamed
    assert "rollout.n: Input should be a valid integer" in err


def test_plan_json_is_json_when_refused_too(capsys):
    import json

    assert main(["plan", str(TINY), "--json", "actor.parallel.pp=3", "data.val_files=[]", "trainer.eval_freq=2"]) == EXIT_USER
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False
    by_field = {i["field"]: i for i in out["issues"]}
    assert by_field["actor.parallel.pp"]["level"] == "error"
    assert by_field["actor.parallel.pp"]["message"].startswith("(3) must divide num_layers (2)")
    assert [w["field"] for w in out["warnings"]] == ["trainer.eval_freq"]  # the warnings too, as the text refusal has them
    assert main(["plan", str(TINY), "--json", "rollout.n=many"]) == EXIT_USER  # the loader refuses it
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and out["issues"] == [] and "override rollout.n=many" in out["error"]
    assert main(["plan", "--json"]) == EXIT_USER  # no config: JSON too
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and "needs a CONFIG file" in out["error"]
    assert main(["plan", str(TINY), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is True and out["roles"]["policy"]["pp"] == 1
    phases = [p["phase"] for p in out["step"]["phases"]]  # the report's step timeline, in order
    assert phases[:2] == ["generate", "reward"] and phases[-1] == "weight_push" and out["step"]["asynchronous"] is False


def test_user_error_traceback_only_with_debug(capsys):
    assert main(["plan", str(TINY), "actor.parallel.pp=3"]) == EXIT_USER
    assert "Traceback" not in capsys.readouterr().err
    assert main(["--debug", "plan", str(TINY), "actor.parallel.pp=3"]) == EXIT_USER
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.rstrip().splitlines()[-1].startswith("  - actor.parallel.pp")
    for argv in (["plan", str(TINY), "--debug", "actor.parallel.pp=3"], ["plan", str(TINY), "actor.parallel.pp=3", "--debug"]):
        assert main(argv) == EXIT_USER  # --debug after the subcommand works too
        assert "Traceback (most recent call last)" in capsys.readouterr().err
    # and after a nested subcommand; without it, no traceback
    assert build_parser().parse_args(["data", "inspect", "x.parquet", "--debug"]).debug is True
    assert build_parser().parse_args(["data", "inspect", "x.parquet"]).debug is False


def test_data_errors_and_os_errors_on_user_paths_are_one_line(tmp_path, capsys):
    (tmp_path / "x.parquet").write_text("not parquet")
    assert main(["data", "inspect", str(tmp_path / "x.parquet")]) == EXIT_USER
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "cannot read" in err and err.count("\n") == 1
    from megarl.cli import user_error_line

    line = user_error_line(PermissionError(13, "Permission denied", "/ro/run/logs"))
    assert line == "/ro/run/logs: Permission denied; check the permissions or choose another path"
    assert user_error_line(KeyError("a bug")) is None  # not a user error: a traceback


def test_broken_pipe_is_quiet(tmp_path):
    from megarl.data.tasks import write_reverse_digits

    train, _ = write_reverse_digits(tmp_path, val_size=100)
    cmd = f"{sys.executable} -m megarl.cli data inspect {train} --json | head -c 10"
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert "BrokenPipeError" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout.startswith("{")


@pytest.mark.parametrize("argv", [["launch", "no_such.yaml"], ["convert", "/no/such/step_000001", "out"]])
def test_missing_inputs_are_user_errors(argv, capsys):
    assert main(argv) == EXIT_USER
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err


def test_a_missing_checkpoint_is_a_user_error_in_a_fresh_process(tmp_path):
    # In a process of its own (the test process may have imported the modules that re-export the
    # error class): CheckpointError is raised by megarl.checkpoint.verification, which defines it.
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", "convert", str(tmp_path / "step_000001"), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == EXIT_USER, proc.stderr
    assert proc.stderr == f"error: {tmp_path / 'step_000001'} does not exist; give a checkpoint directory " \
                          "(<output_dir>/checkpoints/step_NNNNNN)\n"


def test_an_assert_in_a_worker_is_an_internal_error(capsys):
    from megarl.cli import EXIT_INTERNAL, report
    from megarl.ray_cluster.worker_group import WorkerError

    said = "policy rank 1 raised RuntimeError in PolicyRank.load: size mismatch for weight (log: r1.log)"
    mistake = WorkerError(said + "\n--- last lines ---\n...", "policy", 1, cause=RuntimeError("size mismatch for weight"))
    assert report(mistake) == EXIT_USER and capsys.readouterr().err == f"error: {said}\n"
    bug = WorkerError("policy rank 0 raised AssertionError in PolicyRank.save: (no message) at x.py:3 in save\n"
                      "--- last lines ---\nTraceback ...", "policy", 0, cause=AssertionError())
    assert report(bug) == EXIT_INTERNAL
    err = capsys.readouterr().err
    assert "Traceback" in err and "raised AssertionError in PolicyRank.save: (no message) at x.py:3 in save" in err
    died = WorkerError("policy rank 0 died during PolicyRank.step: Killed", "policy", 0)  # no cause: the OOM killer, a signal
    assert report(died) == EXIT_USER


@pytest.mark.parametrize("argv", [["evaluate", "--data", "gen.parquet", "--dat=x"],
                                  ["generate", str(TINY), "--data", "in.parquet", "--out", "o.parquet", "--dat=x"],
                                  ["data", "inspect", "x.parquet", "--js"]])  # fmt: skip
def test_abbreviated_flags_are_refused(argv, capsys):
    """An abbreviation means whichever flag it prefixes today: `--d` was --data until --debug came."""
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == EXIT_USER
    assert capsys.readouterr().err.splitlines()[-1] == f"megarl: error: unrecognized arguments: {argv[-1]}"


def test_a_word_after_the_options_is_an_override_and_named(capsys):
    # after an option, `trainer.seed` (no =) made argparse refuse every override there, valid ones too
    argv = ["generate", str(TINY), "--data", "in.parquet", "rollout.n=2", "--out", "o.parquet", "trainer.seed"]
    assert main(argv) == EXIT_USER
    assert capsys.readouterr().err == "error: override 'trainer.seed' must look like key.path=value (e.g. rollout.n=8)\n"


@pytest.mark.parametrize(
    ("argv", "dest"),
    [(["convert", "hf-to-megatron", "--hf", "m", "--out", "~/x"], "out"), (["convert", "megatron-to-hf", "--ckpt", "~/x"], "ckpt"),
     (["data", "inspect", "~/x"], "file"), (["plot", "~/x"], "run_dir"), (["generate", "c.yaml", "--data", "d", "--out", "~/x"], "out"),
     (["launch", "~/x"], "config")],
)
def test_a_quoted_tilde_in_a_path_argument_is_the_home_directory(argv, dest, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    # The shell leaves '~/x' quoted as it is; a literal ./~ folder would follow, and then an `rm -rf ~`.
    assert getattr(build_parser().parse_args(argv), dest) == str(tmp_path / "x")


def test_convert_to_a_quoted_tilde_writes_nothing_under_a_literal_tilde(monkeypatch, tmp_path, capsys):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    assert main(["convert", "hf-to-megatron", "--hf", "~/nohf", "--out", "~/x", "--tp", "2"]) == EXIT_USER
    assert capsys.readouterr().err == f"error: --hf {home / 'nohf'} has no config.json; give a Hugging Face model directory\n"
    assert not (work / "~").exists()


def test_a_generate_flag_out_of_range_is_named_by_the_flag(capsys):
    """Not as the override it becomes (rollout.n=0), which the user never wrote; all of them at once."""
    argv = ["generate", str(TINY), "--data", "in.parquet", "--out", "o.parquet", "--n", "0", "--top-p", "1.5"]
    assert main(argv) == EXIT_USER
    assert capsys.readouterr().err == ("error: --n 0: give the number of responses per prompt, 1 or more; "
                                       "--top-p 1.5: give a number in (0, 1]\n")  # fmt: skip
