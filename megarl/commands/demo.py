"""`megarl demo`: the CPU demo end to end (what `make demo` runs).

Builds, once, a tiny random-init Qwen2 model with a digit vocabulary and the reverse-three-
digits task data under ``outputs/demo/``, then launches configs/tiny_grpo.yaml (embedded Ray,
a 2-process Megatron policy, the torch engine, rewards in worker processes) and plots the curves.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from megarl.commands.arguments import user_path
from megarl.commands.supervision import Supervision, driver_user_code, supervised_command
from megarl.config.loading import ConfigError
from megarl.data.tasks import TASK_VOCAB, write_reverse_digits
from megarl.data.tool_sums import CALL_MARKERS, TOOL_SUM_VOCAB, write_tool_sums
from megarl.models.tiny import build_tiny_model

# The demo model: the size a plain calibration probe (HF model + hand-written GRPO) learned the task with.
DEMO_MODEL: dict[str, Any] = dict(arch="qwen2", task_vocab=TASK_VOCAB, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                  ffn_hidden_size=128, max_position_embeddings=64)
# The mixture-of-experts demo's (configs/tiny_moe_grpo.yaml): the same size with 4 experts of
# which each token takes 2, in both layers.
DEMO_MOE_MODEL: dict[str, Any] = dict(DEMO_MODEL, arch="qwen3_moe", num_experts=4, experts_per_token=2, moe_ffn_hidden_size=64)
# The DeepSeek-V3 demo's (configs/tiny_dsv3_grpo.yaml): the same width in 3 layers, the first
# dense; multi-latent attention with a low-rank query, 4 routed experts (top-2 of 2 groups, 1 group
# per token) beside 1 shared expert, a sigmoid router with a correction bias, a scaling factor of
# 2.5 (megarl/models/tiny_deepseek_v3.py's defaults).
DEMO_DSV3_MODEL: dict[str, Any] = dict(DEMO_MODEL, arch="deepseek_v3", num_layers=3, deepseek={"moe_intermediate_size": 64})
# The tool-use demo's (configs/tiny_tool_agent.yaml): the same size, with the digits, '+' and the
# two tool-call markers (one token each) as its vocabulary.
DEMO_TOOL_MODEL: dict[str, Any] = dict(DEMO_MODEL, task_vocab=TOOL_SUM_VOCAB, markers=CALL_MARKERS)
# The model a demo config's model.arch asks for.
DEMO_MODELS: dict[str, dict[str, Any]] = {"tiny-demo": DEMO_MODEL, "tiny-moe-demo": DEMO_MOE_MODEL,
                                          "tiny-dsv3-demo": DEMO_DSV3_MODEL, "tiny-tool-demo": DEMO_TOOL_MODEL}
# The task data a demo model trains on: the reversal, unless named here.
DEMO_DATA: dict[str, Callable[..., object]] = {"tiny-tool-demo": write_tool_sums}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="the CPU demo: GRPO teaches a tiny model to reverse three digits (what `make demo` runs)",
        description="Builds a tiny random-init model and the task data under --root (once), trains it with "
        "configs/tiny_grpo.yaml on this machine (embedded Ray, 2 Megatron processes, torch engine) and writes "
        "<root>/run/curves.png.",
    )
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. trainer.total_steps=50")
    p.add_argument("--config", type=user_path, default="configs/tiny_grpo.yaml",
                   help="the demo config (default: %(default)s, from this directory, else from the checkout megarl runs from)")
    p.add_argument("--root", type=user_path, default=None,
                   help="where the model, data and run go (default: the folder of the config's model.path: outputs/demo "
                        "for configs/tiny_grpo.yaml, outputs/moe-demo for configs/tiny_moe_grpo.yaml, outputs/dsv3-demo for "
                        "configs/tiny_dsv3_grpo.yaml, outputs/tool-demo for configs/tiny_tool_agent.yaml)")
    p.set_defaults(handler=supervised_command(_run, _prepare))


def _prepare(args: argparse.Namespace) -> Supervision:
    """A config mistake: its line from the command's process, no driver started. The driver
    reports the command that resumes the demo (its launch does)."""
    from megarl.config.loading import load_config
    from megarl.trainer.run_lock import output_dir_lock

    config = _demo_config(args.config)
    # the run folder the driver's launch holds (a trainer.output_dir override wins, as in run_demo)
    run_dir = f"trainer.output_dir={demo_run_dir(args.root or default_root(config), args.overrides)}"
    cfg = load_config(config, [run_dir, *args.overrides])
    # another demo into the same folder: refused before the driver's seconds of imports, as launch does
    return Supervision(user_code=driver_user_code(cfg), holds=partial(output_dir_lock, cfg.trainer.output_dir))


def _run(args: argparse.Namespace) -> int:
    config = _demo_config(args.config)
    print(f"curves: {run_demo(config, args.overrides, args.root or default_root(config))}")
    return 0


def default_root(config: str | Path) -> Path:
    """The demo's folder of ``config``: where its model.path lies (``<root>/model``)."""
    from megarl.config.loading import load_config

    path = load_config(config).model.path
    return Path(path).parent if path else Path("outputs/demo")


def _demo_config(config: str) -> str:
    """``config`` as given; the default one, when this directory has none, from the checkout
    that holds this megarl (an editable install run from elsewhere)."""
    checkout = Path(__file__).resolve().parents[2] / config
    if config == "configs/tiny_grpo.yaml" and not Path(config).is_file() and checkout.is_file():
        return str(checkout)
    return config


def demo_command(config: str | Path, overrides: list[str], root: str | Path) -> str:
    """The `megarl demo` command line that resumes this demo run."""
    args = ["megarl", "demo", *(o for o in overrides if not o.startswith("trainer.resume="))]
    args += ["--root", str(root)] if Path(root) != default_root(config) else []
    args += ["--config", str(config)] if str(config) != "configs/tiny_grpo.yaml" else []
    if any(o.startswith("trainer.resume=") and o != "trainer.resume=auto" for o in overrides):
        args.append("trainer.resume=auto")
    return shlex.join(args)


# The real SGLang server on this CPU (`megarl demo rollout.engine=sglang`): a pool of its own
# (its CPU engine cannot release memory), one server next to the 2 policy ranks, weights pushed
# over a gloo group as a disaggregated GPU run pushes them over NCCL.
SGLANG_ON_CPU = ("cluster.placement=disaggregated", "cluster.gpus_per_node=3", "cluster.rollout_gpus=1",
                 "rollout.mem_fraction=0.05")  # fmt: skip


def sglang_on_cpu(overrides: list[str]) -> list[str]:
    """The placement the demo needs for ``rollout.engine=sglang`` on CPU (before the user's own
    overrides, which win), with the interpreter `make sglang-cpu` built when none is given."""
    if "rollout.engine=sglang" not in overrides:
        return []
    extra = list(SGLANG_ON_CPU)
    if not any(o.startswith("rollout.server_python=") for o in overrides):
        from megarl.rollout_sglang.cpu_venv import sglang_cpu_python

        python = sglang_cpu_python()
        if python is not None:
            extra.append(f"rollout.server_python={python}")
    return extra


def prepare_demo(root: str | Path = "outputs/demo", seed: int = 0, arch: str = "tiny-demo") -> tuple[Path, Path]:
    """Model and data directories under ``root`` (made if missing; each is built beside its place
    and renamed in whole, so an interrupted build never leaves half a model). ``arch``: the
    demo model (DEMO_MODELS) the config names in model.arch."""
    if arch not in DEMO_MODELS:
        raise ConfigError(f"model.arch ({arch}) names no demo model; a demo config uses one of {', '.join(DEMO_MODELS)}")
    root = Path(root)
    model = root / "model"
    _check_demo_model(model, arch)
    if not (model / "config.json").is_file():
        _build_in_place(model, lambda tmp: build_tiny_model(tmp, seed=seed, **DEMO_MODELS[arch]))
    data = root / "data"
    if not (data / "train.parquet").is_file() or not (data / "val.parquet").is_file():
        write = DEMO_DATA.get(arch, write_reverse_digits)
        _build_in_place(data, lambda tmp: write(tmp, seed=seed))
    return model, data


def _check_demo_model(model: Path, arch: str) -> None:
    """Refuse a demo root whose model is another demo's (the dense one under the MoE config)."""
    import json

    if not (model / "config.json").is_file():
        return
    found, wanted = json.loads((model / "config.json").read_text()).get("model_type"), DEMO_MODELS[arch]["arch"]
    if found != wanted:
        raise ConfigError(f"{model} holds a {found} model, and this config's model.arch ({arch}) is a {wanted} one; "
                         f"give this demo its own --root (e.g. --root outputs/{arch.removeprefix('tiny-')})")  # fmt: skip


def _build_in_place(target: Path, build: Callable[[Path], object]) -> None:
    staging = target.with_name(f".{target.name}.staging-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)  # ours: a leftover of this very process id
    try:
        build(staging)
        if target.is_dir() and not any(target.iterdir()):
            target.rmdir()
        try:
            os.rename(staging, target)
        except OSError as exc:
            raise OSError(exc.errno, f"{exc.strerror}: it holds files but not a complete demo {target.name}; move it "
                          "away or use another --root", str(target)) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# Seconds a demo step takes on a 2-core CPU, by engine: the torch engine's 500 steps take 1.5 to
# 3.5 minutes (README); through the SGLang CPU server a step takes about 4 s.
DEMO_STEP_S = {"torch": 0.4, "sglang": 4.0}
LONG_DEMO_S = 300.0  # a demo expected to run longer than this says so before it starts


def long_demo_note(cfg: Any) -> str | None:
    """The line a demo expected to run for long (``cfg``: its config, overrides applied) prints
    before it starts: how long, and how to shorten it; None for a short one."""
    steps, engine = cfg.trainer.total_steps, cfg.rollout.engine
    seconds = steps * DEMO_STEP_S[engine] if steps is not None and engine in DEMO_STEP_S else 0.0
    if seconds < LONG_DEMO_S:
        return None
    return (f"megarl demo: {steps} steps (trainer.total_steps) of about {DEMO_STEP_S[engine]:g} s each with "
            f"rollout.engine={engine} take about {seconds / 60:.0f} minutes on a 2-core CPU; add trainer.total_steps=4 "
            "for a short run (Ctrl-C stops it after a step, saved: the same command resumes)")  # fmt: skip


def demo_run_dir(root: str | Path, overrides: list[str]) -> Path:
    """The demo's run folder under ``root``: ``run``, or ``run-sglang`` for the SGLang variant, so
    that it trains from step 0 beside an earlier torch-engine run instead of resuming it (a
    finished `make demo` would leave it nothing to train)."""
    return Path(root) / ("run-sglang" if "rollout.engine=sglang" in overrides else "run")


def run_demo(config: str | Path, overrides: list[str], root: str | Path = "outputs/demo") -> Path:
    """Prepare, train, plot; returns the PNG of the curves."""
    from megarl.commands.curves import plot_run
    from megarl.config.loading import load_config
    from megarl.trainer.launch import launch

    asked = load_config(config, overrides)
    if note := long_demo_note(asked):
        print(note, flush=True)
    model, data = prepare_demo(root, arch=asked.model.arch or "tiny-demo")
    paths = [f"model.path={model}", f"data.train_files=[{data / 'train.parquet'}]", f"data.val_files=[{data / 'val.parquet'}]",
             f"trainer.output_dir={demo_run_dir(root, overrides)}", *sglang_on_cpu(overrides)]
    launch(config, [*paths, *overrides], resume_command=demo_command(config, overrides, root))
    cfg = load_config(config, [*paths, *overrides])
    return plot_run(cfg.trainer.output_dir)
