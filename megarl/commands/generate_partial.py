"""The resumable state of `megarl generate`: ``OUT.parquet.partial/`` holds the job record
(generate.json: everything that changes what is generated, the model's contents included),
the finished parts (part-NNNNNN.parquet, one per --batch-size prompts) and the staged model
export; a re-run with the same job continues it, and the parts are merged into OUT at the end.
megarl/commands/generate.py runs the generation."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from megarl.config.differences import ABSENT, differences
from megarl.disk_full import writing
from megarl.kept_files import write_atomically

log = logging.getLogger(__name__)
PARTIAL_SUFFIX = ".partial"
JOB_FILE = "generate.json"
MODEL_DIR = "model"


class GenerateError(ValueError):
    """A bad output path, or a partial generation made with other settings."""


def job_record(cfg: Any, data: Path, model: str, batch_size: int) -> dict[str, Any]:
    """What a partial generation must match to be continued: everything that changes what is
    generated (the model's contents too: the same path can hold other weights later)."""
    from megarl.plan.extensions import AGENT_FILES

    agent = cfg.rollout.agent if cfg.rollout.generate_function == "default" else None  # a user's function ignores it
    files = {field: getattr(agent, field.rsplit(".", 1)[1]) for field in AGENT_FILES} if agent else {}
    job = {
        "data_sha256": _sha256(data),  # missing: refused later
        "model": model,
        "model_fingerprint": model_fingerprint(Path(model)),
        "engine": cfg.rollout.engine,
        "dtype": cfg.model.dtype,
        "n": cfg.rollout.n,
        "sampling": cfg.rollout.sampling.model_dump(mode="json"),
        "data": cfg.data.model_dump(mode="json", include={"prompt_key", "max_prompt_length", "truncation", "apply_chat_template"}
                                    | ({"apply_chat_template_kwargs"} if cfg.data.apply_chat_template_kwargs else set())),
        "generate_function": cfg.rollout.generate_function,
        "agent": agent.model_dump(mode="json") if agent else None,
        "agent_files_sha256": {field: _sha256(Path(path)) for field, path in files.items() if path},
        "seed": cfg.trainer.seed,
        "batch_size": batch_size,
    }
    return json.loads(json.dumps(job))  # as generate.json reads back (tuples as lists)


def _sha256(path: Path) -> str | None:
    from megarl.checkpoint.verification import file_sha256

    return file_sha256(path) if path.is_file() else None


def model_fingerprint(source: Path) -> dict[str, Any] | None:
    """Which model ``source`` holds, read cheaply: a training checkpoint by its step and its
    manifest (which lists every file's sha256); an HF directory or a model checkpoint by its
    weight files (names, sizes, hashes of their ends) and the HF files beside them (config,
    tokenizer, chat template). None when there is no such directory (refused later)."""
    from megarl.checkpoint.model_checkpoint import is_model_checkpoint
    from megarl.checkpoint.verification import MANIFEST
    from megarl.models.hf_files import HF_SIDE_FILES
    from megarl.models.weight_files import weights_fingerprint

    if not source.is_dir():
        return None
    if (source / MANIFEST).is_file() and not is_model_checkpoint(source):
        try:
            step = json.loads((source / MANIFEST).read_text()).get("step")
        except (ValueError, AttributeError):
            step = None  # a torn manifest: the export refuses it, naming what is wrong
        return {"step": step, "manifest_sha256": _sha256(source / MANIFEST)}
    return {"weights": weights_fingerprint(source),
            "files": {name: _sha256(source / name) for name in HF_SIDE_FILES if (source / name).is_file()}}  # fmt: skip


def open_partial(partial: Path, job: dict[str, Any]) -> None:
    """Create the partial directory, or check that the one there was made with the same settings."""
    record = partial / JOB_FILE
    if partial.exists():
        if not record.is_file():
            raise GenerateError(f"{partial} exists but was not made by megarl generate (no {JOB_FILE}); move it away")
        try:
            before = json.loads(record.read_text())
        except ValueError:  # cut (written whole since: a full disk or a kill met an older version's write)
            if any(partial.glob("part-*.parquet")):
                raise GenerateError(f"{record} is not a whole job record, so the finished parts in {partial} cannot be "
                                    "checked against these settings; move the folder away to start over") from None  # fmt: skip
            before = {}
        differ = differences(before, job, whole={"model_fingerprint"})
        changed = {key.split(".")[0] for key in differ}  # the job record's fields
        if not changed:
            log.info("continuing the generation in %s", partial)
            return
        if _holds_work(partial, changed):
            same = "with the same model and settings" if {"model", "model_fingerprint"} & changed else "with the same settings"
            raise GenerateError(f"{partial} holds a generation made with other settings ({_told(differ, before)}); "
                                f"run {same} to continue it, or move it away to start over")  # fmt: skip
        # e.g. a run that failed before its first part: nothing to continue, so the new settings start it afresh
        log.info("%s holds no finished part; starting it afresh with these settings (%s)", partial, _told(differ, before))
    with writing(record, "the partial generation's job record", kept="no part generated yet; the same command starts again"):
        if not partial.exists():
            partial.mkdir()
        write_atomically(record, json.dumps(job, indent=2) + "\n")  # never a cut record to read next time


def _told(differ: dict[str, tuple[Any, Any]], before: dict[str, Any]) -> str:
    """The differences between two job records as ``key was OLD, now NEW`` (nested settings by
    their dotted key; a file or a model by what changed in it: their hashes say nothing to a reader)."""
    parts = []
    for key, (old, new) in sorted(differ.items()):
        field = key.split(".")[0]
        if field.endswith("_sha256") and key != field:  # a file among several (one set since, too): its field says which
            parts.append(f"the {key.split('.', 1)[1]} file's contents differ")
        elif old is ABSENT:
            now = "" if field.endswith(("_sha256", "_fingerprint")) else f", now {json.dumps(new)}"  # (hashes)
            parts.append(f"{key} was not recorded (an older megarl wrote {JOB_FILE}){now}")
        elif key == "model_fingerprint":
            if "model" not in differ:  # else the path's change says it
                parts.append(_model_change(before["model"], old, new))
        elif key == "data_sha256":
            parts.append("the --data file's contents differ")
        else:
            parts.append(f"{key} was {json.dumps(old)}, now {json.dumps(None if new is ABSENT else new)}")
    return "; ".join(parts)


def _model_change(model: str, old: Any, new: Any) -> str:
    """The same model path with other contents, in words."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return f"the model at {model} is not the model the parts were generated with"
    if "step" in old or "step" in new:
        steps = f"step {old.get('step')}, now step {new.get('step')}" if old.get("step") != new.get("step") else "its manifest differs"
        return f"the checkpoint at {model} is another one than the parts were generated with ({steps})"
    if old.get("weights") != new.get("weights"):
        return f"the model at {model} holds other weights than the parts were generated with"
    files = sorted(k for k in set(old["files"]) | set(new["files"]) if old["files"].get(k) != new["files"].get(k))
    return f"the model at {model} has other {', '.join(files)} than the parts were generated with"


def _holds_work(partial: Path, changed: set[str]) -> bool:
    """Whether a partial generation made with other settings holds anything this run would lose
    or misuse: a finished part, or the staged HF export of another model."""
    other_model = "model" in changed or "model_fingerprint" in changed
    return any(partial.glob("part-*.parquet")) or (other_model and (partial / MODEL_DIR).exists())


def remove_partial(partial: Path) -> None:
    """What generate wrote in ``partial`` (the parts, now in OUT, the job record, the staged
    model and the server logs); the directory itself only if nothing else is left in it."""
    for path in [*partial.glob("part-*.parquet*"), partial / JOB_FILE]:
        path.unlink(missing_ok=True)
    for folder in (partial / MODEL_DIR, partial / "logs"):
        shutil.rmtree(folder, ignore_errors=True)
    if not any(partial.iterdir()):
        partial.rmdir()
    else:
        log.warning("%s holds files generate did not write; left in place", partial)


def merged_before(partial: Path, job: dict[str, Any]) -> bool:
    """Whether ``partial`` holds every part of this very job (OUT was merged from it and the run
    stopped before removing it)."""
    import pyarrow.parquet as pq

    try:
        if json.loads((partial / JOB_FILE).read_text()) != job:
            return False
        rows = sum(pq.read_metadata(p).num_rows for p in partial.glob("part-*.parquet"))
        return rows == pq.read_metadata(partial.with_name(partial.name.removesuffix(PARTIAL_SUFFIX))).num_rows
    except (OSError, ValueError):
        return False


def parts_of(total: int, size: int) -> list[range]:
    return [range(start, min(start + size, total)) for start in range(0, total, size)]


def part_path(partial: Path, index: int) -> Path:
    return partial / f"part-{index:06d}.parquet"


def check_parts(partial: Path, parts: list[range]) -> None:
    """The parts an earlier run wrote, each read by its footer (cheap), before any generation: a
    damaged one would otherwise fail the merge after all the remaining work."""
    import pyarrow.parquet as pq

    for index, rows in enumerate(parts):
        path = part_path(partial, index)
        if not path.is_file():
            continue
        try:
            count = pq.read_metadata(path).num_rows
        except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            problem = f"is not a readable parquet file ({str(exc).splitlines()[0]})"
        else:
            if count == len(rows):
                continue
            problem = f"holds {count} rows, not the {len(rows)} prompts of its part"
        raise GenerateError(f"{path} {problem}; delete that part file and run the same command to generate its "
                            "prompts again")  # fmt: skip


def merge_parts(partial: Path, count: int, target: Path) -> None:
    """The parts, in order, into ``target`` (written next to it, then renamed into place)."""
    import pyarrow.parquet as pq

    tmp = target.with_name(target.name + ".tmp")
    writer, merged = None, False
    try:
        for index in range(count):
            part = pq.read_table(part_path(partial, index))
            writer = writer or pq.ParquetWriter(tmp, part.schema)
            writer.write_table(part)
        merged = True
    finally:
        if writer is not None:
            writer.close()
        if not merged:  # no half-written file left beside OUT
            tmp.unlink(missing_ok=True)
    tmp.replace(target)
