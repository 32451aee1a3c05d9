"""`megarl plot RUN_DIR`: reward, KL and entropy curves (or an SFT run's loss) from metrics.jsonl to a PNG.
RUN_DIR/metrics.jsonl itself is taken for RUN_DIR (what a shell's tab completion gives). The drawing:
megarl/commands/curves.py (`megarl demo` draws them too)."""

from __future__ import annotations

import argparse

from megarl.commands.arguments import user_path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="draw the reward, KL and entropy curves of a run (an SFT run: its losses) to an image",
                       description="Reads RUN_DIR/metrics.jsonl and writes the reward, KL and entropy curves (the "
                       "train and held-out loss for an SFT run's sft.output_dir).")
    p.add_argument("run_dir", type=user_path, help="a run's trainer.output_dir (or sft.output_dir), or its metrics.jsonl")
    p.add_argument("--out", type=user_path, default=None,
                   help="image to write; its extension picks the format: .png, .pdf, .svg, ... (default: RUN_DIR/curves.png, "
                   "replaced on each plot)")  # fmt: skip
    p.add_argument("--overwrite", action="store_true", help="replace the --out file if it exists")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from megarl.commands.curves import plot_run

    print(plot_run(args.run_dir, args.out, args.overwrite))
    return 0
