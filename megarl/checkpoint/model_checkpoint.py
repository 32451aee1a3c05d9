"""A model as a Megatron dist-checkpoint (what `megarl convert hf-to-megatron` writes).

A directory that names the model it came from and can stand where an HF directory stands
(``model.path``, ``critic.path``)::

    CKPT_DIR/
      megarl_megatron.json   the record: kind, megarl version, source HF directory, the layout it
                             was written with (tp, pp, ep), dtype, the HF config (config.json) it came
                             from, every file written, and the weight files' sizes
      config.json, generation_config.json, tokenizer files   copied from the HF directory
      megatron/              the weights: Megatron ``dist_checkpointing`` (torch_dist) of the
                             model's sharded state dict, under the key "model"

Megatron's sharded state dict names every tensor by its global shape and the piece each rank
holds, so a run with another TP/PP layout loads it (resharding on load). The vocabulary rows a
layout adds as padding are stored as the layout had them; a layout with other padding loads the
rows both have and zeros past them (Megatron's ``allow_shape_mismatch`` for the embedding and
output layer), which equals the HF import's zero padding. There are no safetensors: the
engines start from the config (the torch engine from random weights, SGLang with
``load_format=dummy``) and get the weights from the trainer's initial push.

A record whose HF config differs from the config.json beside it (the directory was edited, or
files of another model copied in) is refused by name of the differing fields.
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megarl.config.differences import ABSENT, differences

RECORD = "megarl_megatron.json"
WEIGHTS = "megatron"
KIND = "megarl hf-to-megatron"
SFT_SOURCE = "megarl sft of "  # the record's source of weights `megarl sft` trained (no conversion remakes them)
SFT_MODEL_DIR = "model"  # where `megarl sft` writes its model checkpoint in sft.output_dir
# Bookkeeping keys of an HF config.json that say nothing about the model.
_CONFIG_NOISE = {"_name_or_path", "transformers_version"}


class ModelCheckpointError(ValueError):
    """A model checkpoint directory that cannot be used; the message says why and what to do."""


def is_model_checkpoint(path: str | os.PathLike | None) -> bool:
    """Whether ``path`` is a directory written by `megarl convert hf-to-megatron`."""
    return path is not None and (Path(path) / RECORD).is_file()


def sft_output_hint(path: str | os.PathLike | None) -> str:
    """For a folder `megarl sft` wrote (sft.output_dir) given where a model goes, the clause that
    names the model checkpoint in it (what README's commands pass); "" for any other path."""
    inner = Path(path or "") / SFT_MODEL_DIR
    return f"it is an sft.output_dir: give the model checkpoint in it, {inner}" if path and is_model_checkpoint(inner) else ""


def read_record(path: str | os.PathLike) -> dict[str, Any]:
    """The record of the model checkpoint at ``path`` (ModelCheckpointError if unreadable)."""
    record_path = Path(path) / RECORD
    try:
        record = json.loads(record_path.read_text())
        if record.get("kind") != KIND or not isinstance(record.get("hf_config"), dict):
            raise ValueError(f"kind {record.get('kind')!r} or hf_config missing")
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelCheckpointError(f"{record_path} is unreadable ({exc}); convert the HF model again with "
                                   "`megarl convert hf-to-megatron`") from None
    return record


def write_record(directory: str | os.PathLike, *, source: str, tp: int, pp: int, dtype: str, hf_config: dict[str, Any],
                 verified_parameters: int | None, ep: int = 1, etp: int = 1) -> None:  # fmt: skip
    """Write the record of the model checkpoint in ``directory``, listing every file already there."""
    import megarl

    directory = Path(directory)
    files = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() and p.name != RECORD)
    record = {"kind": KIND, "megarl_version": megarl.__version__, "time": time.time(), "source": source, "tp": tp,
              "pp": pp, "ep": ep, "etp": etp, "dtype": dtype, "hf_config": hf_config, "verified_parameters": verified_parameters,
              "files": files, "sizes": {f: (directory / f).stat().st_size for f in files if f.startswith(f"{WEIGHTS}/")}}  # fmt: skip
    (directory / RECORD).write_text(json.dumps(record, indent=1) + "\n")


def write_verified(staging: Path, source: Path, record: dict[str, Any], save: Callable[[str], Any],
                   verify: Callable[[str], int]) -> int:  # fmt: skip
    """A model checkpoint in ``staging`` (megarl/commands/model_outputs.py: staged_output):
    ``save(weights dir)``, the HF side files of ``source``, the record; then ``verify(staging)``
    loads it back into a fresh model and compares every parameter, and the record gets the
    count. Returns the count."""
    from megarl.models.hf_files import copy_side_files

    save(str(staging / WEIGHTS))
    copy_side_files(source, staging)
    if not (staging / "config.json").is_file():  # the source went away since the start (an SFT of hours)
        raise FileNotFoundError(f"{source} has no config.json any more, so the model's config and tokenizer files "
                                "were not copied beside the weights; copy them in from the model trained from")
    write_record(staging, **record, verified_parameters=None)  # the verify load recognises it by its record
    checked = verify(str(staging))
    write_record(staging, **record, verified_parameters=checked)
    return checked


def config_differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``field: recorded A, now B`` for every model field that differs between two HF configs
    (a nested one, e.g. rope_scaling.factor, by its dotted key; as transformers reads them, with
    the current file's own key where it holds the field elsewhere)."""
    show = lambda v: "absent" if v is ABSENT else json.dumps(v)  # noqa: E731
    differ = differences(_as_transformers_reads(recorded), _as_transformers_reads(current))
    return [f"{_as_written(key, current)}: recorded {show(a)}, now {show(b)}" for key, (a, b) in sorted(differ.items())
            if key.split(".")[0] not in _CONFIG_NOISE]  # fmt: skip


def _as_written(key: str, written: dict[str, Any]) -> str:
    """``key`` (as transformers reads the config) and, where the file ``written`` holds that
    field under another key, that one too: a transformers 4 config.json keeps
    rope_parameters.rope_theta as rope_theta, and the user looks for what their file says."""

    def leaves(d: dict[str, Any], prefix: str = "") -> list[str]:
        return [p for k, v in d.items() for p in (leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"])]

    found = [p for p in leaves(written) if p.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1]]
    return key if key in found or len(found) != 1 else f"{key} (the file's {found[0]})"


def _as_transformers_reads(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` as the installed transformers reads it (its config class's to_dict): a
    config.json re-saved by another transformers version is the same model (version 5 moves
    rope_theta into rope_parameters and writes layer_types; a field left at its default may be
    written or not). A model_type transformers does not know, or values its class refuses:
    the file's own fields."""
    from transformers import CONFIG_MAPPING
    from transformers.utils import logging as hf_logging

    model_type = config.get("model_type")
    if model_type is None or model_type not in CONFIG_MAPPING:
        return _dtype_key(config)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its notes on legacy fields are not the user's concern here
    try:
        # a deep copy: the class writes into the nested dicts it is given (rope_scaling gets rope_theta)
        return _dtype_key(CONFIG_MAPPING[model_type].from_dict(copy.deepcopy(config)).to_dict())
    except Exception:  # noqa: BLE001 - a config its class refuses is compared as written
        return _dtype_key(config)
    finally:
        hf_logging.set_verbosity(verbosity)


def _dtype_key(config: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 saves ``dtype`` where older versions saved ``torch_dtype``: one field."""
    from megarl.models.hf_files import CONFIG_DTYPE_KEYS, config_dtype

    named = config_dtype(config)
    return {k: v for k, v in config.items() if k not in CONFIG_DTYPE_KEYS} | ({"dtype": named} if named is not None else {})


def check_model_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Refuse (ModelCheckpointError) a model checkpoint that cannot be loaded as the model its
    config.json describes; returns its record."""
    path = Path(path)
    record = read_record(path)
    if not (path / WEIGHTS / "metadata.json").is_file():
        raise ModelCheckpointError(f"{path / WEIGHTS} holds no Megatron checkpoint (metadata.json is missing); {_remake(record)}")
    _check_weight_files(path, record)
    try:
        current = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelCheckpointError(f"{path / 'config.json'} is unreadable ({exc}); it must be the config.json the "
                                   "checkpoint was converted from") from None
    differ = config_differences(record["hf_config"], current)
    if differ:
        raise ModelCheckpointError(
            f"{path}: config.json differs from the HF config the weights were converted from "
            f"({record.get('source')}): {'; '.join(differ)}; restore that config.json"
            + ("" if trained_by_sft(record) else ", or convert the model it describes with `megarl convert hf-to-megatron`")
        )
    return record


def trained_by_sft(record: dict[str, Any]) -> bool:
    """Whether the record's weights are ones `megarl sft` trained (no conversion makes them again)."""
    return str(record.get("source", "")).startswith(SFT_SOURCE)


def _remake(record: dict[str, Any]) -> str:
    """How to get a damaged model checkpoint whole again."""
    if trained_by_sft(record):
        return "copy it again whole from where `megarl sft` wrote it (no conversion remakes trained weights)"
    return "copy the checkpoint again whole, or convert the HF model again with `megarl convert hf-to-megatron`"


def _check_weight_files(path: Path, record: dict[str, Any]) -> None:
    """Refuse a weight file the record lists that is missing, or of another size than recorded
    (older records have no sizes): a shard lost or cut short in a copy fails only once
    the ranks load it, after Ray and the workers have started."""
    sizes = record.get("sizes") or {}
    for name in (f for f in record.get("files", []) if f.startswith(f"{WEIGHTS}/")):
        file = path / name
        if not file.is_file():
            problem = "is missing"
        elif name in sizes and file.stat().st_size != sizes[name]:
            problem = f"has {file.stat().st_size} bytes, {RECORD} says {sizes[name]} (truncated?)"
        else:
            continue
        raise ModelCheckpointError(f"{path}: {name} (listed in {RECORD}) {problem}; {_remake(record)}")


# ---- the weights (collective; Megatron imported lazily) --------------------------------------------


def _model_state(core: Any) -> dict[str, Any]:
    """The model's sharded state dict without a critic's value head (not in a policy's checkpoint:
    it keeps its initialisation, as in an HF import) and without LoRA adapters: a model checkpoint
    is a plain model (`megarl sft` with LoRA merges them into the weights before it saves)."""
    from megarl.models.lora import is_adapter_name

    state = {k: v for k, v in core.sharded_state_dict().items() if not is_adapter_name(k)}
    if getattr(getattr(core, "output_layer", None), "is_value_head", False):
        state = {k: v for k, v in state.items() if not k.startswith("output_layer.")}
    return {"model": state}


def save_model_weights(core: Any, directory: str | os.PathLike) -> None:
    """Write this group's model (a GPTModel, every rank calling) as a dist-checkpoint into ``directory``."""
    import torch.distributed as dist

    from megarl.checkpoint.dist_save import save_dist_checkpoint
    from megarl.parallel.mcore_version import write_checkpoint_versions

    os.makedirs(directory, exist_ok=True)
    save_dist_checkpoint(_model_state(core), directory)  # (its host staging released afterwards)
    if dist.get_rank() == 0:
        write_checkpoint_versions(directory)
    dist.barrier()


def load_model_weights(core: Any, path: str | os.PathLike) -> None:
    """Fill this rank's parameters from the model checkpoint at ``path`` (collective), whatever
    TP/PP layout wrote it."""
    # Not load_trained_weights: a model checkpoint has no value head (a critic starts from it too), so the load is not strict.
    import torch
    from megatron.core import dist_checkpointing

    from megarl.parallel.mcore_version import check_checkpoint_readable

    weights = Path(path) / WEIGHTS
    check_checkpoint_readable(weights)
    state = dist_checkpointing.load(_model_state(core), str(weights))
    with torch.no_grad():
        missing, _ = core.load_state_dict(state["model"], strict=False)
    value_head = getattr(getattr(core, "output_layer", None), "is_value_head", False)
    unexpected_missing = [k for k in missing if not (value_head and k.startswith("output_layer.")) and not k.endswith("._extra_state")]
    if unexpected_missing:
        raise ModelCheckpointError(f"{path}: the checkpoint has no values for {', '.join(unexpected_missing[:5])}")
