"""rollout.engine_kwargs (verl's engine_kwargs.sglang): SGLang server arguments by ServerArgs field
name, checked against the table of the pinned SGLang (megarl/config/sglang_server_args.py) and
turned into the server's flags."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megarl.config.loading import load_config
from megarl.config.rollout_sections import OWNED_ENGINE_KWARGS, RolloutConfig
from megarl.config.sections import ClusterConfig
from megarl.config.sglang_server_args import SERVER_ARGS, SGLANG_VERSION
from megarl.plan.rollout_checks import OWNED_SERVER_ARGS
from megarl.rollout_sglang.server import build_launch_command, spec_from_config

ROOT = Path(__file__).resolve().parents[3]


def _error(overrides: list[str]) -> str:
    with pytest.raises(Exception) as info:
        load_config(None, ["model.path=/m", *overrides])
    lines = str(info.value).strip().splitlines()
    return lines[-1].strip().removeprefix("- ") if lines else ""


def test_engine_kwargs_become_flags_before_server_args():
    rollout = RolloutConfig(
        engine_kwargs={"chunked_prefill_size": 4096, "attention_backend": "torch_native", "disable_radix_cache": True,
                       "enable_mixed_chunk": False, "enable_tf32_matmul": False, "cuda_graph_bs_decode": [1, 2],
                       "json_model_override_args": {"rope_theta": 1e6}, "max_prefill_tokens": None},
        server_args=["--schedule-policy", "fcfs"],
    )  # fmt: skip
    cmd = build_launch_command(spec_from_config("/m", rollout, ClusterConfig()), 1)
    assert cmd[cmd.index("--chunked-prefill-size"):] == [
        "--chunked-prefill-size", "4096", "--attention-backend", "torch_native", "--disable-radix-cache",
        "--no-enable-tf32-matmul", "--cuda-graph-bs-decode", "1", "2", "--json-model-override-args",
        '{"rope_theta": 1000000.0}', "--schedule-policy", "fcfs",
    ]  # fmt: skip
    assert "--enable-mixed-chunk" not in cmd and "--max-prefill-tokens" not in cmd  # false switch, null: left out


def test_engine_kwargs_from_the_command_line_reach_the_config():
    cfg = load_config(None, ["model.path=/m", "rollout.engine_kwargs.chunked_prefill_size=2048", "rollout.engine_kwargs.disable_radix_cache=true"])
    assert cfg.rollout.engine_kwargs == {"chunked_prefill_size": 2048, "disable_radix_cache": True}


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("rollout.engine_kwargs.chunked_prefil_size=4096",
         "chunked_prefil_size (4096) is not a server argument of SGLang " + SGLANG_VERSION),
        ("rollout.engine_kwargs.chunked_prefil_size=4096", "did you mean chunked_prefill_size?"),
        ("rollout.engine_kwargs.tp_size=2", "tp_size (2) is set by megarl from rollout.tp; drop it"),
        ("rollout.engine_kwargs.mem_fraction_static=0.5", "is set by megarl from rollout.mem_fraction"),
        ("rollout.engine_kwargs.max_lora_rank=8", "is set by megarl from actor.lora"),
        ("rollout.engine_kwargs.load_format=dummy", "load_format ('dummy') is set by megarl"),
        ("rollout.engine_kwargs.chunked_prefill_size=4k", "chunked_prefill_size ('4k') takes one value of type int"),
        ("rollout.engine_kwargs.attention_backend=flash", "is not one of SGLang's choices for --attention-backend"),
        ("rollout.engine_kwargs.disable_radix_cache=1", "is an on/off switch (--disable-radix-cache); give true or false"),
    ],
)  # fmt: skip
def test_unknown_owned_or_mistyped_engine_kwargs_are_one_line_errors(override, expected):
    line = _error([override])
    assert line.startswith("rollout.engine_kwargs: ") and expected in line, line


def test_a_flag_in_engine_kwargs_and_server_args_is_refused():
    line = _error(["rollout.engine_kwargs.disable_radix_cache=true", "rollout.server_args=[--disable-radix-cache]"])
    assert "rollout.engine_kwargs.disable_radix_cache and rollout.server_args both give --disable-radix-cache" in line


def test_every_flag_server_args_refuses_is_owned_in_engine_kwargs_too():
    flags = {entry[0]: name for name, entry in SERVER_ARGS.items()}
    aliases = {"--tp": "tp_size"}
    for flag in OWNED_SERVER_ARGS:
        assert (flags.get(flag) or aliases[flag]) in OWNED_ENGINE_KWARGS, flag
    assert set(OWNED_ENGINE_KWARGS) <= set(SERVER_ARGS)


def test_the_table_is_the_pinned_sglangs():
    pin = next(line for line in (ROOT / "ci/sglang-cpu/requirements.lock").read_text().splitlines() if line.startswith("sglang=="))
    assert pin == f"sglang=={SGLANG_VERSION}"


def test_the_table_matches_the_real_sglang(tmp_path):
    """The shipped table is what ci/sglang-cpu/server_args_table.py writes from the real SGLang
    (skipped without `make sglang-cpu`'s venv)."""
    from megarl.rollout_sglang.cpu_venv import sglang_cpu_python

    python = sglang_cpu_python()
    if python is None:
        pytest.skip("no SGLang CPU venv (make sglang-cpu)")
    out = tmp_path / "table.py"
    subprocess.run([str(python), str(ROOT / "ci/sglang-cpu/server_args_table.py"), str(out)], check=True, timeout=300)
    assert out.read_text() == (ROOT / "megarl/config/sglang_server_args.py").read_text()
    assert sys.executable  # (the trainer's own Python never imports SGLang for the check)
