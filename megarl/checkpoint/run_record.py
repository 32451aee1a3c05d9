"""What a training checkpoint records of its run, beside the weights: the config it was trained
with (``config.yaml`` in the step directory: ``<output_dir>/config.yaml`` is the latest launch's
and may have changed since), model.path's config.json as it was (``model_config.json``: `megarl
convert` writes model.path's config.json beside the trained weights, and refuses one that changed
since; a resume too), critic.path's when the critic trains from its own model
(``critic_model_config.json``: a resume with a critic model of another shape is refused), the
run's metrics.jsonl up to the step (``metrics.jsonl``: the records of the history that led to
it) and the directory the run was launched from (``launch_dir`` in the manifest's metadata),
against which the config's relative paths resolve wherever the checkpoint is read later (`megarl
convert`, the resume check before a launch)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

RUN_CONFIG = "config.yaml"
MODEL_CONFIG = "model_config.json"
CRITIC_MODEL_CONFIG = "critic_model_config.json"
METRICS_HISTORY = "metrics.jsonl"  # <output_dir>/metrics.jsonl as it was at the save
LAUNCH_DIR = "launch_dir"

# A LoRA run's policy checkpoint names the base model its adapters adapt in this file (its path and
# fingerprints: megarl/megatron_runtime/training.py writes it, the planner reads it before Ray starts).
LORA_BASE_FILE = "lora_base.json"


def run_metadata() -> dict[str, str]:
    """The manifest metadata a save records: where this run was launched."""
    return {LAUNCH_DIR: os.getcwd()}


def run_config(ckpt: Any, config: str | Path | None = None) -> Any:
    """The config the checkpoint was trained with, its relative model paths made absolute
    against the run's launch directory (or, for --config, the current one first); a model.path
    that no longer holds a model is refused (ConfigError)."""
    from megarl.config.loading import ConfigError, load_config

    cfg_path = Path(config) if config else saved_config_path(ckpt)
    if not cfg_path.is_file():
        raise ConfigError(f"no run config at {cfg_path}; pass --config with the config the run was launched with")
    cfg = load_config(cfg_path)
    bases = ([Path.cwd()] if config else []) + launch_dirs(ckpt, cfg.trainer.output_dir) + [Path.cwd()]
    updates = {}
    for section, value in (("model", cfg.model.path), ("critic", cfg.critic.path)):
        if value is None:
            continue
        if Path(value).is_absolute():
            # The export's ranks read model.path (a missing one fails there as a hub repo id, once Ray is up); the critic's is not read.
            if section == "model" and not (Path(value) / "config.json").is_file():
                raise ConfigError(f"{section}.path ({value}) of {cfg_path} has no config.json (moved or deleted since the run?); "
                                  f"pass --config with a config whose {section}.path holds the model the run trained from")
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


def record_model_configs(folder: Path, cfg: Any) -> None:
    """Copy model.path's config.json, and critic.path's when the critic trains from its own model
    (each when it has one), into the checkpoint ``folder``."""
    models = {MODEL_CONFIG: cfg.model.path, CRITIC_MODEL_CONFIG: cfg.critic.path if cfg.critic_enabled else None}
    for name, model_path in models.items():
        source = Path(model_path) / "config.json" if model_path else None
        if source is not None and source.is_file():
            shutil.copyfile(source, folder / name)


def record_metrics(folder: Path, output_dir: str | Path) -> None:
    """Copy the run's metrics.jsonl (when it logs one) into the checkpoint ``folder``: the records
    of the history that led to this step, which a resume from it takes back where the file has
    gone on with another history (megarl/trainer/metric_sinks.py)."""
    source = Path(output_dir) / METRICS_HISTORY
    if source.is_file():
        shutil.copyfile(source, folder / METRICS_HISTORY)


def model_config_change(ckpt: Any, model_path: str) -> str | None:
    """Why ``model_path``'s config.json is not the one ``ckpt`` was trained with (its fields that
    differ), or None: the same, or nothing to compare (a checkpoint of an older megarl, an
    unreadable file, which the export's own load reports). An edited rope_theta or rope_scaling
    changes no weight shape, so without this the export would carry it silently."""
    differ = model_config_differences(ckpt, model_path)
    if not differ:
        return None
    return (f"model.path {model_path}: config.json differs from the one {ckpt.path.name} was trained with "
            f"({'; '.join(differ)}); restore it (a copy is {ckpt.path / MODEL_CONFIG}), or pass --config with a "
            "model.path whose config.json is the trained one")


def model_config_differences(ckpt: Any, model_path: str) -> list[str]:
    """The fields of ``model_path``'s config.json that differ from the copy ``ckpt`` keeps of the
    one it was trained with (empty: none, or nothing to compare)."""
    from megarl.checkpoint.model_checkpoint import config_differences

    try:
        recorded = json.loads((ckpt.path / MODEL_CONFIG).read_text())
        current = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return []
    return config_differences(recorded, current)
