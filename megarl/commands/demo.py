"""`megarl demo`: the CPU demo end to end (what `make demo` runs).

Builds, once, a tiny random-init Qwen2 model with a digit vocabulary and the reverse-three-
digits task data under ``outputs/demo/``, then launches configs/tiny_grpo.yaml (embedded Ray,
a 2-process Megatron policy, the torch engine, rewards in worker processes) and plots the curves.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megarl.models.tiny import build_tiny_model

# The demo model: what the calibration probe learned the task with (shared/notes).
DEMO_MODEL = dict(arch="qwen2", task_vocab="0123456789", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  ffn_hidden_size=128, max_position_embeddings=64)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="the CPU demo: GRPO teaches a tiny model to reverse three digits (what `make demo` runs)",
        description="Builds a tiny random-init model and the task data under --root (once), trains it with "
        "configs/tiny_grpo.yaml on this machine (embedded Ray, 2 Megatron processes, torch engine) and writes "
        "<root>/run/curves.png.",
    )
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. trainer.total_steps=50")
    p.add_argument("--config", default="configs/tiny_grpo.yaml", help="the demo config (default: %(default)s)")
    p.add_argument("--root", default="outputs/demo", help="where the model, data and run go (default: %(default)s)")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    print(f"curves: {run_demo(args.config, args.overrides, args.root)}")
    return 0


def prepare_demo(root: str | Path = "outputs/demo", seed: int = 0) -> tuple[Path, Path]:
    """Model and data directories under ``root`` (made if missing)."""
    from megarl.data.tasks import write_reverse_digits

    root = Path(root)
    model = root / "model"
    if not (model / "config.json").is_file():
        build_tiny_model(model, seed=seed, **DEMO_MODEL)
    data = root / "data"
    if not (data / "train.parquet").is_file() or not (data / "val.parquet").is_file():
        write_reverse_digits(data, seed=seed)
    return model, data


def run_demo(config: str | Path, overrides: list[str], root: str | Path = "outputs/demo") -> Path:
    """Prepare, train, plot; returns the PNG of the curves."""
    from megarl.commands.launch import launch
    from megarl.commands.plot import plot_run
    from megarl.config.loading import load_config

    model, data = prepare_demo(root)
    paths = [f"model.path={model}", f"data.train_files=[{data / 'train.parquet'}]", f"data.val_files=[{data / 'val.parquet'}]",
             f"trainer.output_dir={Path(root) / 'run'}"]
    launch(config, [*paths, *overrides])
    cfg = load_config(config, [*paths, *overrides])
    return plot_run(cfg.trainer.output_dir)
