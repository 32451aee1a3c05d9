"""What a training checkpoint records of its run, beside the weights: the config it was trained
with (``config.yaml`` in the step directory: ``<output_dir>/config.yaml`` is the latest launch's
and may have changed since) and the directory the run was launched from (``launch_dir`` in the
manifest's metadata), against which the config's relative paths resolve wherever the checkpoint
is read later (`megarl convert`, the resume check before a launch)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

RUN_CONFIG = "config.yaml"
LAUNCH_DIR = "launch_dir"


def run_metadata() -> dict[str, str]:
    """The manifest metadata a save records: where this run was launched."""
    return {LAUNCH_DIR: os.getcwd()}


def run_config(ckpt: Any, config: str | Path | None = None) -> Any:
    """The config the checkpoint was trained with, its relative model paths made absolute
    against the run's launch directory (or, for --config, the current one first)."""
    from megarl.config.loading import ConfigError, load_config

    cfg_path = Path(config) if config else saved_config_path(ckpt)
    if not cfg_path.is_file():
        raise ConfigError(f"no run config at {cfg_path}; pass --config with the config the run was launched with")
    cfg = load_config(cfg_path)
    bases = ([Path.cwd()] if config else []) + launch_dirs(ckpt, cfg.trainer.output_dir) + [Path.cwd()]
    updates = {}
    for section, value in (("model", cfg.model.path), ("critic", cfg.critic.path)):
        if value is None or Path(value).is_absolute():
            continue
        found = next((b / value for b in bases if (b / value / "config.json").is_file()), None)
        if found is None:
            raise ConfigError(
                f"{section}.path ({value}) of {cfg_path} is relative, and no {value}/config.json exists under the run's "
                f"launch directory ({bases[0]}) or here; pass --config with a config whose {section}.path exists"
            )
        updates[section] = getattr(cfg, section).model_copy(update={"path": str(found.resolve())})
    return cfg.model_copy(update=updates)


def saved_config_path(ckpt: Any) -> Path:
    """The config the checkpoint was trained with: in its step directory (written with every
    checkpoint), or for older ones the run's (<output_dir>/config.yaml)."""
    saved = ckpt.path / RUN_CONFIG
    return saved if saved.is_file() else ckpt.path.parent.parent / RUN_CONFIG


def other_dtype_note(ckpt: Any, dtype: str) -> str | None:
    """A note when ``dtype`` (--config's model.dtype) is not the one the run trained in: the export
    casts the checkpoint's weights to it (rounding fp32 weights to bf16, or widening bf16 ones
    with no precision gained, should not pass unmentioned); None when they agree or it is unknown."""
    from megarl.config.loading import ConfigError, load_config

    try:
        trained = load_config(saved_config_path(ckpt)).model.dtype
    except ConfigError:  # no saved config: nothing to compare
        return None
    if trained == dtype:
        return None
    effect = "widened (no precision gained)" if dtype == "float32" else "rounded"
    return (f"note: --config has model.dtype={dtype}, {ckpt.path.name} was trained in {trained}: its weights are "
            f"{effect} to {dtype}; set model.dtype={trained} in --config to export them as trained")


def launch_dirs(ckpt: Any, output_dir: str) -> list[Path]:
    """Where the run was launched: recorded in the manifest, else what remains of the
    checkpoint's absolute path once <output_dir>/checkpoints/step_N is taken off its end."""
    found = []
    recorded = (ckpt.manifest.get("metadata") or {}).get(LAUNCH_DIR)
    if recorded:
        found.append(Path(recorded))
    tail = (*Path(output_dir).parts, "checkpoints", ckpt.path.name)
    parts = ckpt.path.absolute().parts
    if not Path(output_dir).is_absolute() and parts[-len(tail):] == tail:
        found.append(Path(*parts[: -len(tail)]))
    return found
