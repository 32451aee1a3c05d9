"""The curves of a run (reward, KL and entropy; an SFT run's losses) from its metrics.jsonl to an
image: `megarl plot` draws them on request, `megarl demo` at the end of its run."""

from __future__ import annotations

from pathlib import Path

from megarl.checkpoint.metrics_history import MetricsFileError, read_metrics

METRICS = "metrics.jsonl"
CURVES = (
    ("reward", (("reward/mean", "train reward (sampled)"), ("val/reward/mean", "held-out reward (validation)"))),
    ("KL to reference", (("actor/kl", "actor/kl"), ("reward/kl", "reward/kl (in the reward)"))),
    ("entropy", (("actor/entropy", "actor/entropy"),)),
    ("SFT loss", (("sft/loss", "train (per step)"), ("sft/val_loss", "held-out"))),
)


def plot_run(run_dir: str | Path, out: str | Path | None = None, overwrite: bool = False) -> Path:
    """Draw the curves of ``run_dir/metrics.jsonl``; returns the image's path. The default
    RUN_DIR/curves.png is plot's own and is replaced; an existing ``out`` only with ``overwrite``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if out is not None:
        _check_out(Path(out), overwrite)
    run = _run_folder(Path(run_dir))
    records = read_metrics(run / METRICS)
    if not records:
        raise FileNotFoundError(f"{run / METRICS} is missing or empty; is {run} a megarl output_dir?")
    panels = [(title, series) for title, series in CURVES if any(r.get(k) is not None for r in records for k, _ in series)]
    if not panels:  # nothing to draw: matplotlib would fail on a figure of no axes
        drawn = ", ".join(k for _, series in CURVES for k, _ in series)
        raise MetricsFileError(f"{run / METRICS} has none of the metrics plot draws ({drawn}); is {run} a megarl "
                               "RL or SFT output_dir?")  # fmt: skip
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, (title, series) in zip(axes[0], panels):
        for key, label in series:
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o" if len(points) < 30 else None, markersize=3, label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    target = Path(out) if out else run / "curves.png"
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return target


def _run_folder(path: Path) -> Path:
    """The run folder of RUN_DIR, or of its metrics.jsonl; any other file is refused, since the
    default curves.png is replaced without asking only in a run's folder."""
    if not path.is_file():
        return path
    if path.name == METRICS:
        return path.parent
    raise FileNotFoundError(f"{path} is a file, not a run's folder or its {METRICS}; give the folder "
                            "(trainer.output_dir or sft.output_dir)")


def _check_out(out: Path, overwrite: bool) -> None:
    """Refuse --out before the metrics are read: a format matplotlib cannot write (it would fail
    only after drawing), a folder, or a file the user has (replaced only with --overwrite)."""
    from matplotlib.backend_bases import FigureCanvasBase

    from megarl.commands.outputs import OutputError, check_new_file

    if out.is_dir():
        raise OutputError(f"--out {out} is a directory; name an image file, e.g. {out / 'curves.png'}")
    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    if out.suffix.lstrip(".").lower() not in formats:
        got = f"extension {out.suffix}" if out.suffix else "no extension"
        raise OutputError(f"--out {out} has {got}; name an image file ending in one of: {', '.join(formats)} (e.g. curves.png)")
    check_new_file(out, overwrite, in_existing_folder=True)
