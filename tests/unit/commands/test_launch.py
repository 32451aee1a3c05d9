"""`megarl launch` refuses a bad config before Ray starts; the CLI reports user errors as
`error:` lines with exit code 2 (EXIT_USER). (No wall-clock bound here: with the demo's model in
outputs/demo, after `make demo`, the planner reads its config through transformers.)"""

import subprocess
import sys
from pathlib import Path

import pytest
import ray

from megarl.config.loading import ConfigError
from megarl.plan.planner import PlanError
from megarl.trainer.launch import launch

TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny_grpo.yaml"


@pytest.mark.parametrize(
    ("overrides", "error", "text"),
    [
        (["actor.parallel.tp=3"], PlanError, "actor.parallel.tp: (3) must divide num_attention_heads (4)"),
        (["rollout.nn=2"], ConfigError, "did you mean rollout.n?"),
        (["data.train_files=[/nonexistent/train.parquet]"], PlanError, "/nonexistent/train.parquet does not exist"),
        (["cluster.nnodes=2"], PlanError, "cluster.nnodes: (2) nodes, but no Ray cluster is given, so Ray would start "
         "on this machine alone; start Ray on the 2 nodes"),
    ],
)
def test_refused_before_ray(overrides, error, text):
    assert not ray.is_initialized()
    with pytest.raises(error) as info:
        launch(TINY, overrides)
    assert text in str(info.value)
    assert not ray.is_initialized()


def test_cli_exit_code_and_message():
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", "launch", str(TINY), "actor.parallel.pp=3"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: the plan is refused:")
    assert "actor.parallel.pp: (3) must divide num_layers (2)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_overrides_may_follow_options():
    from megarl.cli import main

    # --json sits between the config and the overrides; the override still applies (and fails).
    assert main(["plan", str(TINY), "--json", "actor.parallel.pp=3"]) == 2
    with pytest.raises(SystemExit):
        main(["plan", str(TINY), "--json", "--no-such-flag"])


def test_the_demo_finds_its_config_from_another_directory(tmp_path, monkeypatch):
    from megarl.commands.demo import _demo_config

    monkeypatch.chdir(tmp_path)  # no configs/ here: the checkout's default config
    assert Path(_demo_config("configs/tiny_grpo.yaml")) == TINY
    assert _demo_config("mine.yaml") == "mine.yaml"  # a config the user names is theirs to get right


def test_the_terminal_shows_megarl_and_warnings_and_the_driver_log_has_the_libraries_info_too(tmp_path, caplog):
    # --in-process runs Megatron in the driver: its config dumps, gradient-bucket listings and
    # "Apex is not installed" warnings filled the terminal around megarl's own lines
    import logging
    import sysconfig
    import warnings

    from megarl.terminal import CPU_COMPAT, MEGARL_DIR, for_the_terminal
    from megarl.trainer.launch import driver_log

    def record(name: str, level: int, message: str, path: str = "/home/me/rewards.py") -> logging.LogRecord:
        return logging.LogRecord(name, level, path, 1, message, None, None)

    megatron = f"{sysconfig.get_path('purelib')}/megatron/core/optimizer/__init__.py"
    assert for_the_terminal(record("megarl.trainer.loop", logging.INFO, "training steps 1 to 3", f"{MEGARL_DIR}trainer/loop.py"))
    assert for_the_terminal(record("my_rollout", logging.INFO, "my generate function's note"))  # your own code
    assert for_the_terminal(record("megatron.core.optimizer", logging.WARNING, "loss scale lowered", megatron))
    assert not for_the_terminal(record("megatron.core.optimizer", logging.INFO, "Setting up optimizer with config", megatron))
    assert not for_the_terminal(record("py.warnings", logging.WARNING, f"{megatron}:24: UserWarning: Apex is not installed"))
    assert Path(CPU_COMPAT).is_file()  # (torch's warnings on the libraries' calls on CPU point at its forwarding line)
    assert not for_the_terminal(record("py.warnings", logging.WARNING, f"{CPU_COMPAT}:66: UserWarning: .grad of a non-leaf"))
    assert for_the_terminal(record("py.warnings", logging.WARNING, "/home/me/rewards.py:3: UserWarning: mine"))
    log = tmp_path / "logs" / "driver.log"
    caplog.set_level(logging.INFO)  # as the CLI sets it
    with driver_log(log), warnings.catch_warnings():
        warnings.simplefilter("always")
        logging.getLogger("megatron.core.optimizer").info("Setting up optimizer with config")
        warnings.warn("Apex is not installed", UserWarning, stacklevel=1)
    text = log.read_text()
    assert "INFO megatron.core.optimizer: Setting up optimizer with config" in text
    assert "WARNING py.warnings: " in text and "UserWarning: Apex is not installed" in text


def test_the_cli_terminal_log_leaves_a_librarys_info_out():
    # what `megarl` sets up in a fresh process (pytest's own handlers would make it a no-op here)
    code = ("import logging, sysconfig; from megarl.terminal import setup_logging; setup_logging(); "
            "logging.getLogger('megarl.x').info('kept'); logging.getLogger('lib').handle(logging.LogRecord("
            "'lib', logging.INFO, sysconfig.get_path('purelib') + '/lib/m.py', 1, 'dropped', None, None))")
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr
    assert "INFO megarl.x: kept" in err and "dropped" not in err
