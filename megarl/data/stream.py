"""The trainer's data side: load the configured files, then hand out one PromptBatch per step.

    stream = build_train_stream(cfg.data, tokenizer)     # reads, checks, filters overlong
    prompts = stream.next_batch()                        # PromptBatch of prompts_per_step
    ckpt["data"] = stream.state_dict()                   # resume: stream.load_state_dict(...)

Files are read and checked whole at start-up (so a bad row fails before any GPU work) and
overlong prompts are dropped there when ``data.filter_overlong_prompts`` is on; the prompts a
step draws are templated and tokenized when drawn. Validation prompts come whole, in file order
(:func:`load_val_prompts`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megarl.data.datasets import DataError, PromptRecord, file_label, read_prompt_file
from megarl.data.prompt_batch import PromptBatch
from megarl.data.prompts import PromptBuilder
from megarl.data.sampler import MixtureSampler

if TYPE_CHECKING:
    from megarl.config.sections import DataConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptSet:
    """The checked (and filtered) rows of one file."""

    label: str  # how errors name the file: data.train_files[0] (gsm8k.parquet)
    path: str
    records: list[PromptRecord]
    rows_read: int
    dropped_overlong: int

    def where(self, record: PromptRecord) -> str:
        return f"{self.label}: row {record.row}"


def load_prompt_set(
    path: str, *, label: str, builder: PromptBuilder, prompt_key: str = "prompt", filter_overlong: bool = True,
    source_key: str = "data_source",
) -> PromptSet:
    """Read ``path``, check every row, and drop overlong prompts if ``filter_overlong``."""
    records = read_prompt_file(path, label=label, prompt_key=prompt_key, source_key=source_key)
    return _filtered(records, path, label, builder, filter_overlong)


def _filtered(records: list[PromptRecord], path: str, label: str, builder: PromptBuilder, filter_overlong: bool) -> PromptSet:
    kept = records
    if filter_overlong and records:
        wheres = [f"{label}: row {r.row}" for r in records]
        too_long = builder.overlong([r.prompt for r in records], wheres)
        kept = [r for r, drop in zip(records, too_long, strict=True) if not drop]
    dropped = len(records) - len(kept)
    if dropped:
        log.warning("%s: dropped %d of %d prompts longer than data.max_prompt_length (%d tokens)",
                    label, dropped, len(records), builder.max_prompt_length)
    if not kept:
        reason = f"all {len(records)} prompts are longer than data.max_prompt_length ({builder.max_prompt_length})" if records else "it has no rows"
        raise DataError(f"{label}: no usable prompts, {reason}")
    return PromptSet(label=label, path=str(path), records=kept, rows_read=len(records), dropped_overlong=dropped)


def encode_records(sets: list[PromptSet], picks: list[tuple[int, int]], builder: PromptBuilder, step: int) -> PromptBatch:
    """Template and tokenize the records at ``picks`` ((set index, position in set.records))."""
    records = [sets[f].records[i] for f, i in picks]
    wheres = [sets[f].where(r) for (f, _), r in zip(picks, records, strict=True)]
    ids, texts = builder.encode([r.prompt for r in records], wheres)
    return PromptBatch(
        prompt_ids=ids,
        prompt_text=texts,
        data_source=[r.data_source for r in records],
        ground_truth=[r.ground_truth for r in records],
        extra_info=[dict(r.extra_info) for r in records],
        index=[r.row for r in records],
        file_index=[f for f, _ in picks],
        step=step,
        agent_name=[r.agent_name for r in records],
        raw_prompt=[r.prompt for r in records],
    )


class PromptStream:
    """Training prompts: one :class:`PromptBatch` per step, resumable exactly."""

    def __init__(self, sets: list[PromptSet], builder: PromptBuilder, sampler: MixtureSampler) -> None:
        assert [len(s.records) for s in sets] == sampler.sizes
        self.sets = sets
        self.builder = builder
        self.sampler = sampler
        self._positions = {(f, r.row): i for f, s in enumerate(sets) for i, r in enumerate(s.records)}

    def next_batch(self) -> PromptBatch:
        """The next step's prompts (``data.prompts_per_step`` of them)."""
        step = self.sampler.step
        return encode_records(self.sets, self.sampler.next_indices(), self.builder, step)

    def prompts_of(self, keys: Sequence[tuple[int, int]]) -> PromptBatch:
        """The prompts at ``keys`` ((file index, row in the file), as PromptBatch.file_index /
        index name them), in order: the prompts an asynchronous run re-issues."""
        return encode_records(self.sets, [(f, self._positions[(f, row)]) for f, row in keys], self.builder, self.sampler.step)

    @property
    def step(self) -> int:
        """Steps drawn so far."""
        return self.sampler.step

    @property
    def epoch(self) -> float:
        return self.sampler.epoch

    def steps_per_epoch(self) -> int:
        return self.sampler.steps_per_epoch()

    def first_prompts(self, count: int) -> PromptBatch:
        """The first ``count`` prompts of the first file (fixed for the whole run; the sampler does
        not move): the post-push check's probe when there are no validation prompts."""
        picks = [(0, i) for i in range(min(count, len(self.sets[0].records)))]
        return encode_records(self.sets, picks, self.builder, step=-1)

    def __len__(self) -> int:
        """Usable prompts over all files."""
        return sum(len(s.records) for s in self.sets)

    def load_report(self) -> dict[str, float]:
        """Counts for the start-up log / metrics: prompts read, kept and dropped as overlong."""
        return {
            "data/train_rows_read": float(sum(s.rows_read for s in self.sets)),
            "data/train_prompts": float(len(self)),
            "data/train_dropped_overlong": float(sum(s.dropped_overlong for s in self.sets)),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict(), "files": [s.path for s in self.sets]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])


def custom_prompt_set(cfg: DataConfig, files: list[str], field: str, tokenizer: Any, builder: PromptBuilder) -> PromptSet:
    """The rows of ``data.custom_cls`` built on ``files`` (data.train_files or data.val_files, named
    by ``field``), checked as parquet rows are and filtered as a file is (megarl/data/custom_dataset.py)."""
    from megarl.data.custom_dataset import load_class
    from megarl.data.datasets import record_of_row
    from megarl.user_code import ends_process, printed_head, process_state_kept, running

    spec = cfg.custom_cls
    assert spec is not None
    label = f"data.custom_cls ({spec.name} on {field})"
    try:
        cls = load_class(spec.path, spec.name)
    except ValueError as exc:
        raise DataError(str(exc)) from exc
    except BaseException as exc:
        if not ends_process(exc):  # the user's own Ctrl-C, an import's own error
            raise
        raise _ended(exc, f"{label} ({spec.path})", "while it was imported") from exc
    try:
        with running(label), process_state_kept(label):  # what the class prints goes to the user-code log, not the terminal
            rows = _read_rows(cls, f"data.custom_cls {spec.name}", files, tokenizer, cfg)
    except Exception as exc:  # the user's own code: one line with its error, the traceback chained
        raise DataError(f"{label}: building it or reading its rows failed: {type(exc).__name__}: {exc}"
                        f"{printed_head(label)}") from exc  # fmt: skip
    except BaseException as exc:
        if not ends_process(exc):
            raise
        raise _ended(exc, f"{label} ({spec.path})", "while it was built or its rows read", printed_head(label)) from exc
    records = [record_of_row(label, i, row, prompt_key=cfg.prompt_key, source_key=cfg.reward_fn_key) for i, row in enumerate(rows)]
    return _filtered(records, f"{spec.path}:{spec.name}", label, builder, cfg.filter_overlong_prompts)


def _read_rows(cls: type, name: str, files: list[str], tokenizer: Any, cfg: DataConfig) -> list[Any]:
    """Every row of ``cls`` built on ``files``; the method running is told to a supervisor (one
    report per method, not per row), whose line then names it if the class ends the process, and
    to user_code.waiting_on, which a stop's line reads (``... while starting (data.custom_cls
    DS.__getitem__(5) had run for 28 s)``). A read that lasts says where it is, as other waits do
    (``data.custom_cls DS: reading rows 5/800 ... (15 s)``): a class that hangs is no silent start."""
    from megarl import progress
    from megarl.data.custom_dataset import build_dataset
    from megarl.driver_supervisor import report
    from megarl.user_code import waiting_on

    reading = _Reading(name)
    # (the intervals read here, not bound as defaults: a test makes them short)
    with progress.still_waiting(reading.text, first_s=progress.NOTE_FIRST_S, every_s=progress.NOTE_EVERY_S):
        try:
            report(user_code=f"{name}.__init__")
            with waiting_on(f"{name}.__init__"):
                dataset = build_dataset(cls, files, tokenizer, cfg.model_dump(mode="json"))
            report(user_code=f"{name}.__len__")
            with waiting_on(f"{name}.__len__"):
                reading.count = len(dataset)
            report(user_code=f"{name}.__getitem__ (reading its {reading.count} rows)")
            rows = []
            for i in range(reading.count):
                with waiting_on(f"{name}.__getitem__({i})"):
                    rows.append(dataset[i])
                reading.done = i + 1
            return rows
        finally:
            report(user_code=None)  # past it, the supervisor names the config's hooks again


class _Reading:
    """Where the read of a dataset class's rows is, for its progress lines."""

    def __init__(self, name: str) -> None:
        self.name, self.count, self.done = name, -1, 0  # count: -1 until __len__ returned

    def text(self) -> str:
        if self.count < 0:
            return f"{self.name}: building it (__init__, __len__)"
        return f"{self.name}: reading rows {self.done}/{self.count}"


def _ended(exc: BaseException, what: str, when: str, printed: str = "") -> DataError:
    """A dataset class that tried to end the process (user_code.ends_process), said as a DataError;
    ``printed``: user_code.printed_head of the class."""
    from megarl.user_code import exit_description

    return DataError(f"{what} {exit_description(exc)} {when}; a dataset class must raise an exception for data it cannot "
                     f"read, never end the process{printed}")


def _prompt_sets(cfg: DataConfig, field: str, paths: list[str], tokenizer: Any, builder: PromptBuilder) -> list[PromptSet]:
    """The checked, filtered prompt sets of ``paths`` (``field``: data.train_files | data.val_files):
    one per file, or one of data.custom_cls built on them all."""
    if cfg.custom_cls is not None:
        return [custom_prompt_set(cfg, paths, field, tokenizer, builder)]
    return [
        load_prompt_set(path, label=file_label(f"{field}[{i}]", path), builder=builder, prompt_key=cfg.prompt_key,
                        filter_overlong=cfg.filter_overlong_prompts, source_key=cfg.reward_fn_key)
        for i, path in enumerate(paths)
    ]  # fmt: skip


def build_train_stream(cfg: DataConfig, tokenizer: Any, tools: Sequence[dict[str, Any]] = ()) -> PromptStream:
    """Load ``cfg.train_files`` (checked, filtered) and build the seeded, weighted sampler;
    ``tools``: the schemas the chat template shows."""
    builder = PromptBuilder.from_config(cfg, tokenizer, tools)
    if not cfg.train_files and cfg.custom_cls is None:
        raise DataError("data.train_files is empty; give at least one parquet file in the verl schema")
    sets = _prompt_sets(cfg, "data.train_files", [f.path for f in cfg.train_files], tokenizer, builder)
    sampler = MixtureSampler(
        [len(s.records) for s in sets],
        [f.weight for f in cfg.train_files] if cfg.custom_cls is None else [1.0],
        batch_size=cfg.prompts_per_step,
        seed=cfg.seed,
        shuffle=cfg.shuffle,
    )
    stream = PromptStream(sets, builder, sampler)
    log.info("training prompts: %s", stream.load_report())
    return stream


def load_val_prompts(cfg: DataConfig, tokenizer: Any, tools: Sequence[dict[str, Any]] = ()) -> PromptBatch | None:
    """Every prompt of ``cfg.val_files`` in file order (overlong ones filtered as for training);
    None when no validation files are configured."""
    if not cfg.val_files:
        return None
    builder = PromptBuilder.from_config(cfg, tokenizer, tools)
    sets = _prompt_sets(cfg, "data.val_files", list(cfg.val_files), tokenizer, builder)
    picks = [(f, i) for f, s in enumerate(sets) for i in range(len(s.records))]
    return encode_records(sets, picks, builder, step=-1)
