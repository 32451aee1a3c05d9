"""The planner's checks of the loop's own settings (trainer.*) that need no file: validation asked
for with no validation files, and a hang watchdog shorter than a checkpoint save.

Both are valid settings that do not do what their user meant: validation that never runs, and a
watchdog that stops the run in its first save (the final one included). The save's time is the
plan's estimate: the checkpoint's bytes (:func:`checkpoint_bytes`, what the free-space check
before a save uses too) written by every training GPU at once at cluster.host_gb_per_s, plus
what a save costs whatever its size (the ranks' agreement, the manifest, fsync). A watchdog
shorter than the bytes alone take is refused (no save can finish); one shorter than the whole
estimate is a warning (a fast filesystem may beat it). Data-dependent checks of the loop (the
prompts repeated within a step) are the preflight's (megarl/plan/preflight.py).
"""

from __future__ import annotations

from megarl.config.sections import MegaRLConfig
from megarl.plan.disk_space import checkpoint_bytes
from megarl.plan.issues import Issue

# What a checkpoint save takes whatever its size: a tiny model's save on a 2-core CPU box takes
# about 2.5 s (the ranks agree on the files, write the manifest, fsync); a GPU node is no slower.
SAVE_OVERHEAD_S = 2.0


def save_seconds(cfg: MegaRLConfig) -> tuple[float, float]:
    """(the bytes' share, the whole estimate) of one checkpoint save, in seconds: every training
    GPU writes its part of :func:`checkpoint_bytes` at cluster.host_gb_per_s."""
    writers = cfg.cluster.world_size - (cfg.cluster.rollout_gpus if cfg.cluster.placement == "disaggregated" else 0)
    share = checkpoint_bytes(cfg) / max(1, writers) / (cfg.cluster.host_gb_per_s * 1e9)
    return share, share + SAVE_OVERHEAD_S


def check_watchdog(cfg: MegaRLConfig, issues: list[Issue]) -> None:
    """trainer.hang_timeout_s against the plan's estimate of a save (module docstring)."""
    timeout = cfg.trainer.hang_timeout_s
    if not timeout:
        return
    share, whole = save_seconds(cfg)
    gib = checkpoint_bytes(cfg) / 1024**3
    what = (f"({timeout:g} s) is shorter than a checkpoint save is expected to take ({whole:.1f} s for {gib:.3g} GiB at "
            f"cluster.host_gb_per_s={cfg.cluster.host_gb_per_s:g}), and the watchdog sees no progress while one runs")
    if timeout < share:
        issues.append(Issue("trainer.hang_timeout_s", f"{what}: every save would stop the run; raise it above {whole:.0f} s, "
                            "or set it to 0 for no watchdog"))  # fmt: skip
    elif timeout < whole:
        issues.append(Issue("trainer.hang_timeout_s", f"{what}: a slow save stops the run, the final one included; raise it "
                            f"above {whole:.0f} s, or set it to 0 for no watchdog", level="warning"))  # fmt: skip


def check_validation_files(cfg: MegaRLConfig, issues: list[Issue]) -> None:
    """Validation asked for (trainer.eval_freq, eval_before_train, val_only) with no data.val_files:
    the loop skips it without a word, and a val_only run has nothing to do."""
    t = cfg.trainer
    if cfg.data.val_files:
        return
    if t.val_only:
        issues.append(Issue("trainer.val_only", "is true and data.val_files is empty: there is nothing to validate; "
                            "give data.val_files, or set trainer.val_only=false"))  # fmt: skip
        return
    asked = [f"trainer.eval_freq={t.eval_freq}"] * bool(t.eval_freq) + ["trainer.eval_before_train=true"] * t.eval_before_train
    if asked:
        issues.append(Issue(asked[0].split("=")[0], f"{' and '.join(asked)} {'ask' if len(asked) > 1 else 'asks'} for validation, and data.val_files is empty: "
                            "no validation runs; give data.val_files, or set trainer.eval_freq=0", level="warning"))  # fmt: skip
